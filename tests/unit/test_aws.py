"""`orchestrator.aws`: every boto3 client the orchestrator makes retries the same way."""

from __future__ import annotations

import pytest
from botocore.config import Config

from orchestrator.aws import RETRY_MAX_ATTEMPTS, aws_client
from orchestrator.cloud.ec2 import EC2Cloud
from orchestrator.controller.wiring import ec2_client
from orchestrator.settings import ControllerSettings, Settings


@pytest.fixture(autouse=True)
def _fake_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)


def retries_of(client: object) -> dict:
    return client.meta.config.retries  # type: ignore[attr-defined]


def test_clients_retry_adaptively_with_the_documented_budget() -> None:
    for client in (
        aws_client("ec2", "us-east-1"),
        aws_client("secretsmanager", "us-east-2"),
        EC2Cloud("us-east-1", "ctl").client,
    ):
        assert retries_of(client)["mode"] == "adaptive"
        assert retries_of(client)["total_max_attempts"] == RETRY_MAX_ATTEMPTS + 1


def test_the_controllers_client_keeps_the_policy_and_takes_the_endpoint() -> None:
    settings = Settings(controller=ControllerSettings(endpoint_url="http://127.0.0.1:5000"))
    client = ec2_client(settings)
    assert client.meta.endpoint_url == "http://127.0.0.1:5000"
    assert retries_of(client)["mode"] == "adaptive"


def test_a_given_config_is_merged_over_the_policy() -> None:
    client = aws_client("ec2", "us-east-1", config=Config(connect_timeout=5))
    assert client.meta.config.connect_timeout == 5
    assert retries_of(client)["mode"] == "adaptive"


@pytest.mark.parametrize(
    ("value", "total"),
    [("2", 2), (" 1 ", 1), ("20", 20), ("0", None), ("21", None), ("-3", None), ("x", None)],
)
def test_aws_max_attempts_replaces_the_budget_only_when_it_is_a_sane_count(
    monkeypatch: pytest.MonkeyPatch, value: str, total: int | None
) -> None:
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", value)
    client = aws_client("ec2", "us-east-1")
    assert retries_of(client)["mode"] == "adaptive"
    assert retries_of(client)["total_max_attempts"] == (total or RETRY_MAX_ATTEMPTS + 1)
