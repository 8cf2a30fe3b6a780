"""Time never runs back: every tick raises the store's clock high-water mark, and a controller
whose clock reads behind it refuses to tick (`ClockRewoundError`), so that nothing is decided
or billed at a time before what was already decided and billed there (an instance that ran 17
hours is never billed as if it ran 5 minutes).

A replay (`--replay-start`) restarted against a store whose controller already ran further
continues from the mark instead (`wiring.controller_clock`); on the wall clock, a step back
(NTP) only skips the ticks until the clock is past the mark again.
"""

from __future__ import annotations

from orchestrator.errors import OrchestratorError
from orchestrator.market.prices import to_datetime
from orchestrator.store.protocol import Store

#: A clock this little behind the mark is not a rewind (a wall clock's jitter).
CLOCK_SLACK_S = 1.0


class ClockRewoundError(OrchestratorError):
    """The controller's clock reads behind the store's high-water mark."""

    def __init__(self, now_s: float, mark_s: float) -> None:
        self.now_s, self.mark_s = now_s, mark_s
        super().__init__(
            f"the clock reads {to_datetime(now_s):%Y-%m-%d %H:%M:%S} UTC, "
            f"{mark_s - now_s:.0f} s behind {to_datetime(mark_s):%Y-%m-%d %H:%M:%S} UTC, where "
            "this store's controller already decided and billed: not ticking until it is past "
            "that (a replay restarted with an earlier --replay-start, or a clock stepped back)"
        )


def check_clock(store: Store, now_s: float) -> None:
    """Raise the store's mark to `now_s`; refuse a clock behind it.

    Raises:
        ClockRewoundError: `now_s` is more than `CLOCK_SLACK_S` behind the mark.
    """
    mark = store.advance_clock(now_s)
    if now_s < mark - CLOCK_SLACK_S:
        raise ClockRewoundError(now_s, mark)
