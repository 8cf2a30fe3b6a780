"""Deadlines in the simulator, on a hand-made world: two spot markets at a flat price whose
capacity vanishes after the first hour (every instance launched after that is taken back
within a minute), so that the safety net's moment can be worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest
from support.sim_worlds import NoPriceRisk, flat_world

from orchestrator.bidbrain.baselines import UniformProgressPolicy
from orchestrator.bidbrain.deadline import no_return_slack_s
from orchestrator.bidbrain.model import AppParams, JobSpec
from orchestrator.bidbrain.policy import BidBrainPolicy, BidBrainSettings
from orchestrator.market.billing import PerSecondBilling
from orchestrator.market.eviction import (
    CapacityHazardModel,
    RemovalStream,
)
from orchestrator.market.prices import Market
from orchestrator.sim.engine import Run, RuntimeParams
from orchestrator.sim.world import World

A = Market("p3.2xlarge", "us-east-1a")
B = Market("p3.2xlarge", "us-east-1b")
T0 = 1_580_000_000.0
DAY, HOUR = 86400.0, 3600.0
SIGMA, LAMBDA = 240.0, 30.0
GONE_FROM_S = HOUR  # spot capacity in both markets ends here
WORK, RATE = 8.0, 4.0  # GPU-hours, GPUs: 2 h at the max rate
DEADLINE_S = 4 * HOUR


@pytest.fixture(scope="module")
def world() -> World:
    return flat_world({A: 0.9, B: 0.95}, T0)


def _removals() -> dict[Market, RemovalStream]:
    every_minute = np.arange(T0 + GONE_FROM_S, T0 + DAY, 60.0)
    return {m: RemovalStream(every_minute, np.ones(len(every_minute)), (i,)) for i, m in
            enumerate((A, B))}  # fmt: skip


def run(world: World, policy_cls=BidBrainPolicy, *, deadline: bool = True, runtime="agileml",
        **kwargs):  # fmt: skip
    policy = policy_cls(world.table, billing="per-second", price_model=NoPriceRisk(),
                        capacity_model=CapacityHazardModel(prior_rate_per_hour=0.1),
                        catalog=world.catalog, **kwargs)  # fmt: skip
    job = JobSpec(
        work_gpu_hours=WORK,
        max_work_rate=RATE,
        app=AppParams(add_overhead_s=SIGMA, eviction_overhead_s=LAMBDA),
        time_value_usd_per_hour=0.0,
        deadline_s=T0 + DEADLINE_S if deadline else None,
    )
    return Run(world, policy=policy, runtime=runtime, billing=PerSecondBilling(), job=job,
               start_s=T0, params=RuntimeParams(), removal_events=_removals(), keep_ledger=True,
               periodic_decisions=True).run()  # fmt: skip


def _gpu_on_demand(result) -> list:
    return [line for line in result.ledger
            if line.market == "on-demand" and line.instance_type == "p3.2xlarge"]  # fmt: skip


def test_the_safety_net_buys_on_demand_gpus_at_the_point_of_no_return_and_meets_the_deadline(
    world,
):
    r = run(world)
    # spot works from σ to the first hour; then nothing works, and the slack runs down
    done_by_then = RATE * (GONE_FROM_S - SIGMA) / HOUR
    need_s = (WORK - done_by_then) / RATE * HOUR
    pnr = no_return_slack_s(
        JobSpec(work_gpu_hours=WORK, max_work_rate=RATE,
                app=AppParams(add_overhead_s=SIGMA, eviction_overhead_s=LAMBDA)),
        BidBrainSettings().decision_interval_s,
    )  # fmt: skip
    trigger_s = DEADLINE_S - need_s - pnr  # slack = pnr from here on
    od = _gpu_on_demand(r)
    assert od, "no on-demand GPU was bought"
    first = min(line.start_s for line in od) - T0
    assert trigger_s <= first <= trigger_s + BidBrainSettings().decision_interval_s
    assert sum(line.count for line in od if line.start_s - T0 == first) == RATE  # the max rate
    assert r.completed and r.deadline_met
    assert r.runtime_s <= DEADLINE_S


def test_without_a_deadline_the_same_job_waits_for_spot_past_it(world):
    r = run(world, deadline=False)
    assert not _gpu_on_demand(r)
    assert r.deadline_met is None
    assert not r.completed or r.runtime_s > DEADLINE_S


def test_once_the_on_demand_gpus_work_the_spot_nodes_are_released_and_none_bought(world):
    r = run(world)
    first_od = min(line.start_s for line in _gpu_on_demand(r))
    spot_after = [line for line in r.ledger if line.market == "spot" and line.start_s > first_od]
    assert not spot_after
    spot_end = max(line.end_s for line in r.ledger if line.market == "spot")
    assert spot_end <= first_od + SIGMA + BidBrainSettings().decision_interval_s


def test_uniform_progress_catches_up_on_on_demand_and_meets_the_deadline(world):
    r = run(world, UniformProgressPolicy, runtime="gang-notice-checkpoint",
            reference_type="p3.2xlarge",
            changeover_s=300.0, spot_retry_s=600.0)  # fmt: skip
    assert _gpu_on_demand(r)
    assert r.completed and r.deadline_met


def test_uniform_progress_without_a_deadline_is_refused(world):
    from orchestrator.bidbrain.errors import DeadlineError

    with pytest.raises(DeadlineError, match="needs a deadline"):
        run(world, UniformProgressPolicy, deadline=False, runtime="gang-checkpoint")


def test_a_run_past_its_deadline_is_counted_as_missed(world):
    """A deadline shorter than the work at the max rate: the job finishes, late."""
    policy = BidBrainPolicy(world.table, billing="per-second", price_model=NoPriceRisk(),
                            capacity_model=CapacityHazardModel(prior_rate_per_hour=0.1),
                            catalog=world.catalog)  # fmt: skip
    job = JobSpec(work_gpu_hours=WORK, max_work_rate=RATE, deadline_s=T0 + HOUR,
                  app=AppParams(add_overhead_s=SIGMA, eviction_overhead_s=LAMBDA))  # fmt: skip
    r = Run(world, policy=policy, runtime="agileml", billing=PerSecondBilling(), job=job,
            start_s=T0, params=RuntimeParams(), removal_events={},
            periodic_decisions=True).run()  # fmt: skip
    assert r.completed and r.runtime_s > HOUR
    assert r.deadline_met is False
