"""Simulator commands of the `orchestrator` CLI: `simulate` (compare strategies on replayed
prices and evictions) and `ledger-check` (recompute a ledger's bill)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from pydantic import ValidationError

from orchestrator.cli.app import (
    app,
    err,
    finite,
    out,
    rates_option,
    validation_to_user_error,
)
from orchestrator.errors import UserError

if TYPE_CHECKING:  # the simulator loads only when a command runs
    from orchestrator.sim.runner import SimConfig

T = TypeVar("T")

PricesOption = Annotated[
    list[Path] | None,
    typer.Option(
        "--prices",
        help="Folder of DescribeSpotPriceHistory JSON files "
        "(repeatable). Default: the bundled us-east-1 2020 prices.",
    ),
]
AvailabilityOption = Annotated[
    Path | None,
    typer.Option(
        "--availability",
        help="Availability trace CSV `ms,add|remove,node` (default: the bundled 32-node p3 trace).",
    ),
]
StrategyOption = Annotated[
    str | None,
    typer.Option(
        "--strategy",
        help="Comma-separated strategies to compare (default: all six: "
        "on-demand,standard-checkpoint,standard-agileml,cheapest-failover,bidbrain,oracle).",
    ),
]
LedgerOption = Annotated[
    Path | None,
    typer.Option(
        "--ledger",
        help="Write every billed interval as JSON lines "
        "(gzip-compressed when the name ends in .gz).",
    ),
]
PlotOption = Annotated[
    Path | None,
    typer.Option(
        "--plot",
        help="Save a PNG of cost and runtime per strategy; a path ending in .html gets the "
        "dashboard's run report instead (every strategy replayed from the first start: "
        "spend, nodes and evictions, prices; one self-contained file).",
    ),
]
JobHoursOption = Annotated[
    float | None, typer.Option("--job-hours", help="Job length on on-demand [20].")
]
NodesOption = Annotated[
    int | None, typer.Option("--nodes", help="Reference GPUs the job's work needs [16].")
]
BillingOption = Annotated[
    str | None,
    typer.Option("--billing", help="per-second (today, default) or hourly-refund (2016)."),
]
MaxScaleOption = Annotated[
    float | None,
    typer.Option("--max-scale", help="Max throughput as a multiple of --nodes [1.0]."),
]
ConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config",
        help="YAML or JSON file of simulation settings (any SimConfig field: overheads "
        "under app/runtime/bidbrain, gpu_work_rates, ...); options given here win.",
    ),
]


@app.command()
def simulate(
    prices: PricesOption = None,
    availability: AvailabilityOption = None,
    strategy: StrategyOption = None,
    job_hours: JobHoursOption = None,
    nodes: NodesOption = None,
    starts: Annotated[
        int | None, typer.Option("--starts", help="Random start times [1000].")
    ] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="\\[default: 1]")] = None,
    billing: BillingOption = None,
    reference_type: Annotated[
        str | None, typer.Option("--reference-type", help="\\[default: p3.2xlarge]")
    ] = None,
    budget: Annotated[
        float | None, typer.Option("--budget", help="Job budget in USD (default: none).")
    ] = None,
    max_scale: MaxScaleOption = None,
    deadline_hours: Annotated[
        float | None,
        typer.Option(
            "--deadline-hours",
            help="Each job's deadline, hours after its start (default: none); the JSON gets "
            "each strategy's deadline_met_fraction.",
        ),
    ] = None,
    gpu_work_rates: Annotated[
        str | None,
        typer.Option(
            "--gpu-work-rates",
            help="The job's stated rates per GPU model, over the catalog's (V100 = 1.0), "
            "e.g. K80=0.3: what strategies decide with before they learn.",
        ),
    ] = None,
    true_work_rates: Annotated[
        str | None,
        typer.Option(
            "--true-work-rates",
            help="The job's real rates where they differ from the stated ones, e.g. K80=0.15: "
            "instances work at these; bidbrain learns them, bidbrain-static never does.",
        ),
    ] = None,
    workers: Annotated[
        int | None, typer.Option("--workers", help="Processes (default: cores).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    ledger: LedgerOption = None,
    plot: PlotOption = None,
    config_file: ConfigOption = None,
) -> None:
    """Compare strategies on replayed spot prices and evictions from many start times."""
    from orchestrator.sim.report import render_table
    from orchestrator.sim.runner import load_world
    from orchestrator.sim.runner import simulate as run_simulation

    given = {
        "prices": tuple(prices) if prices else None,
        "availability": availability,
        "strategies": _names(strategy),
        "job_hours": job_hours,
        "nodes": nodes,
        "starts": starts,
        "seed": seed,
        "billing": billing,
        "reference_type": reference_type,
        "budget_usd": budget,
        "max_scale": max_scale,
        "deadline_hours": deadline_hours,
        "gpu_work_rates": rates_option(gpu_work_rates, "--gpu-work-rates"),
        "true_work_rates": rates_option(true_work_rates, "--true-work-rates"),
        "workers": workers,
    }
    config = simulation_config(config_file, given)
    if plot is not None:
        _check_plot_path(plot)
    world = load_world(config)
    try:
        with _open_for_writing(ledger, "--ledger") as ledger_file:
            report = _with_progress(
                lambda progress: run_simulation(
                    config, world=world, ledger_out=ledger_file, on_progress=progress
                ),
                total=config.starts,
                label=f"simulating {len(config.strategies)} strategies",
            )
    except OSError as exc:  # the simulation itself reads and writes nothing else
        if ledger is None:
            raise
        raise UserError(
            f"cannot write {ledger}: {exc.strerror or exc}",
            field="--ledger",
            fix="pass a path on a disk with room, in a folder you can write to",
        ) from None
    if as_json:
        sys.stdout.write(json.dumps(report.as_dict(), allow_nan=False) + "\n")
    else:
        render_table(report, out)
    if plot is not None:
        saved = _save_plot(plot, config, world, report)
        if not as_json:
            out.print(saved)


def simulation_config(config_file: Path | None, given: Mapping[str, Any]) -> SimConfig:
    """The run's settings: the config file's, with the options given (not None) over them.

    Raises:
        UserError: the file cannot be read, or a setting is invalid (naming its option).
    """
    from orchestrator.settings import read_config_file
    from orchestrator.sim.runner import sim_config

    settings = read_config_file(config_file, option="--config") if config_file else {}
    try:
        return sim_config({**settings, **{k: v for k, v in given.items() if v is not None}})
    except ValidationError as exc:
        raise validation_to_user_error(exc, config_file) from None


def _check_plot_path(plot: Path) -> None:
    """Refuse, before simulating, a --plot that cannot be written: no such folder, or a name
    whose suffix is neither .html (the run report) nor an image format matplotlib writes.

    Raises:
        UserError: naming --plot.
    """
    if not plot.parent.is_dir():
        raise UserError(
            f"cannot write plot {plot}: folder {plot.parent} does not exist",
            field="--plot",
            fix="create the folder or pass another path",
        )
    if plot.suffix.lower() in (".html", ".htm"):
        return
    from orchestrator.extras import require

    require(
        "plot", what=f"--plot {plot.name} (an image; a .html report needs nothing)", field="--plot"
    )
    from matplotlib.backend_bases import FigureCanvasBase

    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    if plot.suffix.lower().removeprefix(".") not in formats:
        raise UserError(
            f"cannot write plot {plot}: its name ends in neither .html (the run report) nor an "
            "image format",
            field="--plot",
            fix=f"name a .html file or an image: .{', .'.join(formats)}",
        )


def _save_plot(plot: Path, config: Any, world: Any, report: Any) -> str:
    """Write the PNG plot, or the dashboard's run report for an .html path; say what."""
    if plot.suffix.lower() in (".html", ".htm"):
        from orchestrator.sim.dashboard import write_run_report

        shown = write_run_report(config, world, report.ondemand_cost_usd, plot)
        return f"report saved to {plot} (every strategy replayed from {shown})"
    from orchestrator.sim.report import save_plot

    save_plot(report, plot)
    return f"plot saved to {plot}"


def _names(text: str | None) -> tuple[str, ...] | None:
    return None if text is None else tuple(x.strip() for x in text.split(",") if x.strip())


def _open_for_writing(path: Path | None, option: str) -> Any:
    """A context manager for text writing (`None`: nothing to write; a `.gz` path is
    gzip-compressed)."""
    import contextlib
    import gzip

    if path is None:
        return contextlib.nullcontext(None)
    try:
        # returned to the caller's `with` block, which closes it
        file: IO[str] = gzip.open(path, "wt") if path.suffix == ".gz" else path.open("w")  # noqa: SIM115
    except OSError as exc:
        raise UserError(
            f"cannot write {path}: {exc.strerror}",
            field=option,
            fix="pass a path in a folder you can write to",
        ) from None
    return file


def _with_progress(
    work: Callable[[Callable[[int, int], None] | None], T], *, total: int, label: str
) -> T:
    """Run `work(progress_callback)`, showing a progress bar on an interactive stderr."""
    if not err.is_terminal:
        return work(None)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    ) as bar:
        task = bar.add_task(label, total=total)
        return work(lambda done, _total: bar.update(task, completed=done))


# -- ledger-check -------------------------------------------------------------------------


@app.command("ledger-check")
def ledger_check(
    ledger: Annotated[Path, typer.Argument(help="The JSON-lines ledger `simulate` wrote.")],
    prices: Annotated[list[Path] | None, typer.Option("--prices")] = None,
    billing: Annotated[str, typer.Option("--billing")] = "per-second",
    report: Annotated[
        Path | None, typer.Option("--report", help="The `simulate --json` output to compare to.")
    ] = None,
    tolerance: Annotated[float, typer.Option("--tolerance")] = 0.001,
) -> None:
    """Recompute a ledger's bill from the price files and the catalog; exit 1 on a mismatch."""
    from orchestrator.market.trace_source import TracePriceSource, bundled_prices_dir
    from orchestrator.sim.ledger import verify_ledger

    finite(tolerance, "--tolerance", low=0.0, high=1.0)
    history = TracePriceSource(prices or [bundled_prices_dir("us-east-1")]).all()
    expected = None
    if report is not None:
        try:
            expected = json.loads(report.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UserError(
                f"cannot read report {report}: {exc}",
                field="--report",
                fix="pass the file `simulate --json` printed",
            ) from None
    result = verify_ledger(ledger, history, billing=billing, report=expected)
    out.print(result.render())
    if result.max_relative_error > tolerance:
        raise typer.Exit(1)
