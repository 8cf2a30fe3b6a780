"""Run a pipeline job on this machine: one `pipeline.stage` process per stage, on loopback.

The launcher binds a rendezvous inbox, starts the stages, tells each one every stage's inbox
once all have said hello, and collects their results and final weights.

A layout is the planner's stages: layer ranges, each run by `replicas` workers (one process
each) that split its minibatches round-robin and sum their gradients at every update.

Elastic runs (`backup=True`, any schedule): after every update each stage sends its weights
here, the reliable tier's copy, with the number of minibatches they include. When a worker's
process dies (an eviction: `evict=(stage, minibatches)` injects one with SIGKILL), the launcher
stops the others, re-plans the layout for the nodes now held (`replan(nodes)`, e.g. the
planner's stages for that many workers, or the same layout on a replacement node), slices the
weights of the last minibatch count every stage backed up into the new stages, and restarts
them there; the minibatches after it, in flight or not begun, are replayed. Flush and GPipe
steps are synchronous, so their result is the same as without the eviction; 1F1B and 2BW
refill the pipeline from that cut (every stage's weights include exactly the same minibatches),
so the replayed minibatches see fresher weights than they would have: close, not equal.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq
from safetensors.torch import load as load_entries
from safetensors.torch import save_file

from orchestrator.agileml import wire
from orchestrator.agileml.errors import AgileMLError, WireError
from orchestrator.agileml.pipeline.planner import PlannedStage
from orchestrator.agileml.pipeline.schedule import Schedule, stuck_worker
from orchestrator.agileml.pipeline.source import builtin_source, job_source, layer_sizes
from orchestrator.agileml.pipeline.stage import ChainModelSpec, StageConfig
from orchestrator.agileml.token import AGILEML_TOKEN_ENV
from orchestrator.agileml.wire import MessageKind

Layout = tuple[PlannedStage, ...]


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


@dataclass
class Recovery:
    """One eviction: when the stage's worker was killed, the minibatch the job resumed at, the
    new layout, and when the next minibatch completed after it."""

    stage: int
    killed_at: float
    resumed_minibatch: int
    layout: Layout
    next_minibatch_at: float | None = None

    @property
    def seconds(self) -> float | None:
        return None if self.next_minibatch_at is None else self.next_minibatch_at - self.killed_at


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
    replan: Callable[[int], Layout] | None = None,
    max_recoveries: int = 3,
    on_backup: Callable[[int, dict[int, float]], None] | None = None,
) -> PipelineResult:
    """Train with one process per worker of `layout` (see `chain_layout`, or a plan's stages):
    the job file `code` (see `source`), or else the built-in chain `model`.

        `forward_ms`/`backward_ms` emulate each stage's compute per microbatch with sleeps (per
        stage; after a re-plan, spread by layer count). `evict=(stage, minibatches)` kills the
        stage's first worker once an input-stage worker backed up weights including that many
        minibatches (needs `backup`); `replan(nodes)`
        gives the layout for the workers left (default: the same layout, on a replacement node).
    `on_backup(minibatches, losses)` is called as the input stage backs up weights including
    that many minibatches, with the losses of every minibatch so far (progress).

        Raises:
            AgileMLError: a layout that does not cover the layers or cannot run the schedule, a
                worker that failed, or a run not done in time.
    """
    layout = tuple(layout)
    model = model or ChainModelSpec()
    sizes = chain_sizes(model, seed, code)
    _check_layout(layout, len(sizes), schedule, minibatches, microbatches)
    _check_run(layout, schedule, minibatches, microbatches, vertical_sync, backup, evict)
    token = secrets.token_bytes(32)
    ctx: zmq.Context[Any] = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.setsockopt(zmq.LINGER, 0)
    port = inbox.bind_to_random_port("tcp://127.0.0.1")
    out_dir = Path(tempfile.mkdtemp(prefix="pipeline-"))
    deadline = time.monotonic() + timeout_s
    launch = _Launch(
        ctx, inbox, f"tcp://127.0.0.1:{port}", token, out_dir, deadline,
        dict(model=model, code=code, sizes=sizes, schedule=schedule, minibatches=minibatches,
             microbatches=microbatches, microbatch_size=microbatch_size, lr=lr, seed=seed,
             vertical_sync=vertical_sync, backup=backup),
    )  # fmt: skip
    emulated = (forward_ms, backward_ms)
    losses: dict[int, float] = {}  # minibatch -> loss, from the output stage's backups
    backups = _Backups()
    recoveries: list[Recovery] = []
    planned = layout
    try:
        while True:
            times = _spread(emulated, planned, layout)
            launch.start(layout, backups, times)
            outcome = launch.run(evict, losses, backups, recoveries, on_backup)
            if outcome == "done":
                break
            if len(recoveries) > max_recoveries:
                raise AgileMLError(f"{len(recoveries)} lost workers; giving up (logs in {out_dir})")
            evict = None  # injected once
            if replan is not None:
                workers = sum(st.replicas for st in layout)
                layout = tuple(replan(workers - 1))  # the lost node is not replaced
                left = minibatches - backups.done
                _check_layout(layout, len(sizes), schedule, left, microbatches)
            recoveries[-1].resumed_minibatch, recoveries[-1].layout = backups.done, layout
        result = _result(launch.results, out_dir, len(layout), losses, recoveries)
        shutil.rmtree(out_dir, ignore_errors=True)  # kept, with the logs, when a run fails
        return result
    finally:
        launch.kill_all()
        inbox.close()
        ctx.term()


def _check_run(
    layout: Layout,
    schedule: Schedule,
    minibatches: int,
    microbatches: int,
    vertical_sync: bool,
    backup: bool,
    evict: tuple[int, int] | None,
) -> None:
    """Refuse run options that cannot work together (`run_pipeline` says which)."""
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
    if evict is not None and not backup:
        raise AgileMLError("an injected eviction needs backup=True (nothing to recover from)")
    if evict is not None and not (0 <= evict[0] < len(layout) and 0 < evict[1] < minibatches):
        raise AgileMLError(f"evict={evict}: want (a stage, a minibatch count before the last)")


def _result(
    results: list[dict[str, Any]],
    out_dir: Path,
    stages: int,
    losses: dict[int, float],
    recoveries: list[Recovery],
) -> PipelineResult:
    """The finished run: the stages' weights in layer order, every minibatch's loss (backed
    up before a recovery, or the last attempt's own), the stages' reports."""
    weights = torch.cat(
        [torch.from_numpy(np.load(out_dir / f"stage{k}.npy")) for k in range(stages)]
    )
    for r in results:  # the last attempt's own, backed up or not
        losses.update(zip(r["loss_minibatches"], r["losses"], strict=True))
    return PipelineResult(
        seconds=max(r["ended"] for r in results) - min(r["started"] for r in results),
        losses=[losses[m] for m in sorted(losses)],
        stages=results,
        weights=weights,
        recoveries=recoveries,
    )


class _Backups:
    """The reliable tier's copy: the weights (flat, in layer order, whatever the layout) and
    the optimizer state (per weight, see `PipelineStage.optimizer_entries`) that include the
    first `done` minibatches, the most that every stage backed up, and the partial newer
    counts (stages whose updates sum different group sizes meet at common multiples)."""

    def __init__(self) -> None:
        self.done = 0
        self.weights: np.ndarray | None = None  # None: the initial weights
        self.optimizer: dict[str, torch.Tensor] = {}
        self._partial: dict[int, dict[int, tuple[np.ndarray, dict[str, torch.Tensor]]]] = {}

    def add(
        self,
        done: int,
        stage: int,
        stages: int,
        weights: np.ndarray,
        optimizer: dict[str, torch.Tensor] | None = None,
    ) -> None:
        parts = self._partial.setdefault(done, {})
        parts[stage] = (weights, optimizer or {})
        if len(parts) == stages and done > self.done:
            self.done = done
            self.weights = np.concatenate([parts[k][0] for k in range(stages)])
            self.optimizer = {key: t for k in range(stages) for key, t in parts[k][1].items()}
            self._partial = {s: p for s, p in self._partial.items() if s > done}

    def optimizer_of(self, first_layer: int, last_layer: int) -> dict[str, torch.Tensor]:
        """The optimizer entries of layers first_layer..last_layer."""
        return {
            key: t
            for key, t in self.optimizer.items()
            if first_layer <= int(key.split(".", 1)[0]) <= last_layer
        }

    def forget_partial(self) -> None:
        self._partial.clear()


def _check_layout(
    layout: Layout, layers: int, schedule: Schedule, minibatches: int, microbatches: int
) -> None:
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


class _Launch:
    """Starting, watching and stopping one attempt's stage processes."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        inbox: zmq.Socket[Any],
        rendezvous: str,
        token: bytes,
        out_dir: Path,
        deadline: float,
        common: dict[str, Any],
    ) -> None:
        self.ctx, self.inbox, self.rendezvous, self.token = ctx, inbox, rendezvous, token
        self.out_dir, self.deadline, self.common = out_dir, deadline, common
        self.procs: list[subprocess.Popen[str]] = []
        self.workers: list[tuple[int, int]] = []
        self.results: list[dict[str, Any]] = []
        self.attempt = 0

    def start(
        self,
        layout: Layout,
        backups: _Backups,
        times: tuple[list[float], list[float]],
    ) -> None:
        """Start every worker of `layout` from the reliable copy (the initial model if it is
        empty)."""
        first_minibatch, initial = backups.done, backups.weights
        self.attempt += 1
        self._started_at = time.time()
        self.job_id = f"pipe-{secrets.token_hex(4)}"
        env = {**os.environ, AGILEML_TOKEN_ENV: self.token.hex(), "OMP_NUM_THREADS": "1"}
        common = {k: v for k, v in self.common.items() if k != "sizes"}
        offsets = np.cumsum([0, *self.common["sizes"]])
        self.procs, self.workers = [], []  # workers: (stage, replica) of each process
        counts = tuple(st.replicas for st in layout)
        for k, st in enumerate(layout):
            weights = optimizer = None
            if initial is not None:
                weights = str(self.out_dir / f"initial{self.attempt}-{k}.npy")
                np.save(weights, initial[offsets[st.first_layer] : offsets[st.last_layer + 1]])
            entries = backups.optimizer_of(st.first_layer, st.last_layer)
            if entries:
                optimizer = str(self.out_dir / f"optimizer{self.attempt}-{k}.safetensors")
                save_file(entries, optimizer)
            for r in range(st.replicas):
                config = StageConfig(
                    job_id=self.job_id,
                    stage=k,
                    stages=len(layout),
                    replicas=counts,
                    replica=r,
                    first_layer=st.first_layer,
                    last_layer=st.last_layer,
                    forward_ms=times[0][k],
                    backward_ms=times[1][k],
                    rendezvous=self.rendezvous,
                    out_dir=str(self.out_dir),
                    first_minibatch=first_minibatch,
                    initial_weights=weights,
                    initial_optimizer=optimizer,
                    **common,
                )
                name = f"stage{k}.{r}-{self.attempt}"
                path = self.out_dir / f"{name}.json"
                path.write_text(config.model_dump_json())
                log = (self.out_dir / f"{name}.log").open("w")
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "orchestrator.agileml.pipeline.stage", str(path)],
                        stdout=subprocess.PIPE,
                        stderr=log,
                        text=True,
                        env=env,
                    )
                )
                self.workers.append((k, r))

    def run(
        self,
        evict: tuple[int, int] | None,
        losses: dict[int, float],
        backups: _Backups,
        recoveries: list[Recovery],
        on_backup: Callable[[int, dict[int, float]], None] | None = None,
    ) -> str:
        """Rendezvous and watch until every worker is done ("done") or one died ("lost")."""
        procs, workers = self.procs, len(self.procs)
        stages = self.workers[-1][0] + 1
        hellos: dict[int, str] = {}
        done: set[int] = set()
        while len(done) < workers:
            codes = [p.poll() for p in procs]
            crashed = [w for w, code in enumerate(codes) if code is not None and code > 0]
            if crashed:  # an error in the stage's code, not a lost node: retrying repeats it
                raise AgileMLError(self._crash_report(crashed[0]))
            dead = [self.workers[w][0] for w, code in enumerate(codes) if code not in (None, 0)]
            if dead:
                if not self.common["backup"]:
                    raise AgileMLError(f"stage {dead[0]} failed (logs in {self.out_dir})")
                if not recoveries or recoveries[-1].killed_at < self._started_at:
                    recoveries.append(Recovery(dead[0], time.time(), 0, ()))  # not injected
                self.kill_all()
                backups.forget_partial()  # minibatches not every stage backed up are redone
                return "lost"
            remaining = int((self.deadline - time.monotonic()) * 1000)
            if remaining <= 0:
                raise AgileMLError(f"the pipeline did not finish in time (logs in {self.out_dir})")
            if not self.inbox.poll(min(remaining, 100)):
                continue
            try:
                header, tensors = wire.decode(self.inbox.recv_multipart(), self.token)
            except WireError:
                continue  # not ours or malformed: dropped unread
            if header.job_id != self.job_id or header.clock is None:
                continue  # a late message of an earlier attempt
            if header.detail == "hello":
                hellos[header.clock] = wire.parse_json_body(tensors)["inbox"]
                if len(hellos) == workers:
                    self._send_peers(hellos)
            elif header.detail == "backup":
                worker, included = self._worker_of(header.sender), header.clock
                if worker is None:
                    continue
                stage, replica = self.workers[worker]
                if replica == 0:
                    blob = tensors["o"].numpy().tobytes() if "o" in tensors else b""
                    optimizer = load_entries(blob) if blob else None
                    backups.add(included, stage, stages, tensors["w"].numpy().copy(), optimizer)
                losses.update(zip(tensors["mb"].tolist(), tensors["loss"].tolist(), strict=True))
                if on_backup is not None and stage == 0 and replica == 0:
                    on_backup(included, losses)
                if evict is not None and stage == 0 and included >= evict[1]:
                    procs[self.workers.index((evict[0], 0))].send_signal(signal.SIGKILL)
                    recoveries.append(Recovery(evict[0], time.time(), 0, ()))
                    evict = None
            elif header.detail == "first":  # stage 0 completed its first minibatch
                if recoveries and recoveries[-1].next_minibatch_at is None:
                    recoveries[-1].next_minibatch_at = time.time()
            elif header.detail == "done":
                done.add(header.clock)
        self.results = []
        for proc in procs:
            try:
                stdout, _ = proc.communicate(timeout=max(1.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AgileMLError(f"a stage did not exit (logs in {self.out_dir})") from None
            lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
            if proc.returncode != 0 or not lines:
                raise AgileMLError(f"a stage failed (logs in {self.out_dir})")
            self.results.append(json.loads(lines[-1]))
        self.results.sort(key=lambda r: (r["stage"], r["replica"]))
        return "done"

    def _crash_report(self, worker: int, tail_lines: int = 12) -> str:
        stage, replica = self.workers[worker]
        log = self.out_dir / f"stage{stage}.{replica}-{self.attempt}.log"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        tail = "\n".join(lines[-tail_lines:])
        return f"stage {stage} (replica {replica}) crashed; the end of its log:\n{tail}"

    def _worker_of(self, sender: str | None) -> int | None:
        try:
            worker = int((sender or "").removeprefix("worker"))
        except ValueError:
            return None
        return worker if 0 <= worker < len(self.workers) else None

    def _send_peers(self, hellos: dict[int, str]) -> None:
        self._started_at = time.time()
        peers = {str(k): v for k, v in hellos.items()}
        for k, endpoint in hellos.items():
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(endpoint)
            fields = {"kind": MessageKind.PIPE, "job_id": self.job_id, "sender": "launcher",
                      "seq": k, "clock": 0, "detail": "peers"}  # fmt: skip
            sock.send_multipart(wire.encode(fields, wire.json_body(peers), self.token))
            sock.close()

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()
