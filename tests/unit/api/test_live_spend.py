"""Spend is live: while a job's instances run, the API's job, job list, cost and dashboard and
the Prometheus gauge show billed + accrued (what the controller's budget check uses), not the
ledger alone, which stays at $0 until an instance ends."""

from __future__ import annotations

from fastapi.testclient import TestClient
from pydantic import SecretStr

from orchestrator.api.app import create_app
from orchestrator.cloud.memory import InMemoryCloud, InMemoryEC2
from orchestrator.controller.wiring import build_controller
from orchestrator.jobspec import JobSubmission
from orchestrator.market.prices import to_epoch_seconds
from orchestrator.market.trace_source import TracePriceSource, bundled_prices_dir
from orchestrator.settings import ApiSettings, Settings
from orchestrator.store import JobRecord, MemoryStore

T0 = to_epoch_seconds("2020-02-03T00:00:00Z")
AUTH = {"Authorization": "Bearer t"}


def test_running_instances_show_in_every_spend_figure_before_any_bill() -> None:
    store = MemoryStore()
    cloud = InMemoryCloud("us-east-1", "ctl", ec2=InMemoryEC2(clock=lambda: T0))
    prices = TracePriceSource([bundled_prices_dir("us-east-1")])
    ctl = build_controller(Settings(), store=store, cloud=cloud, prices=prices)
    sub = JobSubmission(name="live", budget_usd=500.0, work_gpu_hours=400.0, max_gpus=8.0,
                        instance_types=("p3.2xlarge", "p3.8xlarge"))  # fmt: skip
    store.create_job(JobRecord.submit("job-1", sub.model_dump(mode="json"), 500.0, T0))
    now = T0
    for _ in range(12):  # six hours of ticks; the instances run, none ends
        ctl.tick(now)
        now += 1800.0
    ctl.tick(now)
    assert store.list_instances("job-1", alive_only=True)
    assert store.spent_usd("job-1") == 0.0  # the ledger: nothing billed yet
    live = ctl.spend_usd("job-1", now)  # what the budget check counts
    assert live > 1.0

    settings = Settings(api=ApiSettings(token=SecretStr("t")))
    client = TestClient(create_app(store, settings, clock=lambda: now))
    job = client.get("/v1/jobs/job-1", headers=AUTH).json()
    assert job["spent_usd"] == live and job["billed_usd"] == 0.0
    listed = client.get("/v1/jobs", headers=AUTH).json()["jobs"][0]
    assert listed["spent_usd"] == live
    cost = client.get("/v1/jobs/job-1/cost", headers=AUTH).json()
    assert cost["spent_usd"] == live and cost["remaining_usd"] == 500.0 - live
    page = client.get("/v1/jobs/job-1/dashboard", headers=AUTH).json()
    assert page["job"]["spent_usd"] == live
    metrics = client.get("/metrics", headers=AUTH).text
    gauge = next(line for line in metrics.splitlines()
                 if line.startswith('orchestrator_job_spent_usd{job_id="job-1"}'))  # fmt: skip
    assert float(gauge.split()[-1]) == live
