"""The `Cloud` contract (tests/support/cloud_contract.py) on `EC2Cloud` against moto."""

from __future__ import annotations

from typing import Any

import pytest
from botocore.exceptions import ClientError
from support.cloud_contract import ITYPE, REGION, CloudContract

from orchestrator.cloud.ec2 import EC2Cloud


class _Hooks:
    def __init__(self, client: Any) -> None:
        self.client = client

    def refuse_launches(self, code: str) -> None:
        def refuse(**_: Any) -> None:
            error = {"Error": {"Code": code, "Message": f"injected {code}"}}
            raise ClientError(error, "RunInstances")  # type: ignore[arg-type]

        self.client.meta.events.register("before-call.ec2.RunInstances", refuse)

    def reclaim(self, instance_id: str) -> None:
        self.client.terminate_instances(InstanceIds=[instance_id])


@pytest.fixture
def client(ec2: Any) -> Any:
    """moto's EC2 (the `ec2` fixture of tests/conftest.py)."""
    return ec2


@pytest.fixture
def cloud(client: Any) -> EC2Cloud:
    return EC2Cloud(REGION, "ctl", client=client)


@pytest.fixture
def other_cloud(client: Any) -> EC2Cloud:
    return EC2Cloud(REGION, "ctl-2", client=client)


@pytest.fixture
def zone(client: Any) -> str:
    offerings = client.describe_instance_type_offerings(
        LocationType="availability-zone",
        Filters=[{"Name": "instance-type", "Values": [ITYPE]}],
    )["InstanceTypeOfferings"]
    return sorted(o["Location"] for o in offerings)[0]


@pytest.fixture
def hooks(client: Any) -> _Hooks:
    return _Hooks(client)


class TestEC2Cloud(CloudContract):
    """The contract on EC2 (moto)."""
