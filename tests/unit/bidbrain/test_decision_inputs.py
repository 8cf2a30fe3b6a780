"""`bidbrain.inputs`: the decision input the simulator and the controller both build."""

from __future__ import annotations

import math

import numpy as np
import pytest

from orchestrator.bidbrain.inputs import (
    HeldInstance,
    RenewalSchedule,
    decision_input,
    footprint_of,
)
from orchestrator.bidbrain.model import JobSpec
from orchestrator.bidbrain.policy import BidBrainSettings
from orchestrator.market.prices import Market

T0 = 1_580_688_000.0  # 2020-02-03, an epoch second like the traces'
P3 = Market("p3.2xlarge", "us-east-1a")
G4 = Market("g4dn.xlarge", "us-east-1b")
M5 = Market("m5.xlarge", "us-east-1a")
SETTINGS = BidBrainSettings(renew_period_s=3600.0, renew_lead_s=120.0)


def held(
    instance_id: str,
    allocation_id: str,
    market: Market = P3,
    *,
    launched_s: float = T0,
    ready_s: float | None = None,
    reliable: bool = False,
) -> HeldInstance:
    return HeldInstance(
        instance_id=instance_id,
        allocation_id=allocation_id,
        market=market,
        reliable=reliable,
        work_rate=1.0,
        max_price_usd_per_hour=None if reliable else 3.06,
        launched_s=launched_s,
        ready_s=launched_s + 240.0 if ready_s is None else ready_s,
    )


def price_of(market: Market, reliable: bool) -> float:
    return 0.192 if reliable else {P3: 0.95, G4: 0.16}[market]


def test_renewal_point_is_due_once_at_the_first_decision_at_or_after_it() -> None:
    schedule = RenewalSchedule(SETTINGS)
    started = {"a1": T0}
    point = T0 + 3600.0 - 120.0
    assert schedule.due(started, point - 1.0) == frozenset()
    assert schedule.due(started, point) == {"a1"}
    assert schedule.due(started, point + 60.0) == frozenset()  # named once per point
    assert schedule.due(started, point + 3600.0) == {"a1"}  # the next period's point


def test_a_slow_tick_still_catches_a_renewal_point_it_passed() -> None:
    schedule = RenewalSchedule(SETTINGS)
    assert schedule.due({"a1": T0}, T0 + 3600.0 + 500.0) == {"a1"}


def test_renewal_points_survive_float_rounding_of_epoch_sums() -> None:
    """t0 + period − lead computed by additions lands a few ulps off the exact point."""
    schedule = RenewalSchedule(SETTINGS)
    t0 = T0 + 0.1 + 0.2  # not representable exactly
    point = t0 + 3600.0 - 120.0
    assert schedule.due({"a1": t0}, point) == {"a1"}
    assert schedule.next_point_s(t0, t0) == pytest.approx(point, abs=1e-6)
    assert schedule.next_point_s(t0, point) == pytest.approx(point + 3600.0, abs=1e-6)


def test_an_allocation_no_longer_held_is_forgotten() -> None:
    schedule = RenewalSchedule(SETTINGS)
    point = T0 + 3480.0
    assert schedule.due({"a1": T0}, point) == {"a1"}
    assert schedule.due({}, point) == frozenset()
    assert schedule.due({"a1": T0}, point) == {"a1"}  # a new allocation with the same id


def test_footprint_groups_allocations_without_doomed_instances() -> None:
    instances = [
        held("i-1", "a1", launched_s=T0),
        held("i-2", "a1", launched_s=T0 + 10.0),
        held("i-3", "a2", G4, launched_s=T0 + 100.0),
        held("i-r", "r1", M5, reliable=True, ready_s=T0),
    ]
    footprint = footprint_of(instances, now_s=T0 + 300.0, price_of=price_of, doomed={"i-3"})
    by_id = {a.allocation_id: a for a in footprint.allocations}
    assert set(by_id) == {"a1", "r1"}  # a2's only instance has its notice
    a1 = by_id["a1"]
    assert (a1.count, a1.started_s, a1.price_usd_per_hour) == (2, T0, 0.95)
    assert a1.ready  # both were ready by T0 + 250
    assert by_id["r1"].reliable and by_id["r1"].price_usd_per_hour == 0.192


def test_an_allocation_is_ready_when_all_its_instances_are() -> None:
    instances = [held("i-1", "a1", ready_s=T0 + 100.0), held("i-2", "a1", ready_s=T0 + 200.0)]
    early = footprint_of(instances, now_s=T0 + 150.0, price_of=price_of, doomed=frozenset())
    late = footprint_of(instances, now_s=T0 + 200.0, price_of=price_of, doomed=frozenset())
    assert not early.allocations[0].ready and late.allocations[0].ready


def test_decision_input_carries_renewals_unavailable_markets_and_last_evictions() -> None:
    job = JobSpec(name="j", work_gpu_hours=10.0, max_work_rate=4.0)
    renewals = RenewalSchedule(SETTINGS)
    inp = decision_input(
        now_s=T0 + 3480.0,
        job=job,
        work_remaining_gpu_hours=8.0,
        spend_usd=3.5,
        held=[held("i-1", "a1"), held("i-r", "r1", M5, reliable=True)],
        price_of=price_of,
        prices_usd_per_hour=np.array([0.95, math.nan]),
        renewals=renewals,
        unavailable=frozenset({G4}),
        last_eviction_s={G4: T0 + 60.0},
    )
    assert inp.renewal_due == {"a1"}  # spot allocations only; the reliable tier is kept
    assert inp.unavailable == {G4} and inp.last_eviction_s == {G4: T0 + 60.0}
    assert (inp.spend_usd, inp.work_remaining_gpu_hours) == (3.5, 8.0)
    assert len(inp.footprint.allocations) == 2
