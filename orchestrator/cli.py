"""The `orchestrator` command line.

User errors (bad files, bad options) print what is wrong and what to do, with no traceback, and
exit with code 2; `--debug` shows the traceback.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from orchestrator import __version__
from orchestrator.errors import UserError
from orchestrator.units import SECONDS_PER_HOUR

app = typer.Typer(
    name="orchestrator",
    help="Elastic spot-instance training orchestrator: BidBrain bidding, AgileML runtime, "
    "trace-driven cost simulator.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True) if sys.stderr.isatty() else Console(stderr=True, width=200)
# A pipe or a CI log gets a wide table rather than rich's 80-column default.
out = Console() if sys.stdout.isatty() else Console(width=140)
_DEBUG = {"on": False}

#: pydantic field -> the CLI option that sets it, for error messages
_OPTION_OF_FIELD = {
    "prices": "--prices",
    "availability": "--availability",
    "job_hours": "--job-hours",
    "nodes": "--nodes",
    "starts": "--starts",
    "seed": "--seed",
    "billing": "--billing",
    "budget_usd": "--budget",
    "max_scale": "--max-scale",
    "reference_type": "--reference-type",
    "workers": "--workers",
    "strategies": "--strategy",
    "speed": "--speed",
    "replay_start": "--replay-start",
    "endpoint_url": "--endpoint-url",
    "max_running_jobs": "--max-running-jobs",
}


def _version(value: bool) -> None:
    if value:
        out.print(f"orchestrator {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks of errors.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    _DEBUG["on"] = debug


def validation_to_user_error(exc: ValidationError, config_file: Path | None = None) -> UserError:
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ())]
    field = loc[0] if loc else "input"
    option = _OPTION_OF_FIELD.get(field, ".".join(loc) or "input")
    where = f" (from {config_file} or the command line)" if config_file else ""
    fix = f"pass a valid value for {option}"
    if first.get("type") == "extra_forbidden":
        fix = f"remove {option}: it is not a setting (the README lists them under Configuration)"
    return UserError(
        f"{option}: {first.get('msg', 'invalid value')} (got {first.get('input')!r}){where}",
        fix=fix,
        field=option,
    )


def _read_config_file(path: Path) -> dict:
    """A YAML/JSON mapping of SimConfig fields. Raises UserError naming the file."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise UserError(
            f"cannot read config {path}: {exc.strerror}",
            field="--config",
            fix="pass an existing YAML or JSON file",
        ) from None
    except yaml.YAMLError as exc:
        raise UserError(
            f"config {path} is not valid YAML/JSON: {exc}",
            field="--config",
            fix="fix the syntax at the position shown",
        ) from None
    if not isinstance(data, dict):
        raise UserError(
            f"config {path} must hold a mapping of settings, not {type(data).__name__}",
            field="--config",
            fix="write `key: value` lines, e.g. `job_hours: 2`",
        )
    return data


# -- simulate -----------------------------------------------------------------------------


@app.command()
def simulate(
    prices: Annotated[
        list[Path] | None,
        typer.Option(
            "--prices",
            help="Folder of DescribeSpotPriceHistory JSON files "
            "(repeatable). Default: the bundled us-east-1 2020 prices.",
        ),
    ] = None,
    availability: Annotated[
        Path | None,
        typer.Option(
            "--availability",
            help="Availability trace CSV `ms,add|remove,node` "
            "(default: the bundled 32-node p3 trace).",
        ),
    ] = None,
    strategy: Annotated[
        str | None,
        typer.Option(
            "--strategy",
            help="Comma-separated strategies to compare (default: all six: "
            "on-demand,standard-checkpoint,standard-agileml,cheapest-failover,bidbrain,oracle).",
        ),
    ] = None,
    job_hours: Annotated[
        float | None, typer.Option("--job-hours", help="Job length on on-demand [default: 20].")
    ] = None,
    nodes: Annotated[
        int | None, typer.Option("--nodes", help="Reference GPUs the job's work needs [16].")
    ] = None,
    starts: Annotated[
        int | None, typer.Option("--starts", help="Random start times [1000].")
    ] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="[default: 1]")] = None,
    billing: Annotated[
        str | None,
        typer.Option("--billing", help="per-second (today, default) or hourly-refund (2016)."),
    ] = None,
    reference_type: Annotated[
        str | None, typer.Option("--reference-type", help="[default: p3.2xlarge]")
    ] = None,
    budget: Annotated[
        float | None, typer.Option("--budget", help="Job budget in USD (default: none).")
    ] = None,
    max_scale: Annotated[
        float | None,
        typer.Option("--max-scale", help="Max throughput as a multiple of --nodes [1.0]."),
    ] = None,
    workers: Annotated[
        int | None, typer.Option("--workers", help="Processes (default: cores).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    ledger: Annotated[
        Path | None,
        typer.Option(
            "--ledger",
            help="Write every billed interval as JSON lines "
            "(gzip-compressed when the name ends in .gz).",
        ),
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            help="Save a PNG of cost and runtime per strategy; a path ending in .html gets the "
            "dashboard's run report instead (every strategy replayed from the first start: "
            "spend, nodes and evictions, prices; one self-contained file).",
        ),
    ] = None,
    config_file: Annotated[
        Path | None,
        typer.Option(
            "--config",
            help="YAML or JSON file of simulation settings (any SimConfig field: overheads "
            "under app/runtime/bidbrain, gpu_work_rates, ...); options given here win.",
        ),
    ] = None,
) -> None:
    """Compare strategies on replayed spot prices and evictions from many start times."""
    from orchestrator.market.trace_source import bundled_prices_dir
    from orchestrator.sim.report import render_table, save_plot
    from orchestrator.sim.runner import SimConfig, load_world
    from orchestrator.sim.runner import simulate as run_simulation

    settings = _read_config_file(config_file) if config_file else {}
    given = {
        "prices": tuple(prices) if prices else None,
        "availability": availability,
        "strategies": tuple(x.strip() for x in strategy.split(",") if x.strip())
        if strategy is not None
        else None,
        "job_hours": job_hours,
        "nodes": nodes,
        "starts": starts,
        "seed": seed,
        "billing": billing,
        "reference_type": reference_type,
        "budget_usd": budget,
        "max_scale": max_scale,
        "workers": workers,
    }
    settings.update({k: v for k, v in given.items() if v is not None})
    settings.setdefault("prices", (bundled_prices_dir("us-east-1"),))
    try:
        config = SimConfig(**settings)
    except ValidationError as exc:
        raise validation_to_user_error(exc, config_file) from None
    from orchestrator.market.billing import billing_model
    from orchestrator.sim.strategies import get_strategies

    billing_model(config.billing)
    get_strategies(list(config.strategies))
    if plot is not None and not plot.parent.is_dir():
        raise UserError(
            f"cannot write plot {plot}: folder {plot.parent} does not exist",
            field="--plot",
            fix="create the folder or pass another path",
        )
    world = load_world(config)
    ledger_file = _open_for_writing(ledger, "--ledger") if ledger else None
    try:
        report = _with_progress(
            lambda progress: run_simulation(
                config, world=world, ledger_out=ledger_file, on_progress=progress
            ),
            total=config.starts,
            label=f"simulating {len(config.strategies)} strategies",
        )
    finally:
        if ledger_file is not None:
            ledger_file.close()
    if as_json:
        sys.stdout.write(json.dumps(report.as_dict()) + "\n")
    else:
        render_table(report, out)
    if plot is not None and plot.suffix.lower() in (".html", ".htm"):
        from orchestrator.sim.dashboard import write_run_report

        shown = write_run_report(config, world, report.ondemand_cost_usd, plot)
        if not as_json:
            out.print(f"report saved to {plot} (every strategy replayed from {shown})")
    elif plot is not None:
        save_plot(report, plot)
        if not as_json:
            out.print(f"plot saved to {plot}")


def _open_for_writing(path: Path, option: str):
    """Open for text writing; a `.gz` path is gzip-compressed."""
    import gzip

    try:
        return gzip.open(path, "wt") if path.suffix == ".gz" else path.open("w")
    except OSError as exc:
        raise UserError(
            f"cannot write {path}: {exc.strerror}",
            field=option,
            fix="pass a path in a folder you can write to",
        ) from None


def _with_progress(work, *, total: int, label: str):
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


# -- demo ---------------------------------------------------------------------------------


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
            help="Keep serving the dashboard this many seconds after the job ends.",
        ),  # fmt: skip
    ] = 0.0,
) -> None:
    """The offline demo: Redis, a moto EC2 server, replayed 2020 prices and p3 evictions, the
    controller and local node agents, running one job with a budget to the end, watched on a
    live dashboard."""
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
    )
    if json_summary is not None:
        write_summary(summary, json_summary)
    if not job_state_ok(summary):
        raise typer.Exit(1)


# -- risk ---------------------------------------------------------------------------------


@app.command()
def risk(
    instance_type: Annotated[str, typer.Option("--type", help="Instance type, e.g. p3.2xlarge.")],
    zone: Annotated[str, typer.Option("--zone", help="Availability zone, e.g. us-east-1b.")],
    bid_delta: Annotated[
        float, typer.Option("--bid-delta", help="Max price over the market price, USD/h.")
    ] = 0.4,
    horizon_hours: Annotated[float, typer.Option("--horizon-hours")] = 1.0,
    prices: Annotated[list[Path] | None, typer.Option("--prices")] = None,
    availability: Annotated[Path | None, typer.Option("--availability")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Eviction risk of one market at one bid: β within the horizon and median time to eviction."""
    from orchestrator.market.catalog import Catalog
    from orchestrator.market.errors import UnknownMarketError
    from orchestrator.market.eviction import (
        AvailabilityTrace,
        CapacityHazardModel,
        CombinedEvictionModel,
        PriceCrossingModel,
    )
    from orchestrator.market.prices import Market, region_of_zone
    from orchestrator.market.trace_source import TracePriceSource, bundled_prices_dir

    if horizon_hours <= 0 or not math.isfinite(horizon_hours):
        raise UserError(
            f"--horizon-hours must be positive, got {horizon_hours}",
            field="--horizon-hours",
            fix="pass e.g. --horizon-hours 1",
        )
    if bid_delta < 0:
        raise UserError(
            f"--bid-delta must be >= 0, got {bid_delta}",
            field="--bid-delta",
            fix="pass the max price over the market, e.g. --bid-delta 0.1",
        )
    Catalog.load().get(instance_type)
    dirs = prices or [bundled_prices_dir(region_of_zone(zone))]
    history = TracePriceSource(dirs).all()
    market = Market(instance_type, zone)
    if market not in history:
        zones = sorted(m.zone for m in history if m.instance_type == instance_type)
        raise UnknownMarketError(
            f"no prices for {instance_type} in {zone}",
            fix=f"zones with {instance_type} prices: {', '.join(zones) or 'none'}",
            field="--zone",
        )
    trace = AvailabilityTrace.read(availability) if availability else AvailabilityTrace.bundled()
    price_model = PriceCrossingModel(history)
    capacity = CapacityHazardModel.from_trace(trace)
    model = CombinedEvictionModel([price_model, capacity])
    horizon_s = horizon_hours * SECONDS_PER_HOUR
    parts = {
        "price-crossing": price_model.estimate(market, bid_delta, horizon_s),
        "capacity": capacity.estimate(market, bid_delta, horizon_s),
        "combined": model.estimate(market, bid_delta, horizon_s),
    }
    result = {
        "instance_type": instance_type,
        "zone": zone,
        "bid_delta_usd": bid_delta,
        "horizon_hours": horizon_hours,
        **{
            name: {
                "beta": round(e.beta, 6),
                "median_hours": round(e.median_s / SECONDS_PER_HOUR, 3)
                if math.isfinite(e.median_s)
                else None,
            }
            for name, e in parts.items()
        },
    }
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
        return
    table = Table(title=f"Eviction risk of {market} bidding +${bid_delta}/h")
    table.add_column("cause")
    table.add_column(f"β within {horizon_hours:g} h", justify="right")
    table.add_column("median time to eviction", justify="right")
    for name, e in parts.items():
        median = f"{e.median_s / 3600:.2f} h" if math.isfinite(e.median_s) else "never"
        table.add_row(name, f"{e.beta:.3f}", median)
    out.print(table)


# -- catalog ------------------------------------------------------------------------------


@app.command()
def catalog(
    region: Annotated[str, typer.Option("--region")] = "us-east-1",
) -> None:
    """The instance catalog: vCPUs, memory, GPUs, work rate and on-demand price in a region."""
    from orchestrator.market.catalog import Catalog

    cat = Catalog.load()
    if region not in cat.regions():
        raise UserError(
            f"the catalog has no region {region!r}",
            field="--region",
            fix=f"use one of {', '.join(cat.regions())}",
        )
    table = Table(title=f"Instance catalog ({region}, on-demand Linux $/h)")
    for col in ("type", "vCPUs", "memory GiB", "GPUs", "work rate ν", "$/h", "$/h per ν"):
        table.add_column(col, justify="left" if col == "type" else "right")
    for name in cat.names():
        it = cat.get(name)
        nu = cat.work_rate(name)
        price = f"{it.on_demand_price(region):.3f}" if it.offered_in(region) else "not offered"
        per = f"{cat.price_per_work(name, region):.3f}" if nu > 0 and it.offered_in(region) else "-"
        gpus = f"{it.gpu_count}x {it.gpu_model}" if it.gpu_count else "-"
        table.add_row(name, str(it.vcpus), f"{it.memory_gib:g}", gpus, f"{nu:g}", price, per)
    out.print(table)


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

    history = TracePriceSource(prices or [bundled_prices_dir("us-east-1")]).all()
    expected = None
    if report is not None:
        try:
            expected = json.loads(report.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise UserError(
                f"cannot read report {report}: {exc}",
                field="--report",
                fix="pass the file `simulate --json` printed",
            ) from None
    result = verify_ledger(ledger, history, billing=billing, report=expected)
    out.print(result.render())
    if result.max_relative_error > tolerance:
        raise typer.Exit(1)


import orchestrator.cli_controller  # noqa: E402,F401  (registers `controller start`)
import orchestrator.cli_deploy  # noqa: E402,F401  (registers `deploy`, `worker start`)
import orchestrator.cli_jobs  # noqa: E402,F401  (registers the job commands)
import orchestrator.cli_plan  # noqa: E402,F401  (registers `plan`)


def main() -> None:
    """Entry point of the console script: user errors exit 2 without a traceback."""
    try:
        app(standalone_mode=False)
    except UserError as exc:
        if _DEBUG["on"]:
            raise
        err.print(f"[bold red]error:[/bold red] {exc.message}", highlight=False)
        if exc.fix:
            err.print(f"To fix: {exc.fix}", highlight=False)
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        err.print("aborted")
        sys.exit(130)
    except Exception as exc:  # click usage errors
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(2)
        raise


if __name__ == "__main__":
    main()
