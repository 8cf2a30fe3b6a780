"""One controller per fleet, as real processes: two `controller start` of one id on one Redis
and moto; the second stands by (its /healthz says so) and takes the fleet over when the first
is SIGKILLed, adopting its instances (none bought twice); a controller of another id is refused
the store with one line, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
from support.redis_server import free_port
from test_controller_process import TOKEN, describe, moto_ec2, moto_url, start_controller, stop

from orchestrator.api.client import ApiClient
from orchestrator.market.trace_source import bundled_prices_dir

__all__ = ["moto_url"]  # the fixture, used by name
SPEED = 60.0  # a decision every 120 / 60 = 2 real seconds
INTERVAL_S = 120.0 / SPEED


def _status(port: int) -> str:
    try:
        return str(httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).json()["status"])
    except (httpx.HTTPError, ValueError):
        return "down"


def _until(what: str, check, timeout_s: float = 60.0) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if check():
            return time.monotonic() - start
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def _running(moto_url: str) -> set[str]:
    ec2 = moto_ec2(moto_url)
    return {
        i["InstanceId"]
        for i in describe(ec2, {"Name": "tag:orchestrator:controller-id", "Values": ["proc-test"]})
        if i["State"]["Name"] in ("pending", "running")
    }


def test_a_standby_takes_the_fleet_over_when_the_leader_dies(store, redis_url, moto_url):
    a_port, b_port = free_port(), free_port()
    a = start_controller(redis_url, moto_url, a_port, speed=SPEED)
    b = None
    try:
        ApiClient(f"http://127.0.0.1:{a_port}", TOKEN).submit({
            "name": "lease", "budget_usd": 200, "work_gpu_hours": 400, "max_gpus": 2,
            "instance_types": ["p3.2xlarge"]})  # fmt: skip
        _until("the job's instances", lambda: len(_running(moto_url)) >= 2)
        b = start_controller(redis_url, moto_url, b_port, speed=SPEED)
        _until("the second controller to stand by", lambda: _status(b_port) == "standby")
        assert _status(a_port) == "ok"
        time.sleep(2 * INTERVAL_S)  # the standby touches nothing
        before = _running(moto_url)
        a.kill()  # SIGKILL: no clean hand-over, the lease has to lapse
        a.wait()
        took = _until("the standby to take over", lambda: _status(b_port) == "ok", 30.0)
        print(f"takeover: {took:.2f} s = {took / INTERVAL_S:.2f} decision intervals")
        assert took <= 4 * INTERVAL_S  # the lease lives 1.5 intervals; a busy machine's slack
        time.sleep(2 * INTERVAL_S)  # the new leader ticks: it adopts, it does not buy again
        after = _running(moto_url)
        assert before <= after and len(after) <= len(before) + 1, (before, after)
    finally:
        stop(a)
        if b is not None:
            stop(b)


def test_a_controller_of_another_id_is_refused_the_store(store, redis_url, moto_url):
    a = start_controller(redis_url, moto_url, free_port())
    try:
        other = subprocess.run(
            [sys.executable, "-m", "orchestrator", "controller", "start", "--endpoint-url",
             moto_url, "--prices", str(bundled_prices_dir("us-east-1")), "--replay-start",
             "2020-02-03T00:00:00Z"],
            env={**os.environ, "ORCHESTRATOR_REDIS_URL": redis_url,
                 "ORCHESTRATOR_API__TOKEN": TOKEN, "ORCHESTRATOR_CONTROLLER_ID": "other",
                 "ORCHESTRATOR_API__PORT": str(free_port())},
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        stop(a)
    assert other.returncode == 2, other.stderr
    assert "fleet of controller 'proc-test', not 'other'" in other.stderr
    assert "Traceback" not in other.stderr
