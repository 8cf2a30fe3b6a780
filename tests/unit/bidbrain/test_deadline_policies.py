"""Deadline rules as pure decisions: BidBrain's safety net and Can't Be Late's Uniform
Progress, each on hand-built inputs."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.bidbrain.baselines import UniformProgressPolicy
from orchestrator.bidbrain.deadline import no_return_slack_s, slack_s
from orchestrator.bidbrain.model import AppParams, Footprint, HeldAllocation, JobSpec
from orchestrator.bidbrain.policy import BidBrainPolicy, DecisionInput, MarketTable
from orchestrator.market.catalog import Catalog
from orchestrator.market.eviction import EvictionModel
from orchestrator.market.prices import Market

A = Market("p3.2xlarge", "us-east-1a")
B = Market("p3.2xlarge", "us-east-1b")
OD_PRICE = 3.06
NOW = 1_600_000_000.0
HOUR = 3600.0
D = 300.0  # Uniform Progress' changeover delay


class Flat(EvictionModel):
    name = "flat"

    def hazard_per_s(self, market: Market, bid_delta_usd: float) -> float:
        return 1e-5


def policy(cls=BidBrainPolicy, **kwargs):
    table = MarketTable.build([A, B], Catalog.load())
    return cls(table, billing="per-second", price_model=Flat(), capacity_model=Flat(), **kwargs)


def job(*, deadline_in_s: float, work: float = 8.0, budget: float | None = None) -> JobSpec:
    return JobSpec(work_gpu_hours=work, max_work_rate=4.0, budget_usd=budget,
                   app=AppParams(add_overhead_s=240.0, eviction_overhead_s=30.0),
                   deadline_s=NOW + deadline_in_s)  # fmt: skip


def alloc(alloc_id, market, count, *, on_demand=False, ready=True, price=None, rate=1.0):
    price = price if price is not None else OD_PRICE if on_demand else 0.9
    return HeldAllocation(alloc_id, market, count, rate, price, NOW - HOUR,
                          None if on_demand else OD_PRICE, on_demand, ready)  # fmt: skip


RELIABLE = alloc("r", Market("m5.xlarge", "us-east-1a"), 1, on_demand=True, price=0.192, rate=0.0)


def decide(p, j, *, remaining, allocations=(), prices=(0.9, 0.95), **kwargs):
    inp = DecisionInput(now_s=NOW, job=j, work_remaining_gpu_hours=remaining, spend_usd=0.0,
                        footprint=Footprint(list(allocations)),
                        prices_usd_per_hour=np.array(prices), **kwargs)  # fmt: skip
    return p.decide(inp)


def on_demand_gpus(d):
    return [r for r in d.acquire if r.reliable and r.instance_type == "p3.2xlarge"]


# -- BidBrain's safety net -----------------------------------------------------------------


def _at_slack(slack: float, remaining: float = 4.0) -> JobSpec:
    return job(deadline_in_s=remaining / 4.0 * HOUR + slack)


def test_bidbrain_buys_spot_while_the_slack_is_above_the_point_of_no_return():
    j = _at_slack(0.0)
    pnr = no_return_slack_s(j, 120.0)
    d = decide(policy(), _at_slack(pnr + 1.0), remaining=4.0, allocations=[RELIABLE])
    assert not on_demand_gpus(d) and [r for r in d.acquire if not r.reliable]


def test_bidbrain_buys_on_demand_gpus_to_the_max_rate_at_the_point_of_no_return():
    j = _at_slack(no_return_slack_s(_at_slack(0.0), 120.0))
    assert slack_s(j, NOW, 4.0) == pytest.approx(no_return_slack_s(j, 120.0))
    spot = alloc("s", A, 2)
    d = decide(policy(), j, remaining=4.0, allocations=[RELIABLE, spot])
    assert sum(r.count for r in on_demand_gpus(d)) == 4
    assert not [r for r in d.acquire if not r.reliable]  # no more spot
    assert d.release == ()  # the spot nodes work until the on-demand ones do
    assert "safety net" in d.reason


def test_bidbrain_releases_spot_once_the_on_demand_gpus_work():
    j = _at_slack(0.0)
    held = [RELIABLE, alloc("s", A, 2), alloc("od", A, 4, on_demand=True, ready=True)]
    d = decide(policy(), j, remaining=4.0, allocations=held)
    assert d.release == ("s",) and not on_demand_gpus(d)
    not_ready = [RELIABLE, alloc("s", A, 2), alloc("od", A, 4, on_demand=True, ready=False)]
    assert decide(policy(), j, remaining=4.0, allocations=not_ready).release == ()


def test_bidbrain_s_safety_net_never_buys_past_the_budget():
    # the budget carries the reliable node and about 2 on-demand GPUs until the next
    # decision and the reserve past it
    commit_h = (120.0 + 900.0) / HOUR
    budget = (0.192 + 2.5 * OD_PRICE) * commit_h
    j = job(deadline_in_s=HOUR, budget=budget)
    d = decide(policy(), j, remaining=4.0, allocations=[RELIABLE])
    assert sum(r.count for r in on_demand_gpus(d)) == 2


def test_the_reliable_tier_is_bought_even_when_on_demand_gpus_are_held():
    j = _at_slack(0.0)
    d = decide(policy(), j, remaining=4.0, allocations=[alloc("od", A, 4, on_demand=True)])
    assert [r for r in d.acquire if r.instance_type == "m5.xlarge"]


# -- Uniform Progress ----------------------------------------------------------------------


def up(**kwargs) -> UniformProgressPolicy:
    return policy(UniformProgressPolicy, reference_type="p3.2xlarge", changeover_s=D,
                  spot_retry_s=600.0, **kwargs)  # fmt: skip


def test_uniform_progress_goes_spot_in_the_cheapest_zone_when_it_is_available():
    p = up()
    d = decide(p, job(deadline_in_s=4 * HOUR), remaining=8.0)
    (req,) = d.acquire
    assert (req.zone, req.count, req.reliable) == ("us-east-1a", 4, False)


def test_uniform_progress_waits_when_ahead_and_catches_up_on_demand_when_behind():
    p = up()
    j = job(deadline_in_s=8 * HOUR)
    recent = {A: NOW - 60.0}  # spot just preempted: not available for a while
    first = decide(p, j, remaining=8.0, last_eviction_s=recent)  # t0: ep = 0, cp = 0
    assert first.acquire == ()  # not behind: wait for spot
    later = NOW + HOUR  # ep = 1 GPU-h; nothing done
    inp = DecisionInput(now_s=later, job=j, work_remaining_gpu_hours=8.0, spend_usd=0.0,
                        footprint=Footprint([]), prices_usd_per_hour=np.array([0.9, 0.95]),
                        last_eviction_s={A: later - 60.0})  # fmt: skip
    (req,) = p.decide(inp).acquire
    assert req.reliable and req.count == 4


def test_uniform_progress_stays_on_demand_until_ahead_of_the_line_at_now_plus_2d():
    p = up()
    j = job(deadline_in_s=8 * HOUR)
    decide(p, j, remaining=8.0)  # t0 = NOW
    od = [alloc("od", A, 4, on_demand=True)]
    t = NOW + 2 * HOUR  # ep(t) = 2; ep(t + 2d) = 2 + 8·600/28800 ≈ 2.17
    for done, switches in ((2.1, False), (2.2, True)):
        inp = DecisionInput(
            now_s=t,
            job=j,
            work_remaining_gpu_hours=8.0 - done,
            spend_usd=0.0,
            footprint=Footprint(od),
            prices_usd_per_hour=np.array([0.9, 0.95]),
        )
        d = p.decide(inp)
        assert (d.release == ("od",)) is switches, done
        if switches:  # spot is available: back to it
            assert [r for r in d.acquire if not r.reliable]


def test_uniform_progress_safety_net_holds_on_demand_to_the_end():
    p = up()
    j = job(deadline_in_s=2 * HOUR + 2 * D - 1)  # R < C + 2d at once
    (req,) = decide(p, j, remaining=8.0).acquire
    assert req.reliable
    od = [alloc("od", A, 4, on_demand=True)]
    # even far ahead with spot available, it stays
    d = decide(p, j, remaining=0.5, allocations=od)
    assert d.release == () and d.acquire == ()


def test_once_on_demand_gpus_are_held_the_safety_net_holds_even_with_slack_back():
    """Progress faster than the max rate (whole instances round up) can raise the slack above
    the point of no return again: the job stays on on-demand and buys no spot."""
    j = _at_slack(3 * HOUR)
    held = [RELIABLE, alloc("od", A, 4, on_demand=True, ready=False)]
    d = decide(policy(), j, remaining=4.0, allocations=held)
    assert d.acquire == () and d.release == () and "safety net" in d.reason


def test_spot_held_in_the_safety_net_is_paid_only_until_the_on_demand_gpus_work():
    # a budget for the reliable node and 4 on-demand GPUs over the commitment window: the two
    # spot nodes, paid for σ only, must not cut the fill to 3
    commit_h = (120.0 + 900.0) / HOUR
    sigma_h = 240.0 / HOUR
    budget = (0.192 + 4 * OD_PRICE) * commit_h + 2 * 0.9 * sigma_h + 0.01
    j = job(deadline_in_s=HOUR, budget=budget)
    d = decide(policy(), j, remaining=4.0, allocations=[RELIABLE, alloc("s", A, 2)])
    assert sum(r.count for r in on_demand_gpus(d)) == 4 and d.release == ()


def test_a_job_that_can_finish_inside_its_budget_is_not_stopped_by_the_reserve():
    # 0.5 GPU-hours left on 4 ready on-demand GPUs: 7.5 min, about $1.55 with the reliable node
    j = job(deadline_in_s=HOUR, budget=3.2)
    held = [RELIABLE, alloc("od", A, 4, on_demand=True)]
    d = decide(policy(), j, remaining=0.5, allocations=held)
    assert not d.budget_exhausted


def test_the_fill_picks_the_cheapest_whole_instances_not_the_cheapest_per_work():
    from orchestrator.bidbrain.deadline import cheapest_fill

    # need 1 GPU of work: a big type cheap per work (8 at $16) loses to one small one at $3
    i, count = cheapest_fill(1.0, np.array([8.0, 1.0]), np.array([16.0, 3.0]), np.array([True] * 2))
    assert (i, count) == (1, 1)


def test_uniform_progress_takes_spot_when_available_even_when_behind():
    p = up()
    j = job(deadline_in_s=8 * HOUR)
    decide(p, j, remaining=8.0, last_eviction_s={A: NOW - 60.0})  # t0, spot not available
    later = NOW + 2 * HOUR  # behind: ep = 2, nothing done; spot is back
    prices = np.array([0.9, 0.95])
    inp = DecisionInput(now_s=later, job=j, work_remaining_gpu_hours=8.0, spend_usd=0.0,
                        footprint=Footprint([]), prices_usd_per_hour=prices)  # fmt: skip
    (req,) = p.decide(inp).acquire
    assert not req.reliable
