"""Spot interruption and rebalance notices: an IMDSv2 watcher, EventBridge parsing, a local mock.

EC2 warns a spot instance about two minutes before reclaiming it. A node reads the warning from
the instance metadata service (IMDSv2); the controller gets the same news as EventBridge events.
Both become one `InterruptionNotice`. The wire, identical on EC2 and on `MetadataMock`:

    PUT /latest/api/token  (X-aws-ec2-metadata-token-ttl-seconds: 1..21600)  -> 200 token
    GET /latest/meta-data/spot/instance-action               -> 404 | {"action", "time"}
    GET /latest/meta-data/events/recommendations/rebalance   -> 404 | {"noticeTime"}
    GET /latest/meta-data/instance-id                        -> 200 "i-..."
    GET /latest/meta-data/local-ipv4                         -> 200 "10.0.1.23"
    GET /latest/meta-data/tags/instance/<key>                -> 200 value | 404
        (instance tags: only with InstanceMetadataTags enabled, as infra/ sets it)
    Every GET needs X-aws-ec2-metadata-token: <token>; a missing or expired token gets 401.

A typical sequence on one node (poll every 5 s): 404, 404, ... -> rebalance JSON (callback:
rebalance) -> instance-action JSON (callback: interruption) -> the same JSON on every later poll
(no callback: already delivered) -> the instance is gone.

Failure semantics of `NoticeWatcher`: a failed poll (connection refused, timeout, 5xx, a
malformed body) is logged and retried at the next poll; the thread never dies of it. A notice
present during a failed poll is delivered by the first poll that succeeds, so a failure delays a
notice by whole poll intervals and loses nothing the service still serves.
"""

from __future__ import annotations

import email.message
import http.client
import json
import logging
import secrets
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Literal, Self, get_args

from pydantic import (
    AwareDatetime,
    BaseModel,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from orchestrator.cloud.errors import CloudError
from orchestrator.errors import OrchestratorError, UserError

logger = logging.getLogger(__name__)

IMDS_BASE_URL = "http://169.254.169.254"
TOKEN_PATH = "/latest/api/token"
SPOT_ACTION_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
INSTANCE_ID_PATH = "/latest/meta-data/instance-id"
LOCAL_IPV4_PATH = "/latest/meta-data/local-ipv4"
INSTANCE_TAG_PATH = "/latest/meta-data/tags/instance/"
TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
#: IMDSv2 accepts token TTLs of 1 s to 6 h and answers 400 outside that range.
MIN_TOKEN_TTL_SECONDS = 1
MAX_TOKEN_TTL_SECONDS = 21600
#: A token is replaced this long before it expires (at most half its TTL), so it cannot expire
#: between the check and the request that uses it.
TOKEN_REFRESH_MARGIN_SECONDS = 60.0
#: With a 5 s poll a notice is seen within ~5 s of appearing, well inside the 120 s warning.
DEFAULT_POLL_INTERVAL_SECONDS = 5.0
DEFAULT_REQUEST_TIMEOUT_SECONDS = 1.0

EVENT_SOURCE = "aws.ec2"
INTERRUPTION_DETAIL_TYPE = "EC2 Spot Instance Interruption Warning"
REBALANCE_DETAIL_TYPE = "EC2 Instance Rebalance Recommendation"

NoticeKind = Literal["interruption", "rebalance"]
SpotAction = Literal["terminate", "stop", "hibernate"]
SPOT_ACTIONS: tuple[str, ...] = get_args(SpotAction)
NOTICE_KINDS: tuple[str, ...] = get_args(NoticeKind)
_DETAIL_TYPE_KINDS: dict[str, NoticeKind] = {
    INTERRUPTION_DETAIL_TYPE: "interruption",
    REBALANCE_DETAIL_TYPE: "rebalance",
}
_NOTICE_PATHS: tuple[tuple[NoticeKind, str], ...] = (
    ("interruption", SPOT_ACTION_PATH),
    ("rebalance", REBALANCE_PATH),
)
_AWARE_DATETIME: TypeAdapter[datetime] = TypeAdapter(AwareDatetime)


# --------------------------------------------------------------------------------------------
# Errors


class MetadataError(CloudError):
    """A metadata request failed or returned something unusable.

    Attributes (besides `CloudError`'s `code`, `message`, `operation`):
        url: the URL requested, when there was a request.
        status: the HTTP status, or None when no response came back (`code` is then the
            exception class name, e.g. "ConnectionRefusedError" or "TimeoutError").
    """

    def __init__(
        self,
        message: str,
        *,
        code: str,
        operation: str,
        url: str | None = None,
        status: int | None = None,
    ) -> None:
        self.url = url
        self.status = status
        super().__init__(message, code=code, operation=operation)


class NoticeFormatError(MetadataError):
    """A notice body that is not the JSON IMDS documents (`code` "MalformedNotice")."""


class InvalidEventError(UserError):
    """An EventBridge event that is not an EC2 spot interruption or rebalance event."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(
            message,
            field=field,
            fix=(
                f"route only source {EVENT_SOURCE!r} events with detail-type "
                f"{INTERRUPTION_DETAIL_TYPE!r} or {REBALANCE_DETAIL_TYPE!r} here, unmodified."
            ),
        )


class LifecycleError(OrchestratorError):
    """A lifecycle move that its transition table does not allow (a caller bug).

    Attributes:
        component: the class whose lifecycle it is ("NoticeWatcher", "MetadataMock").
        state: the state it was in.
        requested: the state the caller asked for.
    """

    def __init__(self, component: str, state: str, requested: str) -> None:
        self.component = component
        self.state = state
        self.requested = requested
        super().__init__(f"{component}: cannot go from {state!r} to {requested!r}")


# --------------------------------------------------------------------------------------------
# The notice


class InterruptionNotice(BaseModel, frozen=True, extra="forbid"):
    """EC2's warning that an instance will be reclaimed (`interruption`) or is at elevated risk
    of it (`rebalance`).

    `notice_time` is the instant the notice names, in UTC: for an IMDS interruption, when the
    action will happen (`time`); for an IMDS rebalance, when it was issued (`noticeTime`); for an
    EventBridge event, when the event was emitted (`time`, about two minutes before the action).
    `received_at_s` is the receiver's wall clock (epoch seconds) when the notice arrived.
    `action` is set for interruptions and None for rebalance recommendations.
    """

    instance_id: str = Field(min_length=1)
    kind: NoticeKind
    action: SpotAction | None
    notice_time: AwareDatetime
    received_at_s: float

    @field_validator("notice_time")
    @classmethod
    def _to_utc(cls, value: datetime) -> datetime:
        return value.astimezone(UTC)

    @model_validator(mode="after")
    def _action_matches_kind(self) -> Self:
        if self.kind == "interruption" and self.action is None:
            raise ValueError("an interruption notice needs an action (terminate/stop/hibernate)")
        if self.kind == "rebalance" and self.action is not None:
            raise ValueError(f"a rebalance notice has no action, got {self.action!r}")
        return self

    @property
    def dedupe_key(self) -> tuple[NoticeKind, datetime]:
        """Two notices with the same key are the same notice served twice."""
        return (self.kind, self.notice_time)

    @classmethod
    def from_imds(
        cls, instance_id: str, path_kind: NoticeKind, body: str | bytes, received_at_s: float
    ) -> InterruptionNotice:
        """Parse the 200 body of the instance-action (`interruption`) or rebalance path.

        Raises:
            NoticeFormatError: the body is not JSON of the documented shape (the service, not
                the caller, is at fault; the watcher logs it and retries at the next poll).
            ValueError: `path_kind` is not "interruption" or "rebalance".
        """
        if path_kind not in NOTICE_KINDS:
            raise ValueError(f"path_kind must be one of {NOTICE_KINDS}, got {path_kind!r}")
        path = SPOT_ACTION_PATH if path_kind == "interruption" else REBALANCE_PATH
        text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise _format_error(path, f"not JSON ({exc}): {text[:200]!r}") from exc
        if not isinstance(data, dict):
            raise _format_error(path, f"expected a JSON object, got {text[:200]!r}")
        if path_kind == "interruption":
            action, when = data.get("action"), data.get("time")
        else:
            action, when = None, data.get("noticeTime")
        try:
            return cls(
                instance_id=instance_id,
                kind=path_kind,
                action=action,
                notice_time=when,
                received_at_s=received_at_s,
            )
        except ValidationError as exc:
            raise _format_error(path, f"{_first_error(exc)} in {text[:200]!r}") from exc

    @classmethod
    def from_eventbridge(cls, event: Mapping[str, Any], received_at_s: float) -> InterruptionNotice:
        """Parse an "EC2 Spot Instance Interruption Warning" or "EC2 Instance Rebalance
        Recommendation" EventBridge event.

        Raises:
            InvalidEventError (a `UserError`): the event is of another source or detail-type, or
                misses a field; `field` names it ("source", "detail-type", "detail",
                "detail.instance-id", "detail.instance-action", "time").
        """
        if not isinstance(event, Mapping):
            raise InvalidEventError(
                f"an EventBridge event must be a JSON object, got {type(event).__name__}",
                field="event",
            )
        source = event.get("source")
        if source != EVENT_SOURCE:
            raise InvalidEventError(
                f"event field 'source' is {source!r}, expected {EVENT_SOURCE!r}", field="source"
            )
        detail_type = event.get("detail-type")
        kind = _DETAIL_TYPE_KINDS.get(detail_type) if isinstance(detail_type, str) else None
        if kind is None:
            raise InvalidEventError(
                f"event field 'detail-type' is {detail_type!r}, expected one of "
                f"{sorted(_DETAIL_TYPE_KINDS)}",
                field="detail-type",
            )
        detail = event.get("detail")
        if not isinstance(detail, Mapping):
            raise InvalidEventError(
                f"event field 'detail' is missing or not an object: {detail!r}", field="detail"
            )
        instance_id = detail.get("instance-id")
        if not isinstance(instance_id, str) or not instance_id:
            raise InvalidEventError(
                f"event field 'detail.instance-id' is missing or empty: {instance_id!r}",
                field="detail.instance-id",
            )
        action: SpotAction | None = None
        if kind == "interruption":
            raw_action = detail.get("instance-action")
            if raw_action not in SPOT_ACTIONS:
                raise InvalidEventError(
                    f"event field 'detail.instance-action' is {raw_action!r}, expected one of "
                    f"{list(SPOT_ACTIONS)}",
                    field="detail.instance-action",
                )
            action = raw_action
        try:
            when = _AWARE_DATETIME.validate_python(event.get("time"))
        except ValidationError as exc:
            raise InvalidEventError(
                f"event field 'time' is not an ISO 8601 time with a zone: {event.get('time')!r}",
                field="time",
            ) from exc
        return cls(
            instance_id=instance_id,
            kind=kind,
            action=action,
            notice_time=when,
            received_at_s=received_at_s,
        )


def _format_error(path: str, reason: str) -> NoticeFormatError:
    return NoticeFormatError(
        f"malformed notice at {path}: {reason}", code="MalformedNotice", operation=f"GET {path}"
    )


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(part) for part in err["loc"]) or "notice"
    return f"{where}: {err['msg']}"


def _iso_z(when: datetime) -> str:
    """`when` the way IMDS writes times: "2017-09-18T08:22:00Z"."""
    if when.tzinfo is None:
        raise ValueError(f"a notice time must carry a time zone, got naive {when!r}")
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# --------------------------------------------------------------------------------------------
# The local mock


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
        self.send_response(reply.status)
        self.send_header("Content-Type", reply.content_type)
        self.send_header("Content-Length", str(len(reply.body)))
        for name, value in reply.headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(reply.body)

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
        _iso_z(at)
        with self._lock:
            self._interruption = (action, at)

    def recommend_rebalance(self, at: datetime) -> None:
        """Serve `{"noticeTime": at}` at the rebalance path from now on.

        Raises:
            ValueError: `at` has no time zone.
        """
        _iso_z(at)
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
                reply = _json_reply({"action": action, "time": _iso_z(at)})
            elif path == REBALANCE_PATH and self._rebalance_at is not None:
                reply = _json_reply({"noticeTime": _iso_z(self._rebalance_at)})
            else:
                reply = _Reply(404, b"Not Found")
            self._requests["GET", path, reply.status] += 1
        return reply


def _json_reply(data: dict[str, str]) -> _Reply:
    return _Reply(200, json.dumps(data).encode(), content_type="application/json")


# --------------------------------------------------------------------------------------------
# The watcher


class WatcherState(StrEnum):
    """Lifecycle of a `NoticeWatcher`.

    CREATED --start()--> RUNNING --stop()--> STOPPED; CREATED --stop()--> STOPPED.
    A stopped watcher is not restarted: make a new one.
    """

    CREATED = "created"
    RUNNING = "running"
    STOPPED = "stopped"


_WATCHER_TRANSITIONS: dict[WatcherState, frozenset[WatcherState]] = {
    WatcherState.CREATED: frozenset({WatcherState.RUNNING, WatcherState.STOPPED}),
    WatcherState.RUNNING: frozenset({WatcherState.STOPPED}),  # the thread is joined
    WatcherState.STOPPED: frozenset(),  # notices seen are kept; a thread runs once
}


class _StopRequested(Exception):
    """Raised inside a poll once `stop()` was called, to abandon it between requests."""


@dataclass(frozen=True, slots=True)
class _Response:
    status: int
    body: bytes
    headers: email.message.Message  # case-insensitive, as HTTP headers are


class NoticeWatcher:
    """Polls IMDSv2 for spot interruption and rebalance notices and calls `on_notice` for each.

    Every `poll_interval_s` it GETs the instance-action and rebalance paths with an IMDSv2 token,
    which it gets on first use, replaces `TOKEN_REFRESH_MARGIN_SECONDS` (at most half the TTL)
    before it expires, and replaces at once when a request is answered 401.

    Guarantees and failure semantics:
        * `on_notice` is called once per distinct notice (same kind and `notice_time` = same
          notice), from the watcher thread (or the caller of `poll_once`). It is never called
          again for that notice, even if it raised: its exception is logged, not retried.
        * Worst-case latency from a notice appearing to the callback is one `poll_interval_s`
          plus the round trips of one poll (milliseconds on EC2).
        * A poll that fails (connection refused or reset, timeout, 5xx, 401 twice, a malformed
          body) is logged -- a warning when a new kind of failure starts, debug while it
          repeats, info on recovery -- and the next poll retries. The thread never dies of a
          failure, nor of a bug in a poll (logged with its traceback).
        * Requests go straight to `base_url` (proxy environment variables are ignored, as for
          any link-local service). In a container on EC2 the instance's metadata hop limit must
          be at least 2, or the token PUT times out.

    `clock` (monotonic seconds) times the polls and the token's life; `wall_clock` (epoch
    seconds) stamps `received_at_s`.
    """

    def __init__(
        self,
        base_url: str = IMDS_BASE_URL,
        *,
        on_notice: Callable[[InterruptionNotice], None],
        poll_interval_s: float = DEFAULT_POLL_INTERVAL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_SECONDS,
        token_ttl_s: int = MAX_TOKEN_TTL_SECONDS,
        instance_id: str | None = None,
    ) -> None:
        """`instance_id` is read from IMDS on the first poll unless given.

        Raises:
            ValueError: a non-positive interval or timeout, or a TTL outside 1..21600 s.
        """
        if poll_interval_s <= 0 or request_timeout_s <= 0:
            raise ValueError(
                f"poll_interval_s ({poll_interval_s}) and request_timeout_s "
                f"({request_timeout_s}) must be positive"
            )
        if not MIN_TOKEN_TTL_SECONDS <= token_ttl_s <= MAX_TOKEN_TTL_SECONDS:
            raise ValueError(
                f"token_ttl_s must be in {MIN_TOKEN_TTL_SECONDS}..{MAX_TOKEN_TTL_SECONDS}, "
                f"got {token_ttl_s}"
            )
        self.base_url = base_url.rstrip("/")
        self.poll_interval_s = poll_interval_s
        self.request_timeout_s = request_timeout_s
        self.token_ttl_s = token_ttl_s
        self._on_notice = on_notice
        self._clock = clock
        self._wall_clock = wall_clock
        self._instance_id = instance_id
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._token: str | None = None
        self._token_refresh_at = 0.0
        self._seen: set[tuple[NoticeKind, datetime]] = set()
        self._poll_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._state = WatcherState.CREATED
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._failure_signature: tuple[str, ...] | None = None
        self.consecutive_failed_polls = 0

    @property
    def state(self) -> WatcherState:
        return self._state

    @property
    def is_polling(self) -> bool:
        """True while the polling thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    # -- lifecycle --

    def start(self) -> None:
        """Start polling in a daemon thread; the first poll is immediate.

        Raises:
            LifecycleError: already started or stopped.
        """
        with self._state_lock:
            self._move(WatcherState.RUNNING)
            self._thread = threading.Thread(
                target=self._run, name=f"imds-watcher-{self.base_url}", daemon=True
            )
            self._thread.start()

    def stop(self, timeout_s: float | None = None) -> bool:
        """Stop polling and join the thread, waiting at most `timeout_s` (default: two request
        timeouts plus 1 s, enough for the one request a poll may be in). Idempotent.

        Returns:
            True if the thread has exited (or never ran); False if it is still in a request or
            in `on_notice` after `timeout_s` -- it is a daemon, and exits once that returns.
        """
        with self._state_lock:
            if self._state is not WatcherState.STOPPED:
                self._move(WatcherState.STOPPED)
            self._stop_event.set()
            thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(2 * self.request_timeout_s + 1.0 if timeout_s is None else timeout_s)
        if thread.is_alive():
            logger.warning(
                "imds watcher thread still in a request after stop()",
                extra={"event": "imds_watcher_stop_timeout", "base_url": self.base_url},
            )
            return False
        return True

    def _move(self, to: WatcherState) -> None:
        if to not in _WATCHER_TRANSITIONS[self._state]:
            raise LifecycleError(type(self).__name__, self._state, to)
        self._state = to

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

    def _run(self) -> None:
        next_poll_at = self._clock()
        while not self._stop_event.is_set():
            try:
                self.poll_once()
            except Exception:  # a bug in one poll must not end the watch
                logger.exception(
                    "imds poll raised unexpectedly",
                    extra={"event": "imds_poll_crashed", "base_url": self.base_url},
                )
            now = self._clock()
            next_poll_at = max(next_poll_at + self.poll_interval_s, now)  # skip missed slots
            self._stop_event.wait(min(next_poll_at - now, self.poll_interval_s))

    # -- one poll --

    def poll_once(self) -> list[InterruptionNotice]:
        """Poll both paths once; call `on_notice` for each notice not seen before and return
        them (in path order: interruption, then rebalance).

        Never raises for network or service failures: they are logged, and a notice that could
        not be read is picked up by a later poll. After `stop()` it returns [] without a request.
        """
        fresh: list[InterruptionNotice] = []
        with self._poll_lock:
            errors: list[MetadataError] = []
            try:
                self._read_notices(fresh, errors)
            except _StopRequested:
                pass  # deliver what was read before the stop; report nothing of the rest
            else:
                self._record_outcome(errors)
        for notice in fresh:
            self._deliver(notice)
        return fresh

    def _read_notices(self, fresh: list[InterruptionNotice], errors: list[MetadataError]) -> None:
        """Append unseen notices to `fresh` (marking them seen) and failures to `errors`."""
        try:
            instance_id = self._get_instance_id()
        except MetadataError as exc:
            errors.append(exc)
            return
        for kind, path in _NOTICE_PATHS:
            try:
                notice = self._fetch_notice(instance_id, kind, path)
            except MetadataError as exc:
                errors.append(exc)
                continue
            if notice is not None and notice.dedupe_key not in self._seen:
                self._seen.add(notice.dedupe_key)
                fresh.append(notice)

    def _get_instance_id(self) -> str:
        if self._instance_id is None:
            response = self._get(INSTANCE_ID_PATH)
            instance_id = response.body.decode("utf-8", "replace").strip()
            if response.status != 200 or not instance_id:
                raise self._status_error("GET", INSTANCE_ID_PATH, response)
            self._instance_id = instance_id
        return self._instance_id

    def _fetch_notice(
        self, instance_id: str, kind: NoticeKind, path: str
    ) -> InterruptionNotice | None:
        response = self._get(path)
        if response.status == 404:
            return None
        if response.status != 200:
            raise self._status_error("GET", path, response)
        return InterruptionNotice.from_imds(instance_id, kind, response.body, self._wall_clock())

    def _get(self, path: str) -> _Response:
        """GET with a token; on 401 get a new token and try once more."""
        response = self._request("GET", path, {TOKEN_HEADER: self._current_token()})
        if response.status == 401:
            self._token = None
            response = self._request("GET", path, {TOKEN_HEADER: self._current_token()})
        return response

    def _current_token(self) -> str:
        if self._token is not None and self._clock() < self._token_refresh_at:
            return self._token
        asked_at = self._clock()
        response = self._request("PUT", TOKEN_PATH, {TOKEN_TTL_HEADER: str(self.token_ttl_s)})
        token = response.body.decode("utf-8", "replace").strip()
        if response.status != 200 or not token:
            raise self._status_error("PUT", TOKEN_PATH, response)
        try:
            ttl_s = float(response.headers.get(TOKEN_TTL_HEADER) or self.token_ttl_s)
        except ValueError:
            ttl_s = float(self.token_ttl_s)
        self._token = token
        self._token_refresh_at = asked_at + ttl_s - min(TOKEN_REFRESH_MARGIN_SECONDS, ttl_s / 2)
        logger.debug(
            "imds token refreshed",
            extra={"event": "imds_token_refreshed", "base_url": self.base_url, "ttl_s": ttl_s},
        )
        return token

    def _request(self, method: str, path: str, headers: dict[str, str]) -> _Response:
        """One HTTP request; any HTTP status is returned, a transport failure raised.

        Raises:
            MetadataError: no response (refused, reset, timeout, bad HTTP).
            _StopRequested: `stop()` was called.
        """
        if self._stop_event.is_set():
            raise _StopRequested
        url = self.base_url + path
        request = urllib.request.Request(url, method=method, headers=headers)
        try:
            with self._opener.open(request, timeout=self.request_timeout_s) as reply:
                return _Response(reply.status, reply.read(), reply.headers)
        except urllib.error.HTTPError as exc:
            try:
                return _Response(exc.code, exc.read(), exc.headers)
            finally:
                exc.close()
        except (OSError, http.client.HTTPException) as exc:
            cause = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            culprit = cause if isinstance(cause, BaseException) else exc
            raise MetadataError(
                f"{cause} ({self.base_url})",
                code=type(culprit).__name__,  # e.g. ConnectionRefusedError, TimeoutError
                operation=f"{method} {path}",
                url=url,
            ) from exc

    def _status_error(self, method: str, path: str, response: _Response) -> MetadataError:
        text = response.body[:200].decode("utf-8", "replace")
        return MetadataError(
            f"answered {response.status} ({self.base_url}): {text!r}",
            code=f"HTTP{response.status}",
            operation=f"{method} {path}",
            url=self.base_url + path,
            status=response.status,
        )

    # -- reporting --

    def _record_outcome(self, errors: list[MetadataError]) -> None:
        if not errors:
            if self.consecutive_failed_polls:
                logger.info(
                    "imds polls succeed again after %d failed",
                    self.consecutive_failed_polls,
                    extra={
                        "event": "imds_poll_recovered",
                        "base_url": self.base_url,
                        "failed_polls": self.consecutive_failed_polls,
                    },
                )
            self.consecutive_failed_polls = 0
            self._failure_signature = None
            return
        self.consecutive_failed_polls += 1
        signature = tuple(f"{e.operation}:{e.code}" for e in errors)
        level = logging.WARNING if signature != self._failure_signature else logging.DEBUG
        self._failure_signature = signature
        for error in errors:
            logger.log(
                level,
                "imds poll failed: %s",
                error,
                extra={
                    "event": "imds_poll_failed",
                    "base_url": self.base_url,
                    "operation": error.operation,
                    "code": error.code,
                    "status": error.status,
                    "failed_polls": self.consecutive_failed_polls,
                },
            )

    def _deliver(self, notice: InterruptionNotice) -> None:
        fields = {
            "event": "imds_notice",
            "instance_id": notice.instance_id,
            "kind": notice.kind,
            "action": notice.action,
            "notice_time": notice.notice_time.isoformat(),
        }
        logger.info("spot %s notice for %s", notice.kind, notice.instance_id, extra=fields)
        try:
            self._on_notice(notice)
        except Exception:  # the callback owns its failures; the notice is not redelivered
            logger.exception("on_notice raised", extra={**fields, "event": "imds_callback_failed"})


def read_metadata(
    base_url: str, paths: list[str], *, timeout_s: float = 2.0
) -> dict[str, str | None]:
    """GET `paths` once with one IMDSv2 token: path -> body, None where the service says 404.

    Uses a (never started) `NoticeWatcher`'s requests: the same token handling and errors.

    Raises:
        MetadataError: the service is unreachable or answers anything but 200/404.
    """
    client = NoticeWatcher(base_url, on_notice=lambda notice: None, request_timeout_s=timeout_s)
    found: dict[str, str | None] = {}
    for path in paths:
        response = client._get(path)
        if response.status not in (200, 404):
            raise client._status_error("GET", path, response)
        text = response.body.decode("utf-8", "replace").strip()
        found[path] = text if response.status == 200 else None
    return found
