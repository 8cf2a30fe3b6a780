"""How far past the fastest worker the servers let workers compute: the horizon's span.

The coordinator hears each worker's clock with its heartbeat (up to a heartbeat late), checks
the horizon from its reconfiguration loop (every half heartbeat) and moves it with a call to
every server. A fixed span of clocks is therefore too short when iterations are much shorter
than a heartbeat: the workers reach the horizon before it moves and stall there (the digits
CNN, at ~20 ms per iteration and 0.1 s heartbeats, stalled at a span of 8 clocks). A longer
span has a price too: joins and evictions take effect just past the horizon, so they wait for
the workers to get there. `HorizonSpan` keeps the span at a few heartbeats of work.
"""

from __future__ import annotations

import math

HEARTBEATS_AHEAD = 4  # the span, in heartbeats of work at the measured rate
MAX_SPAN_CLOCKS = 10_000  # never more (TrainingSpec.horizon_clocks' own bound)
RATE_WEIGHT = 0.3  # of the newest measurement in the running rate


class HorizonSpan:
    """The span in clocks: at least `min_clocks`, and `HEARTBEATS_AHEAD` heartbeats of work
    at the rate the fastest worker's clock has been moving (a running average)."""

    def __init__(self, min_clocks: int, heartbeat_s: float) -> None:
        self.min_clocks = min_clocks
        self.heartbeat_s = heartbeat_s
        self.clocks_per_s: float | None = None
        self._mark: tuple[int, float] | None = None  # (clock, when) of the last measurement

    def observe(self, clock: int, now_s: float) -> None:
        """The fastest live worker is at `clock` at `now_s`; a clock that went back (a
        roll-back) starts the measurement over, keeping the rate."""
        mark = self._mark
        if mark is None or clock < mark[0] or now_s <= mark[1]:
            self._mark = (clock, now_s)
            return
        if now_s - mark[1] < self.heartbeat_s:
            return  # heartbeats bring clocks in steps: measure over at least one
        rate = (clock - mark[0]) / (now_s - mark[1])
        old = self.clocks_per_s
        self.clocks_per_s = rate if old is None else old + RATE_WEIGHT * (rate - old)
        self._mark = (clock, now_s)

    @property
    def clocks(self) -> int:
        """The span now: `min_clocks` until a rate is measured."""
        if self.clocks_per_s is None:
            return self.min_clocks
        ahead = math.ceil(self.clocks_per_s * HEARTBEATS_AHEAD * self.heartbeat_s)
        return max(self.min_clocks, min(ahead, MAX_SPAN_CLOCKS))
