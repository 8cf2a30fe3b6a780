"""A throwaway `redis-server` for tests, via the package's `LocalRedis` (free loopback port,
no persistence, stopped by pid).

Import it from a test module (`from support.redis_server import start_redis`): pytest's default
`prepend` import mode puts `tests/` (which has no `__init__.py`) on `sys.path`.

A missing `redis-server` is a failure, not a skip: CI installs it (`.ci/run`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from orchestrator.cloud.local.redis_process import LocalRedis, RedisProcessError, free_port

__all__ = ["RedisServerError", "free_port", "start_redis"]

RedisServerError = RedisProcessError


@contextmanager
def start_redis(binary: str = "redis-server") -> Iterator[str]:
    """Run a redis-server on a free loopback port; yield its URL; stop it on exit.

    Raises:
        RedisServerError: the binary is missing ("apt-get install redis-server"), or no server
            answered PING in time (its log is in the message).
    """
    with LocalRedis(binary) as server:
        yield server.url
