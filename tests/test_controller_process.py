"""`orchestrator controller start` as a real process: moto server, real Redis, HTTP API."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import boto3
import httpx
import pytest
from moto.server import ThreadedMotoServer

from orchestrator.api.client import ApiClient
from orchestrator.market.trace_source import bundled_prices_dir

TOKEN = "test-token-123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def moto_url() -> Iterator[str]:
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def controller_process(redis_url: str, moto_url: str) -> Iterator[tuple[str, Any]]:
    api_port = free_port()
    env = {
        **os.environ,
        "ORCHESTRATOR_REDIS_URL": redis_url,
        "ORCHESTRATOR_API__TOKEN": TOKEN,
        "ORCHESTRATOR_API__PORT": str(api_port),
        "ORCHESTRATOR_CONTROLLER_ID": "proc-test",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orchestrator",
            "controller",
            "start",
            "--endpoint-url",
            moto_url,
            "--prices",
            str(bundled_prices_dir("us-east-1")),
            "--replay-start",
            "2020-02-03T00:00:00Z",
            "--speed",
            "600",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    api = f"http://127.0.0.1:{api_port}"
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{api}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            proc.kill()
            pytest.fail(f"controller API did not come up: {proc.communicate()[0]}")
        yield api, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_controller_process_runs_a_submitted_job_and_takes_notices(controller_process, moto_url):
    api, proc = controller_process
    client = ApiClient(api, TOKEN)
    job = client.submit(
        {
            "name": "proc",
            "budget_usd": 30,
            "work_gpu_hours": 4,
            "max_gpus": 2,
            "instance_types": ["p3.2xlarge"],
        }
    )
    ec2 = boto3.client(
        "ec2",
        region_name="us-east-1",
        endpoint_url=moto_url,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )

    def running() -> list[dict]:
        out = []
        for r in ec2.describe_instances(
            Filters=[
                {"Name": "tag:orchestrator:job-id", "Values": [job["job_id"]]},
                {"Name": "instance-state-name", "Values": ["pending", "running"]},
            ]
        )["Reservations"]:
            out.extend(r["Instances"])
        return out

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len(running()) < 3:
        time.sleep(0.2)
    instances = running()
    assert len(instances) == 3  # one reliable node and two p3.2xlarge
    assert client.get_job(job["job_id"])["state"] == "running"

    spot = next(i for i in instances if i.get("InstanceLifecycle") == "spot")
    event = {
        "version": "0",
        "id": "e-1",
        "detail-type": "EC2 Spot Instance Interruption Warning",
        "source": "aws.ec2",
        "account": "123456789012",
        "time": "2020-02-03T00:10:00Z",
        "region": "us-east-1",
        "resources": [],
        "detail": {"instance-id": spot["InstanceId"], "instance-action": "terminate"},
    }
    reply = httpx.post(
        f"{api}/v1/notices", json=event, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5
    )
    assert reply.status_code == 202
    deadline = time.monotonic() + 10
    kinds: list[str] = []
    while time.monotonic() < deadline and "notice" not in kinds:
        kinds = [e["kind"] for e in client.events(job["job_id"])["events"]]
        time.sleep(0.2)
    assert "notice" in kinds
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) is not None
