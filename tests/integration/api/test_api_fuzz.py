"""Fuzzing the HTTP API over the OpenAPI schema FastAPI publishes (issue #19, item 2): every
operation, with the token, on generated bodies, paths and queries (schemathesis). No request
gets a 5xx, and a rejected one (4xx) changes nothing in the store."""

from __future__ import annotations

import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from pydantic import SecretStr

from orchestrator.api.app import create_app
from orchestrator.settings import ApiSettings, Settings, TrainingSettings
from orchestrator.store import JobRecord, MemoryStore

TOKEN = "fuzz-t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
EXAMPLES = 150  # per operation (16 operations)
OUTCOMES: Counter[str] = Counter()
STORE = MemoryStore()
_FOLDER = tempfile.TemporaryDirectory(prefix="api-fuzz-")


@pytest.fixture(scope="module", autouse=True)
def _report() -> Iterator[None]:
    yield
    _FOLDER.cleanup()
    print(f"\nAPI fuzz: {sum(OUTCOMES.values())} cases {dict(OUTCOMES)}")


@pytest.fixture(scope="module")
def api_schema() -> Any:
    settings_ = Settings(
        api=ApiSettings(token=SecretStr(TOKEN)),
        training=TrainingSettings(artifacts_dir=Path(_FOLDER.name)),
    )
    STORE.create_job(JobRecord.submit("job-known", {"name": "k", "budget_usd": 5.0,
                                                    "work_gpu_hours": 1.0}, 5.0, 0.0))  # fmt: skip
    return schemathesis.openapi.from_asgi("/openapi.json", create_app(STORE, settings_))


schema = schemathesis.pytest.from_fixture("api_schema")


def _state() -> tuple[Any, ...]:
    jobs = STORE.list_jobs()
    return tuple(
        (j.job_id, j.version, j.state, len(STORE.events(j.job_id)), len(STORE.training(j.job_id)))
        for j in sorted(jobs, key=lambda j: j.job_id)
    )


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_no_request_gets_a_5xx_and_a_rejected_one_changes_nothing(case: Any) -> None:
    before = _state()
    response = case.call(headers={**(case.headers or {}), **AUTH})
    OUTCOMES[f"{response.status_code // 100}xx"] += 1
    assert response.status_code < 500, (case.method, case.path, response.text[:500])
    if response.status_code >= 400:
        assert _state() == before, (case.method, case.path, response.status_code)
