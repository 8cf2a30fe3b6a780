"""A controller whose training port is told what to say (`FakeTraining`), over MemoryStore and
InMemoryCloud with the bundled us-east-1 prices: one training job, `job-1`, launched."""

from __future__ import annotations

from collections.abc import Mapping

from orchestrator.cloud.memory import InMemoryCloud, InMemoryEC2
from orchestrator.controller.core import Controller
from orchestrator.controller.outcomes import TrainingOutcome
from orchestrator.controller.wiring import build_controller
from orchestrator.jobspec import JobSubmission
from orchestrator.market.prices import to_epoch_seconds
from orchestrator.market.trace_source import TracePriceSource
from orchestrator.settings import Settings
from orchestrator.store import JobRecord, MemoryStore

T0 = to_epoch_seconds("2020-02-03T00:00:00Z")  # as conftest's
REGION = "us-east-1"
WORK = 40.0


class FakeTraining:
    """The controller's training port, told what to say (the training host in production)."""

    def __init__(self, cloud: InMemoryCloud) -> None:
        self.cloud = cloud
        self.outcome_now: TrainingOutcome | None = TrainingOutcome(0, 100)
        self.weights: str | None = None
        self.saved: list[tuple[str, int]] = []  # (job, its instances alive when saving)
        self.save_fails = False
        self.restarts: list[str] = []

    def tags_for(self, job_id: str) -> Mapping[str, str]:
        return {"orchestrator:agileml-controller": "tcp://127.0.0.1:29500"}

    def save_final(self, job_id: str) -> None:
        self.saved.append((job_id, len(self.cloud.describe())))
        if self.save_fails:
            raise RuntimeError("a full disk")  # the instances must go all the same
        if self.outcome_now is not None and self.outcome_now.trained:
            self.weights = f"s3://bucket/artifacts/{job_id}/final/model.safetensors"

    def outcome(self, job: JobRecord) -> TrainingOutcome | None:
        return self.outcome_now

    def final_weights(self, job_id: str, iterations: int) -> str | None:
        return self.weights

    def restart(self, job_id: str) -> None:
        self.restarts.append(job_id)

    def diagnose(self, job_id: str) -> str:
        return "its runtime heard from no node"


class AgentLogs:
    def last_log_line(self, instance_id: str) -> str | None:
        return f"{instance_id}: ModuleNotFoundError: No module named 'transformers'"


def training_world(
    store: MemoryStore, ec2: InMemoryEC2, prices: TracePriceSource, settings: Settings | None = None
) -> tuple[Controller, FakeTraining, InMemoryCloud]:
    cloud = InMemoryCloud(REGION, "ctl", ec2=ec2)
    training = FakeTraining(cloud)
    settings = settings or Settings()
    ctl = build_controller(settings, store=store, cloud=cloud, prices=prices, training=training)
    sub = JobSubmission(
        name="trains", budget_usd=200.0, work_gpu_hours=WORK, max_gpus=8.0,
        instance_types=("p3.2xlarge", "p3.8xlarge", "p3.16xlarge"),
    )  # fmt: skip
    store.create_job(JobRecord.submit("job-1", sub.model_dump(mode="json"), 200.0, T0))
    ctl.tick(T0)
    assert store.list_instances("job-1", alive_only=True)
    return ctl, training, cloud
