"""The controller as a long-running service: APScheduler (3.x) runs the tick.

* every `decision_interval_s` (2 minutes; renew-or-release points are caught by the tick that
  comes before them, `renew_lead_s` ahead);
* at once when an interruption notice arrives (`notify`), so a notice reaches BidBrain within
  the time one tick takes;
* never two ticks at the same time (`max_instances=1`, missed runs coalesce).

The scheduler fires on real time; the tick reads the injected clock, so the offline world runs
the same service on a clock that goes N times faster (pass `speed=N`: real intervals shrink).
A tick that fails (Redis down, EC2 unreachable) is logged and retried at the next interval:
the service does not crash-loop, and no state is lost because every write is atomic and the
next tick reconciles.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from apscheduler.schedulers.background import BackgroundScheduler

from orchestrator.api.health import TickHealth
from orchestrator.cloud.notices import InterruptionNotice
from orchestrator.controller.core import Controller, TickReport
from orchestrator.controller.lease import FleetLease, NotLeaderError

log = logging.getLogger(__name__)

TICK_JOB_ID = "controller-tick"
#: A standby looks for a lapsed lease every this many decision intervals (the lease lives 1.5).
STANDBY_POLL_INTERVALS = 0.25
#: Real seconds between two warnings that ticks take longer than their interval.
LAG_WARNING_EVERY_S = 60.0


class ControllerService:
    """Runs `Controller.tick` on a schedule and on every notice."""

    def __init__(
        self,
        controller: Controller,
        *,
        clock: Callable[[], float],
        speed: float = 1.0,
        on_tick: Callable[[TickReport], None] | None = None,
        lease: FleetLease | None = None,
    ) -> None:
        if speed <= 0:
            raise ValueError("speed must be positive")
        self.controller = controller
        self.clock = clock
        self.speed = speed
        self.on_tick = on_tick
        self.ticks = 0
        self.failures = 0
        self.failing_in_a_row = 0
        self.last_error: str | None = None
        self.lease = lease  # the fleet's: ticks only while this process holds it
        self.standby: str | None = None  # who holds it instead, while this process waits
        self._lock = threading.Lock()
        self._again = False  # a notice came during a tick: tick again right after it
        self._slow_ticks = 0  # ticks longer than the interval since the last warning
        self._lag_warned_at = -math.inf
        self._scheduler = BackgroundScheduler(timezone=UTC)

    @property
    def interval_s(self) -> float:
        """Real seconds between ticks."""
        return self.controller.settings.decision_interval_s / self.speed

    def start(self) -> None:
        """Start ticking now and every interval."""
        self._scheduler.add_job(
            self.tick_once,
            "interval",
            seconds=self.interval_s,
            id=TICK_JOB_ID,
            max_instances=1,
            coalesce=True,
            next_run_time=datetime.now(UTC),
        )
        self._scheduler.start()

    def stop(self) -> None:
        """Stop the scheduler; waits for a running tick to finish; gives the fleet's lease up
        (a standby takes over at its next tick, not after the lease's time to live)."""
        if self._scheduler.running:
            self._scheduler.shutdown(wait=True)
        if self.lease is not None and self.lease.token is not None:
            try:
                self.lease.release()
            except Exception:  # noqa: BLE001 - it lapses by itself
                log.warning("giving the fleet's lease up failed", exc_info=True)

    def notify(self, notice: InterruptionNotice) -> None:
        """Hand a notice to the controller and tick at once (right after the tick running
        now, if one is: never a second one beside it)."""
        self.controller.notify(notice)
        if self._lock.locked():
            self._again = True
        elif self._scheduler.running:
            self._tick_now()

    def health(self) -> TickHealth:
        """How the ticks went so far."""
        return TickHealth(
            self.ticks, self.failures, self.failing_in_a_row, self.last_error, self.standby
        )

    def _note_lag(self, took_s: float) -> None:
        """A tick longer than the interval (the scheduler skips the runs it overlapped): one
        warning line a minute at most, with how many there were since the last."""
        if took_s <= self.interval_s:
            return
        self._slow_ticks += 1
        now = time.monotonic()
        if now - self._lag_warned_at >= LAG_WARNING_EVERY_S:
            lag = {"took_s": round(took_s, 1), "interval_s": self.interval_s,
                   "slow_ticks": self._slow_ticks}  # fmt: skip
            log.warning("controller ticks take longer than their interval", extra=lag)
            self._lag_warned_at, self._slow_ticks = now, 0

    def _tick_now(self, after_s: float = 0.0) -> None:
        at = datetime.now(UTC) + timedelta(seconds=after_s)
        self._scheduler.modify_job(TICK_JOB_ID, next_run_time=at)

    def tick_once(self) -> TickReport | None:
        """One tick now; errors are logged and counted, never raised (the next tick retries)."""
        with self._lock:
            self._again = False
            started = time.monotonic()
            try:
                if self.lease is not None:
                    self.lease.hold()
                report = self.controller.tick(self.clock())
            except NotLeaderError as exc:  # a standby (or it lost the lease mid-tick)
                if self.standby is None:
                    log.warning("controller standing by", extra={"lease": str(exc)})
                self.standby = str(exc)
                if self._scheduler.running:  # look again soon: take over within 2 intervals
                    self._tick_now(after_s=STANDBY_POLL_INTERVALS * self.interval_s)
                return None
            except Exception as exc:  # noqa: BLE001 - a failed tick must not stop the service
                self.failures += 1
                self.failing_in_a_row += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("controller tick failed", extra={"error": self.last_error,
                            "failing_in_a_row": self.failing_in_a_row})  # fmt: skip
                return None
            finally:
                self._note_lag(time.monotonic() - started)
            self.ticks += 1
            self.failing_in_a_row = 0
            self.last_error = None
            if self.standby is not None:
                token = None if self.lease is None else self.lease.token
                log.warning("controller took the fleet's lease", extra={"token": token})
                self.standby = None
        if self._again and self._scheduler.running:
            self._tick_now()
        if self.on_tick is not None:
            self.on_tick(report)
        return report
