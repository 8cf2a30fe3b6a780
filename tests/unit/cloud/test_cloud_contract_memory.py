"""The `Cloud` contract on `InMemoryCloud` (tests/support/cloud_contract.py), and what only the
fake does (its hooks)."""

from __future__ import annotations

import pytest
from support.cloud_contract import REGION, CloudContract, spec

from orchestrator.cloud.errors import CapacityError, ThrottledError
from orchestrator.cloud.memory import InMemoryCloud, InMemoryEC2


class _Hooks:
    def __init__(self, ec2: InMemoryEC2) -> None:
        self.ec2 = ec2

    def refuse_launches(self, code: str) -> None:
        self.ec2.refuse_launches(code)

    def reclaim(self, instance_id: str) -> None:
        self.ec2.reclaim(instance_id)


@pytest.fixture
def ec2() -> InMemoryEC2:
    return InMemoryEC2(clock=lambda: 1_580_688_000.0)


@pytest.fixture
def cloud(ec2: InMemoryEC2) -> InMemoryCloud:
    return InMemoryCloud(REGION, "ctl", ec2=ec2)


@pytest.fixture
def other_cloud(ec2: InMemoryEC2) -> InMemoryCloud:
    return InMemoryCloud(REGION, "ctl-2", ec2=ec2)


@pytest.fixture
def zone() -> str:
    return "us-east-1a"


@pytest.fixture
def hooks(ec2: InMemoryEC2) -> _Hooks:
    return _Hooks(ec2)


class TestInMemoryCloud(CloudContract):
    """The contract on the fake."""


def test_a_refusal_can_be_for_one_market_and_lifted(cloud: InMemoryCloud, ec2: InMemoryEC2) -> None:
    ec2.refuse_launches("InsufficientInstanceCapacity", spec("us-east-1a").market)
    cloud.launch(spec("us-east-1b"))  # another zone: fine
    with pytest.raises(CapacityError):
        cloud.launch(spec("us-east-1a", allocation_id="alloc-2"))
    ec2.allow_launches(spec("us-east-1a").market)
    assert len(cloud.launch(spec("us-east-1a", allocation_id="alloc-2"))) == 2


def test_throttled_calls_fail_then_succeed(cloud: InMemoryCloud, ec2: InMemoryEC2) -> None:
    ec2.throttle(1)
    with pytest.raises(ThrottledError):
        cloud.describe()
    assert cloud.describe() == []


def test_a_zone_without_a_worker_subnet_is_a_capacity_error(ec2: InMemoryEC2) -> None:
    cloud = InMemoryCloud(REGION, "ctl", ec2=ec2, worker_zones={"us-east-1a"})
    with pytest.raises(CapacityError) as refused:
        cloud.launch(spec("us-east-1b"))
    assert refused.value.code == "NoWorkerSubnetInZone"


def test_launch_time_comes_from_the_injected_clock(cloud: InMemoryCloud) -> None:
    [inst, _] = cloud.launch(spec("us-east-1a"))
    assert inst.launched_at.timestamp() == 1_580_688_000.0
