"""The instance agent: who it is from its metadata, what it does on a notice, how it ends."""

from __future__ import annotations

import subprocess
import sys
import threading
from datetime import UTC, datetime, timedelta

import pytest

from orchestrator.agent.identity import InstanceIdentity, read_identity
from orchestrator.agent.instance import InstanceAgent
from orchestrator.agent.work import WorkMeter
from orchestrator.cloud.instances import (
    TAG_AGILEML_CONTROLLER,
    TAG_CONTROLLER,
    TAG_JOB,
    TAG_PARALLELISM,
    TAG_TIER,
)
from orchestrator.cloud.local.metadata_mock import MetadataMock
from orchestrator.errors import UserError

T0 = 1_580_688_000.0


class RecordingReporter:
    """A work reporter that counts its reports (the agent's loop calls it every interval)."""

    def __init__(self) -> None:
        self.meter = WorkMeter(work_rate=1.0, started_s=T0, ready_after_s=0.0)
        self.reports = 0

    def report(self) -> bool:
        self.reports += 1
        return True


def test_the_identity_comes_from_the_instance_tags_with_the_aws_tier_mapped_to_agilemls() -> None:
    tags = {TAG_JOB: "job-3", TAG_TIER: "spot", TAG_CONTROLLER: "prod",
            TAG_AGILEML_CONTROLLER: "tcp://10.0.0.5:29500"}  # fmt: skip
    with MetadataMock("i-0abc", tags=tags, local_ipv4="10.0.0.9") as imds:
        identity = read_identity(imds.base_url)
    assert identity == InstanceIdentity(
        instance_id="i-0abc", job_id="job-3", tier="transient", host="10.0.0.9",
        controller_id="prod", agileml_controller="tcp://10.0.0.5:29500",
    )  # fmt: skip


def test_a_pipeline_jobs_instance_knows_it_runs_stage_workers_from_its_tags() -> None:
    tags = {TAG_JOB: "job-3", TAG_TIER: "spot", TAG_PARALLELISM: "pipeline",
            TAG_AGILEML_CONTROLLER: "tcp://10.0.0.5:29500"}  # fmt: skip
    with MetadataMock("i-0abc", tags=tags) as imds:
        assert read_identity(imds.base_url).parallelism == "pipeline"
    with MetadataMock("i-0abc", tags={**tags, TAG_PARALLELISM: "bogus"}) as imds:
        assert read_identity(imds.base_url).parallelism == "data"


def test_an_instance_with_an_unknown_tier_tag_is_refused_with_how_to_launch_it() -> None:
    tags = {TAG_JOB: "job-3", TAG_TIER: "gold"}
    with MetadataMock("i-0abc", tags=tags) as imds, pytest.raises(UserError, match="template"):
        read_identity(imds.base_url)


def test_an_interruption_notice_stops_the_work_account_at_its_time_and_ends_no_run() -> None:
    identity = InstanceIdentity(instance_id="i-0abc", job_id="job-3", tier="transient")
    reporter = RecordingReporter()
    at = datetime.fromtimestamp(T0 + 600.0, UTC)
    stop = threading.Event()
    with MetadataMock("i-0abc", tags={TAG_JOB: "job-3", TAG_TIER: "spot"}) as imds:
        agent = InstanceAgent(
            identity, token=None, metadata_url=imds.base_url, notice_poll_s=0.05,
            notice_clock=lambda: T0, work=reporter,  # type: ignore[arg-type]
            exit_when_training_ends=False, loop_interval_s=0.05,
        )  # fmt: skip
        runner = threading.Thread(target=lambda: agent.run(stop))
        runner.start()
        imds.schedule_interruption(at=at)
        deadline = datetime.now(UTC) + timedelta(seconds=10)
        while not agent.outcome.notices and datetime.now(UTC) < deadline:
            stop.wait(0.05)
        stop.set()
        runner.join(10)
    assert [n.kind for n in agent.outcome.notices] == ["interruption"]
    assert reporter.meter.advance(T0 + 3600.0) == pytest.approx(600.0 / 3600.0)
    assert reporter.reports >= 1 and agent.outcome.ended == "stopped"


def test_an_agent_that_does_not_train_and_should_exit_when_training_ends_exits_at_once() -> None:
    identity = InstanceIdentity(instance_id="i-0abc", job_id="job-3", tier="reliable")
    outcome = InstanceAgent(identity, token=None, metadata_url=None).run(threading.Event())
    assert outcome.ended == "stopped" and outcome.training is None


def test_an_agent_that_trains_needs_the_jobs_token() -> None:
    identity = InstanceIdentity(
        instance_id="i-0abc", job_id="job-3", tier="reliable", agileml_controller="tcp://x:1"
    )
    with pytest.raises(ValueError, match="token"):
        InstanceAgent(identity, token=None, metadata_url=None)


def test_the_offline_agent_exits_2_when_its_metadata_cannot_be_read() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.agent", "--metadata-url", "http://127.0.0.1:9",
         "--redis-url", "redis://127.0.0.1:9/0", "--namespace", "t", "--work-rate", "1",
         "--clock-start", str(T0), "--clock-speed", "600"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "cannot start" in proc.stderr and "Traceback" not in proc.stderr
