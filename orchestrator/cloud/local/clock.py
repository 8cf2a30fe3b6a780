"""Simulated time for the offline world: a replay clock that runs N times faster than real time.

Every decision in the offline world (controller tick, eviction replay, instance agents' work) reads
simulated epoch seconds from one of these clocks, never `time.time()`:

* `ReplayClock(start_s, speed)`: sim = start_s + speed × (monotonic now − monotonic at origin).
  Node agents in other processes rebuild the same clock from (`start_s`, `speed`,
  `wall_origin`), because `time.monotonic()` is one system-wide clock on Linux and macOS
  (CLOCK_MONOTONIC / mach_absolute_time), shared by every process of the machine.
* `FakeClock(start_s)`: moves only when told (`advance`, `sleep_until`), for tests.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

#: `ReplayClock.sleep_until` never sleeps longer than this many real seconds at once, so a loop
#: that waits for a far-away sim instant still wakes up to notice a stop request.
MAX_SLEEP_WALL_SECONDS = 1.0


@runtime_checkable
class SimClock(Protocol):
    """A clock of simulated epoch seconds."""

    def now(self) -> float:
        """Simulated epoch seconds now."""
        ...

    def sleep_until(self, sim_t: float, *, max_wall_s: float = MAX_SLEEP_WALL_SECONDS) -> float:
        """Wait until `sim_t` (at most `max_wall_s` real seconds); return the sim time after."""
        ...

    def to_wall_delay(self, sim_seconds: float) -> float:
        """Real seconds that `sim_seconds` of simulated time take."""
        ...


class ReplayClock:
    """Simulated epoch seconds that advance `speed` times faster than `wall`.

    Args:
        start_s: simulated epoch seconds at `wall_origin`.
        speed: simulated seconds per real second (> 0; 600 means ten simulated minutes per
            real second).
        wall: a monotonic clock in real seconds (`time.monotonic`; a fake in tests).
        wall_origin: the `wall()` reading at which the sim time was `start_s` (default: now).
            Pass the creator's `wall_origin` to rebuild the same clock in another process.

    Raises:
        ValueError: `speed` is not positive and finite, or `start_s` is not finite.
    """

    def __init__(
        self,
        start_s: float,
        speed: float,
        wall: Callable[[], float] = time.monotonic,
        *,
        wall_origin: float | None = None,
    ) -> None:
        if not (math.isfinite(speed) and speed > 0):
            raise ValueError(f"speed must be positive and finite, got {speed}")
        if not math.isfinite(start_s):
            raise ValueError(f"start_s must be finite, got {start_s}")
        self.start_s = float(start_s)
        self.speed = float(speed)
        self._wall = wall
        self.wall_origin = float(wall() if wall_origin is None else wall_origin)

    def now(self) -> float:
        """Simulated epoch seconds now."""
        return self.start_s + self.speed * (self._wall() - self.wall_origin)

    def to_wall_delay(self, sim_seconds: float) -> float:
        """Real seconds that `sim_seconds` of simulated time take (negative stays negative)."""
        return sim_seconds / self.speed

    def sleep_until(self, sim_t: float, *, max_wall_s: float = MAX_SLEEP_WALL_SECONDS) -> float:
        """Sleep until the simulated time reaches `sim_t`, but at most `max_wall_s` real seconds.

        Returns the simulated time on waking, which is below `sim_t` when the bound cut the
        sleep short: callers loop (and check their stop condition) until it is not. A `sim_t`
        in the past returns at once.
        """
        delay = min(self.to_wall_delay(sim_t - self.now()), max_wall_s)
        if delay > 0:
            time.sleep(delay)
        return self.now()

    def __repr__(self) -> str:
        return f"ReplayClock(start_s={self.start_s}, speed={self.speed})"


class FakeClock:
    """A clock that moves only when told: `advance(s)`, or `sleep_until` (which jumps there)."""

    def __init__(self, start_s: float = 0.0, *, speed: float = 1.0) -> None:
        self._now = float(start_s)
        self.speed = float(speed)

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        """Move forward `seconds` (>= 0); return the new time.

        Raises:
            ValueError: `seconds` is negative (time does not go back).
        """
        if seconds < 0:
            raise ValueError(f"a clock does not go back: advance({seconds})")
        self._now += seconds
        return self._now

    def sleep_until(self, sim_t: float, *, max_wall_s: float = MAX_SLEEP_WALL_SECONDS) -> float:
        """Jump to `sim_t` if it is later (no real sleep); return the time."""
        self._now = max(self._now, float(sim_t))
        return self._now

    def to_wall_delay(self, sim_seconds: float) -> float:
        return sim_seconds / self.speed
