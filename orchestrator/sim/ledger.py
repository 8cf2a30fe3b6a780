"""Recompute a simulation ledger's bill from the price files, independently of the simulator.

Each line is one billed instance interval. The check looks up the price that should apply (the
market price in effect when the interval began, or the catalog's on-demand price), applies the
billing rule to the interval (per-second: its length; hourly-refund: a full hour, nothing for a
partial hour ended by an eviction, the run time for the job's last partial hour) and sums.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.errors import UserError
from orchestrator.market.catalog import Catalog
from orchestrator.market.prices import Market, PriceHistory
from orchestrator.units import SECONDS_PER_HOUR

REQUIRED_FIELDS = (
    "strategy",
    "instance_type",
    "zone",
    "market",
    "count",
    "start_s",
    "end_s",
    "price_usd_per_hour",
    "charged_usd",
    "reason",
)


@dataclass
class LedgerCheck:
    """Per strategy: the ledger's own total, the recomputed total and the reported total."""

    ledger_usd: dict[str, float] = field(default_factory=dict)
    recomputed_usd: dict[str, float] = field(default_factory=dict)
    reported_usd: dict[str, float] = field(default_factory=dict)
    lines: int = 0
    price_mismatches: int = 0

    @property
    def max_relative_error(self) -> float:
        worst = 0.0
        for name, recomputed in self.recomputed_usd.items():
            if not math.isfinite(recomputed):
                return math.inf
            for other in (self.ledger_usd.get(name), self.reported_usd.get(name)):
                if other is not None and other > 0:
                    worst = max(worst, abs(recomputed - other) / other)
        return worst

    def render(self) -> str:
        rows = [
            f"{self.lines} ledger lines; {self.price_mismatches} with a price that differs "
            "from the price files"
        ]
        rows.append(f"{'strategy':22s} {'ledger $':>14s} {'recomputed $':>14s} {'reported $':>14s}")
        for name in sorted(self.recomputed_usd):
            rep = self.reported_usd.get(name)
            rows.append(
                f"{name:22s} {self.ledger_usd[name]:14.2f} {self.recomputed_usd[name]:14.2f} "
                f"{'' if rep is None else f'{rep:14.2f}'}"
            )
        rows.append(f"max relative error: {self.max_relative_error:.2e}")
        return "\n".join(rows)


def recompute_billed_s(billing: str, start_s: float, end_s: float, reason: str) -> float:
    """The seconds a billing rule charges for one interval of a spot instance."""
    run = end_s - start_s
    if billing != "hourly-refund":
        return run
    if run >= SECONDS_PER_HOUR - 1e-6:
        return SECONDS_PER_HOUR
    if reason == "evicted":
        return 0.0
    if reason == "job-finished":
        return run
    return SECONDS_PER_HOUR


_LEDGER_FIX = "pass the file written by `simulate --ledger`"


def verify_ledger(
    path: Path,
    history: PriceHistory,
    *,
    billing: str = "per-second",
    report: dict | None = None,
    catalog: Catalog | None = None,
) -> LedgerCheck:
    """Recompute every line's charge from the price files and the catalog, and sum by strategy.

    Raises:
        UserError: the ledger is unreadable, or a line is malformed or has no price (named).
    """
    catalog = catalog or Catalog.load()
    check = LedgerCheck()
    ledger: dict[str, float] = defaultdict(float)
    recomputed: dict[str, float] = defaultdict(float)
    for where, line in _ledger_lines(path):
        check.lines += 1
        start, end, count, charged, applied = _numbers(where, line)
        market = Market(line["instance_type"], line["zone"])
        price, billed = _recomputed_charge(
            where, line, market, start, end, history=history, billing=billing, catalog=catalog
        )
        if abs(price - applied) > 1e-9:
            check.price_mismatches += 1
        name = line["strategy"]
        recomputed[name] += price * billed / SECONDS_PER_HOUR * count
        ledger[name] += charged
    check.ledger_usd = dict(ledger)
    check.recomputed_usd = dict(recomputed)
    if report is not None:
        for name, summary in report.get("strategies", {}).items():
            if "cost_usd_total" in summary:
                check.reported_usd[name] = float(summary["cost_usd_total"])
    return check


def _ledger_lines(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(`path:line`, the line) for every non-empty line, each checked to have every field."""
    try:
        handle = gzip.open(path, "rt") if path.suffix == ".gz" else path.open()  # noqa: SIM115
    except OSError as exc:
        raise UserError(
            f"cannot read ledger {path}: {exc.strerror}", path=str(path), fix=_LEDGER_FIX
        ) from None
    with handle:
        try:
            yield from _checked_lines(path, handle)
        except (UnicodeDecodeError, EOFError, OSError, zlib.error) as exc:  # binary, not gzip
            raise UserError(
                f"ledger {path} is not JSON lines{' (gzip)' if path.suffix == '.gz' else ''}: "
                f"{exc}",
                path=str(path),
                fix=_LEDGER_FIX,
            ) from None


def _checked_lines(path: Path, handle: Iterable[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each non-empty line of `handle` with every field (`_ledger_lines`)."""
    for lineno, text in enumerate(handle, start=1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except json.JSONDecodeError:
            line = None
        if not isinstance(line, dict):
            missing = ["(not a JSON object)"]
        else:
            missing = [f for f in REQUIRED_FIELDS if f not in line]
        if missing:
            raise UserError(
                f"{path}:{lineno}: missing {', '.join(missing)}",
                path=str(path),
                fix=_LEDGER_FIX,
            )
        yield f"{path}:{lineno}", line


def _numbers(where: str, line: dict[str, Any]) -> tuple[float, float, float, float, float]:
    """start, end, count, charged and applied price of a line."""
    try:
        return (
            float(line["start_s"]),
            float(line["end_s"]),
            float(line["count"]),
            float(line["charged_usd"]),
            float(line["price_usd_per_hour"]),
        )
    except (TypeError, ValueError):
        raise UserError(
            f"{where}: a time, count, price or charge is not a number",
            path=where.rsplit(":", 1)[0],
            fix=_LEDGER_FIX,
        ) from None


def _recomputed_charge(
    where: str,
    line: dict[str, Any],
    market: Market,
    start: float,
    end: float,
    *,
    history: PriceHistory,
    billing: str,
    catalog: Catalog,
) -> tuple[float, float]:
    """The price the line should have paid and the seconds it should have been billed."""
    path, fix = where.rsplit(":", 1)[0], "pass the same --prices as the simulation"
    if line["market"] == "oracle":  # the hindsight bound pays market prices per second
        found = history[market].price_at(start) if market in history else None
        price, billed = (math.nan if found is None else found), end - start
    elif line["market"] == "on-demand":
        price = catalog.get(market.instance_type).on_demand_price(market.region)
        billed = end - start
    else:
        if market not in history:
            raise UserError(
                f"{where}: no prices for {market} in the price files", path=path, fix=fix
            )
        found = history[market].price_at(start)
        price = math.nan if found is None else found
        billed = recompute_billed_s(billing, start, end, line["reason"])
    if math.isnan(price):
        raise UserError(
            f"{where}: no price for {market} at {start}: the price files start later",
            path=path,
            fix=fix,
        )
    return price, billed
