"""`orchestrator demo`: the offline demo (the README's quick start)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer

from orchestrator.cli.app import app, out, rates_option
from orchestrator.errors import UserError

#: The most `--iterations` the demo takes (about an hour of training on a 2-core machine).
MAX_DEMO_ITERATIONS = 100_000


@app.command()
def demo(
    speed: Annotated[
        float, typer.Option("--speed", min=1.0, help="How many times faster than real time.")
    ] = 300.0,
    budget: Annotated[float, typer.Option("--budget", help="The sample job's budget, USD.")] = 40.0,
    seed: Annotated[int, typer.Option("--seed")] = 1,
    json_summary: Annotated[
        Path | None, typer.Option("--json-summary", help="Write the summary as JSON here.")
    ] = None,
    port: Annotated[
        int,
        typer.Option(
            "--port",
            min=0,
            max=65535,
            help="Serve the API and the live dashboard on 127.0.0.1:PORT (0: any free port).",
        ),
    ] = 8750,
    no_dashboard: Annotated[
        bool, typer.Option("--no-dashboard", help="Do not serve the API and dashboard.")
    ] = False,
    linger: Annotated[
        float,
        typer.Option(
            "--linger",
            min=0.0,
            help="Keep serving the dashboard this many seconds after the job ends (Ctrl-C "
            "stops it sooner; the summary follows).",
        ),  # fmt: skip
    ] = 0.0,
    weights_out: Annotated[
        Path | None,
        typer.Option(
            "--weights-out",
            help="Copy the weights the job hands back (model.safetensors) to this path.",
        ),
    ] = None,
    pipeline: Annotated[
        bool,
        typer.Option(
            "--pipeline",
            help="Train the job as a pipeline (its layers in stages across the instances) "
            "instead of data-parallel.",
        ),
    ] = False,
    iterations: Annotated[
        int,
        typer.Option(
            "--iterations",
            min=10,
            max=MAX_DEMO_ITERATIONS,
            help="How many iterations the sample job trains (more: a longer run to watch).",
        ),
    ] = 500,
    true_work_rates: Annotated[
        str | None,
        typer.Option(
            "--true-work-rates",
            help="The world's GPUs work at these rates instead of the catalog's, e.g. "
            "V100=0.5: BidBrain learns them from the instances' work (the job's page shows "
            "learned against catalog rates).",
        ),
    ] = None,
) -> None:
    """The offline demo: Redis, a moto EC2 server, replayed 2020 prices and p3 evictions, the
    controller and local instance agents, running one job with a budget to the end, watched on a
    live dashboard."""
    from orchestrator.extras import require

    require("offline", what="the offline demo")
    from orchestrator.demo import job_state_ok, run_demo, write_summary

    if budget <= 0 or not math.isfinite(budget):
        raise UserError(
            f"--budget must be positive, got {budget}",
            field="--budget",
            fix="pass e.g. --budget 40",
        )
    if json_summary is not None and not json_summary.parent.is_dir():
        raise UserError(
            f"cannot write {json_summary}: folder {json_summary.parent} does not exist",
            field="--json-summary",
            fix="create the folder first",
        )
    summary = run_demo(
        speed=speed,
        budget_usd=budget,
        seed=seed,
        console=out,
        port=None if no_dashboard else port,
        linger_s=linger,
        weights_out=weights_out,
        pipeline=pipeline,
        iterations=iterations,
        true_work_rates=_true_rates(true_work_rates),
    )
    if json_summary is not None:
        write_summary(summary, json_summary)
    if not job_state_ok(summary):
        raise typer.Exit(1)


def _true_rates(text: str | None) -> dict[str, float] | None:
    """`--true-work-rates` as rates per GPU model of the catalog.

    Raises:
        UserError: naming the option: not MODEL=RATE, an unknown model, a rate not > 0.
    """
    from orchestrator.market.catalog import Catalog

    given = rates_option(text, "--true-work-rates")
    if given is None:
        return None
    known = Catalog.load().gpu_work_rates
    out = {}
    for model, value in given.items():
        try:
            rate = float(value)
        except ValueError:
            rate = math.nan
        if model not in known or not (math.isfinite(rate) and rate > 0):
            raise UserError(
                f"--true-work-rates: {model}={value} is no positive rate of a GPU model",
                field="--true-work-rates",
                fix=f"pass e.g. V100=0.5; the GPU models: {', '.join(known)}",
            )
        out[model] = rate
    return out
