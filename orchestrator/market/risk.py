"""The eviction risk of one market at one bid, by cause: what `orchestrator risk` shows.

β is the probability of an eviction within the horizon; the median is the time by which half
the instances launched now would be gone. Price crossings come from the price history, capacity
evictions from the availability trace (seed 002 §4.4), and the combined estimate treats them as
independent causes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.errors import UserError
from orchestrator.market.catalog import Catalog
from orchestrator.market.errors import UnknownMarketError
from orchestrator.market.eviction import (
    AvailabilityTrace,
    CapacityHazardModel,
    CombinedEvictionModel,
    EvictionEstimate,
    PriceCrossingModel,
)
from orchestrator.market.prices import Market, region_of_zone
from orchestrator.market.trace_source import TracePriceSource, bundled_prices_dir
from orchestrator.units import SECONDS_PER_HOUR


@dataclass(frozen=True)
class MarketRisk:
    """Eviction estimates of `market` at `bid_delta_usd` over `horizon_hours`, by cause
    (`price-crossing`, `capacity`, `combined`)."""

    market: Market
    bid_delta_usd: float
    horizon_hours: float
    by_cause: dict[str, EvictionEstimate]

    def as_dict(self) -> dict[str, Any]:
        """The JSON `orchestrator risk --json` prints (median in hours, None: never)."""
        return {
            "instance_type": self.market.instance_type,
            "zone": self.market.zone,
            "bid_delta_usd": self.bid_delta_usd,
            "horizon_hours": self.horizon_hours,
            **{
                cause: {
                    "beta": round(e.beta, 6),
                    "median_hours": round(e.median_s / SECONDS_PER_HOUR, 3)
                    if math.isfinite(e.median_s)
                    else None,
                }
                for cause, e in self.by_cause.items()
            },
        }


def market_risk(
    instance_type: str,
    zone: str,
    *,
    bid_delta_usd: float,
    horizon_hours: float,
    prices: Sequence[Path] | None = None,
    availability: Path | None = None,
) -> MarketRisk:
    """Estimate the risk (see the module docstring) from the price folders (default: the
    bundled ones of the zone's region) and the availability trace (default: the bundled p3
    trace).

    Raises:
        UserError: a non-positive horizon, a negative bid, an unknown type, or a market the
            prices do not cover (naming the zones that have prices).
    """
    if horizon_hours <= 0 or not math.isfinite(horizon_hours):
        raise UserError(
            f"--horizon-hours must be positive, got {horizon_hours}",
            field="--horizon-hours",
            fix="pass e.g. --horizon-hours 1",
        )
    if bid_delta_usd < 0:
        raise UserError(
            f"--bid-delta must be >= 0, got {bid_delta_usd}",
            field="--bid-delta",
            fix="pass the max price over the market, e.g. --bid-delta 0.1",
        )
    Catalog.load().get(instance_type)
    history = TracePriceSource(prices or [bundled_prices_dir(region_of_zone(zone))]).all()
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
    combined = CombinedEvictionModel([price_model, capacity])
    horizon_s = horizon_hours * SECONDS_PER_HOUR
    return MarketRisk(
        market=market,
        bid_delta_usd=bid_delta_usd,
        horizon_hours=horizon_hours,
        by_cause={
            "price-crossing": price_model.estimate(market, bid_delta_usd, horizon_s),
            "capacity": capacity.estimate(market, bid_delta_usd, horizon_s),
            "combined": combined.estimate(market, bid_delta_usd, horizon_s),
        },
    )
