"""The `plan` command of the `orchestrator` CLI: PipeDream's partitioner on a PROFILE.json.

Importing this module registers it on `orchestrator.cli.app` (`orchestrator.cli.console` does so).
numpy and the planner are imported inside the command. Exit codes: 0 ok; 2 user errors
(missing or invalid profile, bad --workers/--bandwidth/--levels/--stages), printed as
`error: ...` and `To fix: ...` without a traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from orchestrator.cli.app import app, out
from orchestrator.errors import UserError

if TYPE_CHECKING:
    from orchestrator.agileml.pipeline import ModelProfile, Plan

#: planner argument -> the option that sets it, for error messages
_OPTION_OF_ARGUMENT = {
    "workers": "--workers",
    "bandwidth_bytes_per_s": "--bandwidth",
    "levels": "--levels",
    "stages": "--stages",
    "layers": "--profile",
}
_LEVELS_FIX = "write workers-per-component:bytes-per-s from the lowest level up, e.g. 4:1e10,2:1e9"


@app.command("plan")
def plan_command(
    workers: Annotated[
        int,
        typer.Option("--workers", min=1, max=4096, help="Workers (GPUs) to use, all of them."),
    ],
    bandwidth: Annotated[
        float, typer.Option("--bandwidth", help="Link bandwidth in bytes/s (one flat level).")
    ],
    profile: Annotated[
        Path | None,
        typer.Option(
            "--profile",
            help='PROFILE.json: {"layers": [{"name", "forward_ms", "backward_ms", '
            '"activation_bytes", "parameter_bytes"}]}.',
        ),
    ] = None,
    job: Annotated[
        Path | None,
        typer.Option(
            "--job",
            help="Profile JOB.py's layers here instead (model() an nn.Sequential, or the job's "
            "stages(model)), on one microbatch of --global-batch.",
        ),
    ] = None,
    global_batch: Annotated[
        int, typer.Option("--global-batch", help="With --job: rows per iteration.", min=1)
    ] = 256,
    save_profile: Annotated[
        Path | None,
        typer.Option("--save-profile", help="With --job: also write the profile as JSON here."),
    ] = None,
    levels: Annotated[
        str | None,
        typer.Option(
            "--levels",
            help="Hierarchical topology, lowest level first: `m:bytes_per_s,...`, e.g. "
            "4:1e10,2:1e9 for 2 servers of 4 GPUs; replaces --bandwidth.",
        ),
    ] = None,
    stages: Annotated[
        int | None, typer.Option("--stages", help="Force this many stages (pipeline depth).")
    ] = None,
    minibatches: Annotated[
        int | None,
        typer.Option(
            "--minibatches",
            min=1,
            help="Size a job of this many minibatches for BidBrain: adds its work_gpu_hours, "
            "max_gpus and gpu_work_rates (the catalog's, scaled by the planned parallel "
            "efficiency) for the job spec. The profile is taken as measured on one V100.",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Split a profiled model into pipeline stages with replicas (PipeDream's planner)."""
    from orchestrator.agileml.pipeline import PlanError, plan
    from orchestrator.agileml.pipeline.sizing import size_pipeline_job
    from orchestrator.market.catalog import Catalog

    model = _profile(profile, job, global_batch, workers)
    if save_profile is not None:
        if job is None:
            raise UserError("--save-profile needs --job", field="--save-profile")
        model.to_json(save_profile)
    source = profile if profile is not None else job
    assert source is not None
    topology = _parse_levels(levels) if levels is not None else None
    try:
        result = plan(model, workers, bandwidth, levels=topology, stages=stages)
        sizing = None
        if minibatches is not None:
            rates = Catalog.load().gpu_work_rates
            sizing = size_pipeline_job(model, workers, bandwidth, minibatches, rates,
                                       levels=topology)  # fmt: skip
    except PlanError as exc:
        option = _OPTION_OF_ARGUMENT.get(exc.field or "", exc.field or "input")
        raise UserError(f"{option}: {exc.message}", fix=exc.fix, field=option) from None
    if as_json:
        body = result.as_dict()
        if sizing is not None:
            body["bidbrain"] = {
                **sizing.job_fields(),
                "parallel_efficiency": sizing.parallel_efficiency,
                "single_worker_per_s": sizing.single_worker_per_s,
            }
        sys.stdout.write(json.dumps(body) + "\n")
    else:
        _render(model, result, source)
        if sizing is not None:
            out.print(
                f"For BidBrain ({minibatches} minibatches): work_gpu_hours "
                f"{sizing.work_gpu_hours:.4g}, max_gpus {workers}, parallel efficiency "
                f"{sizing.parallel_efficiency:.3f} (gpu_work_rates = the catalog's x that); "
                "--json prints them as job-spec fields"
            )


def _profile(
    profile: Path | None, job: Path | None, global_batch: int, workers: int
) -> ModelProfile:
    """The profile read from --profile, or measured from --job's layers here."""
    from orchestrator.agileml.pipeline import ModelProfile

    if (profile is None) == (job is None):
        raise UserError(
            "give one of --profile PROFILE.json and --job JOB.py",
            fix="--job profiles your job's layers on this machine",
            field="--profile",
        )
    if profile is not None:
        return ModelProfile.from_json(profile)
    from orchestrator.agileml.jobcode import job_file
    from orchestrator.agileml.pipeline.trainrun import profile_job

    return profile_job(str(job_file(str(job))), seed=0, global_batch=global_batch, workers=workers)


def _parse_levels(text: str) -> list[tuple[int, float]]:
    """'4:1e10,2:1e9' -> [(4, 1e10), (2, 1e9)]. Raises UserError naming --levels."""
    levels = []
    for part in text.split(","):
        devices, sep, bandwidth = part.strip().partition(":")
        try:
            if not sep:
                raise ValueError
            levels.append((int(devices), float(bandwidth)))
        except ValueError:
            raise UserError(
                f"--levels: cannot read {part.strip()!r} as workers:bytes_per_s",
                fix=_LEVELS_FIX,
                field="--levels",
            ) from None
    return levels


def _render(model: ModelProfile, result: Plan, profile: Path) -> None:
    table = Table(title=f"Pipeline plan for {profile}")
    for column in ("stage", "layers", "first .. last layer", "replicas"):
        table.add_column(column, justify="left" if column == "first .. last layer" else "right")
    for number, stage in enumerate(result.stages, start=1):
        names = f"{model.layers[stage.first_layer].name} .. {model.layers[stage.last_layer].name}"
        span = f"{stage.first_layer}-{stage.last_layer}"
        table.add_row(str(number), span, names, str(stage.replicas))
    out.print(table)
    out.print(
        f"NOAM {result.noam} in-flight minibatches per input-stage replica; "
        f"{result.time_per_minibatch_ms:.3f} ms per minibatch "
        f"({result.throughput_per_s():.1f}/s) vs {result.data_parallel_ms:.3f} ms data-parallel: "
        f"{result.speedup_vs_data_parallel:.2f}x"
    )
