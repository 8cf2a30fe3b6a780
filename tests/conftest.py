"""Fixtures shared by the controller tests: a real Redis, moto EC2, the bundled prices."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
import pytest
import redis
from moto import mock_aws
from support.agileml_jobs import jobs  # noqa: F401  (the fixture, for the AgileML runtime tests)
from support.redis_server import RedisServerError, start_redis

from orchestrator.market.trace_source import TracePriceSource, bundled_prices_dir
from orchestrator.store.redis_store import RedisStore

REGION = "us-east-1"
STORE_NAMESPACE = "ctltest"


@pytest.fixture(autouse=True, scope="session")
def _no_local_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The job CLI reaches the world `orchestrator local up` saved: never a developer's own
    (a test that starts one sets its own folder)."""
    import os

    from orchestrator.cli.local import LOCAL_DIR_ENV

    saved = os.environ.get(LOCAL_DIR_ENV)
    os.environ[LOCAL_DIR_ENV] = str(tmp_path_factory.mktemp("local-world"))
    yield
    if saved is None:
        os.environ.pop(LOCAL_DIR_ENV, None)
    else:
        os.environ[LOCAL_DIR_ENV] = saved


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """A fresh redis-server per test module. A missing one fails the tests (CI installs it)."""
    try:
        with start_redis() as url:
            yield url
            return
    except RedisServerError as exc:
        failure = str(exc)
    pytest.fail(failure, pytrace=False)  # outside `except`: no chained traceback


@pytest.fixture
def store(redis_url: str) -> Iterator[RedisStore]:
    redis.Redis.from_url(redis_url).flushdb()
    s = RedisStore.connect(redis_url, namespace=STORE_NAMESPACE)
    yield s
    s.close()


@pytest.fixture
def ec2(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
        "MOTO_EC2_LOAD_DEFAULT_AMIS": "false",
    }.items():
        monkeypatch.setenv(name, value)
    with mock_aws():
        yield boto3.client("ec2", region_name=REGION)


@pytest.fixture(scope="module")
def prices() -> TracePriceSource:
    return TracePriceSource([bundled_prices_dir(REGION)])
