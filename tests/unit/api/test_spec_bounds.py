"""Every money, time and rate number of a job spec has physical bounds: finite, positive where
it must be, under a bound no real job reaches, and a number (never `true`, never "40"). A job
BidBrain could not decide for is refused at submission, naming the field, instead of sitting
`running` and paying for its on-demand node."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr, ValidationError

from orchestrator.api.app import create_app
from orchestrator.jobspec import STORED, JobSubmission
from orchestrator.market.catalog import Catalog
from orchestrator.settings import ApiSettings, Settings
from orchestrator.store import MemoryStore

BASE: dict[str, Any] = {"name": "bounds", "budget_usd": 10, "work_gpu_hours": 2}

REFUSED = [
    ({"budget_usd": True}, "budget_usd"),
    ({"budget_usd": "40"}, "budget_usd"),
    ({"budget_usd": 1e308}, "budget_usd"),
    ({"work_gpu_hours": 1e308}, "work_gpu_hours"),
    ({"work_gpu_hours": False}, "work_gpu_hours"),
    ({"max_gpus": True}, "max_gpus"),
    ({"reliable_count": True}, "reliable_count"),
    ({"app": {"add_overhead_s": 1e308}}, "app.add_overhead_s"),
    ({"app": {"eviction_overhead_s": 1e308}}, "app.eviction_overhead_s"),
    ({"app": {"phi": True}}, "app.phi"),
    ({"gpu_work_rates": {"V100": 1e308}}, "gpu_work_rates.V100"),
    ({"time_value_usd_per_hour": 1e308}, "time_value_usd_per_hour"),
    ({"deadline_hours": True}, "deadline_hours"),
    ({"training": {"iterations": True}}, "iterations"),
    ({"training": {"iterations": 10**12}}, "iterations"),
    ({"training": {"global_batch": 10**9}}, "global_batch"),
    ({"training": {"lr": 1e308}}, "lr"),
    (
        {"iteration_time": {"seconds_per_iteration": 1e308}, "training": {"iterations": 10}},
        "seconds_per_iteration",
    ),
    # four V100s billed, one trained on (the job's nodes train on one device each)
    (
        {
            "instance_types": ["p3.2xlarge", "p3.8xlarge"],
            "training": {"iterations": 10, "devices_per_node": 1},
        },
        "p3.8xlarge",
    ),
]


@pytest.mark.parametrize(("change", "field"), REFUSED, ids=[f for _, f in REFUSED])
def test_a_number_out_of_bounds_or_a_boolean_is_refused_by_name(
    change: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValidationError) as refused:
        JobSubmission.model_validate({**BASE, **change})
    assert field in str(refused.value)


def test_the_api_refuses_them_with_422_and_stores_nothing() -> None:
    store = MemoryStore()
    settings = Settings(api=ApiSettings(token=SecretStr("t")))
    client = TestClient(create_app(store, settings, clock=lambda: 0.0))
    for change, _ in REFUSED:
        body = {**BASE, **change}
        response = client.post("/v1/jobs", json=body, headers={"Authorization": "Bearer t"})
        assert response.status_code == 422, (body, response.text)
    assert store.list_jobs() == []


def test_ordinary_numbers_pass_as_ints_or_floats() -> None:
    job = JobSubmission.model_validate(
        {**BASE, "budget_usd": 40, "work_gpu_hours": 12.5, "max_gpus": 4,
         "app": {"add_overhead_s": 300}, "gpu_work_rates": {"V100": 1, "A100": 3.2},
         "time_value_usd_per_hour": 2, "training": {"iterations": 500, "lr": 0.1}}
    )  # fmt: skip
    assert job.budget_usd == 40.0 and job.max_gpus == 4.0


def test_a_training_job_is_given_the_types_whose_every_gpu_its_nodes_train_on() -> None:
    """A node trains on every GPU of its instance unless the job caps `devices_per_node`:
    then types with more GPUs are refused at submission (a job stored before the check keeps
    running on those it uses), and BidBrain never buys them; a pipeline stage uses one."""
    catalog = Catalog.load()
    types = {"instance_types": ["p3.2xlarge", "p3.8xlarge"]}
    both = ("p3.2xlarge", "p3.8xlarge")
    assert JobSubmission.model_validate({**BASE, **types}).usable_types(catalog) == both
    every = JobSubmission.model_validate({**BASE, **types, "training": {"iterations": 10}})
    assert every.devices_per_node() == 16 and every.usable_types(catalog) == both
    capped = {**BASE, **types, "training": {"iterations": 10, "devices_per_node": 2}}
    capped_refused = (
        r"p3\.8xlarge has 4 GPUs: 2 would be paid for and idle: the job's nodes train on 2 GPUs"
    )
    with pytest.raises(ValidationError, match=capped_refused):
        JobSubmission.model_validate(capped)
    job = JobSubmission.model_validate(capped, context=STORED)
    assert job.usable_types(catalog) == ("p3.2xlarge",)
    trains = JobSubmission.model_validate(
        {**BASE, "training": {"iterations": 10, "devices_per_node": 4}}
    )
    usable = trains.usable_types(catalog)
    assert usable and all(catalog.get(t).gpu_count <= 4 for t in usable)
    assert any(catalog.get(t).gpu_count == 4 for t in usable)
    assert set(usable) < set(catalog.gpu_types())
    pipeline = {"iterations": 10, "code": "job.py", "parallelism": "pipeline"}
    with pytest.raises(ValidationError, match=r"p3\.8xlarge has 4 GPUs: 3 would be paid for"):
        JobSubmission.model_validate({**BASE, **types, "training": pipeline})


def test_a_pipeline_of_k_workers_a_node_is_given_the_types_of_exactly_k_gpus() -> None:
    """A pipeline node runs `devices_per_node` stage workers, one per GPU: fewer GPUs would
    have them share, more would leave some idle; both are refused."""
    catalog = Catalog.load()
    pipeline = {"iterations": 10, "code": "job.py", "parallelism": "pipeline"}
    one = JobSubmission.model_validate({**BASE, "training": pipeline})
    assert one.devices_per_node() == 1
    assert {catalog.get(t).gpu_count for t in one.usable_types(catalog)} == {1}
    four = JobSubmission.model_validate({**BASE, "training": {**pipeline, "devices_per_node": 4}})
    usable = four.usable_types(catalog)
    assert usable and {catalog.get(t).gpu_count for t in usable} == {4}
    assert "p3.8xlarge" in usable and "p3.2xlarge" not in usable
    for wrong, why in (("p3.2xlarge", "4 stage workers would share"), ("p3.16xlarge", "idle")):
        with pytest.raises(ValidationError, match=rf"{wrong} .*{why}.*exactly 4 GPUs"):
            JobSubmission.model_validate(
                {**BASE, "instance_types": [wrong],
                 "training": {**pipeline, "devices_per_node": 4}}
            )  # fmt: skip
    # no instance type has 2 GPUs: refused at submission, and a job stored so is told why
    two = {**BASE, "training": {**pipeline, "devices_per_node": 2}}
    with pytest.raises(ValidationError, match=r"no instance type has exactly 2 GPUs.*1, 4, 8"):
        JobSubmission.model_validate(two)
    stored = JobSubmission.model_validate(two, context=STORED)
    assert stored.usable_types(catalog) == ()
    assert "none of the instance types" in (stored.types_refused(catalog) or "")
