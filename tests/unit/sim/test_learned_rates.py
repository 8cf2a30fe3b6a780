"""Learned work rates in the simulator, on a hand-made world: a V100 and a K80 market at flat
prices, where the catalog's rates make the V100 cheaper per work (0.9 $/h at ν 1 against 0.3
at ν 0.2) but the job's true V100 rate is a quarter of the catalog's, so that the K80 is the
better buy (3.6 $ per unit of work against 1.5)."""

from __future__ import annotations

import pytest
from support.sim_worlds import NoPriceRisk, flat_world

from orchestrator.bidbrain.baselines import CheapestFailoverPolicy, StandardPolicy
from orchestrator.bidbrain.model import AppParams, JobSpec
from orchestrator.bidbrain.policy import BidBrainPolicy
from orchestrator.market.billing import PerSecondBilling
from orchestrator.market.eviction import CapacityHazardModel
from orchestrator.market.prices import Market
from orchestrator.sim.engine import Run, RuntimeParams
from orchestrator.sim.results import RunResult
from orchestrator.sim.world import World

V100 = Market("p3.2xlarge", "us-east-1a")
K80 = Market("p2.xlarge", "us-east-1a")
T0 = 1_580_000_000.0
TRUE = {"V100": 0.25, "K80": 0.2, "T4": 0.35, "A10G": 0.7}


@pytest.fixture(scope="module")
def world() -> World:
    return flat_world({V100: 0.9, K80: 0.3}, T0)


def run(world: World, *, learns: bool, truth=TRUE, stated=None) -> RunResult:
    table = world.table if stated is None else world.table.with_work_rates(world.catalog, stated)
    policy = BidBrainPolicy(table, billing="per-second", price_model=NoPriceRisk(),
                            capacity_model=CapacityHazardModel(prior_rate_per_hour=0.01),
                            catalog=world.catalog)  # fmt: skip
    job = JobSpec(work_gpu_hours=8.0, max_work_rate=4.0, reliable_count=0,
                  app=AppParams(add_overhead_s=240.0),
                  gpu_work_rates=stated)  # fmt: skip
    return Run(world, policy=policy, runtime="agileml", billing=PerSecondBilling(), job=job,
               start_s=T0, params=RuntimeParams(), removal_events={}, keep_ledger=True,
               periodic_decisions=True, true_work_rates=truth,
               learns_rates=learns).run()  # fmt: skip


def _spend_by_type(result: RunResult) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in result.ledger:
        out[line.instance_type] = out.get(line.instance_type, 0.0) + line.charged_usd
    return out


def test_on_the_catalogs_rates_bidbrain_keeps_buying_the_slow_v100s(world):
    static = run(world, learns=False)
    assert static.completed
    assert set(_spend_by_type(static)) == {"p3.2xlarge"}


def test_learning_finds_the_k80_cheaper_and_recovers_most_of_the_wrong_priors_cost(world):
    static = run(world, learns=False)
    learned = run(world, learns=True)
    known = run(world, learns=False, stated=TRUE)
    assert learned.completed and known.completed
    assert _spend_by_type(learned).get("p2.xlarge", 0.0) > _spend_by_type(learned)["p3.2xlarge"]
    assert known.cost_usd < learned.cost_usd < static.cost_usd
    assert (static.cost_usd - learned.cost_usd) / (static.cost_usd - known.cost_usd) >= 0.8


def test_a_true_rate_equal_to_the_prior_leaves_every_decision_as_it_was(world):
    catalog = dict(world.catalog.gpu_work_rates)
    static = run(world, learns=False, truth=catalog)
    learned = run(world, learns=True, truth=catalog)
    assert learned.cost_usd == static.cost_usd
    assert learned.runtime_s == static.runtime_s
    assert [(x.instance_type, x.start_s, x.end_s) for x in learned.ledger] == [
        (x.instance_type, x.start_s, x.end_s) for x in static.ledger
    ]


@pytest.mark.parametrize(
    ("policy_cls", "runtime"),
    [(StandardPolicy, "checkpoint"), (CheapestFailoverPolicy, "gang-checkpoint")],
)
def test_checkpointing_gangs_start_when_their_true_rates_fall_short_of_the_stated(
    world, policy_cls, runtime
):
    """A gang is bought at the stated rates; slower GPUs make it slower, not never ready."""
    kwargs = {"reference_type": "p3.2xlarge"} if policy_cls is CheapestFailoverPolicy else {}
    policy = policy_cls(world.table, billing="per-second", price_model=NoPriceRisk(),
                        capacity_model=CapacityHazardModel(prior_rate_per_hour=0.01),
                        catalog=world.catalog, **kwargs)  # fmt: skip
    job = JobSpec(work_gpu_hours=8.0, max_work_rate=4.0, app=AppParams(add_overhead_s=240.0))
    results = [
        Run(
            world,
            policy=policy,
            runtime=runtime,
            billing=PerSecondBilling(),
            job=job,
            start_s=T0,
            params=RuntimeParams(),
            removal_events={},
            true_work_rates=truth,
        ).run()  # fmt: skip
        for truth in (None, TRUE)
    ]
    assert all(r.completed for r in results)
    assert results[1].runtime_s > 3 * results[0].runtime_s  # the V100s do a quarter
