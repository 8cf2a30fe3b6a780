"""A throwaway `redis-server` for tests: free loopback port, no persistence, stopped by pid.

Import it from a test module (`from redis_server import start_redis`): pytest's default
`prepend` import mode puts `tests/` (which has no `__init__.py`) on `sys.path`.

A missing `redis-server` is a failure, not a skip: CI installs it (`.ci/run`).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

READY_TIMEOUT_S = 5.0  # a local redis-server answers in ~10 ms; 5 s is for a loaded CI box
STOP_TIMEOUT_S = 5.0  # after SIGTERM, before SIGKILL
START_ATTEMPTS = 3  # a free port can be taken between finding it and redis binding it

INSTALL_HINT = (
    "redis-server is not installed; the store tests need it. "
    "To fix: sudo apt-get install redis-server"
)


class RedisServerError(RuntimeError):
    """redis-server is missing, or did not start."""


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def start_redis(binary: str = "redis-server") -> Iterator[str]:
    """Run a redis-server on a free loopback port; yield its URL; stop it on exit.

    Raises:
        RedisServerError: the binary is missing, or no server answered PING within
            `READY_TIMEOUT_S` (its log is in the message).
    """
    path = shutil.which(binary)
    if path is None:
        raise RedisServerError(INSTALL_HINT)
    with tempfile.TemporaryDirectory(prefix="redis-test-") as workdir:
        log = Path(workdir) / "redis.log"
        for attempt in range(1, START_ATTEMPTS + 1):
            port = free_port()
            proc = subprocess.Popen(
                [
                    path,
                    "--port",
                    str(port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    workdir,
                    "--logfile",
                    str(log),
                ],  # fmt: skip
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
            try:
                url = f"redis://127.0.0.1:{port}/0"
                if _wait_ready(proc, url):
                    yield url
                    return
                if proc.poll() is None or attempt == START_ATTEMPTS:
                    text = log.read_text(errors="replace") if log.exists() else "(no log)"
                    raise RedisServerError(
                        f"redis-server on port {port} did not answer PING within "
                        f"{READY_TIMEOUT_S} s (exit code {proc.poll()}); its log:\n{text}"
                    )
            finally:
                _stop(proc)


def _wait_ready(proc: subprocess.Popen[bytes], url: str) -> bool:
    """True once the server answers PING; False if it exits or the wait times out."""
    client = redis.Redis.from_url(
        url, socket_connect_timeout=0.5, socket_timeout=0.5, retry=Retry(NoBackoff(), 0)
    )
    deadline = time.monotonic() + READY_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            try:
                if client.ping():
                    return True
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                time.sleep(0.02)
        return False
    finally:
        client.close()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM this server (by its pid), SIGKILL it if it lingers, and reap it."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
