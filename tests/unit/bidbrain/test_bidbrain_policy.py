"""BidBrain's decisions on small hand-made markets (fakes for the eviction models)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from orchestrator.bidbrain.baselines import CheapestFailoverPolicy, StandardPolicy
from orchestrator.bidbrain.model import AppParams, Footprint, HeldAllocation, JobSpec
from orchestrator.bidbrain.policy import (
    BidBrainPolicy,
    BidBrainSettings,
    DecisionInput,
    MarketTable,
    policy_class,
)
from orchestrator.errors import UserError
from orchestrator.market.catalog import Catalog
from orchestrator.market.eviction import EvictionModel
from orchestrator.market.prices import Market

A = Market("p3.2xlarge", "us-east-1a")
B = Market("p3.2xlarge", "us-east-1b")
BIG = Market("p3.16xlarge", "us-east-1a")
HOUR = 3600.0


class FixedHazard(EvictionModel):
    """Hazard per market (per hour), optionally higher for bids close to the market."""

    name = "fixed"

    def __init__(
        self,
        per_hour: dict[Market, float] | None = None,
        low_bid_per_hour: float = 0.0,
        low_bid_below_usd: float = 0.0,
    ) -> None:
        self.per_hour = per_hour or {}
        self.low_bid_per_hour = low_bid_per_hour
        self.low_bid_below_usd = low_bid_below_usd

    def hazard_per_s(self, market: Market, bid_delta_usd: float) -> float:
        h = self.per_hour.get(market, 0.0)
        if bid_delta_usd < self.low_bid_below_usd:
            h += self.low_bid_per_hour
        return h / HOUR


def make_policy(
    markets,
    *,
    billing="per-second",
    price_model=None,
    capacity_model=None,
    cls=BidBrainPolicy,
    **kwargs,
):
    table = MarketTable.build(markets, Catalog.load())
    return cls(
        table,
        billing=billing,
        price_model=price_model or FixedHazard(),
        capacity_model=capacity_model or FixedHazard(),
        **kwargs,
    )


def job(**kwargs) -> JobSpec:
    base = {"work_gpu_hours": 160.0, "max_work_rate": 8.0}
    base.update(kwargs)
    return JobSpec(**base)


def prices_for(policy, by_market: dict[Market, float]) -> np.ndarray:
    return np.array([by_market.get(m, math.nan) for m in policy.table.markets])


def held(
    alloc_id, market, count, price, *, started_s=0.0, reliable=False, max_price=None, rate=None
):
    return HeldAllocation(
        allocation_id=alloc_id,
        market=market,
        count=count,
        work_rate_per_instance=rate
        if rate is not None
        else Catalog.load().work_rate(market.instance_type),
        price_usd_per_hour=price,
        started_s=started_s,
        reliable=reliable,
        max_price_usd_per_hour=max_price,
    )


def reliable_alloc():
    return held("r", Market("m5.xlarge", "us-east-1a"), 1, 0.192, reliable=True, rate=0.0)


def decide(policy, *, prices, footprint=None, now=10_000.0, **kwargs):
    j = kwargs.pop("job", None) or job()
    inp = DecisionInput(
        now_s=now,
        job=j,
        work_remaining_gpu_hours=kwargs.pop("remaining", j.work_gpu_hours),
        spend_usd=kwargs.pop("spend", 0.0),
        footprint=footprint or Footprint(),
        prices_usd_per_hour=prices_for(policy, prices),
        **kwargs,
    )
    return policy.decide(inp)


def spot_rate(decision):
    cat = Catalog.load()
    return sum(r.count * cat.work_rate(r.instance_type) for r in decision.acquire if not r.reliable)


def test_first_decision_buys_reliable_tier_and_fills_to_max_rate_with_cheapest_market():
    policy = make_policy([A, B])
    d = decide(policy, prices={A: 1.2, B: 0.95})
    reliable = [r for r in d.acquire if r.reliable]
    assert len(reliable) == 1 and reliable[0].instance_type == "m5.xlarge"
    spot = [r for r in d.acquire if not r.reliable]
    assert {r.zone for r in spot} == {"us-east-1b"}
    assert spot_rate(d) == pytest.approx(8.0)
    assert math.isfinite(d.expected_cost_per_work) and d.expected_cost_per_work > 0.95


def test_never_exceeds_the_jobs_max_work_rate():
    policy = make_policy([A, B, BIG])
    d = decide(policy, prices={A: 0.9, B: 0.9, BIG: 7.2})
    assert spot_rate(d) <= 8.0 + 1e-9


def test_replaces_an_evicted_instance_when_the_job_has_long_to_run():
    policy = make_policy([A, B], capacity_model=FixedHazard({A: 0.1, B: 0.1}))
    fp = Footprint([reliable_alloc(), held("s1", A, 4, 0.95, max_price=3.06)])
    d = decide(policy, prices={A: 0.95, B: 0.95}, footprint=fp)
    assert spot_rate(d) == pytest.approx(4.0)
    assert d.release == ()


def test_does_not_restart_a_node_for_the_last_minutes_of_a_job():
    # σ (4 min of a new node) costs more than the reliable node saves in what is left
    policy = make_policy([A], capacity_model=FixedHazard({A: 0.6}))
    fp = Footprint([reliable_alloc(), held("s1", A, 7, 0.95, max_price=3.06)])
    d = decide(
        policy,
        prices={A: 0.95},
        footprint=fp,
        remaining=0.5,
        job=job(app=AppParams(add_overhead_s=600)),
    )
    assert spot_rate(d) == 0


def test_each_eviction_stalling_the_whole_job_caps_how_many_risky_nodes_pay_off():
    # λ is paid by every node at every eviction: with many evictions, fewer nodes are cheaper
    policy = make_policy([A], capacity_model=FixedHazard({A: 2.0}))
    d = decide(policy, prices={A: 0.95}, job=job(app=AppParams(eviction_overhead_s=120)))
    assert 0 < spot_rate(d) < 8


def test_holds_nothing_new_when_the_footprint_is_full():
    policy = make_policy([A])
    fp = Footprint([reliable_alloc(), held("s1", A, 8, 0.95, max_price=3.06)])
    d = decide(policy, prices={A: 0.95}, footprint=fp)
    assert d.is_noop


def test_per_second_billing_bids_the_on_demand_price_when_low_bids_are_riskier():
    price_model = FixedHazard(low_bid_per_hour=0.5, low_bid_below_usd=1.0)
    policy = make_policy([A], price_model=price_model)
    d = decide(policy, prices={A: 0.95})
    spot = [r for r in d.acquire if not r.reliable]
    assert spot and all(r.max_price_usd_per_hour == pytest.approx(3.06) for r in spot)


def test_renewal_releases_an_allocation_whose_market_became_expensive():
    policy = make_policy([A, B])
    fp = Footprint([reliable_alloc(), held("dear", A, 8, 2.9, max_price=3.06)])
    d = decide(policy, prices={A: 2.9, B: 0.95}, footprint=fp, renewal_due=frozenset({"dear"}))
    assert d.release == ("dear",)
    assert {r.zone for r in d.acquire if not r.reliable} == {"us-east-1b"}
    assert spot_rate(d) == pytest.approx(8.0)


def test_allocation_not_at_its_renewal_point_is_kept():
    policy = make_policy([A, B])
    fp = Footprint([reliable_alloc(), held("dear", A, 8, 2.9, max_price=3.06)])
    d = decide(policy, prices={A: 2.9, B: 0.95}, footprint=fp)
    assert d.release == ()


def test_reliable_allocations_are_never_released():
    policy = make_policy([A])
    fp = Footprint([reliable_alloc(), held("s", A, 8, 0.95, max_price=3.06)])
    d = decide(policy, prices={A: 0.95}, footprint=fp, renewal_due=frozenset({"r", "s"}))
    assert "r" not in d.release


def test_budget_limits_what_is_committed_until_the_next_decision_and_the_reserve():
    policy = make_policy([A])
    commit_h = (policy.settings.decision_interval_s + policy.settings.budget_reserve_s) / HOUR
    budget = 100.0
    spend = budget - (0.192 + 3 * 0.95) * commit_h + 1e-6  # room for the reliable node + 2
    d = decide(
        policy,
        prices={A: 0.95},
        job=job(budget_usd=budget),
        spend=spend,
        footprint=Footprint([reliable_alloc()]),
    )
    committed = sum(r.count * 0.95 for r in d.acquire if not r.reliable) * commit_h
    assert committed + 0.192 * commit_h <= budget - spend + 1e-9
    assert 0 < spot_rate(d) <= 2
    assert not d.budget_exhausted


@pytest.mark.parametrize("late_s", [120.0, 600.0, 1020.0])
def test_a_decision_that_comes_late_by_up_to_the_reserve_finds_the_budget_whole(late_s):
    """Spend on the footprint a decision leaves, paid until a decision `late_s` later (a
    controller restart): never past the budget, whatever the spend it started from."""
    policy = make_policy([A])
    budget = 20.0
    for spend in np.linspace(budget - 3.0, budget, 31):
        fp = Footprint([reliable_alloc(), held("s", A, 4, 0.95, max_price=3.06)])
        d = decide(policy, prices={A: 0.95}, job=job(budget_usd=budget), spend=spend, footprint=fp)
        if d.budget_exhausted:
            continue
        kept = 0.0 if "s" in d.release else 4 * 0.95
        added = sum(r.count * (0.192 if r.reliable else 0.95) for r in d.acquire)
        assert spend + (0.192 + kept + added) * late_s / HOUR <= budget + 1e-9, spend


def test_without_a_reserve_the_budget_is_committed_to_the_next_decision_only():
    policy = make_policy([A], settings=BidBrainSettings(budget_reserve_s=0.0))
    interval_h = policy.settings.decision_interval_s / HOUR
    spend = 100.0 - (0.192 + 3 * 0.95) * interval_h + 1e-6
    d = decide(policy, prices={A: 0.95}, job=job(budget_usd=100.0), spend=spend,
               footprint=Footprint([reliable_alloc()]))  # fmt: skip
    assert not d.budget_exhausted and 0 < spot_rate(d) <= 2


def test_exhausted_budget_releases_spot_nodes_and_keeps_the_model_on_the_reliable_tier():
    policy = make_policy([A])
    fp = Footprint([reliable_alloc(), held("s", A, 8, 0.95, max_price=3.06)])
    d = decide(policy, prices={A: 0.95}, job=job(budget_usd=50.0), spend=49.999, footprint=fp)
    assert d.budget_exhausted
    assert d.release == ("s",)
    assert not [r for r in d.acquire if not r.reliable]


def test_projected_cost_adds_the_expected_cost_of_the_remaining_work_to_the_spend():
    policy = make_policy([A])
    d = decide(policy, prices={A: 1.0}, spend=10.0, remaining=100.0)
    # at least the spot price of the remaining work, plus the spend
    assert d.projected_cost_usd > 10.0 + 100.0 * 1.0
    assert d.projected_cost_usd < 10.0 + 100.0 * 1.3


def test_decisions_are_pure_functions_of_their_input():
    policy = make_policy([A, B, BIG], capacity_model=FixedHazard({A: 0.3, B: 0.6}))
    d1 = decide(policy, prices={A: 0.95, B: 0.92, BIG: 7.4})
    d2 = decide(policy, prices={A: 0.95, B: 0.92, BIG: 7.4})
    assert d1 == d2


def test_markets_without_a_price_or_marked_unavailable_are_not_bought():
    policy = make_policy([A, B])
    d = decide(policy, prices={A: 0.9, B: 0.95}, unavailable=frozenset({A}))
    assert {r.zone for r in d.acquire if not r.reliable} == {"us-east-1b"}
    d = decide(policy, prices={B: 0.95})
    assert {r.zone for r in d.acquire if not r.reliable} == {"us-east-1b"}


def test_standard_policy_buys_cheapest_per_work_at_the_on_demand_bid():
    policy = make_policy([A, B], cls=StandardPolicy)
    d = decide(policy, prices={A: 1.2, B: 0.95})
    spot = [r for r in d.acquire if not r.reliable]
    assert [(r.zone, r.count, r.max_price_usd_per_hour) for r in spot] == [("us-east-1b", 8, 3.06)]


def test_failover_policy_avoids_the_zone_just_preempted():
    policy = make_policy([A, B], cls=CheapestFailoverPolicy)
    d = decide(policy, prices={A: 0.9, B: 0.95}, last_eviction_s={A: 9_900.0})
    assert [r.zone for r in d.acquire] == ["us-east-1b"]
    d = decide(policy, prices={A: 0.9, B: 0.95}, last_eviction_s={A: 0.0})
    assert [r.zone for r in d.acquire] == ["us-east-1a"]


def test_unknown_policy_name_lists_the_valid_ones():
    with pytest.raises(UserError) as info:
        policy_class("bidbrian")
    assert "bidbrain" in info.value.fix


@pytest.mark.parametrize(
    ("setting", "value"),
    [("counts", [0]), ("counts", [-1]), ("counts", []), ("counts", [1, 0]),
     ("bid_deltas_usd", []), ("bid_deltas_usd", [-0.1]), ("budget_reserve_s", -1.0)],
)  # fmt: skip
def test_settings_that_cannot_be_bought_or_bid_are_refused_by_name(setting, value):
    with pytest.raises(ValueError, match=setting):
        BidBrainSettings(**{setting: value})
