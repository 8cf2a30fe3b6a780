"""Billing models: how EC2 charges a spot instance, both today and in 2016.

* `per-second` (default, AWS Linux today): an instance pays the market price in effect each second
  it runs; an interruption refunds nothing.
* `hourly-refund` (AWS until 2017, what the Proteus paper assumed): an instance pays for each
  instance-hour, at the price in effect when the hour began; if AWS evicts it, the partial hour it
  was in is free. A partial hour cut short by the user is charged in full, except the job's last
  one, which is prorated (the paper's accounting: the rest of that hour goes to the next job).

On-demand instances pay their fixed price for the time they run in both models.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np

from orchestrator.market.errors import MarketError
from orchestrator.market.prices import PriceSeries
from orchestrator.units import SECONDS_PER_HOUR


class EndReason(StrEnum):
    """Why a billed interval ended."""

    PRICE_CHANGE = "price-change"  # per-second: the market price changed; the instance runs on
    HOUR_COMPLETE = "hour-complete"  # hourly: a full instance-hour was charged
    EVICTED = "evicted"  # the cloud took the instance back
    RELEASED = "released"  # the controller terminated it before the job ended
    JOB_FINISHED = "job-finished"  # the job's work was done; the instance was terminated


@dataclass(frozen=True, slots=True)
class BilledInterval:
    """One line of the bill: `charged_usd = price_usd_per_hour × billed hours`.

    `start_s`/`end_s` are the interval the instance ran. `billed_s` is the time charged, which
    differs from the run time only under `hourly-refund` (0 for an evicted partial hour).
    """

    start_s: float
    end_s: float
    price_usd_per_hour: float
    billed_s: float
    reason: EndReason

    @property
    def charged_usd(self) -> float:
        return self.price_usd_per_hour * self.billed_s / SECONDS_PER_HOUR


class BillingModel(abc.ABC):
    """How an instance's run time turns into charges, actual and expected."""

    name: str

    @abc.abstractmethod
    def bill_spot(
        self, series: PriceSeries, start_s: float, end_s: float, reason: EndReason
    ) -> list[BilledInterval]:
        """The charges of one spot instance that ran on `series`'s market over [start, end].

        `reason` is why it stopped: EVICTED, RELEASED or JOB_FINISHED.
        """

    @abc.abstractmethod
    def expected_cost_usd(
        self,
        price_usd_per_hour: float,
        count: int,
        hazard_per_s: float,
        horizon_s: float,
    ) -> float:
        """Expected charge of `count` instance slots kept filled for `horizon_s` at `price`
        (an evicted instance is replaced at once).

        `hazard_per_s` is the eviction rate of one instance (constant over the horizon).
        """

    def bill_on_demand(
        self, price_usd_per_hour: float, start_s: float, end_s: float, reason: EndReason
    ) -> list[BilledInterval]:
        """On-demand instances pay their fixed price for the time they run."""
        run_s = max(0.0, end_s - start_s)
        return [BilledInterval(start_s, end_s, price_usd_per_hour, run_s, reason)]


def charged_fraction(hazard_per_s: float | np.ndarray) -> Any:
    """Share of an instance slot's run time that `hourly-refund` charges, when evicted
    instances are replaced at once: each instance of life T ~ Exp(h) pays its full hours only,
    Σ_n P(T > n hours) = q/(1-q) with q = e^{-h·1h}, over an expected life of 1/h.

    A float gives a float; an array gives the array of fractions (BidBrain's cost model
    evaluates every candidate at once).
    """
    if isinstance(hazard_per_s, np.ndarray):
        xs = hazard_per_s.astype(np.float64) * SECONDS_PER_HOUR
        safe = np.where(xs > 0, xs, 1.0)
        return np.where(xs > 0, safe * np.exp(-safe) / -np.expm1(-safe), 1.0)
    if hazard_per_s <= 0.0:
        return 1.0
    x = hazard_per_s * SECONDS_PER_HOUR
    return x * math.exp(-x) / -math.expm1(-x)


class PerSecondBilling(BillingModel):
    """Today's AWS Linux spot billing: the market price each second, no refund on eviction."""

    name = "per-second"

    def bill_spot(
        self, series: PriceSeries, start_s: float, end_s: float, reason: EndReason
    ) -> list[BilledInterval]:
        if end_s <= start_s:
            return []
        out: list[BilledInterval] = []
        t = start_s
        i = series.index_at(start_s)
        if i < 0:
            raise MarketError(
                f"no price for {series.market} at {start_s}: it runs before "
                "the market's first price record"
            )
        times = series.times_s
        n = len(times)
        while t < end_s:
            nxt = float(times[i + 1]) if i + 1 < n else math.inf
            seg_end = min(nxt, end_s)
            last = seg_end >= end_s
            out.append(
                BilledInterval(
                    t,
                    seg_end,
                    float(series.prices_usd_per_hour[i]),
                    seg_end - t,
                    reason if last else EndReason.PRICE_CHANGE,
                )
            )
            t = seg_end
            i = min(i + 1, n - 1)
        return out

    def expected_cost_usd(
        self, price_usd_per_hour: float, count: int, hazard_per_s: float, horizon_s: float
    ) -> float:
        return price_usd_per_hour * count * horizon_s / SECONDS_PER_HOUR


class HourlyRefundBilling(BillingModel):
    """2016 spot billing: whole instance-hours at the hour's starting price; evicted hour free."""

    name = "hourly-refund"

    def bill_spot(
        self, series: PriceSeries, start_s: float, end_s: float, reason: EndReason
    ) -> list[BilledInterval]:
        if end_s <= start_s:
            return []
        out: list[BilledInterval] = []
        hour_start = start_s
        while hour_start < end_s:
            hour_end = hour_start + SECONDS_PER_HOUR
            price = series.price_at(hour_start)
            if price is None:
                raise MarketError(
                    f"no price for {series.market} at {hour_start}: it runs "
                    "before the market's first price record"
                )
            if hour_end <= end_s:
                out.append(
                    BilledInterval(
                        hour_start,
                        hour_end,
                        price,
                        SECONDS_PER_HOUR,
                        EndReason.HOUR_COMPLETE if hour_end < end_s else reason,
                    )
                )
            elif reason is EndReason.EVICTED:
                out.append(BilledInterval(hour_start, end_s, price, 0.0, reason))
            elif reason is EndReason.JOB_FINISHED:
                out.append(BilledInterval(hour_start, end_s, price, end_s - hour_start, reason))
            else:
                out.append(BilledInterval(hour_start, end_s, price, SECONDS_PER_HOUR, reason))
            hour_start = hour_end
        return out

    def expected_cost_usd(
        self, price_usd_per_hour: float, count: int, hazard_per_s: float, horizon_s: float
    ) -> float:
        """Eq. 4.1, (1 - β)·P·k·t_r, taken over a slot's successive instances: only the
        hours that end before an eviction are paid (`charged_fraction`)."""
        return (
            price_usd_per_hour
            * count
            * horizon_s
            / SECONDS_PER_HOUR
            * charged_fraction(hazard_per_s)
        )


BILLING_MODELS: dict[str, type[BillingModel]] = {
    PerSecondBilling.name: PerSecondBilling,
    HourlyRefundBilling.name: HourlyRefundBilling,
}


def billing_model(name: str) -> BillingModel:
    """The billing model registered under `name`.

    Raises:
        UserError: unknown name (the message lists the valid ones).
    """
    from orchestrator.errors import UserError

    try:
        return BILLING_MODELS[name]()
    except KeyError:
        raise UserError(
            f"unknown billing model {name!r}",
            fix=f"use one of: {', '.join(BILLING_MODELS)}",
            field="billing",
        ) from None
