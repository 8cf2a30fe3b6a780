"""`orchestrator train`: a user's job on local processes, through the real runtime (wire,
parameter servers, elasticity controller), with faults injected at given iterations, like
`torchrun --standalone` for an elastic spot job.

    result = train_locally(TrainPlan(code="job.py", nodes=4, iterations=300), on_progress=print)
    save_outputs(result, Path("out"))   # out/model.safetensors, out/summary.json

An injection `evict@100` gives one transient node its spot interruption notice (it finishes its
clocks, hands off and leaves), `join@150` has a new transient node join (its process is started
with the others and held until then, so that the join is not a process start-up late),
`kill@200` SIGKILLs one transient node without notice, `kill-device@250` one device process of
a transient node (`devices_per_node` > 1: it goes on with one device and leaves). The job's
result does not depend on them: the global batches are fixed, and every clock's gradient is
applied exactly once.
Checkpoints (`checkpoint_every`) let a later run `resume` where this one was.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from orchestrator.agileml import checkpoints
from orchestrator.agileml.control import TrainingSpec
from orchestrator.agileml.elasticity import NodeState, NodeTier
from orchestrator.agileml.errors import AgileMLError
from orchestrator.agileml.evaluations import EvaluationWatch, evaluate_trained
from orchestrator.agileml.event_files import write_scalars
from orchestrator.agileml.jobcode import (
    check_job_code,
    load_job_code,
    seeded_model,
    uses_batch_statistics,
)
from orchestrator.agileml.local import LocalJob, NodeOutcome, mean_phase_seconds
from orchestrator.agileml.partitions import PartitionLayout
from orchestrator.agileml.parts import training_parts
from orchestrator.agileml.spec import MAX_ACCUMULATE, MAX_DEVICES, MAX_LOADER_WORKERS
from orchestrator.artifacts import WEIGHTS, folder_at
from orchestrator.errors import UserError
from orchestrator.straggler.spec import StragglerSpec
from orchestrator.units import MAX_SEED

WARMUP_ITERATIONS = 5  # not counted in the time per iteration
TENSORBOARD = "tensorboard"  # the folder of a run's event files under --out
NEAR_EVENT = 2  # iterations on either side of an injection not counted either
MAX_PARTITIONS = 16
#: Bytes of model per partition (BytePS's default partition size is ~4 MB): the digits CNN
#: (9,930 values) is one partition, the 5,001,000-value MLR five.
PARTITION_TARGET_BYTES = 4 * 1024 * 1024
_INJECTION = re.compile(r"^(evict|join|kill|kill-device)@(\d+)$")


class Injection(BaseModel):
    """A fault at an iteration (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["evict", "join", "kill", "kill-device"]
    at: Annotated[int, Field(ge=0)]


def parse_injections(text: str) -> list[Injection]:
    """`"evict@100,join@150,kill@200"` as injections, in iteration order.

    Raises:
        UserError: a malformed item (named, with the expected form).
    """
    out = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        m = _INJECTION.match(item)
        if m is None:
            raise UserError(
                f"--inject: {item!r} is not KIND@ITERATION with KIND one of evict, join, kill, "
                f"kill-device (e.g. 'evict@100,join@150,kill@200')"
            )
        out.append(Injection(kind=m.group(1), at=int(m.group(2))))
    return sorted(out, key=lambda i: i.at)


class TrainPlan(BaseModel):
    """What `train_locally` runs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    code: str
    nodes: Annotated[int, Field(ge=1, le=64)] = 4  # transient nodes at the start
    reliable: Annotated[int, Field(ge=1, le=16)] = 1
    iterations: Annotated[int, Field(ge=1, le=1_000_000_000)] = 300
    global_batch: Annotated[int, Field(ge=1, le=10_000_000)] = 256
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] = 0
    injections: tuple[Injection, ...] = ()
    slack: Annotated[int, Field(ge=0, le=100)] = 0
    # partitions of the model; None: by its size (`auto_partitions`)
    partitions: Annotated[int, Field(ge=1, le=4096)] | None = None
    checkpoint_dir: str | None = None  # checkpoints written here (see `checkpoints`)
    checkpoint_every: Annotated[int, Field(ge=0, le=1_000_000_000)] = 0  # iterations; 0: none
    resume: str | None = None  # a checkpoint, or a folder of them (the newest is taken)
    overlap: bool = False  # communication overlapped with computation (`agileml.streams`)
    # micro-batches per worker per iteration (gradient accumulation; the global batch is kept)
    accumulate: Annotated[int, Field(ge=1, le=MAX_ACCUMULATE)] = 1
    # the workers' forward and loss (`agileml.precision`; fp16 with a dynamic loss scale)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    # what pushes and pulls carry (`TrainingSpec.wire_precision`; bf16: half the bytes)
    wire_precision: Literal["fp32", "bf16"] = "fp32"
    # each iteration's gradient clipped to this global norm (`agileml.clipping`); None: not
    clip_grad_norm: Annotated[float, Field(gt=0, le=1e9, strict=True)] | None = None
    # DataLoader processes per node reading its next share ahead (`agileml.loading`)
    loader_workers: Annotated[int, Field(ge=0, le=MAX_LOADER_WORKERS)] = 2
    # devices each node trains on, one worker each (`agileml.devices`; CPU processes here)
    devices_per_node: Annotated[int, Field(ge=1, le=MAX_DEVICES)] = 1
    # the job's evaluate() every this many iterations, on a checkpoint (`agileml.evaluations`)
    eval_every: Annotated[int, Field(ge=1, le=1_000_000_000)] | None = None
    # pipeline-parallel instead (`agileml.pipeline.trainrun`): its schedule and, if given, depth
    pipeline: bool = False
    schedule: Literal["1f1b", "flush", "gpipe", "2bw"] = "flush"
    stages: Annotated[int, Field(ge=1, le=64)] | None = None


@dataclass
class TrainResult:
    """What a local run produced."""

    model: nn.Module
    iterations: int
    final_loss: float | None
    seconds_per_iteration: float | None  # the median of the steady iterations
    events: list[dict[str, Any]]
    losses: list[tuple[int, float]]  # (iteration, mean loss of the nodes that computed it)
    evaluation: dict[str, float] = field(default_factory=dict)
    wall_seconds: float = 0.0
    resumed_from: str | None = None  # the checkpoint the run started from
    # the workers' own timers: mean seconds per iteration in each phase (pull, compute, push)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    # the mean of the steady iterations: unlike the median, it counts the stalls
    mean_seconds_per_iteration: float | None = None
    evaluation_error: str | None = None  # what the job's evaluate() raised, if it did
    precision: str = "fp32"  # the workers' forward and loss (`TrainingSpec.precision`)
    clip_grad_norm: float | None = None  # the global norm gradients were clipped to
    # evaluate() during the run (`--eval-every`): {"iteration": n, metric: value, ...}
    evaluations: list[dict[str, Any]] = field(default_factory=list)
    # the devices each node trained on (`agileml.devices`), as its heartbeats said
    devices: dict[str, int] = field(default_factory=dict)
    # fp16: the iterations whose step every server skipped (a worker's gradient overflowed)
    skipped_steps: list[int] = field(default_factory=list)
    # what pushes and pulls carried (`wire_bytes`)
    wire: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainProgress:
    """How far a run is: the furthest iteration done, its loss, the recent time per iteration."""

    iteration: int
    total: int
    loss: float | None
    seconds_per_iteration: float | None
    starting: str | None = None  # before the first iteration: what start-up is waiting on


def check_devices(plan: TrainPlan) -> None:
    """Refuse `kill-device` when a node has one device (UserError)."""
    if plan.devices_per_node < 2 and any(i.kind == "kill-device" for i in plan.injections):
        raise UserError(
            "--inject kill-device kills one device process inside a node, and each node has "
            "one device. To fix: add --devices-per-node 2 (or more)."
        )


def check_plan(plan: TrainPlan) -> None:
    """Refuse, before any process starts, what cannot run (as UserError/JobCodeError)."""
    joins = sum(1 for i in plan.injections if i.kind == "join")
    workers = plan.nodes + plan.reliable + joins
    if plan.global_batch < workers:
        raise UserError(
            f"--global-batch {plan.global_batch} is smaller than the {workers} nodes that "
            f"would share it. To fix: use a global batch of at least {workers}."
        )
    late = [i for i in plan.injections if i.at >= plan.iterations]
    if late:
        raise UserError(
            f"--inject {late[0].kind}@{late[0].at}: the job has only {plan.iterations} "
            f"iterations. To fix: inject at an iteration below {plan.iterations}."
        )
    check_devices(plan)
    leaving = sum(1 for i in plan.injections if i.kind in ("evict", "kill", "kill-device"))
    if leaving > plan.nodes + joins - 1:
        raise UserError(
            f"--inject takes away {leaving} transient nodes of {plan.nodes + joins}; at least "
            f"one must stay. To fix: start more with --nodes."
        )
    code = load_job_code(plan.code, iterations=plan.iterations)
    check_job_code(code, global_batch=plan.global_batch, seed=plan.seed)
    if plan.checkpoint_every and plan.checkpoint_dir is None:
        raise UserError("--checkpoint-every needs --out: checkpoints go to OUT/checkpoints")
    if plan.clip_grad_norm is not None and plan.slack:
        raise UserError(
            "--clip-grad-norm needs --slack 0: the global norm of an iteration's gradient "
            "needs every worker's share of it before any partition is updated"
        )
    if plan.eval_every is not None and code.evaluate is None:
        raise UserError(
            f"--eval-every: {plan.code} defines no evaluate(model). To fix: add one that "
            "returns held-out metrics (see the job contract), or leave --eval-every out."
        )
    if plan.resume is not None:
        clock = _resume_manifest(plan.resume).clock
        if clock + 1 >= plan.iterations:
            raise UserError(
                f"--resume: the checkpoint has {clock + 1} iterations done, the job "
                f"{plan.iterations}. To fix: ask for more --iterations."
            )


def resume_point(path: str | Path) -> str:
    """The checkpoint to resume from: `path` itself, or the newest complete one in it.

    Raises:
        UserError: neither.
    """
    folder = folder_at(path)
    if folder.exists(checkpoints.MANIFEST):
        return folder.location
    newest = checkpoints.latest(folder)
    if newest is None:
        raise UserError(
            f"--resume {path}: no complete checkpoint there. To fix: name a ckpt-* directory "
            f"or the checkpoints folder of an earlier run (OUT/checkpoints)."
        )
    return newest.location


def _resume_manifest(path: str) -> checkpoints.CheckpointManifest:
    """The manifest of the checkpoint `--resume` names (UserError when it is not one)."""
    try:
        return checkpoints.read_manifest(resume_point(path))
    except AgileMLError as exc:
        raise UserError(f"--resume {path}: {exc}") from None


def auto_partitions(elements: int, nodes: int) -> int:
    """How many partitions a model of `elements` float32 values gets: one per
    `PARTITION_TARGET_BYTES` (each partition costs every worker a push and a pull per
    iteration, so a small model is latency-bound and best kept whole), at most two per node
    (they spread over the servers) and `MAX_PARTITIONS`."""
    by_size = math.ceil(elements * 4 / PARTITION_TARGET_BYTES)
    return max(1, min(by_size, 2 * nodes, MAX_PARTITIONS, elements))


def train_spec(plan: TrainPlan, job_id: str = "train") -> TrainingSpec:
    """The runtime's spec for a plan."""
    model = seeded_model(load_job_code(plan.code), plan.seed)
    total = PartitionLayout(model, 1).total
    if plan.partitions is not None:
        partitions = min(plan.partitions, total)
    else:
        partitions = auto_partitions(total, plan.nodes + plan.reliable)
    resume = str(resume_point(plan.resume)) if plan.resume is not None else None
    if resume is not None:  # the partitioning the checkpoint was written with
        written = _resume_manifest(resume).num_partitions
        if plan.partitions is not None and plan.partitions != written:
            raise UserError(
                f"--partitions {plan.partitions}: the checkpoint has {written} partitions. "
                "To fix: leave --partitions out when resuming."
            )
        partitions = written
    return TrainingSpec(
        job_id=job_id,
        code=str(Path(plan.code).resolve()),
        global_batch=plan.global_batch,
        iterations=plan.iterations,
        seed=plan.seed,
        slack=plan.slack,
        num_partitions=partitions,
        min_nodes=plan.nodes + plan.reliable,
        heartbeat_s=0.1,
        failure_timeout_s=2.0,
        # FlexRR computes a share in chunks: exact for a sum of per-row gradients, not with
        # BatchNorm's per-batch statistics; with fp16 each worker's loss scale is its own
        straggler=StragglerSpec(
            flexrr=not uses_batch_statistics(model) and plan.precision != "fp16"
        ),
        checkpoint_dir=plan.checkpoint_dir,
        checkpoint_every=math.gcd(plan.checkpoint_every, plan.eval_every or 0),
        resume_from=resume,
        overlap=plan.overlap,
        accumulate=plan.accumulate,
        precision=plan.precision,
        wire_precision=plan.wire_precision,
        clip_grad_norm=plan.clip_grad_norm,
        devices_per_node=plan.devices_per_node,
        loader_workers=plan.loader_workers,
    )


def train_locally(
    plan: TrainPlan,
    *,
    on_progress: Callable[[TrainProgress], None] | None = None,
    log_dir: Path | None = None,
) -> TrainResult:
    """Run the plan (see the module docstring); every process is gone on return.

    Raises:
        UserError / JobCodeError: the plan or the job's code cannot run (nothing started).
        AgileMLError: the run failed (a node crashed, the job was aborted, or no progress).
    """
    check_plan(plan)
    with contextlib.ExitStack() as stack:
        if plan.eval_every is not None and plan.checkpoint_dir is None:  # for the evaluations
            scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="agileml-eval-"))
            plan = plan.model_copy(update={"checkpoint_dir": scratch})
        return _run(plan, on_progress, log_dir)


def _run(
    plan: TrainPlan, on_progress: Callable[[TrainProgress], None] | None, log_dir: Path | None
) -> TrainResult:
    spec = train_spec(plan)
    parts = training_parts(spec)
    watch = None
    if plan.eval_every is not None and parts.code is not None and spec.checkpoint_dir:
        watch = EvaluationWatch(Path(spec.checkpoint_dir), plan.eval_every, parts.code, parts,
                                since_unix=time.time(), iterations=plan.iterations)  # fmt: skip
    started = time.monotonic()
    # the nodes' logs: in `log_dir`, else a temporary folder of the job's (`LocalJob`)
    with LocalJob(spec, log_dir=log_dir) as job:
        for i in range(plan.reliable):
            job.add_node(f"r{i}", NodeTier.RELIABLE)
        transient = [f"t{i}" for i in range(plan.nodes)]
        for node_id in transient:
            job.add_node(node_id, NodeTier.TRANSIENT)
        joins = sum(1 for i in plan.injections if i.kind == "join")
        for k in range(1, joins + 1):  # started now, joining when asked (see LocalJob)
            job.add_node(f"j{k}", NodeTier.TRANSIENT, held=True)
        events = _drive(job, plan, transient, on_progress, started, watch)
        params, outcomes = job.finish(_finish_timeout(plan))
    # what each node computed: its result, or (one killed here has none) its heartbeats
    heard = {n for n, losses in job.coordinator.node_losses().items() if losses}
    computed = heard | {n for n, o in outcomes.items() if o.losses}
    events += _joins_that_computed_nothing(plan, events, computed, outcomes)
    model = parts.model_with(params)
    losses = _mean_losses(outcomes)
    gaps = _steady_gaps(outcomes, plan, events)
    result = TrainResult(
        model=model,
        iterations=plan.iterations,
        final_loss=losses[-1][1] if losses else None,
        seconds_per_iteration=statistics.median(gaps) if gaps else None,
        mean_seconds_per_iteration=statistics.fmean(gaps) if gaps else None,
        events=events + [_event(e, started) for e in job.events()],
        losses=losses,
        wall_seconds=time.monotonic() - started,
        resumed_from=spec.resume_from,
        phase_seconds=mean_phase_seconds(outcomes),
        precision=spec.precision,
        clip_grad_norm=spec.clip_grad_norm,
        devices={n: k for n, k in job.coordinator.node_devices().items() if n in computed},
        skipped_steps=sorted({c for o in outcomes.values() for c in o.skipped_clocks}),
        wire=wire_bytes(
            parts.layout.total, spec.wire_precision, _buffer_partition_values(parts.layout)
        ),
    )
    if parts.code is not None:
        result.evaluation, result.evaluation_error = evaluate_trained(parts.code, model)
    if watch is not None:
        watch.poll()  # checkpoints written as the run ended
        if result.evaluation_error is None:  # and at the end
            watch.add_final(plan.iterations, result.evaluation)
        result.evaluations = watch.results  # in iteration order: polled oldest first
        result.evaluation_error = result.evaluation_error or watch.error
    return result


def _drive(
    job: LocalJob,
    plan: TrainPlan,
    transient: list[str],
    on_progress: Callable[[TrainProgress], None] | None,
    started: float,
    watch: EvaluationWatch | None = None,
) -> list[dict[str, Any]]:
    """Wait for the job to finish its iterations, injecting faults on the way (`started`:
    the run's start, on `time.monotonic`), evaluating its checkpoints with `watch`."""
    pending = list(plan.injections)
    alive = list(transient)
    joined = 0
    injected: list[dict[str, Any]] = []
    deadline = time.monotonic() + _finish_timeout(plan)
    recent: list[tuple[int, float]] = []
    while not job.coordinator.wait_done(0.1):
        crashed = job.crashed()
        if crashed:
            node_id, tail = next(iter(crashed.items()))
            raise AgileMLError(f"node {node_id} crashed; the end of its log:\n{tail}")
        if time.monotonic() > deadline:
            raise AgileMLError(f"no finish within {_finish_timeout(plan):.0f} s: {job.events()}")
        clock = job.max_clock()
        joined_nodes = {n for e in job.events() if e.kind == "joined" for n in e.nodes}
        waiting = [n for n in alive if n.startswith("j") and n not in joined_nodes]
        while pending and clock >= pending[0].at:
            if waiting and pending[0].kind != "join":
                break  # a node takes away only once the joiner computes: every fault happens
            injection = pending.pop(0)
            if injection.kind == "join":
                joined += 1
                node_id = f"j{joined}"
                job.release(node_id)
                alive.append(node_id)
                waiting.append(node_id)
            else:
                node_id = _victim(job, alive, clock)
                alive.remove(node_id)
                if injection.kind == "evict":
                    job.evict(node_id)
                elif injection.kind == "kill-device":
                    job.kill_device(node_id)  # the node goes on with one device and leaves
                else:
                    job.kill(node_id)
            injected.append(
                {
                    "at_s": round(time.monotonic() - started, 3),
                    "iteration": clock,
                    "kind": f"injected_{injection.kind}",
                    "node": node_id,
                }
            )
        if on_progress is not None:
            recent = (recent + [(clock, time.monotonic())])[-50:]
            on_progress(_progress(job, plan, recent))
        if watch is not None:
            watch.poll()
    if job.coordinator.error is not None:
        raise AgileMLError(f"the job was aborted: {job.coordinator.error}")
    for injection in pending:
        why = "a joining node was not computing yet" if waiting else "the job ended first"
        injected.append(
            {"iteration": injection.at, "kind": f"skipped_{injection.kind}", "reason": why}
        )
    return injected


def _joins_that_computed_nothing(
    plan: TrainPlan,
    injected: list[dict[str, Any]],
    computed: set[str],
    outcomes: dict[str, NodeOutcome],
) -> list[dict[str, Any]]:
    """A `skipped_join` for each node released to join (`j1` for the first `join@N`, ...)
    that is not in `computed` (the job ended while it was still joining): `injected_join`
    says only that it was let go."""
    asked = [i.at for i in plan.injections if i.kind == "join"]
    skipped = []
    for e in injected:
        node = e.get("node", "")
        if e["kind"] != "injected_join" or node in computed:
            continue
        ended = outcomes[node].ended if node in outcomes else "no result"
        why = f"{node} computed no iteration before the job ended ({ended})"
        at = asked[int(node.removeprefix("j")) - 1]
        skipped.append({"iteration": at, "kind": "skipped_join", "reason": why})
    return skipped


def _victim(job: LocalJob, alive: list[str], clock: int) -> str:
    """The oldest transient node that computes at `clock` (else the oldest one alive): the
    longest-running ones hold partitions (ActivePSs), so taking one away is the hard case, a
    hand-off on notice or a roll-back without."""
    roster = job.coordinator.view().roster
    members = set(roster.members(clock)) if roster is not None else set()
    computing = [n for n in alive if n in members]
    return (computing or alive)[0]


def _progress(job: LocalJob, plan: TrainPlan, recent: list[tuple[int, float]]) -> TrainProgress:
    clock = max(job.max_clock(), -1)
    losses = job.coordinator.node_losses()
    latest = [ls[-1] for ls in losses.values() if ls]
    loss = None
    if latest:
        top = max(c for c, _ in latest)
        values = [v for c, v in latest if c == top and math.isfinite(v)]
        loss = sum(values) / len(values) if values else None
    rate = None
    if len(recent) >= 2 and recent[-1][0] > recent[0][0]:
        rate = (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0])
    return TrainProgress(clock + 1, plan.iterations, loss, rate, _starting(job, clock))


def _starting(job: LocalJob, clock: int) -> str | None:
    """Before the first iteration, how far the start-up is (None once training)."""
    if clock >= 0:
        return None
    nodes = job.starting_nodes()
    states = [job.coordinator.node_state(n) for n in nodes]
    ready = sum(1 for s in states if s in (NodeState.READY, NodeState.ACTIVE))
    if any(e.kind == "started" for e in job.events()):
        return f"{len(nodes)} nodes started; first iteration"
    joined = sum(1 for s in states if s is not None)
    return f"starting {len(nodes)} nodes: {joined} joined, {ready} ready"


def startup_seconds(result: TrainResult) -> float | None:
    """Seconds from the run's start to the job's start (every first node joined, loaded and
    configured): the start-up, apart from the training."""
    return next((e["at_s"] for e in result.events if e.get("kind") == "started"), None)


def _finish_timeout(plan: TrainPlan) -> float:
    return 120.0 + 5.0 * plan.iterations


def wire_bytes(values: int, precision: str, fp32_values: int = 0) -> dict[str, Any]:
    """What each worker sends and receives per iteration: it pulls every value and pushes a
    gradient of each (tensor bytes; headers and MACs add under 100 bytes a partition); with
    bf16, the `fp32_values` of partitions that hold buffers travel in fp32 both ways."""
    per_value = 2 if precision == "bf16" else 4
    fp32_values = fp32_values if precision == "bf16" else 0
    moved = 2 * values * per_value + 2 * fp32_values * (4 - per_value)
    return {
        "precision": precision,
        "bytes_per_worker_iteration": moved,
        "saved_bytes_per_worker_iteration": 8 * values - moved,
    }


def _buffer_partition_values(layout: PartitionLayout) -> int:
    """The values of the partitions that hold buffers (in fp32 both ways: `Worker._delta`,
    `ServerRequests._send`)."""
    parts = range(layout.num_partitions)
    return sum(layout.size(p) for p in parts if layout.holds_buffers(p))


def _mean_losses(outcomes: dict[str, NodeOutcome]) -> list[tuple[int, float]]:
    by_clock: dict[int, list[float]] = {}
    for outcome in outcomes.values():
        for clock, loss in outcome.losses:
            if math.isfinite(loss):
                by_clock.setdefault(clock, []).append(loss)
    return [(c, sum(v) / len(v)) for c, v in sorted(by_clock.items())]


def _steady_gaps(
    outcomes: dict[str, NodeOutcome], plan: TrainPlan, injected: list[dict[str, Any]]
) -> list[float]:
    """The times between consecutive iterations' completion (the last node's), not counting
    the first iterations or those next to an injection."""
    done: dict[int, float] = {}
    for outcome in outcomes.values():
        for clock, at in outcome.ends:
            done[clock] = max(done.get(clock, at), at)
    near = {e["iteration"] + d for e in injected for d in range(-NEAR_EVENT, NEAR_EVENT + 1)}
    gaps = [
        done[c] - done[c - 1]
        for c in range(WARMUP_ITERATIONS, plan.iterations)
        if c in done and c - 1 in done and c not in near
    ]
    return gaps


def tensorboard_scalars(result: TrainResult) -> list[tuple[str, int, float]]:
    """(tag, step, value): `train/loss` at each iteration (its mean over the nodes, the step
    the iterations done after it), `eval/<metric>` at each evaluation's iteration (the run's
    final one at its last), in step order."""
    scalars = [("train/loss", c + 1, v) for c, v in result.losses if math.isfinite(v)]
    found = list(result.evaluations)
    if not found and result.evaluation:
        found = [{"iteration": result.iterations, **result.evaluation}]
    for e in found:
        for name, value in e.items():
            if name != "iteration" and isinstance(value, int | float) and math.isfinite(value):
                scalars.append((f"eval/{name}", int(e["iteration"]), float(value)))
    return sorted(scalars, key=lambda s: s[1])


def _event(e: Any, started: float) -> dict[str, Any]:
    """A runtime event, `at_s` seconds after the run started."""
    at_s = round(e.at_s - started, 3)
    return {"at_s": at_s, "kind": e.kind, "nodes": list(e.nodes), "detail": e.detail}


def save_outputs(result: TrainResult, out: Path) -> None:
    """Write `out/model.safetensors` (the model's full state_dict), `out/summary.json` and
    TensorBoard event files under `out/tensorboard/` (`event_files`: the loss per iteration,
    each evaluation's metrics at its iteration)."""
    out.mkdir(parents=True, exist_ok=True)
    checkpoints.save_weights(result.model, out, WEIGHTS)
    summary = {
        "iterations": result.iterations,
        "precision": result.precision,
        "clip_grad_norm": result.clip_grad_norm,
        "devices": sum(result.devices.values()),
        "devices_per_node": result.devices,
        "skipped_steps": result.skipped_steps,
        "wire": result.wire,
        "final_loss": result.final_loss,
        "seconds_per_iteration": result.seconds_per_iteration,
        "mean_seconds_per_iteration": result.mean_seconds_per_iteration,
        "phase_seconds": {k: round(v, 6) for k, v in result.phase_seconds.items()},
        "wall_seconds": round(result.wall_seconds, 2),
        "startup_seconds": startup_seconds(result),
        "resumed_from": result.resumed_from,
        "evaluation": result.evaluation,
        "evaluations": result.evaluations,
        "evaluation_error": result.evaluation_error,
        "events": result.events,
        "losses": [[c, round(v, 6)] for c, v in result.losses],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_scalars(out / TENSORBOARD, tensorboard_scalars(result))  # after what matters more
