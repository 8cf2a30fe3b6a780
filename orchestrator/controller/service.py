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
from datetime import UTC, datetime

from apscheduler.schedulers.background import BackgroundScheduler

from orchestrator.api.health import TickHealth
from orchestrator.cloud.notices import InterruptionNotice
from orchestrator.controller.core import Controller, TickReport

log = logging.getLogger(__name__)

TICK_JOB_ID = "controller-tick"
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
        """Stop the scheduler; waits for a running tick to finish."""
        if self._scheduler.running:
            self._scheduler.shutdown(wait=True)

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
        return TickHealth(self.ticks, self.failures, self.failing_in_a_row, self.last_error)

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

    def _tick_now(self) -> None:
        self._scheduler.modify_job(TICK_JOB_ID, next_run_time=datetime.now(UTC))

    def tick_once(self) -> TickReport | None:
        """One tick now; errors are logged and counted, never raised (the next tick retries)."""
        with self._lock:
            self._again = False
            started = time.monotonic()
            try:
                report = self.controller.tick(self.clock())
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
        if self._again and self._scheduler.running:
            self._tick_now()
        if self.on_tick is not None:
            self.on_tick(report)
        return report
