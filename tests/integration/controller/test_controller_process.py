"""`orchestrator controller start` as a real process: moto server, real Redis, HTTP API."""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import httpx
import pytest
from moto.server import ThreadedMotoServer
from support.redis_server import free_port

from orchestrator.api.client import ApiClient
from orchestrator.errors import UserError
from orchestrator.market.trace_source import bundled_prices_dir
from orchestrator.store.protocol import Store

TOKEN = "test-token-123"


@pytest.fixture
def moto_url() -> Iterator[str]:
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


def start_controller(
    redis_url: str,
    moto_url: str,
    api_port: int,
    extra_env: dict[str, str] | None = None,
    ca_cert: Path | None = None,
    speed: float = 600.0,
) -> subprocess.Popen:
    """`orchestrator controller start` on the moto server, replaying prices `speed` times
    faster than real time; with `ca_cert`, its API is reached over HTTPS trusting that
    certificate (once it exists). `extra_env` wins over the defaults."""
    env = {
        **os.environ,
        "ORCHESTRATOR_REDIS_URL": redis_url,
        "ORCHESTRATOR_API__TOKEN": TOKEN,
        "ORCHESTRATOR_API__PORT": str(api_port),
        "ORCHESTRATOR_CONTROLLER_ID": "proc-test",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        **(extra_env or {}),
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
            f"{speed:g}",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    api = f"{'https' if ca_cert else 'http'}://127.0.0.1:{api_port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            verify = ssl.create_default_context(cafile=ca_cert) if ca_cert else True
            if httpx.get(f"{api}/healthz", timeout=1, verify=verify).status_code == 200:
                return proc
        except (httpx.HTTPError, OSError):  # OSError: the certificate is not there yet
            time.sleep(0.2)
    proc.kill()
    pytest.fail(f"controller API did not come up: {proc.communicate()[0]}")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it does not stop within 10 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def moto_ec2(moto_url: str):  # type: ignore[no-untyped-def]
    """A boto3 EC2 client on the moto server."""
    return boto3.client(
        "ec2",
        region_name="us-east-1",
        endpoint_url=moto_url,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


def describe(ec2, *filters: dict) -> list[dict]:  # type: ignore[no-untyped-def]
    """Every instance matching `filters`, across reservations."""
    out: list[dict] = []
    for r in ec2.describe_instances(Filters=list(filters))["Reservations"]:
        out.extend(r["Instances"])
    return out


@pytest.fixture
def controller_process(
    store: Store, redis_url: str, moto_url: str
) -> Iterator[tuple[str, subprocess.Popen]]:
    api_port = free_port()
    proc = start_controller(redis_url, moto_url, api_port)
    try:
        yield f"http://127.0.0.1:{api_port}", proc
    finally:
        stop(proc)


def test_controller_process_runs_a_submitted_job_and_takes_notices(
    store, controller_process, moto_url
):
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
    ec2 = moto_ec2(moto_url)

    def running() -> list[dict]:
        return describe(
            ec2,
            {"Name": "tag:orchestrator:job-id", "Values": [job["job_id"]]},
            {"Name": "instance-state-name", "Values": ["pending", "running"]},
        )

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


def test_a_self_signed_controller_serves_https_with_the_certificate_it_publishes(
    store, redis_url, moto_url, tmp_path
):
    """As the AWS stack runs it (`api.tls_self_signed`): the certificate is made at the
    first start, published to the artifact store, trusted by a client given it, and kept
    across a restart."""
    api_port = free_port()
    artifacts = tmp_path / "artifacts"
    env = {"ORCHESTRATOR_API__TLS_SELF_SIGNED": "true", "HOME": str(tmp_path / "home"),
           "ORCHESTRATOR_TRAINING__ARTIFACTS_DIR": str(artifacts)}  # fmt: skip
    published = artifacts / "tls" / "api-cert.pem"
    api = f"https://127.0.0.1:{api_port}"
    proc = start_controller(redis_url, moto_url, api_port, env, ca_cert=published)
    try:
        with ApiClient(api, TOKEN, ca_cert=published) as client:
            job_id = client.submit({"name": "tls", "budget_usd": 1, "work_gpu_hours": 1})["job_id"]
        with ApiClient(api, TOKEN) as untrusting, pytest.raises(UserError) as refused:
            untrusting.list_jobs()
        assert refused.value.field == "ORCHESTRATOR_API__CA_CERT"
        key = tmp_path / "home" / ".local" / "share" / "orchestrator" / "tls" / "api-key.pem"
        assert key.stat().st_mode & 0o077 == 0  # the key: its user's only
        first = published.read_bytes()
    finally:
        stop(proc)
    proc = start_controller(redis_url, moto_url, api_port, env, ca_cert=published)
    try:
        assert published.read_bytes() == first  # kept: clients trusting it still do
        with ApiClient(api, TOKEN, ca_cert=published) as client:
            assert client.get_job(job_id)["job_id"] == job_id
    finally:
        stop(proc)


@pytest.mark.slow
def test_sigkill_mid_acquisition_then_restart_launches_nothing_twice(store, redis_url, moto_url):
    # `store` flushes Redis: only this test's job exists
    api_port = free_port()
    proc = start_controller(redis_url, moto_url, api_port)
    api = f"http://127.0.0.1:{api_port}"
    ec2 = moto_ec2(moto_url)

    def ours() -> list[dict]:
        return describe(ec2, {"Name": "tag:orchestrator:controller-id", "Values": ["proc-test"]})

    try:
        client = ApiClient(api, TOKEN)
        job = client.submit(
            {
                "name": "crash",
                "budget_usd": 30,
                "work_gpu_hours": 4,
                "max_gpus": 2,
                "instance_types": ["p3.2xlarge"],
            }
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not ours():
            time.sleep(0.01)
        proc.kill()  # SIGKILL as soon as the first launch is visible
        proc.wait(timeout=10)
        proc = start_controller(redis_url, moto_url, api_port)
        time.sleep(3.0)  # about 15 ticks at 600x
        live = [i for i in ours() if i["State"]["Name"] in ("pending", "running")]
        assert len(live) == 3  # one reliable node and two p3.2xlarge: nothing launched twice
        allocations = [
            next(t["Value"] for t in i["Tags"] if t["Key"] == "orchestrator:allocation-id")
            for i in live
        ]
        assert len(set(allocations)) <= len(allocations)
        cost = ApiClient(api, TOKEN).cost(job["job_id"])
        assert cost["billed_usd"] == 0  # nothing ended, so nothing billed twice or lost
        assert cost["spent_usd"] > 0  # but the three running instances' cost shows, live
        assert ApiClient(api, TOKEN).get_job(job["job_id"])["state"] == "running"
    finally:
        stop(proc)
