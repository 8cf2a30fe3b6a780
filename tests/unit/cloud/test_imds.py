"""IMDSv2 spot notices: the local metadata mock on real sockets, the watcher, EventBridge events."""

from __future__ import annotations

import copy
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from orchestrator.cloud.errors import LifecycleError
from orchestrator.cloud.imds import NoticeWatcher, WatcherState
from orchestrator.cloud.imds_wire import (
    INSTANCE_ID_PATH,
    REBALANCE_PATH,
    SPOT_ACTION_PATH,
    TOKEN_HEADER,
    TOKEN_PATH,
    TOKEN_TTL_HEADER,
)
from orchestrator.cloud.local.metadata_mock import MetadataMock
from orchestrator.cloud.notices import InterruptionNotice, NoticeFormatError
from orchestrator.errors import UserError

INSTANCE_ID = "i-1234567890abcdef0"
ACTION_AT = datetime(2017, 9, 18, 8, 22, tzinfo=UTC)
REBALANCE_AT = datetime(2020, 10, 27, 8, 22, tzinfo=UTC)
FAST_POLL_S = 0.05
#: Scheduling slack on a loaded machine on top of one poll interval (loopback round trips are
#: well under a millisecond).
LATENCY_MARGIN_S = 0.25
#: Upper bound on any single wait; a test that hits it has failed.
WAIT_S = 3.0

INTERRUPTION_EVENT: dict[str, Any] = {
    "version": "0",
    "id": "12345678-1234-1234-1234-123456789012",
    "detail-type": "EC2 Spot Instance Interruption Warning",
    "source": "aws.ec2",
    "account": "123456789012",
    "time": "2017-09-18T08:20:00Z",
    "region": "us-east-1",
    "resources": ["arn:aws:ec2:us-east-1b:instance/i-1234567890abcdef0"],
    "detail": {"instance-id": INSTANCE_ID, "instance-action": "terminate"},
}
REBALANCE_EVENT: dict[str, Any] = {
    "version": "0",
    "id": "12345678-1234-1234-1234-123456789013",
    "detail-type": "EC2 Instance Rebalance Recommendation",
    "source": "aws.ec2",
    "account": "123456789012",
    "time": "2020-10-27T08:22:00Z",
    "region": "us-east-1",
    "resources": ["arn:aws:ec2:us-east-1b:instance/i-1234567890abcdef0"],
    "detail": {"instance-id": INSTANCE_ID},
}


# -- helpers -----------------------------------------------------------------------------------


class FakeClock:
    """A monotonic clock that moves only when told to."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


class Recorder:
    """An `on_notice` callback that records each notice and when (monotonic) it arrived."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls: list[tuple[InterruptionNotice, float]] = []

    def __call__(self, notice: InterruptionNotice) -> None:
        with self._lock:
            self.calls.append((notice, time.monotonic()))

    @property
    def notices(self) -> list[InterruptionNotice]:
        with self._lock:
            return [notice for notice, _ in self.calls]


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {WAIT_S} s waiting for {what}")
        time.sleep(0.005)


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def call(method: str, url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with _OPENER.open(request, timeout=2.0) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read()


def token_for(mock: MetadataMock, ttl_s: int = 60) -> str:
    status, body = call("PUT", mock.base_url + TOKEN_PATH, {TOKEN_TTL_HEADER: str(ttl_s)})
    assert status == 200
    return body.decode()


def imds_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("imds-")]


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def no_leftover_threads() -> Iterator[None]:
    """Every watcher and mock thread a test starts is gone when it ends (checked last)."""
    assert imds_threads() == []
    yield
    assert imds_threads() == []


@pytest.fixture
def mock() -> Iterator[MetadataMock]:
    with MetadataMock(INSTANCE_ID) as started:
        yield started


@pytest.fixture
def make_watcher() -> Iterator[Callable[..., NoticeWatcher]]:
    """Build watchers; each is stopped (and must stop promptly) when the test ends."""
    made: list[NoticeWatcher] = []

    def make(base_url: str, **kwargs: Any) -> NoticeWatcher:
        watcher = NoticeWatcher(base_url, **kwargs)
        made.append(watcher)
        return watcher

    yield make
    for watcher in made:
        assert watcher.stop(timeout_s=2.0), "watcher thread did not stop"


def imds_records(caplog: pytest.LogCaptureFixture, event: str) -> list[dict[str, Any]]:
    """The structured fields (plus `levelno`) of the captured log records of one event."""
    return [r.__dict__ for r in caplog.records if r.__dict__.get("event") == event]


# -- the mock on the wire ----------------------------------------------------------------------


def test_mock_answers_401_to_gets_without_a_valid_token(mock: MetadataMock) -> None:
    mock.schedule_interruption(at=ACTION_AT)
    for path in (SPOT_ACTION_PATH, REBALANCE_PATH, INSTANCE_ID_PATH):
        assert call("GET", mock.base_url + path)[0] == 401
        assert call("GET", mock.base_url + path, {TOKEN_HEADER: "forged"})[0] == 401
    assert call("PUT", mock.base_url + TOKEN_PATH)[0] == 400  # no TTL header
    assert call("PUT", mock.base_url + TOKEN_PATH, {TOKEN_TTL_HEADER: "21601"})[0] == 400
    assert token_for(mock) != token_for(mock)  # tokens are random


def test_mock_serves_404_until_a_notice_is_set_then_its_json(mock: MetadataMock) -> None:
    headers = {TOKEN_HEADER: token_for(mock)}
    assert call("GET", mock.base_url + INSTANCE_ID_PATH, headers) == (200, INSTANCE_ID.encode())
    assert call("GET", mock.base_url + SPOT_ACTION_PATH, headers)[0] == 404
    assert call("GET", mock.base_url + REBALANCE_PATH, headers)[0] == 404

    mock.schedule_interruption("stop", at=ACTION_AT)
    mock.recommend_rebalance(REBALANCE_AT)
    status, body = call("GET", mock.base_url + SPOT_ACTION_PATH, headers)
    assert (status, json.loads(body)) == (200, {"action": "stop", "time": "2017-09-18T08:22:00Z"})
    status, body = call("GET", mock.base_url + REBALANCE_PATH, headers)
    assert (status, json.loads(body)) == (200, {"noticeTime": "2020-10-27T08:22:00Z"})

    mock.clear()
    assert call("GET", mock.base_url + SPOT_ACTION_PATH, headers)[0] == 404
    assert call("GET", mock.base_url + REBALANCE_PATH, headers)[0] == 404


def test_mock_token_expires_after_its_ttl() -> None:
    clock = FakeClock()
    with MetadataMock(INSTANCE_ID, clock=clock) as mock:
        headers = {TOKEN_HEADER: token_for(mock, ttl_s=2)}
        assert call("GET", mock.base_url + INSTANCE_ID_PATH, headers)[0] == 200
        clock.advance(1.999)
        assert call("GET", mock.base_url + INSTANCE_ID_PATH, headers)[0] == 200
        clock.advance(0.001)
        assert call("GET", mock.base_url + INSTANCE_ID_PATH, headers)[0] == 401


def test_mock_restarts_on_the_same_port_and_forgets_tokens(mock: MetadataMock) -> None:
    port, headers = mock.port, {TOKEN_HEADER: token_for(mock)}
    mock.stop()
    with pytest.raises(urllib.error.URLError):
        call("GET", mock.base_url + INSTANCE_ID_PATH, headers)
    mock.start()
    assert mock.port == port
    assert call("GET", mock.base_url + INSTANCE_ID_PATH, headers)[0] == 401
    with pytest.raises(LifecycleError):
        mock.start()


# -- the watcher -------------------------------------------------------------------------------


def test_watcher_delivers_interruption_once_within_one_poll_interval(
    mock: MetadataMock, make_watcher: Callable[..., NoticeWatcher]
) -> None:
    recorder = Recorder()
    watcher = make_watcher(mock.base_url, on_notice=recorder, poll_interval_s=FAST_POLL_S)
    watcher.start()
    wait_until(lambda: mock.request_count("GET", SPOT_ACTION_PATH, 404) >= 2, "polls to start")

    wall_before, set_at = time.time(), time.monotonic()
    mock.schedule_interruption(at=ACTION_AT)
    wait_until(lambda: len(recorder.calls) == 1, "the interruption notice")

    notice, delivered_at = recorder.calls[0]
    latency_s = delivered_at - set_at
    assert latency_s < watcher.poll_interval_s + LATENCY_MARGIN_S, f"latency {latency_s:.3f} s"
    assert notice.instance_id == INSTANCE_ID
    assert (notice.kind, notice.action, notice.notice_time) == (
        "interruption",
        "terminate",
        ACTION_AT,
    )
    assert wall_before <= notice.received_at_s <= time.time()

    # The notice stays served; later polls see it again and must not call back again.
    served = mock.request_count("GET", SPOT_ACTION_PATH, 200)
    wait_until(lambda: mock.request_count("GET", SPOT_ACTION_PATH, 200) >= served + 5, "5 polls")
    assert len(recorder.calls) == 1


def test_watcher_delivers_rebalance_recommendation_then_interruption(
    mock: MetadataMock, make_watcher: Callable[..., NoticeWatcher]
) -> None:
    recorder = Recorder()
    watcher = make_watcher(mock.base_url, on_notice=recorder, poll_interval_s=FAST_POLL_S)
    watcher.start()

    set_at = time.monotonic()
    mock.recommend_rebalance(REBALANCE_AT)
    wait_until(lambda: len(recorder.calls) == 1, "the rebalance recommendation")
    rebalance, delivered_at = recorder.calls[0]
    assert delivered_at - set_at < watcher.poll_interval_s + LATENCY_MARGIN_S
    assert (rebalance.kind, rebalance.action, rebalance.notice_time) == (
        "rebalance",
        None,
        REBALANCE_AT,
    )

    mock.schedule_interruption("hibernate", at=ACTION_AT)
    wait_until(lambda: len(recorder.calls) == 2, "the interruption notice")
    assert [(n.kind, n.action) for n in recorder.notices] == [
        ("rebalance", None),
        ("interruption", "hibernate"),
    ]


def test_watcher_calls_back_again_for_a_new_notice_time(
    mock: MetadataMock, make_watcher: Callable[..., NoticeWatcher]
) -> None:
    recorder = Recorder()
    watcher = make_watcher(mock.base_url, on_notice=recorder, instance_id=INSTANCE_ID)
    mock.schedule_interruption(at=ACTION_AT)
    assert len(watcher.poll_once()) == 1
    assert watcher.poll_once() == []
    mock.schedule_interruption(at=ACTION_AT + timedelta(minutes=5))
    assert [n.notice_time for n in watcher.poll_once()] == [ACTION_AT + timedelta(minutes=5)]
    assert len(recorder.calls) == 2


def test_watcher_refreshes_token_before_it_expires(
    make_watcher: Callable[..., NoticeWatcher],
) -> None:
    clock = FakeClock()
    recorder = Recorder()
    with MetadataMock(INSTANCE_ID, clock=clock) as mock:
        watcher = make_watcher(mock.base_url, on_notice=recorder, clock=clock, token_ttl_s=10)
        puts = lambda: mock.request_count("PUT", TOKEN_PATH, 200)  # noqa: E731

        assert watcher.poll_once() == [] and puts() == 1
        clock.advance(4.9)  # refresh is due at half the TTL (5 s) for a TTL this short
        assert watcher.poll_once() == [] and puts() == 1
        clock.advance(0.2)
        assert watcher.poll_once() == [] and puts() == 2
        clock.advance(60.0)  # far past expiry: still refreshed before use
        mock.schedule_interruption(at=ACTION_AT)
        assert [n.kind for n in watcher.poll_once()] == ["interruption"]
        assert puts() == 3
        assert mock.request_count(status=401) == 0
        assert watcher.consecutive_failed_polls == 0


def test_watcher_gets_a_new_token_when_one_is_refused(
    mock: MetadataMock, make_watcher: Callable[..., NoticeWatcher]
) -> None:
    recorder = Recorder()
    watcher = make_watcher(mock.base_url, on_notice=recorder)
    assert watcher.poll_once() == []
    mock.revoke_tokens()  # as if the token had expired on the service's side
    mock.schedule_interruption(at=ACTION_AT)
    assert [n.kind for n in watcher.poll_once()] == ["interruption"]
    assert mock.request_count("GET", SPOT_ACTION_PATH, 401) == 1
    assert mock.request_count("PUT", TOKEN_PATH, 200) == 2
    assert watcher.consecutive_failed_polls == 0


def test_watcher_logs_connection_refused_and_keeps_going(
    caplog: pytest.LogCaptureFixture, make_watcher: Callable[..., NoticeWatcher]
) -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    watcher = make_watcher(f"http://127.0.0.1:{port}", on_notice=Recorder())
    with caplog.at_level(logging.DEBUG, logger="orchestrator.cloud.imds"):
        assert watcher.poll_once() == []
        assert watcher.poll_once() == []
    assert watcher.consecutive_failed_polls == 2
    failures = imds_records(caplog, "imds_poll_failed")
    assert [(r["levelno"], r["code"], r["operation"]) for r in failures] == [
        (logging.WARNING, "ConnectionRefusedError", "PUT /latest/api/token"),
        (logging.DEBUG, "ConnectionRefusedError", "PUT /latest/api/token"),  # repeat: quiet
    ]


def test_watcher_thread_survives_mock_stop_and_restart_on_same_port(
    caplog: pytest.LogCaptureFixture,
    mock: MetadataMock,
    make_watcher: Callable[..., NoticeWatcher],
) -> None:
    recorder = Recorder()
    watcher = make_watcher(mock.base_url, on_notice=recorder, poll_interval_s=FAST_POLL_S)
    with caplog.at_level(logging.DEBUG, logger="orchestrator.cloud.imds"):
        watcher.start()
        wait_until(lambda: mock.request_count("GET", SPOT_ACTION_PATH, 404) >= 2, "polls")

        mock.stop()
        wait_until(lambda: watcher.consecutive_failed_polls >= 5, "5 failed polls")
        assert watcher.is_polling

        mock.start()  # same port, new process: the old token is unknown there
        mock.schedule_interruption(at=ACTION_AT)
        wait_until(lambda: len(recorder.calls) == 1, "the interruption after the restart")
        wait_until(lambda: watcher.consecutive_failed_polls == 0, "recovery")

    assert watcher.is_polling and watcher.state is WatcherState.RUNNING
    assert mock.request_count("GET", SPOT_ACTION_PATH, 401) >= 1  # token replaced on 401
    failures = imds_records(caplog, "imds_poll_failed")
    # A request caught mid-shutdown is reset; later ones are refused.
    assert {r["code"] for r in failures} <= {"ConnectionResetError", "ConnectionRefusedError"}
    # Each path fails on every poll, but a failure is a warning only when it is new.
    warnings = [r for r in failures if r["levelno"] == logging.WARNING]
    assert 1 <= len(warnings) <= 4 < 5 <= len(failures)
    assert len(imds_records(caplog, "imds_poll_recovered")) == 1


def test_callback_exception_is_logged_and_notice_not_redelivered(
    caplog: pytest.LogCaptureFixture,
    mock: MetadataMock,
    make_watcher: Callable[..., NoticeWatcher],
) -> None:
    calls: list[InterruptionNotice] = []

    def explode(notice: InterruptionNotice) -> None:
        calls.append(notice)
        raise RuntimeError("boom")

    watcher = make_watcher(mock.base_url, on_notice=explode)
    mock.recommend_rebalance(REBALANCE_AT)
    with caplog.at_level(logging.ERROR, logger="orchestrator.cloud.imds"):
        assert len(watcher.poll_once()) == 1
        assert watcher.poll_once() == []
    assert len(calls) == 1
    assert len(imds_records(caplog, "imds_callback_failed")) == 1


def test_watcher_lifecycle_stop_is_idempotent_and_restart_refused(
    mock: MetadataMock, make_watcher: Callable[..., NoticeWatcher]
) -> None:
    watcher = make_watcher(mock.base_url, on_notice=Recorder(), poll_interval_s=FAST_POLL_S)
    watcher.start()
    with pytest.raises(LifecycleError):
        watcher.start()
    started = time.monotonic()
    assert watcher.stop() and watcher.stop()
    assert time.monotonic() - started < 1.0
    assert watcher.state is WatcherState.STOPPED and not watcher.is_polling
    assert watcher.poll_once() == []
    with pytest.raises(LifecycleError):
        watcher.start()


# -- parsing -----------------------------------------------------------------------------------


def test_from_imds_parses_both_paths_in_utc() -> None:
    notice = InterruptionNotice.from_imds(
        INSTANCE_ID,
        "interruption",
        b'{"action": "terminate", "time": "2017-09-18T10:22:00+02:00"}',
        5.0,
    )
    assert notice.notice_time == ACTION_AT and notice.notice_time.tzinfo is UTC
    rebalance = InterruptionNotice.from_imds(
        INSTANCE_ID, "rebalance", '{"noticeTime": "2020-10-27T08:22:00Z"}', 5.0
    )
    assert (rebalance.action, rebalance.notice_time) == (None, REBALANCE_AT)


@pytest.mark.parametrize(
    "body",
    [
        "<html>",
        "[]",
        '{"action": "terminate"}',
        '{"action": "explode", "time": "2017-09-18T08:22:00Z"}',
        '{"action": "terminate", "time": "2017-09-18T08:22:00"}',  # no zone
    ],
)
def test_from_imds_rejects_malformed_bodies(body: str) -> None:
    with pytest.raises(NoticeFormatError) as caught:
        InterruptionNotice.from_imds(INSTANCE_ID, "interruption", body, 0.0)
    assert caught.value.code == "MalformedNotice"


def test_from_eventbridge_parses_interruption_warning() -> None:
    notice = InterruptionNotice.from_eventbridge(INTERRUPTION_EVENT, received_at_s=7.0)
    assert notice == InterruptionNotice(
        instance_id=INSTANCE_ID,
        kind="interruption",
        action="terminate",
        notice_time=datetime(2017, 9, 18, 8, 20, tzinfo=UTC),
        received_at_s=7.0,
    )


def test_from_eventbridge_parses_rebalance_recommendation() -> None:
    notice = InterruptionNotice.from_eventbridge(REBALANCE_EVENT, received_at_s=7.0)
    assert (notice.instance_id, notice.kind, notice.action) == (INSTANCE_ID, "rebalance", None)
    assert notice.notice_time == REBALANCE_AT


def _broken(event: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    event = copy.deepcopy(event)
    *parents, leaf = path.split(".")
    target = event
    for key in parents:
        target = target[key]
    if value is _MISSING:
        del target[leaf]
    else:
        target[leaf] = value
    return event


_MISSING = object()


@pytest.mark.parametrize(
    ("event", "field"),
    [
        (
            _broken(INTERRUPTION_EVENT, "detail-type", "EC2 Instance State-change Notification"),
            "detail-type",
        ),
        (_broken(REBALANCE_EVENT, "detail-type", _MISSING), "detail-type"),
        (_broken(INTERRUPTION_EVENT, "source", "aws.s3"), "source"),
        (_broken(INTERRUPTION_EVENT, "detail.instance-id", _MISSING), "detail.instance-id"),
        (_broken(REBALANCE_EVENT, "detail.instance-id", ""), "detail.instance-id"),
        (_broken(REBALANCE_EVENT, "detail", _MISSING), "detail"),
        (_broken(INTERRUPTION_EVENT, "detail.instance-action", "reboot"), "detail.instance-action"),
        (_broken(INTERRUPTION_EVENT, "time", "yesterday"), "time"),
    ],
)
def test_from_eventbridge_rejects_bad_events_naming_the_field(
    event: dict[str, Any], field: str
) -> None:
    with pytest.raises(UserError) as caught:
        InterruptionNotice.from_eventbridge(event, received_at_s=0.0)
    assert caught.value.field == field
    assert f"'{field}'" in caught.value.message
    assert caught.value.fix


def test_notice_requires_an_aware_time_and_matching_action() -> None:
    naive = datetime(2017, 9, 18, 8, 22)
    with pytest.raises(ValueError):
        InterruptionNotice(
            instance_id=INSTANCE_ID,
            kind="rebalance",
            action=None,
            notice_time=naive,
            received_at_s=0,
        )
    with pytest.raises(ValueError):
        InterruptionNotice(
            instance_id=INSTANCE_ID,
            kind="rebalance",
            action="stop",
            notice_time=ACTION_AT,
            received_at_s=0,
        )
    with pytest.raises(ValueError):
        MetadataMock().schedule_interruption(at=naive)
    eastern = ACTION_AT.astimezone(timezone(timedelta(hours=-4)))
    notice = InterruptionNotice(
        instance_id=INSTANCE_ID,
        kind="interruption",
        action="stop",
        notice_time=eastern,
        received_at_s=0,
    )
    assert notice.notice_time.tzinfo is UTC and notice.dedupe_key == ("interruption", ACTION_AT)
