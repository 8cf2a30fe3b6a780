"""`LocalRedis`: a throwaway `redis-server` for the demo (free loopback port, no persistence
unless asked: the chaos soak crashes and restarts one that keeps an append-only file, as the
AWS controller's does).

The same procedure as the tests' `tests/support/redis_server.py`, in the package because the demo
needs it: start `redis-server` on a free 127.0.0.1 port with persistence off and a private
working directory, wait (bounded) for PING, and stop it by its pid (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Self

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from orchestrator.errors import UserError

log = logging.getLogger(__name__)

READY_TIMEOUT_SECONDS = 5.0  # a local redis-server answers in ~10 ms; 5 s is for a loaded box
STOP_TIMEOUT_SECONDS = 5.0  # after SIGTERM, before SIGKILL
START_ATTEMPTS = 3  # a free port can be taken between finding it and redis binding it
PING_RETRY_SECONDS = 0.02
PORT_RACE_EXIT_SECONDS = 1.0  # a server that lost its port exits within milliseconds


class RedisProcessError(UserError):
    """redis-server is missing, or did not answer PING in time (its log is in the message)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (someone may take it before you bind it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class LocalRedis:
    """A private redis-server on 127.0.0.1; `url` is valid between start and stop.

        with LocalRedis() as r:
            store = RedisStore.connect(r.url, namespace="demo")

    Nothing is persisted unless `persist` (an append-only file fsynced on every write, which
    `crash_restart` keeps); stopping the server loses its data (its directory is deleted).

    Raises (on start):
        RedisProcessError: the binary is missing ("apt-get install redis-server"), or no
            server answered PING within `READY_TIMEOUT_SECONDS` after `START_ATTEMPTS` tries.
    """

    def __init__(
        self, binary: str = "redis-server", *, host: str = "127.0.0.1", persist: bool = False
    ) -> None:
        self.binary = binary
        self.host = host
        self.persist = persist
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._workdir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        """`redis://127.0.0.1:<port>/0`.

        Raises:
            RedisProcessError: not running.
        """
        if self._proc is None:
            raise RedisProcessError("the local redis-server is not running", fix="start it first")
        return f"redis://{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> None:
        """Start the server and wait until it answers PING (see the class for `Raises`)."""
        if self._proc is not None:
            raise RedisProcessError("the local redis-server is already running")
        path = shutil.which(self.binary)
        if path is None:
            raise RedisProcessError(
                f"{self.binary} is not installed; the offline world needs a local Redis",
                fix="sudo apt-get install redis-server (or set ORCHESTRATOR_REDIS_URL to the URL "
                "of a running Redis)",
            )
        self._workdir = tempfile.TemporaryDirectory(prefix="orchestrator-redis-")
        logfile = Path(self._workdir.name) / "redis.log"
        try:
            for attempt in range(1, START_ATTEMPTS + 1):
                port = free_port(self.host)
                proc = self._spawn(path, port, logfile)
                if _wait_ready(proc, f"redis://{self.host}:{port}/0"):
                    self._proc, self.port = proc, port
                    log.info("redis-server started", extra={"port": port, "pid": proc.pid})
                    return
                # lost a race for the port? Such a server exits at once.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=PORT_RACE_EXIT_SECONDS)
                exited = proc.poll() is not None
                _stop(proc)
                if not exited or attempt == START_ATTEMPTS:
                    text = logfile.read_text(errors="replace") if logfile.exists() else "(no log)"
                    raise RedisProcessError(
                        f"redis-server on port {port} did not answer PING within "
                        f"{READY_TIMEOUT_SECONDS} s (exit code {proc.poll()}); its log:\n{text}",
                        fix="check that redis-server runs (`redis-server --version`)",
                    )
        except BaseException:
            self._cleanup_dir()
            raise

    def crash_restart(self) -> None:
        """SIGKILL the server and start it again on the same port and directory (with
        `persist`, with every acknowledged write).

        Raises:
            RedisProcessError: not running, or the new server did not answer PING in time.
        """
        if self._proc is None or self._workdir is None:
            raise RedisProcessError("the local redis-server is not running", fix="start it first")
        self._proc.kill()
        self._proc.wait()
        path = shutil.which(self.binary)
        assert path is not None  # it started once
        logfile = Path(self._workdir.name) / "redis.log"
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        while True:  # the port may linger a moment after the kill
            proc = self._spawn(path, self.port, logfile)
            if _wait_ready(proc, f"redis://{self.host}:{self.port}/0"):
                self._proc = proc
                return
            _stop(proc)
            if time.monotonic() > deadline:
                self._proc = None
                raise RedisProcessError(f"redis-server did not come back on port {self.port}")
            time.sleep(0.05)

    def _spawn(self, path: str, port: int, logfile: Path) -> subprocess.Popen[bytes]:
        assert self._workdir is not None
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.persist else [
            "--appendonly", "no"]  # fmt: skip
        argv = [
            path,
            "--port", str(port),
            "--bind", self.host,
            "--save", "",
            *persistence,
            "--dir", self._workdir.name,
            "--logfile", str(logfile),
        ]  # fmt: skip
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )

    def stop(self) -> None:
        """SIGTERM the server by pid (SIGKILL after `STOP_TIMEOUT_SECONDS`), reap it and delete
        its directory. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            _stop(proc)
            log.info("redis-server stopped", extra={"port": self.port, "pid": proc.pid})
        self._cleanup_dir()

    def _cleanup_dir(self) -> None:
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _wait_ready(proc: subprocess.Popen[bytes], url: str) -> bool:
    """True once the server answers PING and is `proc` (not another server that took the port
    first); False if it exits or the wait times out."""
    client = redis.Redis.from_url(
        url, socket_connect_timeout=0.5, socket_timeout=0.5, retry=Retry(NoBackoff(), 0)
    )
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            try:
                if client.ping():
                    return int(client.info("server")["process_id"]) == proc.pid
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                time.sleep(PING_RETRY_SECONDS)
        return False
    finally:
        client.close()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM this server (by its pid), SIGKILL it if it lingers, and reap it."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=STOP_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
