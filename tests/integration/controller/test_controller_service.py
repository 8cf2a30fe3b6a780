"""The scheduled controller service: periodic ticks, ticks on notices, no crash loop."""

from __future__ import annotations

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
