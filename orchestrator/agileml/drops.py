"""Messages a serving loop drops (unauthenticated, malformed, or one whose handling failed):
each is counted, and logged at most once per `interval_s` with how many were dropped since, so
that a flood of hostile frames neither floods the log nor hides that it happened.

    drops = DropLog(log, "param server dropped a message", node="n1")
    drops.drop("bad_mac: wrong MAC")      # counted; logged if the last line is old enough
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

#: Seconds between two log lines of one `DropLog`.
DROP_LOG_INTERVAL_S = 10.0


class DropLog:
    """Counts dropped messages and logs them, rate-limited (see the module docstring)."""

    def __init__(
        self,
        logger: logging.Logger,
        message: str,
        *,
        interval_s: float = DROP_LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        **fields: Any,
    ) -> None:
        self._log, self._message, self._fields = logger, message, fields
        self._interval_s, self._clock = interval_s, clock
        self._lock = threading.Lock()
        self.count = 0  # dropped in all
        self._unlogged = 0
        self._logged_at: float | None = None

    def drop(self, why: str) -> None:
        """Count one dropped message; log it (with the count since the last line) unless a
        line was written less than `interval_s` ago."""
        with self._lock:
            self.count += 1
            self._unlogged += 1
            now = self._clock()
            if self._logged_at is not None and now - self._logged_at < self._interval_s:
                return
            dropped, self._unlogged, self._logged_at = self._unlogged, 0, now
        self._log.warning(
            self._message, extra={**self._fields, "why": why[:300], "dropped": dropped}
        )
