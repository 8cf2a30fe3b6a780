"""What the input fuzzers share (issue #19, item 2): a tally of outcomes that keeps each crash
with the case that made it, and a time limit per case, so that a hang counts as a crash instead
of stalling the suite."""

from __future__ import annotations

import signal
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

from orchestrator.errors import UserError

MAX_CRASHES_SHOWN = 10


class CaseTimeout(BaseException):
    """A case ran over its time limit (a BaseException: the code under test may catch any
    Exception and must not swallow this)."""


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise `CaseTimeout` in the block when it runs longer than `seconds` (main thread only)."""

    def expire(signum: int, frame: FrameType | None) -> None:
        raise CaseTimeout(f"ran over {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Tally:
    """Outcomes of a fuzzer's cases: accepted, rejected (the clean error), crashed."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.outcomes: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()
        self.crashes: list[str] = []

    def accepted(self, kind: str) -> None:
        self.kinds[kind] += 1
        self.outcomes["accepted"] += 1

    def rejected(self, kind: str) -> None:
        self.kinds[kind] += 1
        self.outcomes["rejected"] += 1

    def crashed(self, kind: str, case: object, what: object) -> None:
        self.kinds[kind] += 1
        self.outcomes["crashes"] += 1
        text = repr(case)
        if len(text) > 300:
            text = text[:300] + "..."
        self.crashes.append(f"[{kind}] {what}\n    case: {text}")

    def judge(
        self,
        kind: str,
        case: object,
        run: Callable[[], str | None],
        unclear: Callable[[UserError], str | None],
        limit_s: float,
    ) -> None:
        """Run one case within `limit_s` and file it: `run` returns what is wrong with an
        accepted input (None: nothing); a UserError is a rejection unless `unclear` says what
        it fails to name; any other exception or a time-out is a crash."""
        try:
            with time_limit(limit_s):
                problem = run()
        except UserError as exc:
            problem = unclear(exc)
            if problem is None:
                self.rejected(kind)
            else:
                self.crashed(kind, case, f"unclear error ({problem}): {exc.message[:500]!r}")
        except (Exception, CaseTimeout) as exc:  # noqa: BLE001 - any other is the finding
            self.crashed(kind, case, f"{type(exc).__name__}: {str(exc)[:500]}")
        else:
            if problem is None:
                self.accepted(kind)
            else:
                self.crashed(kind, case, f"accepted but {problem}")

    @property
    def cases(self) -> int:
        return sum(self.outcomes.values())

    def summary(self) -> str:
        return (
            f"{self.name}: {self.cases} cases, {self.outcomes['accepted']} accepted, "
            f"{self.outcomes['rejected']} rejected, {self.outcomes['crashes']} crashes; "
            f"by kind {dict(sorted(self.kinds.items()))}"
        )

    def check(self, *, min_cases: int) -> None:
        """Print the summary (quoted in the README) and fail on any crash."""
        print(f"\n{self.summary()}")
        assert self.cases >= min_cases, self.summary()
        shown = "\n".join(self.crashes[:MAX_CRASHES_SHOWN])
        assert not self.crashes, f"{len(self.crashes)} crashes, the first ones:\n{shown}"
