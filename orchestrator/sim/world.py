"""The simulated market a run lives in: replayed prices, replayed capacity evictions, and the
eviction models a policy may know at a given time (fitted on the past only)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from orchestrator.bidbrain.policy import WIDE_BID_DELTAS_USD, MarketTable
from orchestrator.errors import UserError
from orchestrator.market.catalog import Catalog
from orchestrator.market.eviction import (
    DEFAULT_BID_DELTAS_USD,
    AvailabilityTrace,
    CapacityHazardModel,
    PriceCrossingModel,
    RemovalStream,
)
from orchestrator.market.prices import Market, PriceHistory
from orchestrator.units import SECONDS_PER_DAY, SECONDS_PER_HOUR

#: Price-crossing models are refitted at this period, each on the history before it.
REFIT_PERIOD_S = 7 * SECONDS_PER_DAY
#: A start needs at least this much history before it for the price model to learn from.
MIN_HISTORY_S = 7 * SECONDS_PER_DAY


@dataclass
class World:
    """Everything the simulated runs share: prices, the catalog, the capacity trace."""

    history: PriceHistory
    catalog: Catalog
    trace: AvailabilityTrace
    table: MarketTable
    primary_region: str
    gpu_work_rates: dict[str, float] | None = None
    _price_models: dict[int, PriceCrossingModel] = field(default_factory=dict)
    _price_times: np.ndarray | None = None

    @classmethod
    def build(
        cls,
        history: PriceHistory,
        catalog: Catalog,
        trace: AvailabilityTrace,
        *,
        primary_region: str,
        gpu_work_rates: dict[str, float] | None = None,
    ) -> World:
        """Raises UserError when a market's type is missing from the catalog or not offered."""
        markets = [m for m in history if m.instance_type in catalog]
        unknown = sorted({m.instance_type for m in history} - {m.instance_type for m in markets})
        if unknown:
            raise UserError(
                f"the price data names instance types the catalog does not know: {unknown}",
                fix="add them to the catalog file or drop their price files",
                field="--prices",
            )
        table = MarketTable.build(markets, catalog, gpu_work_rates)
        return cls(history, catalog, trace, table, primary_region, gpu_work_rates)

    # -- time range -----------------------------------------------------------------------
    def start_range(self, job_hours: float) -> tuple[float, float]:
        """Where a job may start: after a week of history, and with its nominal duration
        before the end of the price data.

        Raises:
            UserError: the data is too short for the job.
        """
        first = self.history.start_s + MIN_HISTORY_S
        last = self.history.end_s - job_hours * SECONDS_PER_HOUR
        if last <= first:
            span_days = (self.history.end_s - self.history.start_s) / SECONDS_PER_DAY
            raise UserError(
                f"the price data spans {span_days:.1f} days, too short for a {job_hours} h job "
                "after the 7 days of history the eviction model needs",
                fix="pass longer price traces or a shorter --job-hours",
                field="--job-hours",
            )
        return first, last

    # -- models ---------------------------------------------------------------------------
    def price_model_at(self, t_s: float) -> PriceCrossingModel:
        """The price-crossing model fitted on history up to the last refit boundary before t."""
        epoch = int((t_s - self.history.start_s) // REFIT_PERIOD_S)
        model = self._price_models.get(epoch)
        if model is None:
            until = self.history.start_s + epoch * REFIT_PERIOD_S
            until = max(until, self.history.start_s + MIN_HISTORY_S)
            model = PriceCrossingModel(
                self.history,
                fit_until_s=until,
                bid_deltas_usd=sorted(set(DEFAULT_BID_DELTAS_USD) | set(WIDE_BID_DELTAS_USD)),
            )
            self._price_models[epoch] = model
        return model

    def capacity_model(self) -> CapacityHazardModel:
        """A fresh capacity model (the trace's rate as prior) for one run to update online."""
        return CapacityHazardModel.from_trace(self.trace, applies_to=None)

    def price_change_times(self) -> np.ndarray:
        """Every instant at which some market's price changes, sorted."""
        if self._price_times is None:
            self._price_times = np.unique(
                np.concatenate([self.history[m].times_s for m in self.table.markets])
            )
        return self._price_times

    # -- capacity evictions ---------------------------------------------------------------
    def removal_events(
        self, markets: Sequence[Market], start_s: float, horizon_s: float, seed: Sequence[int]
    ) -> dict[Market, RemovalStream]:
        """Per market, the capacity-removal instants over [start, start+horizon] and the chance
        that any one live instance is among those removed at each.

        Each market replays the availability trace, repeated, from its own random offset, so
        markets are independent. Every strategy of the same start sees the same instants, and
        the n-th instance a strategy launches in a market draws the same random numbers as
        the n-th of any other strategy (common random numbers, for paired comparisons).
        """
        return self.trace.replay(markets, start_s, horizon_s, seed)
