"""`MetadataMock`: a local IMDSv2 for one instance of the offline world, on 127.0.0.1.

It serves the wire of `cloud.imds_wire` (tokens, instance id, address, instance tags) and the
notices the eviction replayer schedules on it, so that an instance agent reads who it is and
hears its two-minute warning exactly as on EC2.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Self

from orchestrator.cloud.errors import LifecycleError
from orchestrator.cloud.imds_wire import (
    INSTANCE_ID_PATH,
    INSTANCE_TAG_PATH,
    LOCAL_IPV4_PATH,
    MAX_TOKEN_TTL_SECONDS,
    MIN_TOKEN_TTL_SECONDS,
    REBALANCE_PATH,
    SPOT_ACTION_PATH,
    TOKEN_HEADER,
    TOKEN_PATH,
    TOKEN_TTL_HEADER,
    iso_z,
)
from orchestrator.cloud.notices import SPOT_ACTIONS, SpotAction

logger = logging.getLogger(__name__)


class MockState(StrEnum):
    """Lifecycle of a `MetadataMock`.

    CREATED --start()--> RUNNING --stop()--> STOPPED --start()--> RUNNING (same port).
    """

    CREATED = "created"
    RUNNING = "running"
    STOPPED = "stopped"


_MOCK_TRANSITIONS: dict[MockState, frozenset[MockState]] = {
    MockState.CREATED: frozenset({MockState.RUNNING}),  # start(): bind a free port, serve
    MockState.RUNNING: frozenset({MockState.STOPPED}),  # stop(): close the port, forget tokens
    MockState.STOPPED: frozenset({MockState.RUNNING}),  # start() again: rebind the same port
}


@dataclass(frozen=True, slots=True)
class _Reply:
    status: int
    body: bytes = b""
    content_type: str = "text/plain"
    headers: tuple[tuple[str, str], ...] = ()


class _MockServer(ThreadingHTTPServer):
    # Handler threads are joined by server_close(), so stop() leaves no thread behind; a client
    # that stalls mid-request holds stop() up for at most _MockHandler.timeout.
    daemon_threads = False
    block_on_close = True

    def __init__(self, address: tuple[str, int], mock: MetadataMock) -> None:
        self.mock = mock
        super().__init__(address, _MockHandler)


class _MockHandler(BaseHTTPRequestHandler):
    """The wire layer only: parse the request, ask the mock, render its reply."""

    server: _MockServer
    server_version = "EC2ws"
    timeout = 2.0  # seconds a connection may stall before the handler gives up on it

    def do_PUT(self) -> None:
        self._send(self.server.mock._serve_put(self._path(), self.headers.get(TOKEN_TTL_HEADER)))

    def do_GET(self) -> None:
        self._send(self.server.mock._serve_get(self._path(), self.headers.get(TOKEN_HEADER)))

    def _path(self) -> str:
        return self.path.split("?", 1)[0]

    def _send(self, reply: _Reply) -> None:
        try:
            self.send_response(reply.status)
            self.send_header("Content-Type", reply.content_type)
            self.send_header("Content-Length", str(len(reply.body)))
            for name, value in reply.headers:
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(reply.body)
        except (BrokenPipeError, ConnectionResetError):
            # the client gave up (an agent stopping mid-poll): nothing to answer
            logger.debug("imds mock: client went away before the answer")

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("imds mock: " + format, *args)


class MetadataMock:
    """A local IMDSv2 for one instance, on 127.0.0.1, serving the paths in the module docstring.

    Tokens are random, expire after the TTL asked for (measured on `clock`), and are forgotten
    when the mock stops. A notice is served from the moment it is set until `clear()`: the caller
    (the offline world) decides when the two-minute warning begins. All methods are thread-safe.

        with MetadataMock("i-0abc") as mock:
            watcher = NoticeWatcher(mock.base_url, on_notice=print)
            mock.schedule_interruption(at=datetime.now(UTC) + timedelta(minutes=2))
    """

    def __init__(
        self,
        instance_id: str = "i-0123456789abcdef0",
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        clock: Callable[[], float] = time.monotonic,
        tags: Mapping[str, str] | None = None,
        local_ipv4: str = "127.0.0.1",
    ) -> None:
        self.instance_id = instance_id
        self.tags = dict(tags or {})
        self.local_ipv4 = local_ipv4
        self._host = host
        self._port = port
        self._clock = clock
        self._lock = threading.Lock()  # guards the served data below; handlers take it briefly
        self._life_lock = threading.Lock()  # guards start/stop (never held by handlers)
        self._state = MockState.CREATED
        self._server: _MockServer | None = None
        self._thread: threading.Thread | None = None
        self._tokens: dict[str, float] = {}  # token -> expiry on `clock`
        self._interruption: tuple[SpotAction, datetime] | None = None
        self._rebalance_at: datetime | None = None
        self._requests: Counter[tuple[str, str, int]] = Counter()

    # -- lifecycle --

    @property
    def state(self) -> MockState:
        return self._state

    @property
    def port(self) -> int:
        """The bound port (0 until the first `start()`)."""
        return self._port

    @property
    def base_url(self) -> str:
        """`http://127.0.0.1:<port>`, to pass to `NoticeWatcher`.

        Raises:
            LifecycleError: the mock has not been started yet, so it has no port.
        """
        if self._port == 0:
            raise LifecycleError(type(self).__name__, self._state, MockState.RUNNING)
        return f"http://{self._host}:{self._port}"

    def start(self) -> None:
        """Bind the port (a free one the first time, the same one after a stop) and serve.

        Raises:
            LifecycleError: already running.
            OSError: the port cannot be bound (e.g. taken by someone else since the stop).
        """
        with self._life_lock:
            self._move(MockState.RUNNING)
            server = _MockServer((self._host, self._port), self)
            self._port = server.server_address[1]
            self._server = server
            self._thread = threading.Thread(
                target=server.serve_forever,
                kwargs={"poll_interval": 0.05},
                name=f"imds-mock-{self.instance_id}",
                daemon=True,
            )
            self._thread.start()
            self._state = MockState.RUNNING

    def stop(self) -> None:
        """Close the port and forget all tokens; notices are kept. A no-op unless running."""
        with self._life_lock:
            if self._state is not MockState.RUNNING:
                return
            assert self._server is not None and self._thread is not None
            self._server.shutdown()
            self._server.server_close()
            self._thread.join()
            self._server = self._thread = None
            with self._lock:
                self._tokens.clear()
            self._state = MockState.STOPPED

    def _move(self, to: MockState) -> None:
        if to not in _MOCK_TRANSITIONS[self._state]:
            raise LifecycleError(type(self).__name__, self._state, to)

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

    # -- what is served --

    def schedule_interruption(self, action: SpotAction = "terminate", *, at: datetime) -> None:
        """Serve `{"action": action, "time": at}` at the instance-action path from now on.

        Raises:
            ValueError: `action` is not terminate/stop/hibernate, or `at` has no time zone.
        """
        if action not in SPOT_ACTIONS:
            raise ValueError(f"action must be one of {SPOT_ACTIONS}, got {action!r}")
        iso_z(at)
        with self._lock:
            self._interruption = (action, at)

    def recommend_rebalance(self, at: datetime) -> None:
        """Serve `{"noticeTime": at}` at the rebalance path from now on.

        Raises:
            ValueError: `at` has no time zone.
        """
        iso_z(at)
        with self._lock:
            self._rebalance_at = at

    def clear(self) -> None:
        """Withdraw both notices (both paths answer 404 again)."""
        with self._lock:
            self._interruption = None
            self._rebalance_at = None

    def revoke_tokens(self) -> None:
        """Invalidate every token issued so far (the next GET with one gets 401)."""
        with self._lock:
            self._tokens.clear()

    def request_count(
        self, method: str | None = None, path: str | None = None, status: int | None = None
    ) -> int:
        """How many requests matched (None matches anything), since the mock was created."""
        with self._lock:
            return sum(
                n
                for (m, p, s), n in self._requests.items()
                if (method is None or m == method)
                and (path is None or p == path)
                and (status is None or s == status)
            )

    # -- request handling (called from handler threads) --

    def _serve_put(self, path: str, ttl_header: str | None) -> _Reply:
        reply = self._issue_token(ttl_header) if path == TOKEN_PATH else _Reply(405)
        with self._lock:
            self._requests["PUT", path, reply.status] += 1
        return reply

    def _issue_token(self, ttl_header: str | None) -> _Reply:
        try:
            ttl_s = int(ttl_header or "")
        except ValueError:
            ttl_s = 0
        if not MIN_TOKEN_TTL_SECONDS <= ttl_s <= MAX_TOKEN_TTL_SECONDS:
            return _Reply(400, f"invalid {TOKEN_TTL_HEADER}: {ttl_header!r}".encode())
        token = secrets.token_urlsafe(32)
        now = self._clock()
        with self._lock:
            self._tokens = {t: exp for t, exp in self._tokens.items() if exp > now}
            self._tokens[token] = now + ttl_s
        return _Reply(200, token.encode(), headers=((TOKEN_TTL_HEADER, str(ttl_s)),))

    def _serve_get(self, path: str, token: str | None) -> _Reply:
        with self._lock:
            expiry = self._tokens.get(token or "")
            if expiry is None or expiry <= self._clock():
                reply = _Reply(401, b"Unauthorized")
            elif path == INSTANCE_ID_PATH:
                reply = _Reply(200, self.instance_id.encode())
            elif path == LOCAL_IPV4_PATH:
                reply = _Reply(200, self.local_ipv4.encode())
            elif path.startswith(INSTANCE_TAG_PATH) and path[len(INSTANCE_TAG_PATH) :] in self.tags:
                reply = _Reply(200, self.tags[path[len(INSTANCE_TAG_PATH) :]].encode())
            elif path == SPOT_ACTION_PATH and self._interruption is not None:
                action, at = self._interruption
                reply = _json_reply({"action": action, "time": iso_z(at)})
            elif path == REBALANCE_PATH and self._rebalance_at is not None:
                reply = _json_reply({"noticeTime": iso_z(self._rebalance_at)})
            else:
                reply = _Reply(404, b"Not Found")
            self._requests["GET", path, reply.status] += 1
        return reply


def _json_reply(data: dict[str, str]) -> _Reply:
    return _Reply(200, json.dumps(data).encode(), content_type="application/json")
