"""Expected cost per work of a footprint (`orchestrator.bidbrain.cost`, seed 002 Eq. 4.1-4.4)."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.bidbrain.cost import (
    FootprintTerms,
    allocation_terms,
    cost_per_work_with,
    footprint_terms,
)

H = 3600.0
HORIZON_S = 6 * H
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
    horizon_s: float = HORIZON_S,
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
        horizon_s=horizon_s,
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


def test_empty_footprint_terms_are_zero() -> None:
    empty = np.array([], dtype=np.float64)
    terms = footprint_terms(
        billing="per-second",
        count=empty,
        work_rate=empty,
        price_usd_per_hour=empty,
        hazard_price_per_s=empty,
        hazard_capacity_per_s=empty,
        horizon_s=HORIZON_S,
        add_overhead_s=SIGMA_S,
        pending_overhead_s=empty,
    )
    assert terms == FootprintTerms(0.0, 0.0, 0.0, 0.0)
    assert terms.work(1.0, 600.0) == 0.0
    assert terms.cost_per_work(1.0, 600.0) == float("inf")


@pytest.mark.parametrize("billing", BILLINGS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_adding_candidate_equals_footprint_recomputed_with_candidate(
    billing: str, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    base_alloc = random_allocations(rng, 3, new=False)
    cands = random_allocations(rng, 25, new=True)
    phi, lam = 0.85, 600.0
    common = {"billing": billing, "horizon_s": HORIZON_S, "add_overhead_s": SIGMA_S}
    base = footprint_terms(**common, **base_alloc)
    c_cost, c_events, c_kv, c_busy = allocation_terms(**common, **cands)
    fast = cost_per_work_with(
        base,
        phi=phi,
        eviction_overhead_s=lam,
        cand_cost_usd=c_cost,
        cand_events=c_events,
        cand_kv=c_kv,
        cand_busy_s=c_busy,
    )
    assert fast.shape == (25,)
    for j in range(25):
        merged = {k: np.append(v, cands[k][j]) for k, v in base_alloc.items()}
        slow = footprint_terms(**common, **merged).cost_per_work(phi, lam)
        assert float(fast[j]) == pytest.approx(slow, rel=1e-12)


def test_candidate_that_leaves_no_work_has_infinite_cost_per_work() -> None:
    base = FootprintTerms(cost_usd=0.0, events=0.0, rate=0.0, busy_s=0.0)
    out = cost_per_work_with(
        base,
        phi=1.0,
        eviction_overhead_s=600.0,
        cand_cost_usd=np.array([1.0, 1.0]),
        cand_events=np.array([0.0, 100.0]),
        cand_kv=np.array([1.0, 1.0]),
        cand_busy_s=np.array([H, H]),
    )
    assert out[0] == pytest.approx(1.0 / H)
    assert out[1] == np.inf


@pytest.mark.parametrize("billing", BILLINGS)
def test_cost_per_work_rises_with_price(billing: str) -> None:
    e = [
        single(billing=billing, price=p, hazard_capacity=5e-5).cost_per_work(1.0, 600.0)
        for p in (0.3, 0.9, 3.06)
    ]
    assert e[0] < e[1] < e[2]


@pytest.mark.parametrize("billing", BILLINGS)
def test_cost_per_work_falls_with_work_rate(billing: str) -> None:
    e = [
        single(billing=billing, work_rate=v, hazard_capacity=5e-5).cost_per_work(1.0, 600.0)
        for v in (0.5, 1.0, 2.5)
    ]
    assert e[0] > e[1] > e[2]


@pytest.mark.parametrize("billing", BILLINGS)
def test_cost_per_work_rises_with_eviction_overhead_when_hazard_is_positive(
    billing: str,
) -> None:
    terms = single(billing=billing, count=2.0, hazard_price=3e-5, hazard_capacity=2e-5)
    e = [terms.cost_per_work(1.0, lam) for lam in (0.0, 300.0, 1200.0)]
    assert e[0] < e[1] < e[2]


def test_eviction_overhead_is_irrelevant_without_hazard() -> None:
    terms = single(hazard_price=0.0, hazard_capacity=0.0)
    assert terms.events == 0.0
    assert terms.cost_per_work(1.0, 0.0) == terms.cost_per_work(1.0, 5000.0)


@pytest.mark.parametrize("billing", BILLINGS)
@pytest.mark.parametrize(
    ("count", "rate", "price", "phi", "horizon_s"),
    [(1.0, 1.0, 0.9, 1.0, HORIZON_S), (4.0, 2.5, 12.24, 0.8, 2 * H), (2.0, 0.3, 0.1, 1.0, 900.0)],
)
def test_zero_hazard_cost_per_work_is_price_over_rate_times_useful_share(
    billing: str, count: float, rate: float, price: float, phi: float, horizon_s: float
) -> None:
    """One new allocation, no eviction: E = P / (3600·φ·ν·(1 - σ/t)) $ per reference-GPU-s."""
    terms = single(billing=billing, count=count, work_rate=rate, price=price, horizon_s=horizon_s)
    expected = price / H / (phi * rate * (1.0 - SIGMA_S / horizon_s))
    assert terms.cost_per_work(phi, 600.0) == pytest.approx(expected, rel=1e-12)


def test_working_allocation_pays_no_add_overhead() -> None:
    terms = single(pending_s=0.0, add_overhead_s=SIGMA_S)
    assert terms.cost_per_work(1.0, 0.0) == pytest.approx(0.9 / H)


def test_footprint_terms_add_componentwise() -> None:
    a = FootprintTerms(1.0, 0.5, 2.0, 100.0)
    b = FootprintTerms(2.0, 0.25, 3.0, 50.0)
    assert a + b == FootprintTerms(3.0, 0.75, 5.0, 150.0)


def test_capacity_events_scale_with_count_and_price_events_do_not() -> None:
    one = single(count=1.0, hazard_price=1e-5, hazard_capacity=2e-5)
    four = single(count=4.0, hazard_price=1e-5, hazard_capacity=2e-5)
    assert one.events == pytest.approx((1e-5 + 2e-5) * HORIZON_S)
    assert four.events == pytest.approx((1e-5 + 4 * 2e-5) * HORIZON_S)
