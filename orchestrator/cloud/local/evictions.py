"""`EvictionReplayer`: EC2's spot reclaims, replayed offline from an availability trace.

moto never interrupts an instance, so the offline world does it the way AWS does:

    launch seen (sim t0) -> eviction drawn from the trace: t_e
    sim >= t_e - notice_s -> interruption notice {"action": "terminate", "time": t_e}
                             (to `on_notice`, e.g. the controller, and at the instance's
                             metadata path if a `MetadataMock` is attached)
    sim >= t_e            -> TerminateInstances in moto; the controller's next reconciliation
                             finds the instance gone and bills it as evicted

Only capacity evictions are replayed (`AvailabilityTrace.replay` streams, one per market, the
n-th instance seen in a market drawing launch slot n); price-crossing evictions are not.

Guarantee: an instance is never terminated less than `notice_s` simulated seconds after its
notice was delivered. When a step comes late (the loop is coarse at high clock speeds), the
eviction is postponed to `notice delivered + notice_s` and the notice names that time.
"""

from __future__ import annotations

import logging
import math
import threading
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from orchestrator.cloud.ec2 import EC2Cloud
from orchestrator.cloud.errors import CloudError
from orchestrator.cloud.instances import CloudInstance
from orchestrator.cloud.local.clock import SimClock
from orchestrator.cloud.local.metadata_mock import MetadataMock
from orchestrator.cloud.notices import InterruptionNotice
from orchestrator.market.eviction import AvailabilityTrace, RemovalStream
from orchestrator.market.prices import Market

log = logging.getLogger(__name__)

#: EC2's spot interruption warning: two minutes before the instance is reclaimed.
DEFAULT_NOTICE_SECONDS = 120.0
#: How far past the replayer's start the trace is replayed; later launches are never evicted.
DEFAULT_HORIZON_SECONDS = 30 * 86400.0


class EvictionState(StrEnum):
    """The replay lifecycle of one instance of ours::

        scheduled --notice due--> noticed --eviction due--> evicted
            |                        |
            +--------gone------------+---> gone   (terminated by someone else: the controller)

    `evicted` and `gone` are terminal.
    """

    SCHEDULED = "scheduled"
    NOTICED = "noticed"
    EVICTED = "evicted"
    GONE = "gone"


_TRANSITIONS: dict[EvictionState, frozenset[EvictionState]] = {
    EvictionState.SCHEDULED: frozenset(
        {
            EvictionState.NOTICED,  # sim time reached eviction - notice_s
            EvictionState.GONE,  # released by the controller before its eviction
        }
    ),
    EvictionState.NOTICED: frozenset(
        {
            EvictionState.EVICTED,  # sim time reached the eviction: terminated in moto
            EvictionState.GONE,  # the controller released it during the warning
        }
    ),
    EvictionState.EVICTED: frozenset(),
    EvictionState.GONE: frozenset(),
}


class ReplayTransitionError(RuntimeError):
    """A move the transition table forbids (a bug in the replayer); nothing changed."""


@dataclass(frozen=True, slots=True)
class EvictionRecord:
    """One eviction the replayer carried out (all times simulated epoch seconds)."""

    instance_id: str
    market: Market
    seen_at_s: float  # when the replayer first saw the instance (its launch, to a step)
    noticed_at_s: float  # when the notice was delivered
    evicted_at_s: float  # when the instance was terminated in moto
    forced: bool  # by `force_evict`, not drawn from the trace


@dataclass
class ReplayStepReport:
    """What one `step` did."""

    now_s: float
    tracked: list[str] = field(default_factory=list)
    notices: list[InterruptionNotice] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)


@dataclass
class _Tracked:
    instance: CloudInstance
    seen_at_s: float
    evict_at_s: float  # inf: never
    forced: bool = False
    state: EvictionState = EvictionState.SCHEDULED
    noticed_at_s: float | None = None
    notice: InterruptionNotice | None = None

    def move(self, to: EvictionState) -> None:
        if to not in _TRANSITIONS[self.state]:
            raise ReplayTransitionError(
                f"instance {self.instance.instance_id}: cannot go from {self.state} to {to}"
            )
        self.state = to


class EvictionReplayer:
    """Replays capacity evictions of one controller's instances in moto.

    Args:
        cloud_client: a boto3 EC2 client (of the moto server).
        controller_id: whose instances to evict (tag `orchestrator:controller-id`).
        trace: the availability trace (`AvailabilityTrace.bundled()`).
        clock: simulated time.
        seed: seeds the per-market replay streams (same seed, same launches: same evictions).
        notice_s: simulated seconds between the notice and the termination (at least).
        on_notice: called with each interruption notice (e.g. `Controller.notify`); its
            exceptions are logged and do not stop the eviction.
        start_s: where the trace replay starts (default: the clock's time now).
        horizon_s: how long the replay runs; instances seen after it are never evicted.
        evict_on_demand: also draw evictions for on-demand instances (never on AWS; default
            False: only `force_evict` evicts them).

    Thread-safe: `step`, `force_evict`, `attach_metadata` and `detach_metadata` may be called
    from different threads; callbacks run outside the lock.
    """

    def __init__(
        self,
        cloud_client: Any,
        controller_id: str,
        trace: AvailabilityTrace,
        clock: SimClock,
        *,
        seed: int | Sequence[int],
        notice_s: float = DEFAULT_NOTICE_SECONDS,
        on_notice: Callable[[InterruptionNotice], None] | None = None,
        start_s: float | None = None,
        horizon_s: float = DEFAULT_HORIZON_SECONDS,
        evict_on_demand: bool = False,
    ) -> None:
        if notice_s < 0:
            raise ValueError(f"notice_s must be >= 0, got {notice_s}")
        self.cloud = EC2Cloud(cloud_client.meta.region_name, controller_id, client=cloud_client)
        self.trace = trace
        self.clock = clock
        self.seed: tuple[int, ...] = (seed,) if isinstance(seed, int) else tuple(seed)
        self.notice_s = float(notice_s)
        self.on_notice = on_notice
        self.start_s = clock.now() if start_s is None else float(start_s)
        self.horizon_s = float(horizon_s)
        self.evict_on_demand = evict_on_demand
        self._lock = threading.RLock()
        self._streams: dict[Market, RemovalStream] = {}
        self._slots: dict[Market, int] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._forced: dict[str, float] = {}  # force_evict before the instance was seen
        self._metadata: dict[str, MetadataMock] = {}
        self._evictions: list[EvictionRecord] = []

    # -- outside inputs -------------------------------------------------------------------

    def force_evict(self, instance_id: str, at_sim_s: float) -> bool:
        """Evict `instance_id` at `at_sim_s` instead of its drawn time (notice at
        `at_sim_s - notice_s`, or at the next step if that is past, eviction then postponed to
        keep the full warning).

        An instance not seen yet is evicted so once a step sees it.

        Returns:
            True if scheduled; False if its notice was already delivered, or it is evicted or
            gone (a notice once given is not changed; logged).
        """
        with self._lock:
            tracked = self._tracked.get(instance_id)
            if tracked is None:
                self._forced[instance_id] = float(at_sim_s)
                return True
            if tracked.state is not EvictionState.SCHEDULED:
                log.warning(
                    "force_evict refused",
                    extra={"instance_id": instance_id, "state": str(tracked.state)},
                )
                return False
            tracked.evict_at_s = float(at_sim_s)
            tracked.forced = True
            return True

    def attach_metadata(self, instance_id: str, mock: MetadataMock) -> None:
        """Serve this instance's notices on `mock` too (at once if one was already given)."""
        with self._lock:
            self._metadata[instance_id] = mock
            tracked = self._tracked.get(instance_id)
            notice = tracked.notice if tracked is not None else None
        if notice is not None:
            _serve(mock, notice)

    def detach_metadata(self, instance_id: str) -> None:
        """Stop using this instance's `MetadataMock` (the caller stops the mock itself)."""
        with self._lock:
            self._metadata.pop(instance_id, None)

    # -- reading ----------------------------------------------------------------------------

    @property
    def evictions(self) -> list[EvictionRecord]:
        """Evictions done so far, in order."""
        with self._lock:
            return list(self._evictions)

    def eviction_time(self, instance_id: str) -> float | None:
        """The sim time `instance_id` is due to be evicted (inf: never; None: not tracked)."""
        with self._lock:
            tracked = self._tracked.get(instance_id)
            return None if tracked is None else tracked.evict_at_s

    def state(self, instance_id: str) -> EvictionState | None:
        with self._lock:
            tracked = self._tracked.get(instance_id)
            return None if tracked is None else tracked.state

    # -- the step -----------------------------------------------------------------------------

    def step(self) -> ReplayStepReport:
        """Observe our instances in moto, then deliver the notices and evictions now due.

        Failure semantics: a failed DescribeInstances is logged and the step does nothing
        (the next step catches up: notices late, then the eviction postponed by `notice_s`).
        A failed TerminateInstances is logged and retried at the next step.
        """
        now = self.clock.now()
        report = ReplayStepReport(now)
        try:
            live = {i.instance_id: i for i in self.cloud.describe()}
        except CloudError as exc:
            log.warning("eviction replay: describe failed", extra={"error": str(exc)})
            return report
        deliveries: list[tuple[InterruptionNotice, MetadataMock | None]] = []
        with self._lock:
            self._observe(live, now, report)
            for tracked in self._tracked.values():
                if tracked.state is EvictionState.SCHEDULED and (
                    now >= tracked.evict_at_s - self.notice_s
                ):
                    notice = self._give_notice(tracked, now)
                    report.notices.append(notice)
                    deliveries.append((notice, self._metadata.get(notice.instance_id)))
            due = [
                t
                for t in self._tracked.values()
                if t.state is EvictionState.NOTICED and now >= t.evict_at_s
            ]
        for notice, mock in deliveries:
            self._deliver(notice, mock)
        if due:
            self._evict(due, now, report)
        return report

    def _observe(
        self, live: dict[str, CloudInstance], now: float, report: ReplayStepReport
    ) -> None:
        for instance_id, instance in live.items():
            if instance_id not in self._tracked:
                self._track(instance, now)
                report.tracked.append(instance_id)
        for instance_id, tracked in self._tracked.items():
            if instance_id not in live and tracked.state in (
                EvictionState.SCHEDULED,
                EvictionState.NOTICED,
            ):
                tracked.move(EvictionState.GONE)

    def _track(self, instance: CloudInstance, now: float) -> None:
        evict_at = math.inf
        if instance.lifecycle == "spot" or self.evict_on_demand:
            market = instance.market
            slot = self._slots.get(market, 0)
            self._slots[market] = slot + 1
            evict_at = self._stream(market).eviction_after(now, slot)
        forced_at = self._forced.pop(instance.instance_id, None)
        self._tracked[instance.instance_id] = _Tracked(
            instance,
            seen_at_s=now,
            evict_at_s=evict_at if forced_at is None else forced_at,
            forced=forced_at is not None,
        )
        log.info(
            "eviction scheduled",
            extra={
                "instance_id": instance.instance_id,
                "market": str(instance.market),
                "lifecycle": instance.lifecycle,
                "evict_at_s": evict_at if forced_at is None else forced_at,
                "forced": forced_at is not None,
            },
        )

    def _stream(self, market: Market) -> RemovalStream:
        """The market's removal stream, seeded by (seed, market) so that markets are
        independent whatever order they are first seen in."""
        stream = self._streams.get(market)
        if stream is None:
            market_key = zlib.crc32(f"{market.instance_type}@{market.zone}".encode())
            stream = self.trace.replay(
                [market], self.start_s, self.horizon_s, (*self.seed, market_key)
            )[market]
            self._streams[market] = stream
        return stream

    def _give_notice(self, tracked: _Tracked, now: float) -> InterruptionNotice:
        tracked.evict_at_s = max(tracked.evict_at_s, now + self.notice_s)
        notice = InterruptionNotice(
            instance_id=tracked.instance.instance_id,
            kind="interruption",
            action="terminate",
            notice_time=datetime.fromtimestamp(tracked.evict_at_s, UTC),
            received_at_s=now,
        )
        tracked.move(EvictionState.NOTICED)
        tracked.noticed_at_s = now
        tracked.notice = notice
        return notice

    def _deliver(self, notice: InterruptionNotice, mock: MetadataMock | None) -> None:
        fields = {
            "instance_id": notice.instance_id,
            "notice_time": notice.notice_time.isoformat(),
            "at_s": notice.received_at_s,
        }
        log.info("interruption notice", extra=fields)
        if mock is not None:
            _serve(mock, notice)
        if self.on_notice is not None:
            try:
                self.on_notice(notice)
            except Exception:  # the receiver owns its failures; the eviction goes ahead
                log.exception("on_notice raised", extra=fields)

    def _evict(self, due: list[_Tracked], now: float, report: ReplayStepReport) -> None:
        ids = [t.instance.instance_id for t in due]
        try:
            self.cloud.terminate(ids)
        except CloudError as exc:
            log.warning(
                "eviction replay: terminate failed; retried next step",
                extra={"instance_ids": ids, "error": str(exc)},
            )
            return
        with self._lock:
            for tracked in due:
                if tracked.state is not EvictionState.NOTICED:  # released meanwhile
                    continue
                tracked.move(EvictionState.EVICTED)
                assert tracked.noticed_at_s is not None
                record = EvictionRecord(
                    instance_id=tracked.instance.instance_id,
                    market=tracked.instance.market,
                    seen_at_s=tracked.seen_at_s,
                    noticed_at_s=tracked.noticed_at_s,
                    evicted_at_s=now,
                    forced=tracked.forced,
                )
                self._evictions.append(record)
                report.evicted.append(record.instance_id)
                log.info(
                    "evicted",
                    extra={
                        "instance_id": record.instance_id,
                        "market": str(record.market),
                        "at_s": now,
                        "forced": record.forced,
                    },
                )


def _serve(mock: MetadataMock, notice: InterruptionNotice) -> None:
    assert notice.action is not None
    mock.schedule_interruption(notice.action, at=notice.notice_time)
