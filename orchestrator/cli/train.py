"""The `train` command: the user's job on local processes through the real AgileML runtime
(`orchestrator.agileml.trainrun`), with injected evictions, joins and kills, and the weights
written back. Exit codes: 0 trained; 1 the run failed (a node crashed, the job was aborted);
2 bad input (no such file, a broken job module, --global-batch below the nodes, a malformed
--inject), printed as one `error:` line without a traceback.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from pydantic import ValidationError
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from orchestrator.cli.app import app as cli_app
from orchestrator.cli.app import err, out, validation_to_user_error
from orchestrator.errors import UserError

if TYPE_CHECKING:  # the runtime (and torch) load only when the command runs
    from orchestrator.agileml.trainrun import TrainPlan, TrainProgress, TrainResult


PartitionsOption = Annotated[
    int | None,
    typer.Option(
        "--partitions",
        help="Split the model into N partitions (default: one per 4 MiB, at most two per node).",
        min=1,
    ),
]
InjectOption = Annotated[
    str,
    typer.Option(
        "--inject",
        help="Faults at iterations: evict@N (spot notice), join@N (a new node), kill@N "
        "(SIGKILL), kill-device@N (SIGKILL one device process of a node, with "
        "--devices-per-node), comma-separated, e.g. evict@100,join@150,kill@200.",
    ),
]
CheckpointEveryOption = Annotated[
    int,
    typer.Option(
        "--checkpoint-every",
        help="Write a checkpoint to OUT/checkpoints every N iterations (needs --out).",
        min=0,
    ),
]
OverlapOption = Annotated[
    bool,
    typer.Option(
        "--overlap/--no-overlap",
        help="Compute on the first pulled partitions while the rest arrive, and push each "
        "partition as soon as backward has its gradients (the same gradients; off by default: "
        "see docs/results.md).",
    ),
]
ResumeOption = Annotated[
    Path | None,
    typer.Option(
        "--resume",
        help="Start from a checkpoint (a ckpt-* directory, or OUT/checkpoints of an "
        "earlier run: its newest).",
    ),
]


AccumulateOption = Annotated[
    int,
    typer.Option(
        "--accumulate",
        help="Compute each worker's rows of an iteration in K micro-batches, their gradients "
        "summed (less memory for activations; the global batch and the update are unchanged).",
        min=1,
        metavar="K",
    ),
]
PrecisionOption = Annotated[
    str,
    typer.Option(
        "--precision",
        help="fp32; bf16: each worker's forward and loss under autocast to bfloat16; fp16: to "
        "float16, with a dynamic loss scale (a step whose gradient overflowed is skipped). "
        "The parameter servers keep fp32 weights and optimizer state.",
        metavar="fp32|bf16|fp16",
    ),
]
WirePrecisionOption = Annotated[
    str,
    typer.Option(
        "--wire-precision",
        help="What pushes and pulls carry between workers and parameter servers: fp32, or "
        "bf16 (half the bytes: the gradients and the values the workers compute on rounded to "
        "bfloat16; the servers still sum and keep fp32).",
        metavar="fp32|bf16",
    ),
]
ClipOption = Annotated[
    float | None,
    typer.Option(
        "--clip-grad-norm",
        help="Scale each iteration's gradient to at most this global 2-norm over the whole "
        "model, as torch.nn.utils.clip_grad_norm_ on one process (one more round between "
        "workers and servers per iteration).",
        min=0.0,
        metavar="X",
    ),
]
LoaderWorkersOption = Annotated[
    int,
    typer.Option(
        "--loader-workers",
        help="DataLoader processes per node that read a worker's next rows while it computes "
        "(for a dataset read item by item; 0: the worker reads its rows itself).",
        min=0,
        max=16,
        metavar="N",
    ),
]
DevicesOption = Annotated[
    int,
    typer.Option(
        "--devices-per-node",
        help="Devices each node trains on, one worker per device, their gradients summed "
        "inside the node before its push; with --pipeline, a stage worker each "
        "(CPU processes stand in for GPUs without CUDA).",
        min=1,
        max=16,
        metavar="K",
    ),
]
EvalEveryOption = Annotated[
    int | None,
    typer.Option(
        "--eval-every",
        help="Run the job's evaluate(model) during the run, at least N iterations apart, on "
        "checkpoints of the weights after an exact number of iterations (training goes on); "
        "in summary.json.",
        min=1,
        metavar="N",
    ),
]
PipelineOption = Annotated[
    bool,
    typer.Option(
        "--pipeline",
        help="Train as a pipeline (PipeDream): model() must return an nn.Sequential, or the "
        "job defines stages(model); the planner splits it into stages on the nodes.",
    ),
]
ScheduleOption = Annotated[
    str,
    typer.Option(
        "--schedule",
        help="Pipeline schedule: flush (synchronous, as on one process), gpipe, 1f1b "
        "(asynchronous, weight stashing) or 2bw.",
    ),
]
StagesOption = Annotated[
    int | None,
    typer.Option("--stages", help="Pipeline depth (default: the planner's choice).", min=1),
]


@cli_app.command("train")
def train_command(
    job: Annotated[Path, typer.Argument(metavar="JOB", help="JOB.py, or a directory with job.py.")],
    nodes: Annotated[int, typer.Option("--nodes", help="Transient (spot) nodes.", min=1)] = 4,
    reliable: Annotated[
        int, typer.Option("--reliable", help="Reliable (on-demand) nodes.", min=1)
    ] = 1,
    iterations: Annotated[int, typer.Option("--iterations", help="Iterations.", min=1)] = 300,
    global_batch: Annotated[
        int, typer.Option("--global-batch", help="Rows per iteration, over all nodes.", min=1)
    ] = 256,
    seed: Annotated[int, typer.Option("--seed", help="Initial model and batch order.")] = 0,
    partitions: PartitionsOption = None,
    out_dir: Annotated[
        Path | None,
        typer.Option("--out", help="Write DIR/model.safetensors and DIR/summary.json."),
    ] = None,
    inject: InjectOption = "",
    checkpoint_every: CheckpointEveryOption = 0,
    resume: ResumeOption = None,
    overlap: OverlapOption = False,
    accumulate: AccumulateOption = 1,
    precision: PrecisionOption = "fp32",
    wire_precision: WirePrecisionOption = "fp32",
    clip_grad_norm: ClipOption = None,
    loader_workers: LoaderWorkersOption = 2,
    devices_per_node: DevicesOption = 1,
    eval_every: EvalEveryOption = None,
    pipeline: PipelineOption = False,
    schedule: ScheduleOption = "flush",
    stages: StagesOption = None,
) -> None:
    """Train JOB.py on local processes, like torchrun --standalone for a spot job."""
    from orchestrator.agileml.errors import AgileMLError
    from orchestrator.agileml.trainrun import TrainPlan, check_plan, parse_injections, save_outputs

    if not job.exists():
        raise UserError(f"job file {job} does not exist", field="JOB")
    try:
        plan = TrainPlan(
            code=str(job),
            nodes=nodes,
            reliable=reliable,
            iterations=iterations,
            global_batch=global_batch,
            seed=seed,
            partitions=partitions,
            injections=tuple(parse_injections(inject)),
            checkpoint_dir=str(out_dir / "checkpoints") if out_dir and checkpoint_every else None,
            checkpoint_every=checkpoint_every,
            resume=str(resume) if resume is not None else None,
            overlap=overlap,
            accumulate=accumulate,
            precision=precision,
            wire_precision=wire_precision,
            clip_grad_norm=clip_grad_norm,
            loader_workers=loader_workers,
            devices_per_node=devices_per_node,
            eval_every=eval_every,
            pipeline=pipeline,
            schedule=schedule,
            stages=stages,
        )
    except ValidationError as exc:
        raise validation_to_user_error(exc) from None
    if not pipeline and (schedule != "flush" or stages is not None):
        raise UserError("--schedule and --stages need --pipeline", field="--pipeline")
    if pipeline and (
        partitions is not None or overlap or reliable != 1 or accumulate != 1
        or precision != "fp32" or eval_every is not None
        or clip_grad_norm is not None or wire_precision != "fp32"
    ):  # fmt: skip
        raise UserError(
            "--partitions, --overlap, --reliable, --accumulate, --precision, --eval-every, "
            "--clip-grad-norm and --wire-precision "
            "are data-parallel options; "
            "a pipeline runs each iteration as microbatches and "
            "backs its stages up to the launcher",
            field="--pipeline",
            fix="leave them out with --pipeline",
        )
    if pipeline:
        from orchestrator.agileml.pipeline.trainrun import check_pipeline_plan

        check_pipeline_plan(plan)
    else:
        check_plan(plan)
    # the bar shows the progress, and a failure ends with its error line
    logging.getLogger("orchestrator").setLevel(logging.CRITICAL)
    log_dir = out_dir / "logs" if out_dir is not None else None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    try:
        result = _train_with_progress(plan, log_dir)
    except AgileMLError as exc:
        err.print(f"[bold red]error:[/bold red] training failed: {exc}", highlight=False)
        raise typer.Exit(1) from exc
    if out_dir is not None:  # first: nothing printed after this can lose the weights
        save_outputs(result, out_dir)
    _print_result(result)
    if out_dir is not None:
        out.print(f"wrote {out_dir / 'model.safetensors'} and {out_dir / 'summary.json'}")
        out.print(
            f"loss and evaluations for TensorBoard: tensorboard --logdir {out_dir / 'tensorboard'}",
            highlight=False,
            soft_wrap=True,
        )
        out.print(f"the nodes' logs: {out_dir / 'logs'}", highlight=False, soft_wrap=True)
    else:
        err.print("[yellow]note:[/yellow] no --out DIR: the trained weights were not saved")
    if result.evaluation_error is not None:
        err.print(f"[bold red]error:[/bold red] {result.evaluation_error}", highlight=False)
        raise typer.Exit(1)


def _train_with_progress(plan: TrainPlan, log_dir: Path | None) -> TrainResult:
    """`train_locally` under a progress bar (iteration, loss, seconds per iteration)."""
    from orchestrator.agileml.trainrun import train_locally

    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}  {task.fields[rate]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err, transient=False) as bar:
        task = bar.add_task("starting", total=plan.iterations, loss="-", rate="")

        def show(p: TrainProgress) -> None:
            bar.update(
                task,
                description=p.starting or "training",
                completed=min(p.iteration, p.total),
                loss=f"{p.loss:.4f}" if p.loss is not None else "-",
                rate=f"{p.seconds_per_iteration:.3f} s/it" if p.seconds_per_iteration else "",
            )

        if plan.pipeline:
            from orchestrator.agileml.pipeline.trainrun import train_pipeline_locally

            result = train_pipeline_locally(plan, on_progress=show)
        else:
            result = train_locally(plan, on_progress=show, log_dir=log_dir)
        bar.update(task, completed=plan.iterations)
    return result


def _print_result(result: TrainResult) -> None:
    from orchestrator.agileml.trainrun import startup_seconds

    per_it = result.seconds_per_iteration
    took = f"{result.wall_seconds:.1f} s"
    startup = startup_seconds(result)
    if startup is not None:
        took += f" (start-up {startup:.1f} s, training {result.wall_seconds - startup:.1f} s)"
    out.print(
        f"trained {result.iterations} iterations in {took}; final loss "
        f"{result.final_loss:.4f}; {per_it:.3f} s per steady iteration"
        if result.final_loss is not None and per_it is not None
        else f"trained {result.iterations} iterations in {took}"
    )
    if any(n > 1 for n in result.devices.values()):
        total, nodes = sum(result.devices.values()), len(result.devices)
        out.print(f"trained on {total} devices in {nodes} node{'s' * (nodes != 1)}",
                  highlight=False)  # fmt: skip
    if result.wire.get("precision") == "bf16":
        moved = _size(result.wire["bytes_per_worker_iteration"])
        saved = result.wire["saved_bytes_per_worker_iteration"]
        out.print(
            f"bf16 on the wire: {moved} pushed and pulled per worker per iteration "
            + (
                f"({_size(saved)} less than fp32)"
                if saved
                else "(nothing saved: every partition holds buffers' values, which travel in "
                "fp32; more --partitions split them off)"
            ),
            highlight=False,
        )
    if result.skipped_steps:
        shown = ", ".join(str(c) for c in result.skipped_steps[:10])
        more = "" if len(result.skipped_steps) <= 10 else ", ..."
        err.print(
            f"[yellow]fp16:[/yellow] {len(result.skipped_steps)} steps skipped for a gradient "
            f"that overflowed (iterations {shown}{more}; the loss scale was halved each time)",
            highlight=False,
        )
    if result.resumed_from is not None:
        out.print(f"resumed from {result.resumed_from}")
    for name, value in result.evaluation.items():
        out.print(f"evaluate: {name} = {value:.4f}")
    for found in result.evaluations:  # --eval-every: one line per evaluation
        metrics = ", ".join(f"{k} {v:.4f}" for k, v in found.items() if k != "iteration")
        out.print(f"  at iteration {found['iteration']}: {metrics}", highlight=False)
    for e in result.events:
        try:
            line = _event_line(e)
        except (TypeError, ValueError, AttributeError):  # a shape no runtime writes today
            line = f"  {e!r}"
        if line is None:
            continue
        if line.startswith("warning:"):
            err.print(Text.assemble(("warning:", "yellow"), line.removeprefix("warning:")))
        else:
            out.print(line, markup=False, highlight=False)


def _event_line(e: dict[str, Any]) -> str | None:
    """One line for an event of the run worth a user's eye (None for the rest). Pipeline
    events carry `stages` and `resumed_iteration`; the data-parallel runtime's carry `nodes`
    and `detail`: every field is read with a default, so an event of another shape prints
    less rather than failing."""
    kind = str(e.get("kind", ""))
    nodes = ", ".join(str(n) for n in e.get("nodes") or ())
    placed = f" on nodes {e['placement']}" if e.get("placement") else ""  # a pipeline's, K > 1
    if kind == "planned":
        line = (
            f"pipeline: stages {e.get('stages')} ([first, last layer, replicas]), "
            f"{e.get('microbatches')} microbatches per iteration"
        )
        if placed:
            line += f"\n {placed} (each stage's replicas)"
        if len(e.get("stages") or ()) == 1:
            line += (
                "\n  the planner found one replicated stage (data parallelism) fastest for "
                "this model; --stages K forces a pipeline of K stages"
            )
        return line
    if kind == "joined" and "resumed_iteration" in e:  # a pipeline re-planned for a joiner
        return (
            f"  a node joined: resumed at iteration {e['resumed_iteration']} on stages "
            f"{e.get('stages')}{placed}"
        )
    if kind == "recovered":
        what = "evicted (notice)" if e.get("notice") else "lost"
        whose = "the node of stage" if placed else "stage"
        return (
            f"  {what} {whose} {e.get('stage')}: resumed at iteration "
            f"{e.get('resumed_iteration')} on stages {e.get('stages')}{placed}"
        )
    if kind in ("joined", "evicted", "rolled_back", "failed"):  # the data-parallel runtime
        detail = f" ({e['detail']})" if e.get("detail") else ""
        return f"  runtime: {kind.replace('_', ' ')} {nodes}{detail}"
    if kind.startswith("injected_"):
        what = kind.removeprefix("injected_")
        return f"  {what} {e.get('node')} at iteration {e.get('iteration')}"
    if kind.startswith("skipped_"):
        what = kind.removeprefix("skipped_")
        return f"warning: {what}@{e.get('iteration')} not done: {e.get('reason')}"
    return None


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"
