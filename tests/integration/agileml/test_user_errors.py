"""A user's error stops the run: an exception in the job's own code, on a worker (its loss) or
on a parameter server (its scheduler), aborts the job with the user's message and the end of
its traceback, within seconds; nothing retries a deterministic error."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.agileml.control import ControlClient, JobFailed, Join, TrainingSpec
from orchestrator.agileml.elasticity import NodeTier
from orchestrator.agileml.errors import AgileMLError
from orchestrator.agileml.hosting import HostedTraining, host_training
from orchestrator.agileml.local import LocalJob
from orchestrator.agileml.trainrun import TrainPlan, train_locally

JOB = Path(__file__).parents[2] / "support" / "jobs" / "digits_failing.py"


@pytest.mark.parametrize(
    ("fail", "where", "message"),
    [
        ("schedule", "the scheduler's step on a parameter server", "Tried to step 21 times"),
        ("loss", "the model's forward or loss(output, target)", "a bug in the user's loss"),
    ],
)
def test_the_jobs_own_error_aborts_the_run_with_it(
    fail: str, where: str, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORCHESTRATOR_TEST_FAIL", fail)
    plan = TrainPlan(code=str(JOB), nodes=2, reliable=1, iterations=200, global_batch=64)
    started = time.monotonic()
    with pytest.raises(AgileMLError) as caught:
        train_locally(plan)
    text = str(caught.value)
    assert "the job's code failed on node" in text and where in text and message in text
    assert "Traceback (the job's frames" in text
    assert time.monotonic() - started < 90  # not the retry loop's forever, nor 120 s + 5 s/it


@pytest.mark.slow
def test_train_exits_1_with_the_users_traceback_on_the_console(tmp_path: Path) -> None:
    env = {**os.environ, "ORCHESTRATOR_TEST_FAIL": "schedule"}
    out = str(tmp_path / "out")
    command = [sys.executable, "-m", "orchestrator", "train", str(JOB), "--nodes", "2",
               "--iterations", "200", "--global-batch", "64", "--out", out]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "error: training failed" in run.stderr
    assert "ValueError: Tried to step 21 times" in run.stderr
    assert "lr_scheduler.py" in run.stderr  # the frames where it raised
    assert "Traceback (most recent call last)" not in run.stderr  # not ours: the user's


def test_a_node_that_cannot_load_the_job_aborts_it_with_the_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No check ran before (as through the controller, where the nodes load the job on their
    instances): the first node's load fails, and the job is aborted with the user's error."""
    monkeypatch.setenv("ORCHESTRATOR_TEST_FAIL", "data")
    spec = TrainingSpec(job_id="no-data", code=str(JOB), global_batch=64, iterations=50,
                        num_partitions=1, min_nodes=2, failure_timeout_s=2.0)  # fmt: skip
    with LocalJob(spec, log_dir=tmp_path) as job:
        job.add_node("r0", NodeTier.RELIABLE)
        job.add_node("t0", NodeTier.TRANSIENT)
        assert job.coordinator.wait_done(60), job.coordinator.events()
        error = job.coordinator.error
    assert error is not None and "the job's code failed on node" in error
    assert "dataset() raised FileNotFoundError" in error, error
    assert 'digits_failing.py", line' in error  # the frame where it raised
    assert "the user's data is not on this node" in error


def test_the_weights_of_an_aborted_job_are_not_waited_for_from_its_servers() -> None:
    """An aborted job's nodes shut down with the abort, so its weights come from a checkpoint
    (the controller's `save_final`): asking the servers for them fails at once, not after
    the fetch's timeout (which held the controller's tick, and the failed job's end, 10 s)."""
    token = secrets.token_bytes(32)
    spec = TrainingSpec(job_id="job-aborted", code=str(JOB), iterations=20, global_batch=64,
                        num_partitions=2)  # fmt: skip
    hosted = host_training(spec, token=token, host="127.0.0.1", port=0)
    assert isinstance(hosted, HostedTraining)
    client = ControlClient(job_id=spec.job_id, sender="n1", token=token)
    try:
        join = Join(tier=NodeTier.RELIABLE, endpoint="tcp://127.0.0.1:1")
        assert client.call(hosted.endpoint, join.model_dump(mode="json"), 10.0).get("spec")
        failed = JobFailed(error="the scheduler's step raised ValueError")
        client.call(hosted.endpoint, failed.model_dump(mode="json"), 10.0)
        assert hosted.error is not None and "the scheduler's step raised" in hosted.error
        started = time.monotonic()
        with pytest.raises(AgileMLError, match="aborted"):
            hosted.save_weights(Path("unused"), timeout_s=10.0)
        assert time.monotonic() - started < 1.0
    finally:
        client.close()
        hosted.stop()
