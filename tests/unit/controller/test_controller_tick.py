"""The controller's tick on the in-memory store and cloud (fast; the same behaviour runs against
Redis and moto in tests/integration/controller): what it launches, how it reads evictions and
renewals into BidBrain's input, and what a restart knows."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import ValidationError

from orchestrator.bidbrain.policy import BidBrainPolicy, DecisionInput
from orchestrator.cloud.memory import InMemoryCloud, InMemoryEC2
from orchestrator.controller.core import Controller
from orchestrator.controller.wiring import build_controller
from orchestrator.jobspec import JobSubmission
from orchestrator.market.catalog import Catalog
from orchestrator.market.prices import Market, to_epoch_seconds
from orchestrator.market.trace_source import TracePriceSource
from orchestrator.settings import Settings
from orchestrator.store import EventKind, JobRecord, JobState, MemoryStore, StoreUnavailableError

T0 = to_epoch_seconds("2020-02-03T00:00:00Z")  # as conftest's
REGION = "us-east-1"


def controller(store: MemoryStore, ec2: InMemoryEC2, prices: TracePriceSource) -> Controller:
    cloud = InMemoryCloud(REGION, "ctl", ec2=ec2)
    return build_controller(Settings(), store=store, cloud=cloud, prices=prices)


def submit(store: MemoryStore, job_id: str = "job-1", budget: float = 200.0) -> JobRecord:
    sub = JobSubmission(
        name="test", budget_usd=budget, work_gpu_hours=40.0, max_gpus=8.0,
        instance_types=("p3.2xlarge", "p3.8xlarge", "p3.16xlarge"),
    )  # fmt: skip
    return store.create_job(JobRecord.submit(job_id, sub.model_dump(mode="json"), budget, T0))


class Spy:
    """Records the decision inputs BidBrain is given."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.inputs: list[DecisionInput] = []
        decide = BidBrainPolicy.decide

        def spy(policy: BidBrainPolicy, inp: DecisionInput) -> Any:
            self.inputs.append(inp)
            return decide(policy, inp)

        monkeypatch.setattr(BidBrainPolicy, "decide", spy)


def test_a_queued_job_starts_with_a_reliable_node_and_spot_gpus(store, ec2, prices) -> None:
    report = controller(store, ec2, prices).tick(T0)
    assert report.launched == [] and store.list_jobs() == []
    submit(store)
    report = controller(store, ec2, prices).tick(T0)
    assert store.get_job("job-1").state is JobState.RUNNING
    alive = store.list_instances("job-1", alive_only=True)
    assert {r.lifecycle for r in alive} == {"on-demand", "spot"}
    assert sorted(report.launched) == sorted(r.instance_id for r in alive)


def test_an_eviction_is_billed_recorded_and_reaches_bidbrain_as_the_markets_last(
    store, ec2, prices, monkeypatch
) -> None:
    submit(store)
    ctl = controller(store, ec2, prices)
    ctl.tick(T0)
    spot = next(r for r in store.list_instances("job-1") if r.lifecycle == "spot")
    ec2.reclaim(spot.instance_id)
    spy = Spy(monkeypatch)
    report = ctl.tick(T0 + 600.0)
    assert report.evicted == [spot.instance_id]
    ended = store.get_instance(spot.instance_id)
    assert ended.end_reason == "evicted" and ended.ended_at == T0 + 600.0
    assert store.ledger("job-1")  # billed
    [inp] = spy.inputs
    assert inp.last_eviction_s == {Market(spot.instance_type, spot.zone): T0 + 600.0}
    kinds = [e.kind for _, e in store.events("job-1")]
    assert EventKind.EVICTION in kinds


def test_a_restarted_controller_still_knows_the_last_evictions(
    store, ec2, prices, monkeypatch
) -> None:
    submit(store)
    controller(store, ec2, prices).tick(T0)
    spot = next(r for r in store.list_instances("job-1") if r.lifecycle == "spot")
    ec2.reclaim(spot.instance_id)
    controller(store, ec2, prices).tick(T0 + 600.0)
    spy = Spy(monkeypatch)
    controller(store, ec2, prices).tick(T0 + 720.0)  # a new controller process
    assert spy.inputs[0].last_eviction_s == {Market(spot.instance_type, spot.zone): T0 + 600.0}


def test_a_jobs_whole_instance_history_is_read_once_not_at_every_tick(
    store, ec2, prices, monkeypatch
) -> None:
    submit(store)
    ctl = controller(store, ec2, prices)
    ctl.tick(T0)
    spot = next(r for r in store.list_instances("job-1") if r.lifecycle == "spot")
    reads: list[tuple[str | None, bool]] = []
    list_instances = store.list_instances

    def counted(job_id: str | None = None, *, alive_only: bool = False) -> Any:
        reads.append((job_id, alive_only))
        return list_instances(job_id, alive_only=alive_only)

    monkeypatch.setattr(store, "list_instances", counted)
    ec2.reclaim(spot.instance_id)
    spy = Spy(monkeypatch)
    for minutes in (10, 12, 14):
        ctl.tick(T0 + 60.0 * minutes)
    assert ("job-1", False) not in reads  # read at the first tick only
    evicted = {Market(spot.instance_type, spot.zone): T0 + 600.0}
    assert [inp.last_eviction_s for inp in spy.inputs] == [evicted] * 3


def test_an_eviction_whose_end_reply_was_lost_still_reaches_the_next_decision(
    store, ec2, prices, monkeypatch
) -> None:
    submit(store)
    ctl = controller(store, ec2, prices)
    ctl.tick(T0)
    spot = next(r for r in store.list_instances("job-1") if r.lifecycle == "spot")
    ec2.reclaim(spot.instance_id)
    end_instance = store.end_instance

    def lost_reply(instance_id: str, ended_at: float, reason: str, bill: Any = ()) -> Any:
        end_instance(instance_id, ended_at, reason, bill)  # applied; the caller never hears
        raise StoreUnavailableError("redis://test", "timed out")

    monkeypatch.setattr(store, "end_instance", lost_reply)
    with pytest.raises(StoreUnavailableError):
        ctl.tick(T0 + 600.0)
    monkeypatch.undo()
    spy = Spy(monkeypatch)
    ctl.tick(T0 + 720.0)  # the instance is no longer alive: only the store knows
    assert spy.inputs[0].last_eviction_s == {Market(spot.instance_type, spot.zone): T0 + 600.0}


def test_a_spot_allocation_is_due_for_renewal_once_per_period_per_job(
    store, ec2, prices, monkeypatch
) -> None:
    submit(store)
    ctl = controller(store, ec2, prices)
    ctl.tick(T0)
    spot = {r.allocation_id for r in store.list_instances("job-1") if r.lifecycle == "spot"}
    spy = Spy(monkeypatch)
    for minutes in range(2, 60, 2):  # a tick every two minutes for the first hour
        ctl.tick(T0 + 60.0 * minutes)
    due = [inp.renewal_due for inp in spy.inputs]
    assert due[-1] == spot  # at 58 min: 2 min before the hour ends
    assert all(not d for d in due[:-1])
    ctl.tick(T0 + 3600.0)
    assert spy.inputs[-1].renewal_due == frozenset()  # named once per period


def test_a_market_out_of_capacity_is_avoided(store, ec2, prices) -> None:
    submit(store)
    ec2.refuse_launches("InsufficientInstanceCapacity", Market("p3.16xlarge", "us-east-1b"))
    report = controller(store, ec2, prices).tick(T0)
    assert report.launch_failures == ["p3.16xlarge@us-east-1b: InsufficientInstanceCapacity"]
    assert report.launched  # launched elsewhere in the same tick or the next
    events = [e for _, e in store.events("job-1") if e.kind is EventKind.LAUNCH_FAILED]
    assert events and events[0].code == "InsufficientInstanceCapacity"


def test_cancelling_a_running_job_terminates_its_instances(store, ec2, prices) -> None:
    submit(store)
    ctl = controller(store, ec2, prices)
    ctl.tick(T0)
    job = store.get_job("job-1")
    store.transition("job-1", JobState.CANCELLING, expected_version=job.version, now_s=T0 + 60)
    report = ctl.tick(T0 + 120.0)
    assert report.finished == {"job-1": JobState.CANCELLED}
    assert store.list_instances("job-1", alive_only=True) == []
    assert InMemoryCloud(REGION, "ctl", ec2=ec2).describe() == []


def test_a_job_out_of_slack_gets_on_demand_gpus_from_the_controller(store, ec2, prices) -> None:
    """A deadline the work only just meets at max_gpus: the first tick is at the point of no
    return, so the controller launches on-demand GPUs (and the reliable node), not spot."""
    deadline_s = T0 + 40.0 / 8.0 * 3600 + 300.0  # 5 h of work at 8 GPUs, 5 min of slack
    sub = JobSubmission(
        name="late", budget_usd=500.0, work_gpu_hours=40.0, max_gpus=8.0,
        instance_types=("p3.2xlarge",), deadline=datetime.fromtimestamp(deadline_s, UTC),
    )  # fmt: skip
    store.create_job(JobRecord.submit("job-1", sub.model_dump(mode="json"), 500.0, T0))
    controller(store, ec2, prices).tick(T0)
    alive = store.list_instances("job-1", alive_only=True)
    gpus = [r for r in alive if r.instance_type == "p3.2xlarge"]
    assert len(gpus) == 8 and {r.lifecycle for r in gpus} == {"on-demand"}
    assert [r for r in alive if r.instance_type == "m5.xlarge"]
    decided = [e for _, e in store.events("job-1") if e.kind is EventKind.DECISION]
    assert decided and any("8xp3.2xlarge" in a for a in decided[-1].acquire)
    assert "safety net" in decided[-1].reason


def test_half_a_bill_from_an_older_controller_does_not_stop_the_ticks(store, ec2, prices) -> None:
    """Before bills were atomic a crash could leave part of one; a later, longer bill conflicts
    with it. The instance ends anyway (its recorded charges stand) and the ticks go on."""
    from orchestrator.store import LedgerEntry

    submit(store)
    ctl = controller(store, ec2, prices)
    ctl.tick(T0)
    spot = next(r for r in store.list_instances("job-1") if r.lifecycle == "spot")
    store.append_ledger(LedgerEntry(
        job_id="job-1", instance_id=spot.instance_id, instance_type=spot.instance_type,
        zone=spot.zone, start_s=spot.launched_at, end_s=spot.launched_at + 60.0,
        price_usd_per_hour=0.5, billed_s=60.0, charged_usd=0.5 / 60, reason="evicted",
    ))  # fmt: skip
    ec2.reclaim(spot.instance_id)
    ctl.tick(T0 + 600.0)
    assert not store.get_instance(spot.instance_id).alive
    ctl.tick(T0 + 720.0)


def test_a_jobs_spec_is_typed_once_and_its_state_dropped_when_it_ends(
    store, ec2, prices, monkeypatch
) -> None:
    """The controller types a job's stored spec at its first tick (not at every one) and
    keeps its BidBrain state in one place, dropped when the job ends."""
    submit(store)
    ctl = controller(store, ec2, prices)
    validated: list[object] = []
    original = JobSubmission.model_validate.__func__  # type: ignore[attr-defined]

    def counting(cls: type[JobSubmission], obj: Any, *args: Any, **kwargs: Any) -> Any:
        validated.append(obj)
        return original(cls, obj, *args, **kwargs)

    monkeypatch.setattr(JobSubmission, "model_validate", classmethod(counting))
    for k in range(4):
        ctl.tick(T0 + 300.0 * k)
    assert len(validated) == 1
    assert set(ctl._jobs) == {"job-1"}
    job = store.get_job("job-1")
    store.transition("job-1", JobState.CANCELLING, expected_version=job.version, now_s=T0 + 1300.0)
    ctl.tick(T0 + 1300.0)
    assert store.get_job("job-1").state is JobState.CANCELLED
    assert ctl._jobs == {}


def test_a_stored_spec_that_no_longer_validates_fails_its_job_not_the_tick(
    store, ec2, prices
) -> None:
    """A job stored by an older version with looser checks (a boolean for a number) fails
    with the reason at its first tick; the jobs after it still run."""
    sub = JobSubmission(name="old", budget_usd=100.0, work_gpu_hours=10.0, max_gpus=4.0,
                        instance_types=("p3.2xlarge",))  # fmt: skip
    spec = {**sub.model_dump(mode="json"), "app": {"add_overhead_s": True}}
    store.create_job(JobRecord.submit("job-0", spec, 100.0, T0 - 60))
    submit(store, "job-1")
    ctl = controller(store, ec2, prices)
    ctl.tick(T0)
    old = store.get_job("job-0")
    assert old.state is JobState.FAILED
    assert "stored spec is no longer valid" in old.message and "add_overhead_s" in old.message
    assert store.get_job("job-1").state is JobState.RUNNING
    assert store.list_instances("job-1", alive_only=True)
    assert store.list_instances("job-0", alive_only=True) == []


def test_a_training_job_is_given_only_instances_whose_every_gpu_its_nodes_train_on(
    store, ec2, prices
) -> None:
    """A job whose nodes train on one device each (`devices_per_node: 1`) is never given a
    p3.8xlarge (four V100s billed, one training), though the same work without that cap
    would be: a node trains on every GPU of its instance by default. A pipeline node runs a
    stage worker per GPU: one unless the job says K, then instances of exactly K GPUs."""
    catalog = Catalog.load()

    def bought(job_id: str, training: dict[str, Any] | None) -> set[int]:
        sub = JobSubmission(name=job_id, budget_usd=400.0, work_gpu_hours=40.0, max_gpus=16.0,
                            training=training)  # fmt: skip
        store.create_job(JobRecord.submit(job_id, sub.model_dump(mode="json"), 400.0, T0))
        controller(store, ec2, prices).tick(T0)
        spot = [r for r in store.list_instances(job_id) if r.lifecycle == "spot"]
        assert spot
        return {catalog.get(r.instance_type).gpu_count for r in spot}

    assert max(bought("job-sim", None)) > 1  # what this test would catch
    assert max(bought("job-every", {"code": "job.py", "iterations": 100})) > 1
    one = {"code": "job.py", "iterations": 100, "devices_per_node": 1}
    assert bought("job-train", one) == {1}
    pipeline = {"code": "job.py", "iterations": 100, "parallelism": "pipeline"}
    assert bought("job-pipe", pipeline) == {1}  # a stage worker an instance
    assert bought("job-pipe4", {**pipeline, "devices_per_node": 4}) == {4}  # exactly 4


def test_a_training_job_stored_before_the_check_runs_on_its_one_gpu_types_or_fails_saying_why(
    store, ec2, prices
) -> None:
    """A spec stored before the check with types of more GPUs than its nodes train on keeps
    running on the others; with none, it fails naming them (not as if no market existed)."""
    training = {"code": "job.py", "iterations": 100, "devices_per_node": 1}

    def stored(job_id: str, types: tuple[str, ...]) -> None:
        spec = {"name": job_id, "budget_usd": 200.0, "work_gpu_hours": 40.0, "max_gpus": 8.0,
                "instance_types": list(types), "training": training}  # fmt: skip
        with pytest.raises(ValidationError, match="p3.8xlarge has 4 GPUs: 3 would be paid"):
            JobSubmission.model_validate(spec)  # a new submission is refused them
        store.create_job(JobRecord.submit(job_id, spec, 200.0, T0))

    stored("job-mixed", ("p3.2xlarge", "p3.8xlarge"))
    stored("job-multi", ("p3.8xlarge",))
    controller(store, ec2, prices).tick(T0)
    mixed = store.get_job("job-mixed")
    assert mixed.state is JobState.RUNNING
    spot = [r for r in store.list_instances("job-mixed") if r.lifecycle == "spot"]
    assert spot and {r.instance_type for r in spot} == {"p3.2xlarge"}
    multi = store.get_job("job-multi")
    assert multi.state is JobState.FAILED
    assert "none of the job's instance_types (p3.8xlarge)" in multi.message
    assert store.list_instances("job-multi", alive_only=True) == []
