"""Run a pipeline job on this machine: one `pipeline.stage` process per stage, on loopback.

The launcher binds a rendezvous inbox, starts the stages, tells each one every stage's inbox
once all have said hello, and collects their results and final weights.

A layout is the planner's stages: layer ranges, each run by `replicas` workers (one process
each) that split its minibatches round-robin and sum their gradients at every update.

Elastic runs (`backup=True`, any schedule): after every update each stage sends its weights
here, the reliable tier's copy, with the number of minibatches they include. When a worker's
process dies (an eviction: `evict=(stage, minibatches)` injects one with SIGKILL), the job
resumes from the cut: the last minibatch count every stage backed up. On the same layout (a
replacement node) only the lost node's workers are restarted and the others rewind in place
(stage-only recovery, `launch.Launch.replace`); after a re-plan for the nodes now held
(`replan(nodes)`, e.g. the planner's stages for that many workers) every stage restarts with
its slice of the cut's weights. The minibatches after the cut, in flight or not begun, are
replayed. Flush and GPipe steps are synchronous, so their result is the same as without the
eviction; 1F1B and 2BW refill the pipeline from that cut (every stage's weights include exactly
the same minibatches), so the replayed minibatches see fresher weights than they would have:
close, not equal.
"""

from __future__ import annotations

import secrets
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import zmq

from orchestrator.agileml.errors import AgileMLError
from orchestrator.agileml.pipeline.launch import (
    Backups,
    Fault,
    Launch,
    Layout,
    Recovery,
    logs_hint,
)
from orchestrator.agileml.pipeline.planner import PlannedStage, slots_of
from orchestrator.agileml.pipeline.schedule import Schedule, stuck_worker
from orchestrator.agileml.pipeline.source import (
    ChainModelSpec,
    builtin_source,
    job_source,
    layer_sizes,
)
from orchestrator.lifecycle import remove_run_dir


def chain_layout(boundaries: list[tuple[int, int]], replicas: list[int] | None = None) -> Layout:
    """The layout of stages `boundaries[k]` (first and last layer, inclusive), stage k run by
    `replicas[k]` workers (default 1)."""
    counts = replicas if replicas is not None else [1] * len(boundaries)
    if len(counts) != len(boundaries):
        raise AgileMLError(f"replicas {counts} do not give one count per stage {boundaries}")
    return tuple(
        PlannedStage(first_layer=a, last_layer=b, replicas=r)
        for (a, b), r in zip(boundaries, counts, strict=True)
    )


def describe(layout: Layout) -> list[list[int]]:
    """[first_layer, last_layer, replicas] per stage: a layout as plain JSON."""
    return [[st.first_layer, st.last_layer, st.replicas] for st in layout]


@dataclass(frozen=True)
class PipelineResult:
    """What a run did: seconds from the first stage's start to the last stage's end (of the
    last attempt), the losses by minibatch, each worker's result (last attempt; stages in
    order, replicas within), the final weights (flat, in layer order) and the recoveries."""

    seconds: float
    losses: list[float]
    stages: list[dict[str, Any]]
    weights: torch.Tensor
    recoveries: list[Recovery] = field(default_factory=list)
    joins: list[tuple[int, Layout]] = field(default_factory=list)  # (cut, new layout)

    def throughput_per_s(self, skip: int = 0) -> float:
        """Minibatches per second through the input stage's backward passes, after the first
        `skip` (start-up: process warm-up and the pipeline filling)."""
        inputs = [r for r in self.stages if r["stage"] == 0]
        ends = sorted(t for r in inputs for t in r["backward_ends"])
        if skip >= len(ends) - 1:
            raise AgileMLError(f"skip {skip} leaves nothing to time of {len(ends)} minibatches")
        first = ends[skip - 1] if skip > 0 else min(r["started"] for r in inputs)
        return (len(ends) - skip) / (ends[-1] - first)


def chain_sizes(model: ChainModelSpec, seed: int, code: str | None = None) -> list[int]:
    """Values of each layer's travelling state (see `source`), in order: of the job's
    code, or of the built-in chain."""
    source = job_source(code, seed) if code is not None else builtin_source(model, seed)
    return layer_sizes(source.layers())


def run_pipeline(
    *,
    model: ChainModelSpec | None = None,
    code: str | None = None,
    layout: Layout,
    schedule: Schedule,
    minibatches: int,
    microbatches: int = 1,
    microbatch_size: int = 32,
    lr: float = 0.05,
    seed: int = 0,
    vertical_sync: bool = False,
    forward_ms: list[float] | None = None,
    backward_ms: list[float] | None = None,
    timeout_s: float = 300.0,
    backup: bool = False,
    evict: tuple[int, int] | None = None,
    faults: Sequence[Fault] = (),
    replan: Callable[[int], Layout] | None = None,
    max_recoveries: int = 3,
    on_backup: Callable[[int, dict[int, float]], None] | None = None,
    recovery: Literal["stage", "restart"] = "stage",
    notice: bool = False,
    devices_per_node: int = 1,
) -> PipelineResult:
    """Train with one process per worker of `layout` (see `chain_layout`, or a plan's stages):
    the job file `code` (see `source`), or else the built-in chain `model`.

        `forward_ms`/`backward_ms` emulate each stage's compute per microbatch with sleeps (per
        stage; after a re-plan, spread by layer count). `evict=(stage, minibatches)` kills the
        stage's first worker once an input-stage worker backed up weights including that many
        minibatches (needs `backup`); `replan(nodes)`
        gives the layout for the workers left (default: the same layout, on a replacement node).
    With `notice` the injected eviction is the node's notice (SIGUSR1): the worker leaves after
    its next update is backed up, so the job resumes from there (nothing it computed is lost).
    `faults` injects several (kills, notices, joins; see `launch.Fault`); a join restarts every
    stage from the cut on `replan(workers + 1)`.
    With `devices_per_node` K a node runs the workers of K consecutive slots (see
    `PlannedStage.slots`; `replan` is asked for nodes, each of K workers), and a worker lost
    loses its node: the job re-plans without it.
    A lost node on an unchanged layout (no `replan`) has its workers replaced (every one of
    them seen lost) while the others rewind in place to the cut (`recovery="stage"`, when a
    cut past the start exists), or
    every worker restarts from the cut (`recovery="restart"`, and after a re-plan).
    `on_backup(minibatches, losses)` is called as the input stage backs up weights including
    that many minibatches, with the losses of every minibatch so far (progress).

        Raises:
            AgileMLError: a layout that does not cover the layers or cannot run the schedule, a
                worker that failed, or a run not done in time.
    """
    layout = tuple(layout)
    model = model or ChainModelSpec()
    sizes = chain_sizes(model, seed, code)
    check_layout(layout, len(sizes), schedule, minibatches, microbatches)
    _check_run(layout, schedule, microbatches, vertical_sync, devices_per_node)
    injected = [*faults]
    if evict is not None:
        injected.append(Fault("evict" if notice else "kill", evict[1], evict[0]))
    _check_faults(injected, layout, backup, replan, minibatches)
    token = secrets.token_bytes(32)
    ctx: zmq.Context[Any] = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.setsockopt(zmq.LINGER, 0)
    port = inbox.bind_to_random_port("tcp://127.0.0.1")
    out_dir = Path(tempfile.mkdtemp(prefix="pipeline-"))
    launch = Launch(
        ctx, inbox, f"tcp://127.0.0.1:{port}", token, out_dir, time.monotonic() + timeout_s,
        dict(model=model, code=code, sizes=sizes, schedule=schedule, minibatches=minibatches,
             microbatches=microbatches, microbatch_size=microbatch_size, lr=lr, seed=seed,
             vertical_sync=vertical_sync, backup=backup),
        devices_per_node=devices_per_node,
    )  # fmt: skip
    launch.faults = sorted(injected, key=lambda f: f.at)
    failed = False
    try:
        return _supervise(
            launch, layout, (forward_ms, backward_ms),
            replan=replan, recovery=recovery, max_recoveries=max_recoveries,
            on_backup=on_backup,
        )  # fmt: skip
    except BaseException:
        failed = True
        raise
    finally:
        try:
            launch.kill_all()
            inbox.close()
            ctx.term()
        finally:  # also when a second signal interrupts the above
            remove_run_dir(out_dir, failed=failed)  # the stages' logs (ORCHESTRATOR_KEEP_LOGS)


def _supervise(
    launch: Launch,
    layout: Layout,
    emulated: tuple[list[float] | None, list[float] | None],
    *,
    replan: Callable[[int], Layout] | None,
    recovery: str,
    max_recoveries: int,
    on_backup: Callable[[int, dict[int, float]], None] | None,
) -> PipelineResult:
    """Start the run and see it through its faults (see `run_pipeline`)."""
    common = launch.common
    backups, recoveries = Backups(), list[Recovery]()
    losses: dict[int, float] = {}  # minibatch -> loss, from the output stage's backups
    joins: list[tuple[int, Layout]] = []  # (the cut it restarted from, the new layout)
    planned = layout

    def restart_on(new: Layout) -> Layout:
        launch.kill_all()
        backups.forget_partial()  # minibatches not every stage backed up are redone
        left = common["minibatches"] - backups.done
        check_layout(new, len(common["sizes"]), common["schedule"], left, common["microbatches"])
        launch.start(new, backups, _spread(emulated, planned, new))
        return new

    launch.start(layout, backups, _spread(emulated, planned, layout))
    while (outcome := launch.run(losses, backups, recoveries, on_backup)) != "done":
        nodes = launch.nodes()
        if outcome == "join":
            assert replan is not None  # `_check_faults`
            layout = restart_on(tuple(replan(nodes + 1)))
            joins.append((backups.done, layout))
            continue
        if backups.done >= common["minibatches"]:  # lost after the last update: all backed up
            launch.kill_all()
            recoveries[-1].resumed_minibatch, recoveries[-1].layout = backups.done, layout
            return _result([], launch.out_dir, len(layout), losses, recoveries, joins,
                           final=backups.weights)  # fmt: skip
        if len(recoveries) > max_recoveries:
            hint = logs_hint(launch.out_dir)
            raise AgileMLError(f"{len(recoveries)} lost workers; giving up ({hint})")
        if replan is None and recovery == "stage" and launch.can_replace(backups):
            launch.replace(backups)
            recoveries[-1].mode = "stage"
        else:  # the lost nodes are not replaced when the job re-plans
            gone = len({launch.node_of(w) for w in launch.lost})
            layout = restart_on(layout if replan is None else tuple(replan(nodes - gone)))
        recoveries[-1].resumed_minibatch, recoveries[-1].layout = backups.done, layout
    final = None if launch.results else backups.weights  # a node went after the last update
    return _result(launch.results, launch.out_dir, len(layout), losses, recoveries, joins, final)


def _check_run(
    layout: Layout, schedule: Schedule, microbatches: int, vertical_sync: bool, per_node: int
) -> None:
    """Refuse run options that cannot work together (`run_pipeline` says which)."""
    workers = sum(st.replicas for st in layout)
    slots = sorted(slot for stage_slots in slots_of(layout) for slot in stage_slots)
    if slots != list(range(workers)) or workers % per_node:
        raise AgileMLError(
            f"stages {describe(layout)} do not place their {workers} workers on nodes of "
            f"{per_node} (slots {slots})"
        )
    if vertical_sync and any(st.replicas > 1 for st in layout):
        raise AgileMLError(
            "vertical_sync numbers weight versions by update, and replicated stages update "
            "once per replica group: use unreplicated stages with vertical_sync"
        )
    if schedule is Schedule.TWO_BW and microbatches < len(layout):
        raise AgileMLError(
            f"2bw keeps two weight versions only when it accumulates at least as many "
            f"microbatches as there are stages: microbatches {microbatches} < "
            f"{len(layout)} stages"
        )


def _check_faults(
    faults: list[Fault],
    layout: Layout,
    backup: bool,
    replan: Callable[[int], Layout] | None,
    minibatches: int,
) -> None:
    """Refuse faults that cannot be injected (`run_pipeline` says which)."""
    if faults and not backup:
        raise AgileMLError("an injected fault needs backup=True (nothing to recover from)")
    if any(f.kind == "join" for f in faults) and replan is None:
        raise AgileMLError("an injected join needs replan (the layout for one more node)")
    bad = [f for f in faults if not 0 < f.at < minibatches or not 0 <= (f.stage or 0) < len(layout)]
    if bad:
        raise AgileMLError(
            f"{bad[0]}: want a minibatch count in 1..{minibatches - 1} and a stage in "
            f"0..{len(layout) - 1}"
        )


def _result(
    results: list[dict[str, Any]],
    out_dir: Path,
    stages: int,
    losses: dict[int, float],
    recoveries: list[Recovery],
    joins: list[tuple[int, Layout]],
    final: np.ndarray | None = None,
) -> PipelineResult:
    """The finished run: the stages' weights in layer order, every minibatch's loss (backed
    up before a recovery, or the last attempt's own), the stages' reports. `results` empty:
    a worker was lost after every stage backed up its last update; the weights are the
    reliable copy's (`final`)."""
    if results:
        files = [out_dir / f"stage{k}.npy" for k in range(stages)]
        weights = torch.cat([torch.from_numpy(np.load(f)) for f in files])
    else:
        assert final is not None
        weights = torch.from_numpy(final.copy())
    for r in results:  # the last attempt's own, backed up or not
        losses.update(zip(r["loss_minibatches"], r["losses"], strict=True))
    spans = [(r["started"], r["ended"]) for r in results] or [(0.0, 0.0)]
    return PipelineResult(
        seconds=max(e for _, e in spans) - min(b for b, _ in spans),
        losses=[losses[m] for m in sorted(losses)],
        stages=results,
        weights=weights,
        recoveries=recoveries,
        joins=joins,
    )


def check_layout(
    layout: Layout, layers: int, schedule: Schedule, minibatches: int, microbatches: int
) -> None:
    """Refuse a layout that does not cover the layers in order or deadlocks (AgileMLError)."""
    expected = 0
    for st in layout:
        if st.first_layer != expected:
            raise AgileMLError(f"stages {describe(layout)} must cover the layers in order")
        expected = st.last_layer + 1
    if expected != layers:
        raise AgileMLError(f"stages {describe(layout)} do not cover all {layers} layers")
    try:
        stuck = stuck_worker(schedule, replicas=[st.replicas for st in layout],
                             minibatches=minibatches, microbatches=microbatches)  # fmt: skip
    except ValueError as e:
        raise AgileMLError(f"stages {describe(layout)}: {e}") from None
    if stuck is not None:
        raise AgileMLError(
            f"stages {describe(layout)} would deadlock under {schedule}: stage {stuck[0]} "
            f"replica {stuck[1]} waits forever at {stuck[2]}"
        )


def _spread(
    emulated: tuple[list[float] | None, list[float] | None], original: Layout, now: Layout
) -> tuple[list[float], list[float]]:
    """Per-stage emulated ms for layout `now`, from per-stage ms of `original` spread evenly
    over each original stage's layers."""
    out = []
    for per_stage in emulated:
        per_layer: list[float] = []
        for st, ms in zip(original, per_stage or [0.0] * len(original), strict=True):
            width = st.last_layer - st.first_layer + 1
            per_layer += [ms / width] * width
        out.append([sum(per_layer[st.first_layer : st.last_layer + 1]) for st in now])
    return out[0], out[1]
