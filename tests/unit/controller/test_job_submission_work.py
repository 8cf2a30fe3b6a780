"""A training job's work may be given as its iterations' time on one GPU type: the submission
converts it to reference-GPU-hours with the catalog's work rates (what BidBrain plans with)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from orchestrator.jobspec import JobSubmission
from orchestrator.market.catalog import Catalog


def _job(**fields: object) -> JobSubmission:
    return JobSubmission.model_validate({"name": "w", "budget_usd": 10.0, **fields})


def test_iterations_times_their_time_become_reference_gpu_hours() -> None:
    # 3,600 iterations of 1 s on one V100 (the reference) is one reference-GPU-hour
    assert _job(training={"iterations": 3600}, iteration_time={"seconds_per_iteration": 1.0})\
        .work_gpu_hours == pytest.approx(1.0)  # fmt: skip
    catalog = Catalog.load()
    t4 = catalog.get("g4dn.xlarge")
    assert t4.gpu_model is not None
    job = _job(
        training={"iterations": 20_000},
        iteration_time={"seconds_per_iteration": 0.9, "measured_on": "g4dn.xlarge"},
    )
    expected = 20_000 * 0.9 / 3600 * t4.gpu_count * catalog.gpu_work_rates[t4.gpu_model]
    assert job.work_gpu_hours == pytest.approx(expected)
    assert job.job_spec().work_gpu_hours == pytest.approx(expected)
    # stored with the job as submitted: the API and a restarted controller read the same work
    assert JobSubmission.model_validate(job.model_dump(mode="json")) == job


@pytest.mark.parametrize(
    ("fields", "where", "says"),
    [
        ({"iteration_time": {"seconds_per_iteration": 1}}, "", "needs a training section"),
        ({"training": {}, "iteration_time": {"seconds_per_iteration": 1,
                                              "measured_on": "m5.xlarge"}},
         "iteration_time.measured_on", "has no GPU"),
        ({"training": {}, "iteration_time": {"seconds_per_iteration": 0}},
         "iteration_time.seconds_per_iteration", "greater than 0"),
        ({"training": {}}, "work_gpu_hours", "Field required"),
    ],
)  # fmt: skip
def test_work_that_cannot_be_told_is_refused_naming_the_field(
    fields: dict[str, object], where: str, says: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        _job(**fields)
    first = caught.value.errors()[0]
    assert ".".join(str(p) for p in first["loc"]) == where and says in first["msg"]
