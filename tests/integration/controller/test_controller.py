"""The controller's tick against moto EC2, a real Redis and the bundled 2020 spot prices."""

from __future__ import annotations

from typing import Any

import pytest
from botocore.exceptions import ClientError

from orchestrator.controller.core import Controller
from orchestrator.controller.wiring import build_controller
from orchestrator.jobspec import JobSubmission
from orchestrator.market.prices import to_epoch_seconds
from orchestrator.market.trace_source import TracePriceSource
from orchestrator.settings import Settings
from orchestrator.store import EventKind, JobRecord, JobState
from orchestrator.store.protocol import Store

REGION = "us-east-1"
T0 = to_epoch_seconds("2020-02-03T00:00:00Z")
NS = "ctltest"  # the `store` fixture's namespace (tests/conftest.py)


def controller(store: Store, ec2: Any, prices: TracePriceSource, cid: str = "ctl") -> Controller:
    """The controller `controller start` would build, on moto and the bundled prices."""
    settings = Settings(region=REGION, controller_id=cid)
    return build_controller(settings, store=store, client=ec2, prices=prices)


def submit(
    store: Store,
    *,
    budget: float = 200.0,
    work: float = 40.0,
    gpus: float = 8.0,
    job_id: str = "job-1",
    **extra: Any,
) -> JobRecord:
    sub = JobSubmission(
        name="test",
        budget_usd=budget,
        work_gpu_hours=work,
        max_gpus=gpus,
        instance_types=("p3.2xlarge", "p3.8xlarge", "p3.16xlarge"),
        **extra,
    )
    return store.create_job(JobRecord.submit(job_id, sub.model_dump(mode="json"), budget, T0))


def ours(ec2: Any, states: tuple[str, ...] = ("pending", "running")) -> list[dict]:
    out = []
    for page in ec2.get_paginator("describe_instances").paginate(
        Filters=[
            {"Name": "tag-key", "Values": ["orchestrator:job-id"]},
            {"Name": "instance-state-name", "Values": list(states)},
        ]
    ):
        for reservation in page["Reservations"]:
            out.extend(reservation["Instances"])
    return out


def gpus_of(instances: list[dict]) -> int:
    per = {"p3.2xlarge": 1, "p3.8xlarge": 4, "p3.16xlarge": 8}
    return sum(per.get(i["InstanceType"], 0) for i in instances)


def test_a_queued_job_starts_with_a_reliable_node_and_spot_gpus_up_to_its_max(store, ec2, prices):
    submit(store)
    report = controller(store, ec2, prices).tick(T0)
    assert store.get_job("job-1").state is JobState.RUNNING
    running = ours(ec2)
    assert {i["InstanceType"] for i in running} >= {"m5.xlarge"}
    assert gpus_of(running) == 8
    spot = [i for i in running if i.get("InstanceLifecycle") == "spot"]
    assert spot and len(spot) == len(running) - 1
    assert sorted(report.launched) == sorted(i["InstanceId"] for i in running)
    assert len(store.list_instances("job-1", alive_only=True)) == len(running)
    kinds = [e.kind for _, e in store.events("job-1")]
    assert EventKind.DECISION in kinds and EventKind.LAUNCH in kinds


def test_an_instance_ec2_took_back_is_billed_as_evicted_and_replaced(store, ec2, prices):
    submit(store)
    ctl = controller(store, ec2, prices)
    ctl.tick(T0)
    victim = next(i for i in ours(ec2) if i.get("InstanceLifecycle") == "spot")
    ec2.terminate_instances(InstanceIds=[victim["InstanceId"]])  # AWS reclaims it
    report = ctl.tick(T0 + 1800)
    assert report.evicted == [victim["InstanceId"]]
    assert store.get_instance(victim["InstanceId"]).end_reason == "evicted"
    charged = [e for e in store.ledger("job-1") if e.instance_id == victim["InstanceId"]]
    assert charged and sum(e.billed_s for e in charged) == pytest.approx(1800.0)
    assert gpus_of(ours(ec2)) == 8  # replaced at once
    assert store.spent_usd("job-1") == pytest.approx(
        sum(e.charged_usd for e in store.ledger("job-1"))
    )


def test_a_restarted_controller_launches_nothing_twice(store, ec2, prices):
    submit(store)
    controller(store, ec2, prices).tick(T0)
    before = sorted(i["InstanceId"] for i in ours(ec2))
    report = controller(store, ec2, prices).tick(T0 + 60)  # fresh memory, same store and EC2
    assert report.launched == []
    assert sorted(i["InstanceId"] for i in ours(ec2)) == before


def test_instances_launched_before_a_crash_are_adopted_not_relaunched(store, ec2, prices):
    submit(store)
    ctl = controller(store, ec2, prices)
    ctl.tick(T0)
    launched = store.list_instances("job-1", alive_only=True)
    # the crash: EC2 has the instances but the store lost one record (as if killed mid-write)
    store._client.delete(f"{NS}:instance:{launched[-1].instance_id}")  # noqa: SLF001
    store._client.srem(f"{NS}:job:job-1:instances:alive", launched[-1].instance_id)  # noqa: SLF001
    report = controller(store, ec2, prices).tick(T0 + 60)
    assert launched[-1].instance_id in report.adopted
    assert report.launched == []


def test_a_finished_job_terminates_everything_and_leaves_no_orphan(store, ec2, prices):
    submit(store, work=10.0)
    ctl = controller(store, ec2, prices)
    ctl.tick(T0)
    store.update_progress("job-1", 10.0, T0 + 4000)
    report = ctl.tick(T0 + 4000)
    assert report.finished == {"job-1": JobState.SUCCEEDED}
    assert ours(ec2) == []
    assert store.list_instances("job-1", alive_only=True) == []
    assert store.spent_usd("job-1") > 0


def test_instances_of_no_active_job_are_terminated_as_orphans(store, ec2, prices):
    submit(store)
    ctl = controller(store, ec2, prices)
    ctl.tick(T0)
    job = store.get_job("job-1")
    store.transition("job-1", JobState.FAILED, expected_version=job.version, now_s=T0 + 10)
    report = ctl.tick(T0 + 60)
    assert len(report.terminated) > 0
    assert ours(ec2) == []


def test_a_market_out_of_capacity_is_avoided_and_the_job_runs_elsewhere(store, ec2, prices):
    failed: list[str] = []

    def no_capacity(params: dict, **_: Any) -> None:
        market = (params["InstanceType"], params["Placement"]["AvailabilityZone"])
        if params.get("InstanceMarketOptions") and not failed:
            failed.append(f"{market[0]}@{market[1]}")
            raise ClientError(
                {"Error": {"Code": "InsufficientInstanceCapacity", "Message": "no capacity"}},
                "RunInstances",
            )

    ec2.meta.events.register("before-parameter-build.ec2.RunInstances", no_capacity)
    submit(store)
    ctl = controller(store, ec2, prices)
    first = ctl.tick(T0)
    assert first.launch_failures and "InsufficientInstanceCapacity" in first.launch_failures[0]
    ctl.tick(T0 + 120)
    running = ours(ec2)
    assert gpus_of(running) == 8
    assert all(
        f"{i['InstanceType']}@{i['Placement']['AvailabilityZone']}" != failed[0]
        for i in running
        if i.get("InstanceLifecycle") == "spot"
    )


def test_spend_never_exceeds_the_budget(store, ec2, prices):
    budget = 15.0
    submit(store, budget=budget, work=200.0)
    ctl = controller(store, ec2, prices)
    t = T0
    for _ in range(80):
        ctl.tick(t)
        if store.get_job("job-1").state is not JobState.RUNNING:
            break
        t += 120
    assert store.get_job("job-1").state is JobState.BUDGET_EXHAUSTED
    assert store.spent_usd("job-1") <= budget
    assert ours(ec2) == []  # nothing keeps billing past the budget
    assert store.list_instances("job-1", alive_only=True) == []


def test_cancelling_a_running_job_terminates_its_instances(store, ec2, prices):
    submit(store)
    ctl = controller(store, ec2, prices)
    ctl.tick(T0)
    job = store.get_job("job-1")
    store.transition("job-1", JobState.CANCELLING, expected_version=job.version, now_s=T0 + 5)
    report = ctl.tick(T0 + 60)
    assert report.finished == {"job-1": JobState.CANCELLED}
    assert ours(ec2) == []


def test_with_one_job_at_a_time_a_second_job_waits_for_the_first(store, ec2, prices):
    submit(store, job_id="job-1", work=10.0)
    submit(store, job_id="job-2", work=10.0)
    settings = Settings(region=REGION, controller_id="ctl", controller={"max_running_jobs": 1})
    ctl = build_controller(settings, store=store, client=ec2, prices=prices)
    ctl.tick(T0)
    assert store.get_job("job-1").state is JobState.RUNNING
    assert store.get_job("job-2").state is JobState.QUEUED
    store.update_progress("job-1", 10.0, T0 + 3600)
    ctl.tick(T0 + 3600)  # job-1 finishes
    ctl.tick(T0 + 3720)  # job-2's turn
    assert store.get_job("job-1").state is JobState.SUCCEEDED
    assert store.get_job("job-2").state is JobState.RUNNING


def test_without_a_limit_jobs_run_side_by_side_each_on_its_own_budget(store, ec2, prices):
    submit(store, job_id="job-1", budget=100.0)
    submit(store, job_id="job-2", budget=5.0)
    ctl = controller(store, ec2, prices)
    t = T0
    for _ in range(40):
        ctl.tick(t)
        t += 120
    assert store.get_job("job-1").state is JobState.RUNNING
    assert store.get_job("job-2").state is JobState.BUDGET_EXHAUSTED
    assert store.spent_usd("job-2") <= 5.0


def test_a_job_changed_during_a_tick_is_left_for_the_next_tick(store, ec2, prices):
    submit(store, job_id="job-1")
    submit(store, job_id="job-2")
    ctl = controller(store, ec2, prices)
    ctl.tick(T0)
    # a cancel lands between the tick's read and its write for job-1
    original = store.list_jobs

    def stale_list_jobs(*args: Any, **kwargs: Any) -> list[JobRecord]:
        jobs = original(*args, **kwargs)
        job = store.get_job("job-1")
        store.transition("job-1", JobState.CANCELLING, expected_version=job.version, now_s=T0 + 100)
        store.list_jobs = original  # only once
        return jobs

    store.list_jobs = stale_list_jobs  # type: ignore[method-assign]
    store.update_progress("job-1", 40.0, T0 + 120)  # job-1 would finish: its write conflicts
    report = ctl.tick(T0 + 120)
    assert "job-2" in report.decisions  # the other job was still run
    ctl.tick(T0 + 240)
    assert store.get_job("job-1").state is JobState.CANCELLED
