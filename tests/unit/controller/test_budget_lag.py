"""The budget holds under lag: the reserve follows the measured gap between a job's decisions,
so a controller that decides an hour apart (instead of every 2 minutes) keeps the job within
its budget (it used to go 50% over) and releases early instead; a restarted controller reads
how late the job's last decisions came from its decision events."""

from __future__ import annotations

import pytest

from benchmarks.budget_lag import T0, run
from orchestrator.bidbrain.policy import BidBrainSettings
from orchestrator.cloud.memory import InMemoryCloud, InMemoryEC2
from orchestrator.controller.job import LAG_FACTOR, ControllerJob, last_decisions
from orchestrator.controller.wiring import build_controller
from orchestrator.jobspec import JobSubmission
from orchestrator.market.trace_source import TracePriceSource, bundled_prices_dir
from orchestrator.settings import Settings
from orchestrator.store import JobRecord, MemoryStore
from orchestrator.store.events import DecisionEvent, StateEvent


@pytest.mark.parametrize("gap_s", [120.0, 1800.0, 3600.0])
def test_a_lagging_controller_keeps_the_job_within_its_budget(gap_s: float) -> None:
    result = run(gap_s, budget_usd=10.0)
    assert result["state"] == "budget_exhausted", result  # it ran until the budget bound
    assert result["spent_usd"] <= 10.0 + 1e-6, result


def test_the_reserve_follows_the_longest_recent_gap() -> None:
    sub = JobSubmission(name="t", budget_usd=10.0, work_gpu_hours=1.0, max_gpus=1.0)
    job = ControllerJob.of(
        JobRecord.submit("job-1", sub.model_dump(mode="json"), 10.0, 0.0), BidBrainSettings()
    )
    assert job.lag_reserve_s(0.0) == 0.0  # nothing measured yet
    job.decided(0.0)
    assert job.lag_reserve_s(120.0) == LAG_FACTOR * 120.0
    job.decided(120.0)
    assert job.lag_reserve_s(3720.0) == LAG_FACTOR * 3600.0  # this decision comes an hour late
    job.decided(3720.0)
    job.decided(3840.0)
    assert job.lag_reserve_s(3960.0) == LAG_FACTOR * 3600.0  # remembered for a while
    for k in range(1, 12):
        job.decided(3840.0 + 120.0 * k)
    assert job.lag_reserve_s(3840.0 + 120.0 * 12) == LAG_FACTOR * 120.0  # and then forgotten


def test_a_restarted_controller_knows_how_late_the_jobs_decisions_came() -> None:
    sub = JobSubmission(name="t", budget_usd=10.0, work_gpu_hours=1.0, max_gpus=1.0)
    store = MemoryStore()
    record = store.create_job(JobRecord.submit("job-1", sub.model_dump(mode="json"), 10.0, 0.0))
    for at_s in (0.0, 120.0, 3720.0, 3840.0):  # one decision came an hour late
        store.append_event(DecisionEvent(job_id="job-1", at_s=at_s, spent_usd=0.0,
                                         work_done_gpu_hours=0.0))  # fmt: skip
    store.append_event(StateEvent(job_id="job-1", at_s=3900.0, state="running"))
    decided = last_decisions(store, "job-1")
    assert decided == [0.0, 120.0, 3720.0, 3840.0]
    job = ControllerJob.of(record, BidBrainSettings(), decided)  # what a restart builds
    assert job.lag_reserve_s(3960.0) == LAG_FACTOR * 3600.0
    fresh = ControllerJob.of(record, BidBrainSettings())
    assert fresh.lag_reserve_s(3960.0) == 0.0  # what it knew before: nothing
    # the hours the controller was down are not a decision's lag: a near-spent job is not
    # ended for them at the first tick after the restart
    steady = ControllerJob.of(record, BidBrainSettings(), [0.0, 120.0, 240.0])
    assert steady.lag_reserve_s(240.0 + 3 * 3600.0) == LAG_FACTOR * 120.0


def test_a_job_new_to_a_lagging_controller_keeps_its_budget() -> None:
    """Found by the chaos soak: a job submitted while the controller ticked an hour apart had
    no lag of its own, bought what a 15-minute reserve allowed, and went over its budget by
    the next tick. The controller's own tick gaps count for every job."""
    now = [T0]
    store = MemoryStore()
    cloud = InMemoryCloud("us-east-1", "lag", ec2=InMemoryEC2(clock=lambda: now[0]))
    prices = TracePriceSource([bundled_prices_dir("us-east-1")])
    ctl = build_controller(Settings(), store=store, cloud=cloud, prices=prices)
    for _ in range(3):  # lagging: an hour between ticks, no job yet
        ctl.tick(now[0])
        now[0] += 3600.0
    sub = JobSubmission(name="new", budget_usd=3.76, work_gpu_hours=2.5, max_gpus=4.0,
                        instance_types=("p3.2xlarge", "p3.8xlarge"))  # fmt: skip
    store.create_job(JobRecord.submit("job-1", sub.model_dump(mode="json"), 3.76, now[0]))
    for _ in range(3):
        ctl.tick(now[0])
        now[0] += 3600.0
    assert ctl.spend_usd("job-1", now[0]) <= 3.76 + 1e-6
