"""No progress, no spending: a training job whose instances run without a sign of life for
`stall_after_s` (market seconds) has them released, and fails after `attempts` such releases.
The clock starts when the job's first instance alive now was launched, and again at every
iteration trained and every node its runtime hears from for the first time (a node that joins
is alive, however long it then loads): nodes that never join, a runtime that cannot start, an
agent that died all cost at most that long per attempt.

    watch = StallWatch(stall_after_s=600.0, attempts=3, stalls_so_far=count_stall_events)
    seen = JobStall()  # the job's own (its `ControllerJob` keeps it)
    stall = watch.check(job_id, seen, outcome, alive, now_s)   # None, or a Stall to act on

The attempts already made are counted from the job's stall events the first time a job is
seen, so a restarted controller goes on counting; when it last progressed is not kept, so a
restart gives a job a fresh clock (never less time).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from orchestrator.controller.outcomes import TrainingOutcome
from orchestrator.store.models import InstanceRecord


@dataclass(frozen=True)
class Stall:
    """A job found stalled: the `attempt`-th time (it fails at `attempts`)."""

    attempt: int
    attempts: int
    stalled_s: float
    iteration: int

    @property
    def fails(self) -> bool:
        return self.attempt >= self.attempts


@dataclass
class JobStall:
    """What the watch saw of one job's progress (kept by the job's owner; None: not yet)."""

    signs: tuple[int, int] | None = None  # (iterations done, nodes heard) when last changing
    since_s: float = 0.0  # when they last changed (or the job was first seen)
    attempts: int = 0  # stalls so far (its stall events, read at the first check)


class StallWatch:
    """Judges a training job's progress (see the module docstring); what it saw of a job is
    the job's `JobStall`."""

    def __init__(
        self, *, stall_after_s: float, attempts: int, stalls_so_far: Callable[[str], int]
    ) -> None:
        self.stall_after_s = stall_after_s
        self.attempts = attempts
        self._stalls_so_far = stalls_so_far  # the job's stall events (read once per job)

    def check(
        self,
        job_id: str,
        seen: JobStall,
        outcome: TrainingOutcome,
        alive: Sequence[InstanceRecord],
        now_s: float,
    ) -> Stall | None:
        """Whether the job is stalled now: no sign of life (an iteration trained, a node
        heard from for the first time) since its clock started. Only a live runtime's outcome
        counts (after a restart, the runtime resumes from a checkpoint: any change of its
        figures, down as well as up, starts the clock again)."""
        if not outcome.live:
            return None
        signs = (outcome.iterations_done, outcome.nodes_heard)
        if seen.signs is None:  # read first: a failed read leaves it to the next check
            attempts = self._stalls_so_far(job_id)
            seen.signs, seen.since_s, seen.attempts = signs, now_s, attempts
        if signs != seen.signs:
            seen.signs, seen.since_s = signs, now_s
            return None
        if not alive or outcome.trained:
            return None  # nothing is paid for, or nothing is left to train
        started = max(seen.since_s, min(r.launched_at for r in alive))
        if now_s - started < self.stall_after_s:
            return None
        seen.attempts += 1
        seen.since_s = now_s  # the next attempt's clock starts with its new instances
        return Stall(seen.attempts, self.attempts, now_s - started, outcome.iterations_done)
