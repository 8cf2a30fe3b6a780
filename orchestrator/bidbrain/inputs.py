"""What a decision looks at, built the same way by the simulator and the live controller.

Both hold instances (simulated ones, or the store's records of EC2's), prices and a spend; both
call `decision_input` to turn them into the `DecisionInput` a policy decides on, with the same
footprint (allocations grouped, doomed instances left out, readiness after σ), the same
renew-or-release points (`RenewalSchedule`) and the markets' last evictions.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from orchestrator.bidbrain.model import Footprint, HeldAllocation, JobSpec
from orchestrator.bidbrain.policy import BidBrainSettings, DecisionInput
from orchestrator.market.prices import Market

#: Slack when comparing a time with a renew-or-release point (float sums of epoch seconds
#: land a few ulps either side of it): 1e-9 of a period, about 4 µs for an hour.
_PERIOD_EPSILON = 1e-9


class Held(Protocol):
    """One instance a job holds, as a decision sees it (the simulator's instances have these
    attributes; the controller builds `HeldInstance`s from the store's records)."""

    @property
    def instance_id(self) -> str: ...
    @property
    def allocation_id(self) -> str: ...
    @property
    def market(self) -> Market: ...
    @property
    def reliable(self) -> bool: ...
    @property
    def work_rate(self) -> float: ...
    @property
    def max_price_usd_per_hour(self) -> float | None: ...
    @property
    def launched_s(self) -> float: ...
    @property
    def ready_s(self) -> float: ...


@dataclass(frozen=True, slots=True)
class HeldInstance:
    """A `Held` instance (see there)."""

    instance_id: str
    allocation_id: str
    market: Market
    reliable: bool  # on-demand (the reliable tier); spot otherwise
    work_rate: float  # ν: reference GPUs
    max_price_usd_per_hour: float | None
    launched_s: float
    ready_s: float  # when it starts doing useful work (launch + σ, or + boot)


#: The price an allocation pays now: (market, reliable) -> USD per instance-hour.
PriceOf = Callable[[Market, bool], float]


#: The rate a decision takes an instance of a type to have (the job's learned rates).
WorkRateOf = Callable[[str], float]


def footprint_of(
    held: Iterable[Held],
    *,
    now_s: float,
    price_of: PriceOf,
    doomed: AbstractSet[str],
    work_rate_of: WorkRateOf | None = None,
) -> Footprint:
    """The allocations `held` make up, leaving out `doomed` instances (an interruption notice
    came for them: they are as good as gone). An allocation is ready when all its instances
    are, and started when its first instance was launched. Each works at `work_rate_of` its
    type when given (what the job believes), else at the instance's own `work_rate`."""
    groups: dict[str, list[Held]] = defaultdict(list)
    for inst in held:
        if inst.instance_id not in doomed:
            groups[inst.allocation_id].append(inst)
    allocations = []
    for allocation_id, insts in groups.items():
        first = insts[0]
        allocations.append(
            HeldAllocation(
                allocation_id=allocation_id,
                market=first.market,
                count=len(insts),
                work_rate_per_instance=first.work_rate
                if work_rate_of is None
                else work_rate_of(first.market.instance_type),
                price_usd_per_hour=price_of(first.market, first.reliable),
                started_s=min(i.launched_s for i in insts),
                max_price_usd_per_hour=first.max_price_usd_per_hour,
                reliable=first.reliable,
                ready=all(i.ready_s <= now_s for i in insts),
            )
        )
    return Footprint(allocations)


class RenewalSchedule:
    """The renew-or-release points of spot allocations (seed 002 §4.3): an allocation started
    at t0 is reconsidered once per `renew_period_s`, `renew_lead_s` before each period ends,
    i.e. at t0 + k·period − lead for k = 1, 2, ...

    `due` names each allocation once per point, at the first decision at or after it, however
    many decisions come in between (so a decision missed by a slow tick is caught by the
    next). The simulator schedules its decisions at `next_point_s`; the controller ticks.
    """

    def __init__(self, settings: BidBrainSettings) -> None:
        self.period_s = settings.renew_period_s
        self.lead_s = settings.renew_lead_s
        self._seen: dict[str, int] = {}

    def points_passed(self, started_s: float, now_s: float) -> int:
        """How many renew-or-release points of an allocation started at `started_s` lie at
        or before `now_s`."""
        return math.floor((now_s - started_s + self.lead_s) / self.period_s + _PERIOD_EPSILON)

    def next_point_s(self, started_s: float, now_s: float) -> float:
        """The allocation's first renew-or-release point after `now_s`."""
        k = max(self.points_passed(started_s, now_s), 0) + 1
        return started_s + k * self.period_s - self.lead_s

    def due(self, started_s: Mapping[str, float], now_s: float) -> frozenset[str]:
        """The allocations (id -> start) that passed a point since `due` last named them;
        allocations no longer given are forgotten."""
        due = set()
        for allocation_id, t0 in started_s.items():
            passed = self.points_passed(t0, now_s)
            if passed >= 1 and self._seen.get(allocation_id, 0) < passed:
                self._seen[allocation_id] = passed
                due.add(allocation_id)
        for gone in set(self._seen) - set(started_s):
            del self._seen[gone]
        return frozenset(due)


def decision_input(
    *,
    now_s: float,
    job: JobSpec,
    work_remaining_gpu_hours: float,
    spend_usd: float,
    held: Iterable[Held],
    price_of: PriceOf,
    prices_usd_per_hour: np.ndarray,
    renewals: RenewalSchedule,
    doomed: AbstractSet[str] = frozenset(),
    unavailable: frozenset[Market] = frozenset(),
    last_eviction_s: Mapping[Market, float] | None = None,
    work_rate_of: WorkRateOf | None = None,
    lag_reserve_s: float = 0.0,
) -> DecisionInput:
    """The `DecisionInput` for a job holding `held` at `now_s` (see the module docstring).

    `prices_usd_per_hour` aligns with the policy's `MarketTable` (NaN: no price known);
    `unavailable` are markets refusing launches for now (capacity errors); `last_eviction_s`
    when each market last took one of the job's instances back; `work_rate_of` the rate the
    job believes an instance of a type has (default: each instance's own `work_rate`);
    `lag_reserve_s` the budget's reserve the controller's measured lag needs.
    """
    held = list(held)
    spot_started: dict[str, float] = {}
    for inst in held:
        if not inst.reliable:
            first = spot_started.get(inst.allocation_id, math.inf)
            spot_started[inst.allocation_id] = min(first, inst.launched_s)
    return DecisionInput(
        now_s=now_s,
        job=job,
        work_remaining_gpu_hours=work_remaining_gpu_hours,
        spend_usd=spend_usd,
        footprint=footprint_of(
            held, now_s=now_s, price_of=price_of, doomed=doomed, work_rate_of=work_rate_of
        ),
        prices_usd_per_hour=prices_usd_per_hour,
        unavailable=unavailable,
        renewal_due=renewals.due(spot_started, now_s),
        last_eviction_s=dict(last_eviction_s or {}),
        lag_reserve_s=lag_reserve_s,
    )
