"""The scheduled controller service: periodic ticks, ticks on notices, no crash loop."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from test_controller import T0, controller, submit

from orchestrator.cloud.notices import InterruptionNotice
from orchestrator.controller.service import ControllerService
from orchestrator.store.models import JobState


def wait_for(predicate: Any, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.fixture
def service_factory(store, ec2, prices) -> Iterator[Any]:
    started: list[ControllerService] = []

    def make(speed: float = 1.0, clock: Any = None) -> ControllerService:
        m0 = time.monotonic()
        svc = ControllerService(
            controller(store, ec2, prices),
            clock=clock or (lambda: T0 + speed * (time.monotonic() - m0)),
            speed=speed,
        )
        started.append(svc)
        return svc

    yield make
    for svc in started:
        svc.stop()


def test_the_service_ticks_at_start_and_then_every_interval(store, service_factory):
    submit(store)
    svc = service_factory(speed=1200.0)  # 120 s of sim time every 0.1 s
    svc.start()
    assert wait_for(lambda: svc.ticks >= 3, timeout_s=5.0)
    assert store.get_job("job-1").state is JobState.RUNNING


def test_a_notice_triggers_a_tick_at_once(store, service_factory):
    submit(store)
    svc = service_factory(speed=1.0)  # the next scheduled tick is two minutes away
    svc.start()
    assert wait_for(lambda: svc.ticks == 1)
    instance_id = store.list_instances("job-1", alive_only=True)[-1].instance_id
    sent = time.monotonic()
    svc.notify(
        InterruptionNotice(
            instance_id=instance_id,
            kind="interruption",
            action="terminate",
            notice_time=datetime.now(UTC),
            received_at_s=T0,
        )
    )
    assert wait_for(lambda: svc.ticks == 2, timeout_s=5.0)
    assert time.monotonic() - sent < 5.0  # the product's bound for notice -> re-plan
    kinds = [e.kind for _, e in store.events("job-1")]
    assert "notice" in kinds


def test_a_failing_tick_is_counted_and_the_service_keeps_going(store, service_factory):
    submit(store)
    calls = {"n": 0}

    def flaky_clock() -> float:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("clock glitch")
        return T0 + calls["n"] * 120.0

    svc = service_factory(speed=1200.0, clock=flaky_clock)
    svc.start()
    assert wait_for(lambda: svc.ticks >= 2, timeout_s=5.0)
    assert svc.failures == 1


def test_ticks_failing_in_a_row_make_the_api_degraded_and_counted(store, service_factory):
    """/healthz tells the truth: three failed ticks in a row and it is 503 "degraded" with the
    last error; /metrics counts ticks and failures; one tick that works makes it ok again."""
    from fastapi.testclient import TestClient
    from pydantic import SecretStr

    from orchestrator.api.app import create_app
    from orchestrator.settings import ApiSettings, Settings

    submit(store)
    failing = {"on": True}

    def clock() -> float:
        if failing["on"]:
            raise RuntimeError("EC2 unreachable")
        return T0 + 120.0

    svc = service_factory(clock=clock)
    settings = Settings(api=ApiSettings(token=SecretStr("t")))
    client = TestClient(create_app(store, settings, clock=lambda: T0, tick_health=svc.health))
    for _ in range(2):
        svc.tick_once()
    assert client.get("/healthz").status_code == 200  # two failures: not yet
    svc.tick_once()
    health = client.get("/healthz")
    assert health.status_code == 503, health.text
    assert health.json()["status"] == "degraded"
    assert "3 controller ticks failed in a row: RuntimeError: EC2 unreachable" in health.text
    metrics = client.get("/metrics", headers={"Authorization": "Bearer t"}).text
    assert "orchestrator_controller_tick_failures_total 3.0" in metrics
    failing["on"] = False
    svc.tick_once()
    assert client.get("/healthz").json()["status"] == "ok"
    metrics = client.get("/metrics", headers={"Authorization": "Bearer t"}).text
    assert "orchestrator_controller_ticks_total 1.0" in metrics


def test_a_notice_during_a_tick_ticks_again_after_it_not_beside_it(store, service_factory):
    """A notice that comes while a tick runs asks for the next tick right after it (no
    scheduler warning about a run skipped for the one running)."""
    submit(store)
    svc = service_factory(speed=1.0)
    svc.start()
    assert wait_for(lambda: svc.ticks == 1)
    notice = InterruptionNotice(instance_id="i-none", kind="rebalance", action=None,
                                notice_time=datetime.now(UTC), received_at_s=T0)  # fmt: skip
    tick = svc.controller.tick

    def slow_tick(now_s: float) -> Any:
        time.sleep(0.5)
        return tick(now_s)

    svc.controller.tick = slow_tick  # type: ignore[method-assign]
    running = threading.Thread(target=svc.tick_once)
    running.start()
    assert wait_for(svc._lock.locked)
    svc.notify(notice)  # during the tick
    running.join()
    assert wait_for(lambda: svc.ticks == 3, timeout_s=5.0)  # and one right after it
