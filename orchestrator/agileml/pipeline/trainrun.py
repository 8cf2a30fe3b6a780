"""`orchestrator train JOB.py --pipeline`: a user's job trained as a pipeline on local
processes, with the same plan, outputs and injections as the data-parallel path.

    result = train_pipeline_locally(TrainPlan(code="job.py", nodes=4, pipeline=True))
    save_outputs(result, Path("out"))   # out/model.safetensors loads into the job's model()

The job's layers (`model()` as an `nn.Sequential`, or its `stages(model)` hook) are profiled
on one microbatch here, and PipeDream's planner lays them out on the `nodes` workers (stages,
and replicas per stage; `stages` forces the depth). An iteration is one global batch of rows:
`microbatches` (M) microbatches of `global_batch / M` rows. Under `flush` (the default) and
`gpipe` each iteration is one synchronous optimizer step of the global batch, exactly as on one
process; `1f1b` updates each stage after every microbatch its replicas ran (PipeDream's
asynchronous schedule, with weight stashing), `2bw` after every M.

Every stage backs its weights and optimizer state up to the reliable tier (here, the
launcher) after each update. `kill@N` SIGKILLs a worker of a middle stage once the input stage
has done N iterations; `evict@N` gives it the eviction notice instead: it leaves right after
its next update is backed up, so nothing it computed is redone. Either way the node is gone
(not replaced), the job re-plans for the nodes left and resumes from the last iteration every
stage backed up. `join@N` adds a node: the job re-plans for one more and every stage restarts
from the last iteration backed up. Faults are injected in iteration order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from orchestrator.agileml.errors import AgileMLError
from orchestrator.agileml.evaluations import evaluate_trained
from orchestrator.agileml.jobcode import (
    JobCodeError,
    check_job_code,
    load_job_code,
    seeded_model,
)
from orchestrator.agileml.pipeline.launch import Fault
from orchestrator.agileml.pipeline.local import Layout, PipelineResult, run_pipeline
from orchestrator.agileml.pipeline.planner import plan as plan_stages
from orchestrator.agileml.pipeline.planner import slots_of
from orchestrator.agileml.pipeline.profiler import ModelProfile, profile_sequential
from orchestrator.agileml.pipeline.schedule import Schedule
from orchestrator.agileml.pipeline.sizing import PipelineSizing, size_pipeline_job
from orchestrator.agileml.pipeline.source import job_layers, job_source, load_layers
from orchestrator.agileml.pipeline.stage import device_for
from orchestrator.agileml.trainrun import TrainPlan, TrainProgress, TrainResult, check_devices
from orchestrator.errors import UserError

#: The link bandwidth the planner assumes between local processes (loopback, bytes/s).
LOOPBACK_BYTES_PER_S = 1e9
#: The link bandwidth the planner assumes between instances of a job (bytes/s: 10 Gbit/s).
INSTANCE_BYTES_PER_S = 1.25e9
#: ... and between the devices of one node (`--devices-per-node`: PCIe 3.0 x16, bytes/s).
NODE_DEVICES_BYTES_PER_S = 1e10
#: Microbatches per iteration aim at this many per stage (PipeDream-Flush fills a pipeline of S
#: stages with S in flight; twice that keeps the bubble at a third of a step or less).
MICROBATCHES_PER_STAGE = 2
MAX_RECOVERIES = 3


def microbatches_for(global_batch: int, stages: int) -> int:
    """M: the largest divisor of the global batch up to max(4, 2 * stages)."""
    cap = max(4, MICROBATCHES_PER_STAGE * stages)
    return max(m for m in range(1, min(cap, global_batch) + 1) if global_batch % m == 0)


def check_pipeline_plan(plan: TrainPlan) -> None:
    """Refuse, before any process starts, what a pipeline run cannot do (UserError or
    JobCodeError naming the option or function and the fix)."""
    check_devices(plan)
    for injection in plan.injections:
        if not 0 < injection.at < plan.iterations:
            raise UserError(
                f"--inject {injection.kind}@{injection.at}: want an iteration in 1.."
                f"{plan.iterations - 1}. To fix: inject within the run."
            )
    nodes = plan.nodes
    for injection in plan.injections:  # in iteration order: a join may come too late
        nodes += 1 if injection.kind == "join" else -1
        if nodes < 1:
            joins = sum(1 for i in plan.injections if i.kind == "join")
            leaving = len(plan.injections) - joins
            raise UserError(
                f"--inject takes away {leaving} nodes of {plan.nodes + joins} (none left at "
                f"{injection.kind}@{injection.at}); at least one must stay. To fix: start more "
                "with --nodes."
            )
    if plan.checkpoint_every or plan.resume is not None:
        raise UserError(
            "--checkpoint-every and --resume are not supported with --pipeline yet. To fix: "
            "leave them out (every stage's weights are backed up after each update)."
        )
    if (
        plan.accumulate != 1
        or plan.precision != "fp32"
        or plan.eval_every is not None
        or plan.clip_grad_norm is not None
    ):
        raise UserError(
            "--accumulate, --precision, --clip-grad-norm and --eval-every are data-parallel "
            "options: a pipeline runs each iteration as microbatches, in fp32, unclipped, and "
            "is evaluated at the end. To fix: leave them out with --pipeline."
        )
    code = load_job_code(plan.code, iterations=plan.iterations)
    check_job_code(code, global_batch=plan.global_batch, seed=plan.seed)
    layers = job_source(plan.code, plan.seed).layers()
    _check_untied(layers)
    workers = plan.nodes * plan.devices_per_node
    if plan.stages is not None and plan.stages > min(workers, len(layers)):
        raise UserError(
            f"--stages {plan.stages}: the job has {len(layers)} layers and {workers} stage "
            f"workers (a device each). To fix: ask for at most {min(workers, len(layers))} "
            "stages."
        )


def profile_job(code: str, *, seed: int, global_batch: int, workers: int) -> ModelProfile:
    """Each of the job's layers timed on one microbatch of its own rows on this machine (the
    microbatch a pipeline of up to `workers` stages would run). Raises JobCodeError,
    ProfileError (UserErrors)."""
    source = job_source(code, seed)
    device = torch.device(device_for(0))  # where a stage trains here (a GPU if there is one)
    layers = [layer.to(device) for layer in source.layers()]
    size = global_batch // microbatches_for(global_batch, min(workers, len(layers)))
    x, _ = source.rows().take(torch.arange(size))
    return profile_sequential(layers, x.to(device))


def size_pipeline_submission(
    code: str,
    *,
    seed: int,
    global_batch: int,
    workers: int,
    gpu_work_rates: Mapping[str, float],
    devices_per_node: int = 1,
) -> PipelineSizing:
    """BidBrain's view of a pipeline job on up to `workers` GPUs (`sizing`), on instances of
    `devices_per_node` GPUs when that divides them (the planner's two levels): its layers (tied
    weights refused) profiled here, the planner's parallel efficiency applied to the catalog's
    rates `gpu_work_rates`. Raises JobCodeError, ProfileError, PlanError (UserErrors)."""
    _check_untied(job_source(code, seed).layers())
    profile = profile_job(code, seed=seed, global_batch=global_batch, workers=workers)
    k, levels = devices_per_node, None
    if k > 1 and workers % k == 0:
        levels = [(k, NODE_DEVICES_BYTES_PER_S), (workers // k, INSTANCE_BYTES_PER_S)]
    return size_pipeline_job(profile, workers, INSTANCE_BYTES_PER_S, 1, gpu_work_rates,
                             levels=levels)  # fmt: skip


def _check_untied(layers: list[torch.nn.Module]) -> None:
    """Refuse a weight shared by two layers: stages hold their own copies (JobCodeError)."""
    owner: dict[int, int] = {}
    for index, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            first = owner.setdefault(id(p), index)
            if first != index:
                raise JobCodeError(
                    f"layers {first} and {index} share the weight `{name}` (tied weights), "
                    "which pipeline stages cannot keep in step. To fix: train this model "
                    "data-parallel (without --pipeline), or untie the weights."
                )


def plan_layout(plan: TrainPlan, nodes: int, stages: int | None = None) -> Layout:
    """PipeDream's stages and replicas of the job's layers on `nodes` nodes of
    `plan.devices_per_node` devices (see `plan_on_nodes`), from a profile of one microbatch on
    this machine. Raises PlanError/ProfileError (UserErrors)."""
    k = plan.devices_per_node
    profile = profile_job(plan.code, seed=plan.seed, global_batch=plan.global_batch,
                          workers=nodes * k)  # fmt: skip
    return plan_on_nodes(profile, nodes, k, LOOPBACK_BYTES_PER_S, stages)


def plan_on_nodes(
    profile: ModelProfile,
    nodes: int,
    devices_per_node: int,
    between_nodes_bytes_per_s: float,
    stages: int | None = None,
) -> Layout:
    """PipeDream's layout of `profile` on `nodes` nodes of `devices_per_node` devices (a
    worker each; the planner's two levels: the devices of a node, then the nodes). A forced
    depth (`stages`) above the nodes is planned on one level of every worker: its stages fill
    the nodes in order (slot // K). Raises PlanError (a UserError)."""
    k = devices_per_node
    workers = nodes * k
    levels = [(k, NODE_DEVICES_BYTES_PER_S), (nodes, between_nodes_bytes_per_s)]
    if k == 1 or (stages is not None and stages > nodes):
        levels = [(workers, between_nodes_bytes_per_s)]
    elif nodes == 1:
        levels = levels[:1]
    depth = None if stages is None else min(stages, workers)
    planned = plan_stages(profile, workers, between_nodes_bytes_per_s, levels=levels,
                          stages=depth)  # fmt: skip
    return tuple(planned.stages)


def train_pipeline_locally(
    plan: TrainPlan,
    *,
    on_progress: Callable[[TrainProgress], None] | None = None,
) -> TrainResult:
    """Run the plan as a pipeline (see the module docstring); every process is gone on return.

    Raises:
        UserError / JobCodeError: the plan or the job's code cannot run (nothing started).
        AgileMLError: the run failed (a stage crashed more than MAX_RECOVERIES times, or
            did not finish in time).
    """
    check_pipeline_plan(plan)
    code = str(Path(plan.code).resolve())
    started = time.monotonic()
    layout = plan_layout(plan, plan.nodes, plan.stages)
    m = microbatches_for(plan.global_batch, len(layout))
    # kills and notices: the node of a middle stage's first worker (kill-device: that worker)
    faults = [Fault(i.kind, i.at * m) for i in plan.injections]

    def replan(nodes: int) -> Layout:
        return plan_layout(plan, nodes, plan.stages)

    def progress(done: int, losses: dict[int, float]) -> None:
        if on_progress is None:
            return
        recent = [losses[k] for k in sorted(losses)[-m:]]
        elapsed = time.monotonic() - started
        iteration = done // m
        rate = elapsed / iteration if iteration else None
        loss = sum(recent) / len(recent) if recent else None
        on_progress(TrainProgress(iteration, plan.iterations, loss, rate))

    result = run_pipeline(
        code=code,
        layout=layout,
        schedule=Schedule(plan.schedule),
        minibatches=plan.iterations * m,
        microbatches=m,
        microbatch_size=plan.global_batch // m,
        seed=plan.seed,
        backup=True,
        faults=faults,
        replan=replan,
        max_recoveries=MAX_RECOVERIES,
        timeout_s=120.0 + 5.0 * plan.iterations,
        on_backup=progress,
        devices_per_node=plan.devices_per_node,
    )
    return _train_result(plan, code, result, m, layout, started)


def _train_result(
    plan: TrainPlan,
    code: str,
    result: PipelineResult,
    m: int,
    layout: Layout,
    started: float,
) -> TrainResult:
    """The run as `orchestrator train` reports it: the job's model with the trained weights,
    the mean loss of each iteration's microbatches, the recoveries as events."""
    job = load_job_code(code)
    model = seeded_model(job, plan.seed)
    load_layers(job_layers(job, model), result.weights)  # the model's own modules
    per_iteration = [
        (k, sum(result.losses[k * m : (k + 1) * m]) / m) for k in range(len(result.losses) // m)
    ]
    k = plan.devices_per_node

    def laid_out(layout: Layout) -> dict[str, Any]:
        if k == 1:
            return {"stages": _describe(layout)}
        return {"stages": _describe(layout), "placement": placement(layout, k)}

    events: list[dict[str, Any]] = [
        {"at_s": 0.0, "kind": "planned", **laid_out(layout), "microbatches": m}
    ]
    changes: list[dict[str, Any]] = []
    for cut, joined in result.joins:
        changes.append({"kind": "joined", "resumed_iteration": cut // m, **laid_out(joined)})
    for r in result.recoveries:
        changes.append(
            {
                "kind": "recovered",
                "stage": r.stage,
                "notice": r.notice,
                "resumed_iteration": r.resumed_minibatch // m,
                **laid_out(r.layout),
                "recovery_s": r.seconds,
            }
        )
    events += sorted(changes, key=lambda e: int(e["resumed_iteration"]))
    out = TrainResult(
        model=model,
        iterations=plan.iterations,
        final_loss=per_iteration[-1][1] if per_iteration else None,
        seconds_per_iteration=_seconds_per_iteration(result, m),
        events=events,
        losses=per_iteration,
        wall_seconds=time.monotonic() - started,
    )
    # the last attempt's workers (a device each) by node, from their results (none when a
    # node went after the last update: the weights are then the reliable copy's)
    for worker in result.stages:
        node = f"n{worker['node']}"
        out.devices[node] = out.devices.get(node, 0) + 1
    out.evaluation, out.evaluation_error = evaluate_trained(job, model)
    return out


def _seconds_per_iteration(result: PipelineResult, m: int) -> float | None:
    """Of the last attempt's steady state: M minibatches over the input stage's throughput
    after its first iteration (process start-up and the pipeline filling)."""
    try:
        return m / result.throughput_per_s(skip=m)
    except AgileMLError:
        return None  # too short to time


def placement(layout: Layout, devices_per_node: int) -> list[list[int]]:
    """The node of each stage's replicas (`PlannedStage.slots`, `devices_per_node` a node)."""
    return [[slot // devices_per_node for slot in slots] for slots in slots_of(layout)]


def _describe(layout: Layout) -> list[list[int]]:
    return [[st.first_layer, st.last_layer, st.replicas] for st in layout]
