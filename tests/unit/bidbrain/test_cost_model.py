"""Expected cost per work of a footprint (`orchestrator.bidbrain.cost`, seed 002 Eq. 4.1-4.4)."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.bidbrain.cost import (
    ZERO,
    FootprintTerms,
    allocation_terms,
    cost_per_work_with,
    footprint_terms,
)
from orchestrator.market.billing import charged_fraction

H = 3600.0
WORK_S = 100 * H  # 100 reference-GPU-hours left
SIGMA_S = 300.0  # add overhead σ
BILLINGS = ("per-second", "hourly-refund")


def single(
    *,
    billing: str = "per-second",
    count: float = 1.0,
    work_rate: float = 1.0,
    price: float = 0.9,
    hazard_price: float = 0.0,
    hazard_capacity: float = 0.0,
    add_overhead_s: float = SIGMA_S,
    pending_s: float = SIGMA_S,
) -> FootprintTerms:
    """The terms of a footprint of one (new, by default) allocation."""
    return footprint_terms(
        billing=billing,
        count=np.array([count]),
        work_rate=np.array([work_rate]),
        price_usd_per_hour=np.array([price]),
        hazard_price_per_s=np.array([hazard_price]),
        hazard_capacity_per_s=np.array([hazard_capacity]),
        add_overhead_s=add_overhead_s,
        pending_overhead_s=np.array([pending_s]),
    )


def random_allocations(rng: np.random.Generator, n: int, *, new: bool) -> dict[str, np.ndarray]:
    return {
        "count": rng.integers(1, 8, n).astype(np.float64),
        "work_rate": rng.uniform(0.2, 4.0, n),
        "price_usd_per_hour": rng.uniform(0.1, 10.0, n),
        "hazard_price_per_s": rng.choice([0.0, 1.0], n) * rng.uniform(0.0, 2e-4, n),
        "hazard_capacity_per_s": rng.uniform(0.0, 1e-4, n),
        "pending_overhead_s": np.full(n, SIGMA_S) if new else rng.choice([0.0, 120.0], n),
    }


def test_empty_footprint_costs_nothing_and_never_finishes() -> None:
    empty = np.array([], dtype=np.float64)
    terms = footprint_terms(
        billing="per-second",
        count=empty,
        work_rate=empty,
        price_usd_per_hour=empty,
        hazard_price_per_s=empty,
        hazard_capacity_per_s=empty,
        add_overhead_s=SIGMA_S,
        pending_overhead_s=empty,
    )
    assert terms == ZERO
    assert terms.effective_rate(1.0, 600.0) == 0.0
    assert terms.cost_per_work(WORK_S, 1.0, 600.0) == float("inf")


@pytest.mark.parametrize("billing", BILLINGS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_adding_a_candidate_equals_the_footprint_recomputed_with_it(billing: str, seed: int):
    rng = np.random.default_rng(seed)
    held = random_allocations(rng, 4, new=False)
    cands = random_allocations(rng, 25, new=True)
    base = footprint_terms(billing=billing, add_overhead_s=SIGMA_S, **held)
    vec = cost_per_work_with(
        base,
        work_s=WORK_S,
        phi=0.9,
        eviction_overhead_s=60.0,
        cand=allocation_terms(billing=billing, add_overhead_s=SIGMA_S, **cands),
    )
    for j in range(25):
        merged = {k: np.append(held[k], cands[k][j]) for k in held}
        direct = footprint_terms(billing=billing, add_overhead_s=SIGMA_S, **merged)
        assert vec[j] == pytest.approx(direct.cost_per_work(WORK_S, 0.9, 60.0), rel=1e-12)


def test_cost_per_work_rises_with_price_and_falls_with_work_rate() -> None:
    e = [single(price=p).cost_per_work(WORK_S, 1.0, 30.0) for p in (0.5, 1.0, 2.0)]
    assert e[0] < e[1] < e[2]
    e = [single(work_rate=v).cost_per_work(WORK_S, 1.0, 30.0) for v in (0.5, 1.0, 4.0)]
    assert e[0] > e[1] > e[2]


def test_eviction_overhead_costs_only_when_evictions_happen() -> None:
    risky = single(count=4, hazard_capacity=1e-4)
    assert risky.cost_per_work(WORK_S, 1.0, 120.0) > risky.cost_per_work(WORK_S, 1.0, 10.0)
    safe = single(count=4)
    assert safe.cost_per_work(WORK_S, 1.0, 120.0) == safe.cost_per_work(WORK_S, 1.0, 10.0)


def test_without_evictions_cost_per_work_is_price_over_rate_plus_the_one_time_overhead() -> None:
    terms = single(count=2, work_rate=1.5, price=0.9)
    phi = 0.8
    rate = 2 * 1.5
    expected_time_s = (WORK_S + phi * rate * SIGMA_S) / (phi * rate)
    expected = 2 * 0.9 / H * expected_time_s / WORK_S
    assert terms.cost_per_work(WORK_S, phi, 30.0) == pytest.approx(expected, rel=1e-12)


def test_replacing_evicted_instances_costs_sigma_per_eviction() -> None:
    h = 1.0 / H  # one eviction per instance-hour
    terms = single(hazard_capacity=h, pending_s=0.0)
    # effective rate loses σ·h of work per second and λ per eviction
    assert terms.effective_rate(1.0, 0.0) == pytest.approx(1.0 - SIGMA_S * h)
    assert terms.effective_rate(1.0, 60.0) == pytest.approx(1.0 - SIGMA_S * h - 60.0 * h)


def test_a_price_crossing_takes_the_whole_allocation_as_one_event() -> None:
    per_allocation = single(count=8, hazard_price=1e-4)
    per_instance = single(count=8, hazard_capacity=1e-4)
    assert per_allocation.events_per_s == pytest.approx(1e-4)
    assert per_instance.events_per_s == pytest.approx(8e-4)


def test_hourly_refund_charges_only_hours_that_end_before_an_eviction() -> None:
    h = 0.6 / H
    hourly = single(billing="hourly-refund", hazard_capacity=h)
    per_second = single(billing="per-second", hazard_capacity=h)
    assert hourly.cost_usd_per_s == pytest.approx(
        per_second.cost_usd_per_s * float(charged_fraction(np.array(h)))
    )
    assert hourly.cost_usd_per_s < per_second.cost_usd_per_s


def test_fixed_costs_are_amortised_over_more_work_by_a_bigger_footprint() -> None:
    reliable = FootprintTerms(0.5 / H, 0.0, 0.0, 0.0, 0.0)
    one = reliable + single(count=1, pending_s=0.0)
    four = reliable + single(count=4, pending_s=0.0)
    assert four.cost_per_work(WORK_S, 1.0, 0.0) < one.cost_per_work(WORK_S, 1.0, 0.0)


def test_near_the_end_of_a_job_a_new_nodes_overhead_outweighs_what_it_saves() -> None:
    reliable = FootprintTerms(0.2 / H, 0.0, 0.0, 0.0, 0.0)
    held = reliable + single(count=1, work_rate=8, price=7.3, pending_s=0.0)
    cand = allocation_terms(
        billing="per-second",
        count=np.array([1.0]),
        work_rate=np.array([8.0]),
        price_usd_per_hour=np.array([7.3]),
        hazard_price_per_s=np.array([0.0]),
        hazard_capacity_per_s=np.array([0.0]),
        add_overhead_s=600.0,
        pending_overhead_s=np.array([600.0]),
    )
    for work_h, better in ((500.0, True), (5.0, False)):
        with_new = cost_per_work_with(
            held, work_s=work_h * H, phi=1.0, eviction_overhead_s=0.0, cand=cand
        )[0]
        assert bool(with_new < held.cost_per_work(work_h * H, 1.0, 0.0)) is better
