"""Hand-made simulator worlds: flat prices per market and no price risk, so that every number a
test checks can be worked out by hand."""

from __future__ import annotations

import numpy as np

from orchestrator.market.catalog import Catalog
from orchestrator.market.eviction import AvailabilityTrace, EvictionModel
from orchestrator.market.prices import Market, PriceHistory, PriceSeries
from orchestrator.sim.world import World

DAY = 86400.0


class NoPriceRisk(EvictionModel):
    """A price model that never expects a price crossing."""

    name = "none"

    def hazard_per_s(self, market: Market, bid_delta_usd: float) -> float:
        return 0.0


def flat_world(prices: dict[Market, float], around_s: float) -> World:
    """Markets at a constant price for 30 days either side of `around_s`, and a capacity
    trace with one node for 1,000 hours (evictions come from the test's removal streams)."""
    series = [
        PriceSeries(m, np.array([around_s - 30 * DAY]), np.array([p]), end_s=around_s + 30 * DAY)
        for m, p in prices.items()
    ]
    trace = AvailabilityTrace(((0, "add", "n1"), (3_600_000, "remove", "n1")), "test")
    return World.build(PriceHistory(series), Catalog.load(), trace, primary_region="us-east-1")
