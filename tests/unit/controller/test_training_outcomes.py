"""A training job ends as its training did: `succeeded` only with every iteration trained and
its final weights stored, `failed` with the runtime's error (the user's traceback), and never
from work counted some other way (the offline world's market-clock work)."""

from __future__ import annotations

import pytest
from support.controller_training import T0, WORK, AgentLogs, training_world

from orchestrator.controller.outcomes import TrainingOutcome
from orchestrator.controller.stall import JobStall, StallWatch
from orchestrator.settings import ControllerSettings, Settings
from orchestrator.store import EventKind, JobState, MemoryStore, StallEvent


def test_a_job_whose_work_is_counted_done_but_not_trained_does_not_succeed(
    store, ec2, prices
) -> None:
    ctl, training, cloud = training_world(store, ec2, prices)
    training.outcome_now = TrainingOutcome(iterations_done=30, iterations=100)
    store.update_progress("job-1", WORK, T0 + 60)  # the market clock's work: all of it
    report = ctl.tick(T0 + 120.0)
    assert report.finished == {}
    assert store.get_job("job-1").state is JobState.RUNNING
    assert cloud.describe(), "the job keeps its instances: 70% of it is not trained"
    decision = [e for _, e in store.events("job-1") if e.kind is EventKind.DECISION][-1]
    assert decision.work_done_gpu_hours == WORK  # what was counted, shown as it is


def test_a_trained_job_succeeds_with_its_weights_saved_before_its_instances_go(
    store, ec2, prices
) -> None:
    ctl, training, cloud = training_world(store, ec2, prices)
    alive = len(cloud.describe())
    training.outcome_now = TrainingOutcome(iterations_done=100, iterations=100, done=True)
    report = ctl.tick(T0 + 120.0)  # no work counted: trained is done
    assert report.finished == {"job-1": JobState.SUCCEEDED}
    assert training.saved == [("job-1", alive)] and alive > 0
    job = store.get_job("job-1")
    assert job.work_done_gpu_hours == WORK  # trained is all of the work, reported or not
    assert job.message == (
        "trained 100 iterations; final weights at "
        "s3://bucket/artifacts/job-1/final/model.safetensors"
    )
    assert cloud.describe() == []


def test_a_trained_job_whose_weights_cannot_be_written_fails_saying_so(store, ec2, prices) -> None:
    ctl, training, cloud = training_world(store, ec2, prices)
    training.outcome_now = TrainingOutcome(iterations_done=100, iterations=100, done=True)
    training.save_fails = True
    report = ctl.tick(T0 + 120.0)
    assert report.finished == {"job-1": JobState.FAILED}
    assert "final weights could not be written" in store.get_job("job-1").message
    assert cloud.describe() == []  # the instances went all the same
    assert len(training.saved) == 2  # tried again once they were gone (from a checkpoint)


def test_a_job_whose_training_aborted_fails_with_the_error_and_releases_its_instances(
    store, ec2, prices
) -> None:
    ctl, training, cloud = training_world(store, ec2, prices)
    error = (
        "the job's code failed on node t1: the scheduler's step on a parameter server raised "
        "ValueError: Tried to step 101 times.\nTraceback (the job's frames, ...)"
    )
    training.outcome_now = TrainingOutcome(40, 100, done=True, error=error)
    report = ctl.tick(T0 + 120.0)
    assert report.finished == {"job-1": JobState.FAILED}
    job = store.get_job("job-1")
    assert job.message == f"training failed: {error}"
    assert cloud.describe() == [] and store.list_instances("job-1", alive_only=True) == []
    states = [e for _, e in store.events("job-1") if e.kind is EventKind.STATE]
    assert states[-1].state is JobState.FAILED and "Tried to step 101 times" in states[-1].message


def test_outcomes_count_untrained_work() -> None:
    assert TrainingOutcome(25, 100).untrained_fraction == 0.75
    # every iteration counted but not `done` yet: half of one is left until the runtime says so
    assert TrainingOutcome(100, 100).untrained_fraction == 0.005
    assert TrainingOutcome(100, 100, done=True).trained
    assert not TrainingOutcome(40, 100, done=True, error="boom").trained
    assert TrainingOutcome(40, 100, done=True, error="boom").untrained_fraction == 0.6


def _stalls(store: MemoryStore) -> list[StallEvent]:
    return [e for _, e in store.events("job-1") if isinstance(e, StallEvent)]


def test_a_job_that_trains_nothing_has_its_instances_released_then_fails(
    store, ec2, prices
) -> None:
    """No progress, no spending: 10 minutes (market time) of instances without an iteration
    release them with an event saying why; the third time the job fails."""
    ctl, training, cloud = training_world(store, ec2, prices)
    ctl.instance_logs = AgentLogs()
    first = {r.instance_id for r in store.list_instances("job-1", alive_only=True)}
    assert ctl.tick(T0 + 540.0).finished == {} and cloud.describe()  # 9 min: waited for
    report = ctl.tick(T0 + 660.0)  # 11 min since its first instance ran, nothing trained
    assert set(report.terminated) >= first
    assert store.get_job("job-1").state is JobState.RUNNING
    [stall] = _stalls(store)
    assert (stall.attempt, stall.attempts, stall.iteration) == (1, 3, 0)
    assert set(stall.released) == first and stall.stalled_s == 660.0
    assert stall.reason.startswith("its runtime heard from no node; agent of i-")
    assert "No module named 'transformers'" in stall.reason
    assert training.restarts == ["job-1"]  # the new attempt gets its runtime afresh
    ctl.tick(T0 + 780.0)  # BidBrain buys again: a fresh attempt with a fresh clock
    again = {r.instance_id for r in store.list_instances("job-1", alive_only=True)}
    assert again and not again & first
    now = T0 + 780.0
    for _ in range(2):
        now += 660.0
        ctl.tick(now)
        ctl.tick(now + 60.0)  # launches for the next attempt, if any
        now += 60.0
    job = store.get_job("job-1")
    assert job.state is JobState.FAILED and len(_stalls(store)) == 3
    assert job.message.startswith("no progress: no iteration trained in 11 min, 3 times")
    assert cloud.describe() == [] and store.list_instances("job-1", alive_only=True) == []


def test_a_job_that_trains_slowly_is_not_stalled(store, ec2, prices) -> None:
    settings = Settings(controller=ControllerSettings(stall_after_s=300.0))
    ctl, training, cloud = training_world(store, ec2, prices, settings)
    for minute in range(1, 30):
        training.outcome_now = TrainingOutcome(iterations_done=minute // 4, iterations=100)
        ctl.tick(T0 + 60.0 * minute)  # an iteration every 4 minutes: slow, not stalled
    assert _stalls(store) == [] and store.get_job("job-1").state is JobState.RUNNING
    ctl.tick(T0 + 60.0 * 29 + 301.0)  # and then none for 5 minutes
    assert len(_stalls(store)) == 1


def test_a_restarted_controller_does_not_take_a_resumed_runtime_for_a_stalled_one(
    store, ec2, prices
) -> None:
    """After a restart the job's last report is read back (not live: no clock), and the
    runtime resumes below it from a checkpoint: figures that go down are progress too."""
    ctl, training, cloud = training_world(store, ec2, prices)
    training.outcome_now = TrainingOutcome(1000, 5000, live=False)  # not hosted again yet
    ctl.tick(T0 + 900.0)
    assert _stalls(store) == []
    training.outcome_now = TrainingOutcome(800, 5000, nodes_heard=2)  # resumed from a checkpoint
    ctl.tick(T0 + 1000.0)
    for minute in range(1, 9):  # retraining 800..1000: iterations it had done before
        training.outcome_now = TrainingOutcome(800 + 25 * minute, 5000, nodes_heard=2)
        ctl.tick(T0 + 1000.0 + 60.0 * minute)
    assert _stalls(store) == [] and store.get_job("job-1").state is JobState.RUNNING


def test_a_node_joining_is_a_sign_of_life(store, ec2, prices) -> None:
    """A node that joins and then loads for long (a large data set) is not a stall."""
    ctl, training, cloud = training_world(store, ec2, prices)
    training.outcome_now = TrainingOutcome(0, 100, nodes_heard=0)
    ctl.tick(T0 + 500.0)
    training.outcome_now = TrainingOutcome(0, 100, nodes_heard=1)  # the reliable node joined
    ctl.tick(T0 + 590.0)
    ctl.tick(T0 + 1100.0)  # 8.5 min since: still loading
    assert _stalls(store) == []
    ctl.tick(T0 + 1200.0)  # 10 min since the last sign of life
    assert len(_stalls(store)) == 1


def test_final_weights_count_only_when_they_hold_every_iteration(tmp_path, store) -> None:
    """Weights written from a checkpoint behind the end are not the job's final weights."""
    from orchestrator.artifacts import FINAL_INFO
    from orchestrator.controller.training import TrainingHost

    host = TrainingHost(store, token=bytes(32), advertise_host="127.0.0.1",
                        artifacts_root=tmp_path)  # fmt: skip
    final = host.artifacts("job-1").final  # type: ignore[union-attr]
    assert host.final_weights("job-1", 500) is None  # nothing written
    final.write_bytes(FINAL_INFO, b'{"source": "checkpoint ckpt-450", "iterations_done": 451}')
    assert host.final_weights("job-1", 500) is None
    final.write_bytes(FINAL_INFO, b'{"source": "the model at the end", "iterations_done": 500}')
    assert host.final_weights("job-1", 500) == f"{final.location}/model.safetensors"
    final.write_bytes(FINAL_INFO, b"not json")
    assert host.final_weights("job-1", 500) is None


def test_a_job_without_a_training_section_fails_at_once_under_a_training_controller(
    tmp_path, store, ec2, prices
) -> None:
    """Issue #31: work is what was trained. Nothing counts the work of a job that trains
    nothing (the offline world once counted its agents' simulated work instead): it fails at
    its first tick, saying how to fix it, before anything is bought for it."""
    from orchestrator.cloud.memory import InMemoryCloud
    from orchestrator.controller.training import TrainingHost
    from orchestrator.controller.training_gate import NOTHING_COUNTS_ITS_WORK
    from orchestrator.controller.wiring import build_controller
    from orchestrator.jobspec import JobSubmission
    from orchestrator.store import JobRecord

    cloud = InMemoryCloud("us-east-1", "ctl", ec2=ec2)
    with TrainingHost(store, token=bytes(32), advertise_host="127.0.0.1",
                      artifacts_root=tmp_path) as host:  # fmt: skip
        ctl = build_controller(Settings(), store=store, cloud=cloud, prices=prices,
                               training=host)  # fmt: skip
        spec = JobSubmission(name="no-training", budget_usd=50.0, work_gpu_hours=4.0)
        store.create_job(JobRecord.submit("job-x", spec.model_dump(mode="json"), 50.0, T0))
        report = ctl.tick(T0)
    assert report.finished == {"job-x": JobState.FAILED}
    job = store.get_job("job-x")
    assert job.message == NOTHING_COUNTS_ITS_WORK and "add a `training` section" in job.message
    assert cloud.describe() == [] and job.spent_usd == 0.0


def test_the_stalls_so_far_are_read_again_when_the_first_read_failed() -> None:
    """A restarted controller counts a job's earlier stalls from its events; a store that
    fails that read (Redis restarting) is read again at the next check, not taken for 0."""
    reads = iter([ConnectionError("redis is restarting"), 2])

    def stalls_so_far(job_id: str) -> int:
        found = next(reads)
        if isinstance(found, Exception):
            raise found
        return found

    watch = StallWatch(stall_after_s=600.0, attempts=3, stalls_so_far=stalls_so_far)
    seen, outcome = JobStall(), TrainingOutcome(0, 100)
    with pytest.raises(ConnectionError):
        watch.check("job-1", seen, outcome, [], T0)
    assert watch.check("job-1", seen, outcome, [], T0 + 1.0) is None
    assert seen.attempts == 2
