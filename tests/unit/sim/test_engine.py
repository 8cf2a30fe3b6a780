"""The simulator's event loop on a hand-made world: one market, flat price, evictions at chosen
instants (removal probability 1), so every number can be worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
from support.sim_worlds import NoPriceRisk, flat_world

from orchestrator.bidbrain.baselines import StandardPolicy
from orchestrator.bidbrain.model import AppParams, JobSpec
from orchestrator.bidbrain.policy import BidBrainPolicy
from orchestrator.market.billing import HourlyRefundBilling, PerSecondBilling
from orchestrator.market.eviction import (
    CapacityHazardModel,
    RemovalStream,
)
from orchestrator.market.prices import Market
from orchestrator.sim.engine import Run, RuntimeParams
from orchestrator.sim.world import World

M = Market("p3.2xlarge", "us-east-1a")
B = Market("p3.2xlarge", "us-east-1b")  # a little dearer, never evicted
T0 = 1_580_000_000.0
DAY = 86400.0
PRICE = 0.9
SIGMA = 240.0


@pytest.fixture(scope="module")
def world() -> World:
    return flat_world({M: PRICE, B: PRICE + 0.05}, T0)


def run(
    world,
    *,
    policy_cls=StandardPolicy,
    runtime="agileml",
    evict_at=(),
    billing=None,
    work_gpu_hours=8.0,
    rate=4.0,
    notice=False,
    periodic=False,
    **policy_kwargs,
):
    policy = policy_cls(
        world.table,
        billing=(billing or PerSecondBilling()).name,
        price_model=NoPriceRisk(),
        capacity_model=CapacityHazardModel(prior_rate_per_hour=0.1),
        catalog=world.catalog,
        **policy_kwargs,
    )
    removals = {
        M: RemovalStream(
            np.array([T0 + t for t in evict_at], dtype=float), np.ones(len(evict_at)), (0,)
        )
    }
    job = JobSpec(
        work_gpu_hours=work_gpu_hours,
        max_work_rate=rate,
        app=AppParams(add_overhead_s=SIGMA, eviction_overhead_s=30.0),
        time_value_usd_per_hour=0.0,
    )
    return Run(
        world,
        policy=policy,
        runtime=runtime,
        billing=billing or PerSecondBilling(),
        job=job,
        start_s=T0,
        params=RuntimeParams(),
        removal_events=removals,
        keep_ledger=True,
        periodic_decisions=periodic,
        acts_on_notice=notice,
    ).run()


def test_agileml_new_nodes_work_after_sigma_and_nothing_is_lost_on_eviction(world):
    r = run(world, evict_at=(3600.0,))
    # 4 GPUs work from σ to 3600 s, all are evicted, replacements work from 3600 + σ on
    done_first = 4 * (3600 - SIGMA)
    finish = 3600 + SIGMA + (8 * 3600 - done_first) / 4
    assert r.completed
    assert r.runtime_s == pytest.approx(finish)
    assert r.evictions == 4


def test_acting_on_the_interruption_notice_buys_the_replacement_two_minutes_early(world):
    late = run(world, policy_cls=BidBrainPolicy, evict_at=(3600.0,))
    early = run(world, policy_cls=BidBrainPolicy, evict_at=(3600.0,), notice=True)
    assert early.runtime_s == pytest.approx(late.runtime_s - 120.0)
    in_b = [line.start_s - T0 for line in early.ledger if line.zone == B.zone]
    assert min(in_b) == pytest.approx(3600.0 - 120.0)


def test_a_market_that_reclaims_a_node_before_it_is_ready_is_avoided_for_a_while(world):
    r = run(world, policy_cls=BidBrainPolicy, evict_at=(3600.0,), notice=True)
    # the first replacement (in the cheaper market) is noticed at once; the next goes to B
    second_in_a = [
        line
        for line in r.ledger
        if line.zone == M.zone and line.market == "spot" and line.start_s > T0
    ]
    assert second_in_a and all(line.end_s - T0 == pytest.approx(3600.0) for line in second_in_a)
    assert not [line for line in r.ledger if line.zone == M.zone and line.start_s - T0 > 3600]


def test_checkpoint_runtime_loses_the_work_since_its_last_checkpoint(world):
    elastic = run(world, evict_at=(3600.0,))
    ckpt = run(world, runtime="checkpoint", evict_at=(3600.0,), with_reliable_tier=False)
    assert ckpt.completed and elastic.completed
    # boot + restart (300 s) instead of σ, checkpoints every τ, work rolled back at 3600 s
    assert ckpt.runtime_s > elastic.runtime_s + 300.0


def test_gang_checkpoint_terminates_the_whole_cluster_on_one_preemption(world):
    from orchestrator.bidbrain.baselines import CheapestFailoverPolicy

    r = run(world, policy_cls=CheapestFailoverPolicy, runtime="gang-checkpoint", evict_at=(3600.0,))
    reasons = [line.reason for line in r.ledger]
    assert reasons.count("evicted") + reasons.count("released") >= 4
    assert r.completed


def test_every_instance_is_billed_for_its_whole_life_at_the_market_price(world):
    r = run(world, evict_at=(3600.0,))
    spot = [line for line in r.ledger if line.market == "spot"]
    assert sum(line.charged_usd for line in spot) == pytest.approx(
        sum((line.end_s - line.start_s) / 3600 * PRICE for line in spot)
    )
    total = sum(line.charged_usd for line in r.ledger)
    assert r.cost_usd == pytest.approx(total)


def test_hourly_refund_makes_the_evicted_partial_hour_free(world):
    r = run(world, evict_at=(1800.0,), billing=HourlyRefundBilling())
    evicted = [line for line in r.ledger if line.reason == "evicted"]
    assert len(evicted) == 4 and all(line.charged_usd == 0.0 for line in evicted)
    assert r.free_compute_s == pytest.approx(4 * 1800.0)


def test_a_job_never_works_faster_than_its_max_rate(world):
    r = run(world, rate=4.0, work_gpu_hours=4.0)
    assert r.runtime_s >= 3600.0


def test_no_eviction_means_one_interval_per_instance_and_the_nominal_time_plus_sigma(world):
    r = run(world)
    assert r.evictions == 0
    assert r.runtime_s == pytest.approx(SIGMA + 2 * 3600.0)
    assert not math.isinf(r.cost_usd)
