"""What the controller reads of the market at a tick: a job's market table (the types it may
use, offered in its regions), the price of a market now (spot from the history, on-demand from
the catalog) and the price-crossing eviction model, refitted once a day of market time."""

from __future__ import annotations

import math

from orchestrator.bidbrain.inputs import PriceOf
from orchestrator.bidbrain.model import JobSpec
from orchestrator.bidbrain.policy import WIDE_BID_DELTAS_USD, MarketTable
from orchestrator.jobspec import JobSubmission
from orchestrator.market.catalog import Catalog
from orchestrator.market.eviction import DEFAULT_BID_DELTAS_USD, PriceCrossingModel
from orchestrator.market.prices import Market, PriceHistory

#: The price model is refitted at most this often.
PRICE_MODEL_REFIT_S = 86400.0


class MarketView:
    """The controller's reads of the market (see the module docstring)."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self._price_model: PriceCrossingModel | None = None
        self._price_model_at = -math.inf

    def table(self, submission: JobSubmission, spec: JobSpec, history: PriceHistory) -> MarketTable:
        """The job's markets: the instance types it may use (`JobSubmission.usable_types`) in
        its regions."""
        types = set(submission.usable_types(self.catalog))
        markets = [
            m
            for m in history
            if m.instance_type in types
            and m.region in submission.regions
            and self.catalog.get(m.instance_type).offered_in(m.region)
        ]
        return MarketTable.build(markets, self.catalog, spec.gpu_work_rates)

    def price_of(self, history: PriceHistory, now_s: float) -> PriceOf:
        """A market's price now: on-demand from the catalog, spot from the history."""

        def price(market: Market, reliable: bool) -> float:
            if reliable:
                return self.catalog.get(market.instance_type).on_demand_price(market.region)
            return price_at(history, market, now_s)

        return price

    def price_model(self, history: PriceHistory, now_s: float) -> PriceCrossingModel:
        """The price-crossing eviction model, fitted on the history up to `now_s`."""
        if self._price_model is None or now_s - self._price_model_at >= PRICE_MODEL_REFIT_S:
            self._price_model = PriceCrossingModel(
                history,
                fit_until_s=now_s,
                bid_deltas_usd=sorted(set(DEFAULT_BID_DELTAS_USD) | set(WIDE_BID_DELTAS_USD)),
            )
            self._price_model_at = now_s
        return self._price_model


def price_at(history: PriceHistory, market: Market, now_s: float) -> float:
    """The market's spot price at `now_s` (NaN: no such market, or no price yet)."""
    if market not in history:
        return math.nan
    price = history[market].price_at(now_s)
    return math.nan if price is None else price
