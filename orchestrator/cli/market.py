"""Market commands of the `orchestrator` CLI: `risk` (eviction risk of one market at one bid)
and `catalog` (the instance types, their work rates and prices)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from orchestrator.cli.app import app, finite, out
from orchestrator.errors import UserError
from orchestrator.jobspec import MAX_USD_PER_HOUR
from orchestrator.units import SECONDS_PER_HOUR


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
    from orchestrator.market.risk import market_risk

    finite(bid_delta, "--bid-delta", low=0.0, high=MAX_USD_PER_HOUR)
    finite(horizon_hours, "--horizon-hours", low=1e-6, high=24.0 * 366)
    result = market_risk(
        instance_type,
        zone,
        bid_delta_usd=bid_delta,
        horizon_hours=horizon_hours,
        prices=prices,
        availability=availability,
    )
    if as_json:
        sys.stdout.write(json.dumps(result.as_dict()) + "\n")
        return
    table = Table(title=f"Eviction risk of {result.market} bidding +${bid_delta}/h")
    table.add_column("cause")
    table.add_column(f"β within {horizon_hours:g} h", justify="right")
    table.add_column("median time to eviction", justify="right")
    for cause, e in result.by_cause.items():
        median = f"{e.median_s / SECONDS_PER_HOUR:.2f} h" if math.isfinite(e.median_s) else "never"
        table.add_row(cause, f"{e.beta:.3f}", median)
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
