"""`orchestrator.api` and the job CLI on a real redis-server: the endpoints through FastAPI's
TestClient, then one real uvicorn server (in a thread, on a free loopback port) driven by
`ApiClient` and by the `orchestrator` CLI run as subprocesses."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import uvicorn
from pydantic import SecretStr
from support.redis_server import free_port, start_redis

from orchestrator.api.app import create_app
from orchestrator.api.client import ApiClient, ApiResponseError
from orchestrator.api.errors import COOKIE_MAX_AGE_S, RedactTokens, TokenAuth
from orchestrator.api.operations import CANCEL_ATTEMPTS, cancel_job
from orchestrator.errors import UserError
from orchestrator.market.billing import EndReason
from orchestrator.settings import ApiSettings, Settings
from orchestrator.store import (
    ConflictError,
    DecisionEvent,
    Evaluation,
    EvictionEvent,
    InstanceRecord,
    JobRecord,
    JobState,
    LaunchEvent,
    LaunchFailedEvent,
    LedgerEntry,
    NoticeEvent,
    PipelineStageReport,
    PriceSnapshot,
    RedisStore,
    Store,
    TrainingReport,
)

with warnings.catch_warnings():
    # Starlette asks for `httpx2` in its TestClient; the httpx it is built on works the same.
    warnings.filterwarnings("ignore", message=".*httpx2", category=UserWarning)
    from fastapi.testclient import TestClient

REPO = Path(__file__).resolve().parents[3]
NS = "apitest"
TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
READ_TOKEN = "r3ad-only-token"
READ = {"Authorization": f"Bearer {READ_TOKEN}"}
SPEC: dict[str, Any] = {"name": "resnet", "budget_usd": 40.0, "work_gpu_hours": 20.0}
SERVER_START_TIMEOUT_S = 5.0
CLI_TIMEOUT_S = 30.0


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self, now_s: float = 1_000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def store(redis_url: str) -> Iterator[Store]:
    raw = redis.Redis.from_url(redis_url)
    raw.flushdb()
    raw.close()
    s = RedisStore.connect(redis_url, namespace=NS)
    yield s
    s.close()


def settings_for(redis_url: str, token: str | None = TOKEN) -> Settings:
    return Settings(
        redis_url=redis_url,
        api=ApiSettings(
            token=None if token is None else SecretStr(token), read_token=SecretStr(READ_TOKEN)
        ),
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def client(store: Store, redis_url: str, clock: FakeClock) -> Iterator[TestClient]:
    with TestClient(create_app(store, settings_for(redis_url), clock=clock)) as c:
        yield c


def submit(client: TestClient, **changes: Any) -> dict[str, Any]:
    response = client.post("/v1/jobs", json=SPEC | changes, headers=AUTH)
    assert response.status_code == 201, response.text
    return dict(response.json())


def error_of(response: httpx.Response, status_code: int) -> dict[str, Any]:
    assert response.status_code == status_code, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "field", "fix"}
    return dict(error)


def to_state(store: Store, job_id: str, *states: JobState) -> JobRecord:
    """Walk the job through `states` the way the controller would."""
    job = store.get_job(job_id)
    for state in states:
        job = store.transition(job_id, state, expected_version=job.version, now_s=2_000.0)
    return job


def charge(job_id: str, start_s: float, billed_s: float = 600.0) -> LedgerEntry:
    price = 0.9
    return LedgerEntry(
        job_id=job_id,
        instance_id="i-1",
        instance_type="p3.2xlarge",
        zone="us-east-1a",
        start_s=start_s,
        end_s=start_s + billed_s,
        price_usd_per_hour=price,
        billed_s=billed_s,
        charged_usd=price * billed_s / 3600.0,
        reason=EndReason.PRICE_CHANGE.value,
    )


def decision_event(job_id: str, **numbers: float) -> DecisionEvent:
    fields = {"spent_usd": 0.0, "work_done_gpu_hours": 0.0, **numbers}
    return DecisionEvent(job_id=job_id, at_s=5.0, **fields)


def eviction_event(job_id: str, instance_id: str, at_s: float = 5.0) -> EvictionEvent:
    return EvictionEvent(
        job_id=job_id, at_s=at_s, instance_id=instance_id, instance_type="p3.2xlarge",
        zone="us-east-1a",
    )  # fmt: skip


def launch_event(job_id: str, instance_id: str, at_s: float) -> LaunchEvent:
    return LaunchEvent(
        job_id=job_id, at_s=at_s, instance_id=instance_id, instance_type="p3.2xlarge",
        zone="us-east-1a", lifecycle="spot",
    )  # fmt: skip


def spot_instance(instance_id: str, job_id: str) -> InstanceRecord:
    return InstanceRecord(
        instance_id=instance_id,
        job_id=job_id,
        allocation_id="alloc-1",
        instance_type="p3.2xlarge",
        zone="us-east-1a",
        lifecycle="spot",
        launched_at=10.0,
        state="running",
    )


# --- jobs: submit, get, list, cancel


def test_submit_get_list_then_cancel_queued_job_ends_cancelled(
    client: TestClient, store: Store, clock: FakeClock
) -> None:
    job = submit(client)
    job_id = job["job_id"]
    assert job_id.startswith("job-") and len(job_id) == len("job-") + 8
    int(job_id[4:], 16)
    assert job["state"] == "queued" and job["version"] == 0
    assert job["budget_usd"] == 40.0 and job["spent_usd"] == 0.0
    assert job["spec"]["work_gpu_hours"] == 20.0 and job["submitted_at"] == 1_000.0

    got = client.get(f"/v1/jobs/{job_id}", headers=READ).json()
    assert got == job
    for key in ("state", "budget_usd", "spent_usd", "work_done_gpu_hours", "version", "message"):
        assert key in got
    assert [j["job_id"] for j in client.get("/v1/jobs", headers=READ).json()["jobs"]] == [job_id]

    clock.now_s = 1_500.0
    response = client.post(f"/v1/jobs/{job_id}/cancel", headers=AUTH)
    assert response.status_code == 200
    assert response.json()["state"] == "cancelled" and response.json()["version"] == 1
    stored = store.get_job(job_id)
    assert stored.state is JobState.CANCELLED and stored.updated_at == 1_500.0
    moves = [(e.from_state, e.state) for _, e in store.events(job_id)]
    assert moves == [(None, JobState.QUEUED), (JobState.QUEUED, JobState.CANCELLED)]


def test_list_filters_by_state_and_names_a_bad_state(client: TestClient, store: Store) -> None:
    first, second = submit(client, name="a"), submit(client, name="b")
    to_state(store, second["job_id"], JobState.RUNNING)
    running = client.get("/v1/jobs", params={"state": "running"}, headers=READ).json()["jobs"]
    assert [j["job_id"] for j in running] == [second["job_id"]]
    queued = client.get("/v1/jobs", params={"state": "queued"}, headers=READ).json()["jobs"]
    assert [j["job_id"] for j in queued] == [first["job_id"]]
    error = error_of(client.get("/v1/jobs", params={"state": "sleeping"}, headers=READ), 422)
    assert error["field"] == "state" and "sleeping" in error["message"]


def test_cancel_running_job_moves_to_cancelling_for_the_controller(
    client: TestClient, store: Store
) -> None:
    job_id = submit(client)["job_id"]
    to_state(store, job_id, JobState.RUNNING)
    response = client.post(f"/v1/jobs/{job_id}/cancel", headers=AUTH)
    assert response.status_code == 202 and response.json()["state"] == "cancelling"
    again = client.post(f"/v1/jobs/{job_id}/cancel", headers=AUTH)  # asked twice: no change
    assert again.status_code == 202 and again.json()["version"] == response.json()["version"]


@pytest.mark.parametrize(
    "path",
    [
        (JobState.CANCELLED,),
        (JobState.RUNNING, JobState.SUCCEEDED),
        (JobState.RUNNING, JobState.FAILED),
        (JobState.RUNNING, JobState.BUDGET_EXHAUSTED),
        (JobState.RUNNING, JobState.CANCELLING, JobState.CANCELLED),
    ],
    ids=lambda p: p[-1].value,
)
def test_cancel_of_a_terminal_job_is_409_and_changes_nothing(
    client: TestClient, store: Store, path: tuple[JobState, ...]
) -> None:
    job_id = submit(client)["job_id"]
    before = to_state(store, job_id, *path)
    error = error_of(client.post(f"/v1/jobs/{job_id}/cancel", headers=AUTH), 409)
    assert path[-1].value in error["message"] and "nothing to cancel" in error["message"]
    assert store.get_job(job_id) == before


class RacingStore(RedisStore):
    """A store whose controller moves the job queued -> running just before the first cancel
    lands (so the cancel's version is stale once)."""

    raced = False

    def transition(self, job_id: str, to_state: JobState | str, **kwargs: Any) -> JobRecord:
        if not self.raced:
            self.raced = True
            super().transition(job_id, JobState.RUNNING, **kwargs)
        return super().transition(job_id, to_state, **kwargs)


class AlwaysLosingStore(RedisStore):
    """A store where every transition loses a race."""

    def transition(self, job_id: str, to_state: JobState | str, **kwargs: Any) -> JobRecord:
        raise ConflictError(f"{NS}:job:{job_id}", kwargs["expected_version"], 99)


def test_cancel_rereads_after_a_concurrent_transition(client: TestClient, redis_url: str) -> None:
    job_id = submit(client)["job_id"]
    racing = RacingStore(redis.Redis.from_url(redis_url, decode_responses=True), NS)
    job = cancel_job(racing, job_id, now_s=3_000.0)
    assert racing.raced
    assert job.state is JobState.CANCELLING  # it was running by the time the cancel landed
    assert job.version == 2
    racing.close()


def test_cancel_gives_up_with_409_after_bounded_conflicts(store: Store, redis_url: str) -> None:
    losing = AlwaysLosingStore(redis.Redis.from_url(redis_url, decode_responses=True), NS)
    job_id = "job-0000beef"
    store.create_job(JobRecord.submit(job_id, SPEC, 40.0, 1.0))
    with TestClient(create_app(losing, settings_for(redis_url))) as c:
        error = error_of(c.post(f"/v1/jobs/{job_id}/cancel", headers=AUTH), 409)
    assert "kept changing" in error["message"] and error["fix"] == "try again"
    assert store.get_job(job_id).state is JobState.QUEUED
    assert CANCEL_ATTEMPTS > 1
    losing.close()


# --- authentication


READS = ["/v1/jobs", "/v1/jobs/{id}", "/v1/jobs/{id}/cost", "/v1/jobs/{id}/events",
         "/v1/dashboard", "/v1/jobs/{id}/dashboard", "/metrics"]  # fmt: skip


def test_reads_need_a_token_and_the_read_only_one_reads_everything(client: TestClient) -> None:
    job_id = submit(client)["job_id"]
    for path in (p.format(id=job_id) for p in READS):
        missing = error_of(client.get(path), 401)
        assert "ORCHESTRATOR_API__READ_TOKEN" in missing["fix"], path
        assert (
            "wrong"
            in error_of(client.get(path, headers={"Authorization": "Bearer x"}), 403)["message"]
        )
        assert client.get(path, headers=READ).status_code == 200, path
        assert client.get(path, headers=AUTH).status_code == 200, path
    assert client.get("/healthz").status_code == 200  # a load balancer's check: open
    assert client.get("/dashboard").status_code == 200  # the page: no data in it


def test_the_read_only_token_changes_nothing(client: TestClient, store: Store) -> None:
    job_id = submit(client)["job_id"]
    before = store.get_job(job_id)
    calls = [
        ("POST", "/v1/jobs", {"json": SPEC}),
        ("POST", f"/v1/jobs/{job_id}/cancel", {}),
        ("GET", f"/v1/jobs/{job_id}/weights", {}),
        ("GET", f"/v1/jobs/{job_id}/checkpoint", {}),
        ("PUT", "/v1/code/sha256:" + "0" * 64, {"content": b"x"}),
        ("POST", "/v1/notices", {"json": {}}),
    ]
    for method, path, kwargs in calls:
        refused = error_of(client.request(method, path, headers=READ, **kwargs), 403)
        assert "read-only" in refused["message"], path
    assert [j.job_id for j in store.list_jobs()] == [job_id]
    assert store.get_job(job_id) == before
    assert store.training(job_id) == []


def test_the_dashboard_link_with_a_token_sets_a_cookie_that_only_reads(
    client: TestClient, store: Store, redis_url: str, clock: FakeClock
) -> None:
    job_id = submit(client)["job_id"]
    assert error_of(client.get("/dashboard", params={"token": "nope"}), 403)
    assert "orchestrator_read" not in client.cookies
    opened = client.get("/dashboard", params={"token": READ_TOKEN}, follow_redirects=False)
    assert opened.status_code == 303 and opened.headers["location"] == "dashboard"
    set_cookie = opened.headers["set-cookie"].lower()
    assert "httponly" in set_cookie and "samesite=strict" in set_cookie
    assert READ_TOKEN not in set_cookie and TOKEN not in set_cookie  # derived, not the token
    assert client.get("/v1/dashboard").status_code == 200  # the cookie, sent by the client
    assert client.get(f"/v1/jobs/{job_id}/dashboard").status_code == 200
    assert error_of(client.post("/v1/jobs", json=SPEC), 401)  # a cookie never writes
    assert error_of(client.get(f"/v1/jobs/{job_id}/weights"), 401)
    assert len(store.list_jobs()) == 1
    # a new API token voids the cookies given out under the old one
    other = settings_for(redis_url, token="another-token")
    with TestClient(create_app(store, other, clock=clock), cookies=dict(client.cookies)) as c:
        assert error_of(c.get("/v1/dashboard"), 401)


def test_a_dashboard_cookie_expires_and_a_new_read_token_voids_it() -> None:
    now = [1_000_000.0]
    auth = TokenAuth(SecretStr(TOKEN), SecretStr(READ_TOKEN), clock=lambda: now[0])
    cookie = auth.cookie_for(READ_TOKEN)
    assert cookie is not None and auth.cookie_for("wrong") is None
    assert auth._cookie_valid(cookie)
    rotated = TokenAuth(SecretStr(TOKEN), SecretStr("another-read"), clock=lambda: now[0])
    assert not rotated._cookie_valid(cookie)
    assert not auth._cookie_valid(cookie.split(".")[0] + ".00")  # a forged MAC
    now[0] += COOKIE_MAX_AGE_S + 1
    assert not auth._cookie_valid(cookie)


def test_the_read_only_token_must_differ_from_the_api_token() -> None:
    with pytest.raises(ValueError, match="read_token equals token"):
        ApiSettings(token=SecretStr("same"), read_token=SecretStr("same"))


def test_the_access_log_never_shows_a_token() -> None:
    record = logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "GET", f"/dashboard?token={TOKEN}", "1.1", 303),
                               None)  # fmt: skip
    RedactTokens().filter(record)
    assert TOKEN not in record.getMessage() and "token=***" in record.getMessage()


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/jobs/job-12345678/cancel"])
def test_mutating_calls_need_the_bearer_token(client: TestClient, store: Store, path: str) -> None:
    missing = client.post(path, json=SPEC)
    error = error_of(missing, 401)
    assert "ORCHESTRATOR_API__TOKEN" in error["fix"]
    assert missing.headers["www-authenticate"] == "Bearer"
    error_of(client.post(path, json=SPEC, headers={"Authorization": f"Basic {TOKEN}"}), 401)
    wrong = error_of(client.post(path, json=SPEC, headers={"Authorization": "Bearer nope"}), 403)
    assert "wrong" in wrong["message"]
    # authentication is checked before the body: no validation detail leaks to a stranger
    error_of(client.post(path, json={"name": "-"}, headers={"Authorization": "Bearer x"}), 403)
    assert store.list_jobs() == []


def test_create_app_refuses_to_start_without_a_token(store: Store, redis_url: str) -> None:
    for token in (None, "", "  "):
        with pytest.raises(UserError) as caught:
            create_app(store, settings_for(redis_url, token))
        assert "ORCHESTRATOR_API__TOKEN" in caught.value.fix


# --- validation and errors


@pytest.mark.parametrize(
    ("changes", "field", "needle"),
    [
        ({"name": "-resnet"}, "name", "letters, digits"),
        ({"budget_usd": 0}, "budget_usd", "greater than 0"),
        ({"budget_usd": -5}, "budget_usd", "greater than 0"),
        ({"instance_types": ["p3.2xlarg"]}, "instance_types", "Did you mean 'p3.2xlarge'"),
        ({"regions": ["mars-1"]}, "regions", "unknown region 'mars-1'"),
        ({"gpus": 4}, "gpus", "not a field"),
        ({"work_gpu_hours": None}, "work_gpu_hours", "valid number"),
    ],
    ids=["bad-name", "budget-0", "budget-negative", "unknown-type", "unknown-region", "extra"]
    + ["null-work"],
)
def test_malformed_spec_is_422_naming_the_field(
    client: TestClient, store: Store, changes: dict[str, Any], field: str, needle: str
) -> None:
    error = error_of(client.post("/v1/jobs", json=SPEC | changes, headers=AUTH), 422)
    assert error["field"] == field
    assert error["message"].startswith(f"{field}: ") and needle in error["message"]
    assert error["fix"]
    assert store.list_jobs() == []


def test_a_deadline_is_fixed_at_submission_and_refused_with_its_numbers(
    client: TestClient, store: Store, clock: FakeClock
) -> None:
    """20 GPU-hours at 16 GPUs take 1.25 h: a 1-hour deadline cannot be met; a 30-hour one
    could cost more than $40 if spot ran out, unless the user lets the budget win."""
    error = error_of(client.post("/v1/jobs", json=SPEC | {"deadline_hours": 1}, headers=AUTH), 422)
    assert error["field"] == "deadline_hours" and "cannot be met" in error["message"]
    assert "max_gpus to 23" in error["fix"]  # 20 GPU-hours in 1 h less σ, λ and a tick
    costly = SPEC | {"deadline_hours": 30, "budget_usd": 20.0}
    error = error_of(client.post("/v1/jobs", json=costly, headers=AUTH), 422)
    assert error["field"] == "budget_usd" and "could cost up to $" in error["message"]
    assert "deadline_soft: true" in error["fix"]
    assert store.list_jobs() == []
    job = submit(client, deadline_hours=30, budget_usd=20.0, deadline_soft=True)
    deadline = datetime.fromisoformat(job["spec"]["deadline"]).timestamp()
    assert deadline == clock.now_s + 30 * 3600 and job["spec"]["deadline_hours"] is None
    both = SPEC | {"deadline_hours": 30, "deadline": "2030-01-01T00:00:00Z"}
    assert error_of(client.post("/v1/jobs", json=both, headers=AUTH), 422)["message"]


def test_missing_field_and_non_object_bodies_are_422(client: TestClient) -> None:
    body = {k: v for k, v in SPEC.items() if k != "budget_usd"}
    error = error_of(client.post("/v1/jobs", json=body, headers=AUTH), 422)
    assert error == {
        "message": "budget_usd: required",
        "field": "budget_usd",
        "fix": "add budget_usd",
    }
    error = error_of(client.post("/v1/jobs", json=[1, 2], headers=AUTH), 422)
    assert error["field"] is None and error["message"].startswith("job spec: ")


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/jobs/job-deadbeef"),
        ("GET", "/v1/jobs/job-deadbeef/cost"),
        ("GET", "/v1/jobs/job-deadbeef/events"),
        ("POST", "/v1/jobs/job-deadbeef/cancel"),
        ("GET", "/v1/jobs/not:an:id"),
    ],
)
def test_unknown_job_is_404_json(client: TestClient, method: str, path: str) -> None:
    error = error_of(client.request(method, path, headers=AUTH), 404)
    assert "no job" in error["message"] and "orchestrator jobs" in error["fix"]


def test_unknown_route_is_json_too(client: TestClient) -> None:
    assert error_of(client.get("/v2/nothing"), 404)["message"] == "Not Found"


# --- cost, events


def test_cost_reports_spend_latest_projection_evictions_and_ledger(
    client: TestClient, store: Store
) -> None:
    job_id = submit(client)["job_id"]
    assert client.get(f"/v1/jobs/{job_id}/cost", headers=READ).json()["projected_usd"] is None
    store.append_ledger(charge(job_id, 0.0))
    store.append_ledger(charge(job_id, 600.0))
    for event in [
        decision_event(job_id, projected_cost_usd=31.5),
        eviction_event(job_id, "i-1"),
        decision_event(job_id, projected_cost_usd=33.25),
        eviction_event(job_id, "i-2"),
    ]:
        store.append_event(event)
    cost = client.get(f"/v1/jobs/{job_id}/cost", headers=READ).json()
    assert cost["spent_usd"] == pytest.approx(0.3)
    assert cost["budget_usd"] == 40.0 and cost["remaining_usd"] == pytest.approx(39.7)
    assert cost["projected_usd"] == 33.25  # the latest decision's
    assert cost["evictions"] == 2 and cost["ledger_entries"] == 2


def test_events_since_returns_only_newer_events(client: TestClient, store: Store) -> None:
    job_id = submit(client)["job_id"]
    page = client.get(f"/v1/jobs/{job_id}/events", headers=READ).json()
    assert [e["kind"] for e in page["events"]] == ["state"]
    store.append_event(launch_event(job_id, "i-1", at_s=7.0))
    newer = client.get(
        f"/v1/jobs/{job_id}/events", params={"since": page["next_since"]}, headers=READ
    ).json()
    assert [(e["kind"], e["at_s"]) for e in newer["events"]] == [("launch", 7.0)]
    assert newer["next_since"] == newer["events"][0]["id"]
    for since in ("yesterday", "9" * 31, "1-" + "9" * 20):  # 20 digits: past 64 bits
        bad = client.get(f"/v1/jobs/{job_id}/events", params={"since": since}, headers=READ)
        assert error_of(bad, 422)["field"] == "since"
    top = client.get(f"/v1/jobs/{job_id}/events", params={"since": "9" * 19}, headers=READ)
    assert top.status_code == 200 and top.json()["events"] == []


# --- health and metrics


def test_healthz_is_ok_while_redis_answers(client: TestClient) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json()["status"] == "ok" and response.json()["redis"] == "ok"
    # served apart from a controller: it does not claim the ticks work
    assert response.json()["controller"] == "not watched"


def test_healthz_is_503_degraded_after_redis_stops() -> None:
    own_redis = ExitStack()  # this test's own server, stopped halfway through
    url = own_redis.enter_context(start_redis())
    try:
        store = RedisStore.connect(url, namespace=NS, timeout_s=1.0)
        try:
            with TestClient(create_app(store, settings_for(url))) as c:
                assert c.get("/healthz").status_code == 200
                own_redis.close()  # redis-server is gone; the store's connection is now dead

                health = c.get("/healthz")
                assert health.status_code == 503
                assert health.json()["status"] == "degraded"
                assert health.json()["redis"] == "unavailable"
                assert "ORCHESTRATOR_REDIS_URL" in health.json()["error"]["fix"]

                listing = error_of(c.get("/v1/jobs", headers=READ), 503)
                assert "cannot reach Redis" in listing["message"]
                assert "ORCHESTRATOR_REDIS_URL" in listing["fix"]
                assert error_of(c.post("/v1/jobs", json=SPEC, headers=AUTH), 503)["fix"]

                scrape = c.get("/metrics", headers=READ)
                assert scrape.status_code == 200 and "orchestrator_store_up 0.0" in scrape.text
        finally:
            store.close()
    finally:
        own_redis.close()


def _feed_a_running_job(client: TestClient, store: Store) -> str:
    """A running job with spend, work, a decision, a warned and an unwarned eviction, a
    launch, a capacity error, two alive spot nodes, prices and a training report."""
    job_id = submit(client, budget_usd=123.5)["job_id"]
    to_state(store, job_id, JobState.RUNNING)
    store.append_ledger(charge(job_id, 0.0))
    store.update_progress(job_id, 1.25, now_s=9.0)
    store.append_event(
        decision_event(
            job_id, spent_usd=0.15, work_done_gpu_hours=1.25, projected_cost_usd=2.5,
            expected_cost_per_work=0.8,
        )
    )  # fmt: skip
    store.append_event(launch_event(job_id, "i-1", at_s=5.0))
    store.append_event(
        LaunchFailedEvent(
            job_id=job_id, at_s=5.0, market="p3.8xlarge@us-east-1b",
            code="InsufficientInstanceCapacity",
        )
    )  # fmt: skip
    store.append_event(
        NoticeEvent(job_id=job_id, at_s=6.0, instance_id="i-7", notice="interruption")
    )
    for instance_id in ("i-7", "i-8"):
        store.append_event(eviction_event(job_id, instance_id, at_s=8.0))
    store.put_instance(spot_instance("i-1", job_id))
    store.put_instance(spot_instance("i-2", job_id))
    store.append_prices(
        job_id,
        PriceSnapshot(
            at_s=5.0, prices={"p3.2xlarge@us-east-1a": 0.9, "p3.8xlarge@us-east-1b": 4.0}
        ),
    )
    held_out = Evaluation(iteration=40, metrics={"held_out_accuracy": 0.9, "held_out_loss": 0.3})
    store.append_training(job_id, TrainingReport(at_s=9.0, iteration=42, loss=0.5,
                                                 reassigned=3, stage_transitions=2,
                                                 evaluation=held_out))  # fmt: skip
    return job_id


def test_metrics_expose_spend_projection_evictions_nodes_prices_and_training(
    client: TestClient, store: Store
) -> None:
    job_id = _feed_a_running_job(client, store)
    submit(client, name="other")

    response = client.get("/metrics", headers=READ)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = scrape_samples(response.text)
    job = {"job_id": job_id}
    spot = {"tier": "transient", "lifecycle": "spot", "instance_type": "p3.2xlarge",
            "zone": "us-east-1a"}  # fmt: skip
    for name, labels, value in [
        ("orchestrator_store_up", {}, 1.0),
        ("orchestrator_jobs", {"state": "queued"}, 1.0),
        ("orchestrator_jobs", {"state": "running"}, 1.0),
        ("orchestrator_job_budget_usd", job, 123.5),
        ("orchestrator_job_spent_usd", job, 0.15),
        ("orchestrator_job_work_done_gpu_hours", job, 1.25),
        ("orchestrator_job_projected_cost_usd", job, 2.5),
        ("orchestrator_job_cost_per_work_usd", job, 0.12),
        ("orchestrator_job_expected_cost_per_work_usd", job, 0.8),
        ("orchestrator_job_evictions_total", job | {"warned": "true"}, 1.0),
        ("orchestrator_job_evictions_total", job | {"warned": "false"}, 1.0),
        ("orchestrator_job_launches_total", job, 1.0),
        ("orchestrator_job_launch_failures_total", job | {"code": "InsufficientInstanceCapacity"},
         1.0),
        ("orchestrator_instances_alive", job | spot, 2.0),
        ("orchestrator_spot_price_usd_per_hour",
         {"instance_type": "p3.2xlarge", "zone": "us-east-1a", "held": "true"}, 0.9),
        ("orchestrator_spot_price_usd_per_hour",
         {"instance_type": "p3.8xlarge", "zone": "us-east-1b", "held": "false"}, 4.0),
        ("orchestrator_job_training_iterations_total", job, 42.0),
        ("orchestrator_job_training_loss", job, 0.5),
        ("orchestrator_job_reassigned_work_total", job, 3.0),
        ("orchestrator_job_stage_transitions_total", job, 2.0),
        ("orchestrator_job_evaluation", job | {"metric": "held_out_accuracy"}, 0.9),
        ("orchestrator_job_evaluation", job | {"metric": "held_out_loss"}, 0.3),
        ("orchestrator_job_evaluation_iteration", job, 40.0),
    ]:  # fmt: skip
        key = (name, frozenset(labels.items()))
        assert samples.get(key) == pytest.approx(value), f"{key} in\n{response.text}"


def test_every_metric_the_grafana_dashboard_queries_exists_in_a_live_scrape(
    client: TestClient, store: Store
) -> None:
    import re

    _feed_a_running_job(client, store)
    exported = {name for name, _ in scrape_samples(client.get("/metrics", headers=READ).text)}
    board = json.loads((REPO / "dashboards" / "grafana" / "orchestrator.json").read_text())
    queried = {
        name
        for panel in board["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\borchestrator_[a-z_]+", target["expr"])
    }
    variables = {v["query"]["query"] for v in board["templating"]["list"]}
    queried |= {n for q in variables for n in re.findall(r"\borchestrator_[a-z_]+", q)}
    assert len(queried) >= 15
    assert queried <= exported, f"panels query metrics /metrics lacks: {queried - exported}"
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))


def scrape_samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """(sample name, labels) -> value of a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_dashboard_data_follows_the_contract(client: TestClient, store: Store) -> None:
    job_id = _feed_a_running_job(client, store)
    fleet = client.get("/v1/dashboard", headers=READ).json()
    (summary,) = fleet["jobs"]
    assert summary["job_id"] == job_id and summary["evictions"] == 2
    assert summary["nodes_alive"] == {"reliable": 0, "transient": 2}
    assert summary["iterations"] == 42 and summary["loss"] == 0.5
    assert summary["cost_per_work_usd"] == pytest.approx(0.12)
    page = client.get(f"/v1/jobs/{job_id}/dashboard", headers=READ).json()
    assert set(page) == {"now_s", "job", "spend", "prices", "nodes", "marks", "training",
                         "pipeline", "work_rates", "events"}  # fmt: skip
    assert page["pipeline"] == []  # a data-parallel job has no stages
    assert page["work_rates"] == []  # no instance's work measured yet
    assert page["job"] == summary
    assert page["spend"] == [
        {"t": 5.0, "spent_usd": 0.15, "work_done_gpu_hours": 1.25, "projected_cost_usd": 2.5,
         "expected_cost_per_work_usd": 0.8}
    ]  # fmt: skip
    assert {p["market"]: p["held"] for p in page["prices"]} == {
        "p3.2xlarge@us-east-1a": True, "p3.8xlarge@us-east-1b": False
    }  # fmt: skip
    assert [n["instance_id"] for n in page["nodes"]] == ["i-1", "i-2"]
    kinds = [(m["kind"], m["instance_id"]) for m in page["marks"]]
    assert kinds == [("launch_failed", None), ("notice", "i-7"), ("eviction", "i-7"),
                     ("eviction", "i-8")]  # fmt: skip
    assert "warned" in page["marks"][2]["detail"] and "no warning" in page["marks"][3]["detail"]
    assert page["training"][0]["iteration"] == 42
    held_out = {"iteration": 40, "metrics": {"held_out_accuracy": 0.9, "held_out_loss": 0.3}}
    assert page["training"][0]["evaluation"] == summary["evaluation"] == held_out
    assert page["events"][0]["kind"] == "eviction" and len(page["events"]) == 7
    assert client.get("/v1/jobs/job-nope/dashboard", headers=READ).status_code == 404


def test_a_pipeline_jobs_page_lists_its_stages_as_last_reported(
    client: TestClient, store: Store
) -> None:
    job_id = submit(client)["job_id"]
    stages = [{"stage": 0, "first_layer": 0, "last_layer": 2, "nodes": ["i-1", "i-2"]},
              {"stage": 1, "first_layer": 3, "last_layer": 6, "nodes": ["i-3"]}]  # fmt: skip
    reported = tuple(PipelineStageReport.model_validate(st) for st in stages)
    store.append_training(job_id, TrainingReport(at_s=5.0, iteration=5, stages=reported))
    assert client.get(f"/v1/jobs/{job_id}/dashboard", headers=READ).json()["pipeline"] == stages
    moved = [{**stages[0], "nodes": ["i-4"]}]
    moved_report = (PipelineStageReport.model_validate(moved[0]),)
    store.append_training(job_id, TrainingReport(at_s=9.0, iteration=9, stages=moved_report))
    assert client.get(f"/v1/jobs/{job_id}/dashboard", headers=READ).json()["pipeline"] == moved


def test_dashboard_page_and_its_assets_are_served(client: TestClient) -> None:
    page = client.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'src="static/dashboard.js"' in page.text
    for asset in ("dashboard.js", "dashboard.css"):
        assert client.get(f"/static/{asset}").status_code == 200
    assert client.get("/", follow_redirects=False).headers["location"] == "dashboard"


# --- settings and the client on its own


def test_settings_read_nested_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCHESTRATOR_API__TOKEN", "from-env")
    monkeypatch.setenv("ORCHESTRATOR_API__PORT", "9001")
    monkeypatch.setenv("ORCHESTRATOR_REDIS_URL", "redis://10.0.0.1:6379/2")
    settings = Settings.load()
    assert settings.api.port == 9001 and settings.redis_url == "redis://10.0.0.1:6379/2"
    assert settings.api.require_token().get_secret_value() == "from-env"
    assert "from-env" not in repr(settings)
    assert Settings(api=ApiSettings()).api.url == "http://127.0.0.1:8750"

    monkeypatch.setenv("ORCHESTRATOR_API__PORT", "eighty")
    with pytest.raises(UserError) as caught:
        Settings.load()
    assert caught.value.field == "ORCHESTRATOR_API__PORT"


def test_client_reports_a_non_api_answer_and_a_read_timeout() -> None:
    def html_proxy(request: httpx.Request) -> httpx.Response:
        return httpx.Response(502, text="<html>Bad Gateway</html>")

    proxy = httpx.MockTransport(html_proxy)
    with (
        ApiClient("http://api.test", transport=proxy) as c,
        pytest.raises(ApiResponseError) as caught,
    ):
        c.list_jobs()
    assert caught.value.status_code == 502 and "without the orchestrator's JSON" in str(
        caught.value
    )

    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    with (
        ApiClient("http://api.test", token="t", transport=httpx.MockTransport(slow)) as c,
        pytest.raises(UserError, match="may or may not have been applied"),
    ):
        c.submit(SPEC)


# --- a real server: ApiClient and the CLI


@pytest.fixture(scope="module")
def live_api(redis_url: str) -> Iterator[tuple[str, Store]]:
    """The API served by uvicorn on a free loopback port in a thread; stopped at the end."""
    store = RedisStore.connect(redis_url, namespace="live")
    config = uvicorn.Config(
        create_app(store, settings_for(redis_url)),
        host="127.0.0.1",
        port=free_port(),
        log_level="warning",
        lifespan="off",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                pytest.fail("uvicorn did not start", pytrace=False)
            time.sleep(0.01)
        yield f"http://127.0.0.1:{config.port}", store
    finally:
        server.should_exit = True
        thread.join(timeout=SERVER_START_TIMEOUT_S)
        store.close()
    assert not thread.is_alive(), "uvicorn did not stop"


def cli_env(api_url: str, token: str | None = TOKEN) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATOR_")}
    env["ORCHESTRATOR_API__URL"] = api_url
    if token is not None:
        env["ORCHESTRATOR_API__TOKEN"] = token
    return env


def run_cli(*args: str | Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        env=env,
    )


def assert_user_error(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit 2, `error:` and `To fix:` on stderr, no traceback; returns the flattened stderr."""
    stderr = " ".join(proc.stderr.split())
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "error:" in stderr and "To fix:" in stderr, stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in stderr, (needle, stderr)
    return stderr


def write_spec(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


GOOD_YAML = "name: resnet\nbudget_usd: 40\nwork_gpu_hours: 20\ninstance_types: [p3.2xlarge]\n"


def test_api_client_submits_gets_lists_and_cancels_on_a_live_server(
    live_api: tuple[str, Store],
) -> None:
    url, store = live_api
    with ApiClient(url, token=TOKEN) as api:
        job = api.submit(SPEC)
        assert api.get_job(job["job_id"])["state"] == "queued"
        assert job["job_id"] in [j["job_id"] for j in api.list_jobs("queued")]
        assert api.cancel(job["job_id"])["state"] == "cancelled"
        with pytest.raises(ApiResponseError) as caught:
            api.cancel(job["job_id"])
        assert caught.value.status_code == 409 and "nothing to cancel" in caught.value.message
        with pytest.raises(ApiResponseError) as invalid:
            api.submit(SPEC | {"budget_usd": 0})
        assert invalid.value.status_code == 422 and invalid.value.field == "budget_usd"
        assert api.health()["status"] == "ok"
        assert api.cost(job["job_id"])["ledger_entries"] == 0
    with ApiClient(url) as anonymous, pytest.raises(ApiResponseError) as refused:
        anonymous.submit(SPEC)
    assert refused.value.status_code == 401 and "ORCHESTRATOR_API__TOKEN" in refused.value.fix
    assert store.get_job(job["job_id"]).state is JobState.CANCELLED


def test_cli_submits_lists_shows_and_cancels_through_the_api(
    live_api: tuple[str, Store], tmp_path: Path
) -> None:
    url, store = live_api
    env = cli_env(url)
    submitted = run_cli("submit", write_spec(tmp_path, GOOD_YAML), "--budget", "55", env=env)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    assert store.get_job(job_id).budget_usd == 55.0

    listed = run_cli("jobs", "--json", "--state", "queued", env=env)
    assert job_id in [j["job_id"] for j in json.loads(listed.stdout)]
    shown = json.loads(run_cli("job", job_id, "--json", env=env).stdout)
    assert shown["state"] == "queued" and shown["cost"]["budget_usd"] == 55.0

    cancelled = run_cli("cancel", job_id, env=env)
    assert cancelled.returncode == 0 and f"{job_id}: cancelled" in cancelled.stdout
    assert_user_error(run_cli("cancel", job_id, env=env), "nothing to cancel")
    assert_user_error(run_cli("job", "job-00000000", env=env), "no job 'job-00000000'")


def _submit_and_wait(
    url: str, store: Store, tmp_path: Path, end: Callable[[str, JobRecord], None]
) -> tuple[str, int, str, str]:
    """`submit --wait` as a user runs it; `end(job_id, running)` ends the job meanwhile.
    Returns the job id, the exit code, stdout and stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "submit", str(write_spec(tmp_path, GOOD_YAML))]
        + ["--wait", "--timeout", "20"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(url),
    )
    try:
        assert proc.stdout is not None
        job_id = proc.stdout.readline().strip()
        assert job_id.startswith("job-"), proc.communicate(timeout=CLI_TIMEOUT_S)
        end(job_id, to_state(store, job_id, JobState.RUNNING))
        stdout, stderr = proc.communicate(timeout=CLI_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return job_id, proc.returncode, stdout, stderr


def test_cli_submit_wait_follows_the_job_until_it_succeeds(
    live_api: tuple[str, Store], tmp_path: Path
) -> None:
    url, store = live_api

    def succeed(job_id: str, running: JobRecord) -> None:
        store.update_progress(job_id, 20.0, now_s=3.0)
        store.transition(job_id, JobState.SUCCEEDED, expected_version=running.version, now_s=4.0)

    job_id, code, stdout, stderr = _submit_and_wait(url, store, tmp_path, succeed)
    assert code == 0, stderr
    assert f"{job_id}: succeeded" in stdout and "work 20.00 of 20 GPU-h" in stdout


def test_cli_submit_wait_of_a_job_that_fails_exits_1_saying_why(
    live_api: tuple[str, Store], tmp_path: Path
) -> None:
    """The reason a job failed (a user's traceback, a stall, no training section) is on the
    console, not only in `orchestrator job`."""
    url, store = live_api

    def fail(job_id: str, running: JobRecord) -> None:
        store.transition(job_id, JobState.FAILED, expected_version=running.version, now_s=4.0,
                         message="training failed: ValueError: [bad] lr")  # fmt: skip

    job_id, code, stdout, stderr = _submit_and_wait(url, store, tmp_path, fail)
    assert code == 1, stderr
    assert f"{job_id}: failed" in stdout
    assert f"{job_id}: training failed: ValueError: [bad] lr" in stderr  # brackets kept


def test_cli_submit_of_a_bad_spec_exits_2_naming_the_field(
    live_api: tuple[str, Store], tmp_path: Path
) -> None:
    url, store = live_api
    before = len(store.list_jobs())
    env = cli_env(url)
    bad_budget = write_spec(tmp_path, "name: resnet\nbudget_usd: 0\nwork_gpu_hours: 20\n")
    assert_user_error(run_cli("submit", bad_budget, env=env), "budget_usd", "greater than 0")
    typo = write_spec(tmp_path, GOOD_YAML.replace("p3.2xlarge", "p3.2xlarg"))
    assert_user_error(
        run_cli("submit", typo, env=env), "instance_types", "Did you mean 'p3.2xlarge'"
    )
    broken = write_spec(tmp_path, "name: [resnet\n")
    assert_user_error(run_cli("submit", broken, env=env), "not valid YAML")
    good = write_spec(tmp_path, GOOD_YAML)
    assert_user_error(run_cli("submit", good, "--budget", "0", env=env), "--budget", "budget_usd")
    assert len(store.list_jobs()) == before  # nothing reached the API


def test_cli_exits_2_when_the_api_is_unreachable(tmp_path: Path) -> None:
    nobody = f"http://127.0.0.1:{free_port()}"
    proc = run_cli("submit", write_spec(tmp_path, GOOD_YAML), env=cli_env(nobody))
    assert_user_error(proc, f"not reachable at {nobody}", "orchestrator controller start")


def test_cli_api_serve_refuses_to_start_without_a_token() -> None:
    proc = run_cli("api", "serve", env=cli_env("http://127.0.0.1:1", token=None))
    assert_user_error(proc, "needs a token", "ORCHESTRATOR_API__TOKEN")
