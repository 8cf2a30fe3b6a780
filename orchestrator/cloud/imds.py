"""The instance metadata service's client (IMDSv2): `NoticeWatcher` polls it for spot
interruption and rebalance notices (`cloud.notices`), `read_metadata` reads paths once. The wire
is in `cloud.imds_wire`; the offline world serves it with `cloud.local.metadata_mock`.

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
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from types import TracebackType
from typing import Self

from orchestrator.cloud.errors import LifecycleError, MetadataError
from orchestrator.cloud.imds_wire import (
    IMDS_BASE_URL,
    INSTANCE_ID_PATH,
    MAX_TOKEN_TTL_SECONDS,
    MIN_TOKEN_TTL_SECONDS,
    REBALANCE_PATH,
    SPOT_ACTION_PATH,
    TOKEN_HEADER,
    TOKEN_PATH,
    TOKEN_TTL_HEADER,
)
from orchestrator.cloud.notices import InterruptionNotice, NoticeKind

logger = logging.getLogger(__name__)

#: A token is replaced this long before it expires (at most half its TTL), so it cannot expire
#: between the check and the request that uses it.
TOKEN_REFRESH_MARGIN_SECONDS = 60.0
#: With a 5 s poll a notice is seen within ~5 s of appearing, well inside the 120 s warning.
DEFAULT_POLL_INTERVAL_SECONDS = 5.0
IMDS_REQUEST_TIMEOUT_SECONDS = 1.0

_NOTICE_PATHS: tuple[tuple[NoticeKind, str], ...] = (
    ("interruption", SPOT_ACTION_PATH),
    ("rebalance", REBALANCE_PATH),
)


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
        request_timeout_s: float = IMDS_REQUEST_TIMEOUT_SECONDS,
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
