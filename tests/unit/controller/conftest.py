"""The controller's unit tests: a controller on MemoryStore and InMemoryCloud over the bundled
us-east-1 prices (`test_controller_tick` has the helpers that build and feed one)."""

from __future__ import annotations

import pytest

from orchestrator.cloud.memory import InMemoryEC2
from orchestrator.market.prices import to_epoch_seconds
from orchestrator.market.trace_source import TracePriceSource, bundled_prices_dir
from orchestrator.store import MemoryStore

T0 = to_epoch_seconds("2020-02-03T00:00:00Z")
REGION = "us-east-1"


@pytest.fixture(scope="module")
def prices() -> TracePriceSource:
    return TracePriceSource([bundled_prices_dir(REGION)])


@pytest.fixture
def ec2() -> InMemoryEC2:
    return InMemoryEC2(clock=lambda: T0)


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore()
