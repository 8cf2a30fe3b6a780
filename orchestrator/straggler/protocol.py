"""RapidReassignment (thesis §3.3.3): its messages and both sides' decisions, as pure code.

A slow worker S (the helpee) and a faster worker F (one of S's helpers) talk peer to peer:

    F -> S  progress  (clock, timer)           F reached its progress checkpoint (75%)
    S -> F  do_this   (clock, start, end, ...)  S is behind F by more than the trigger (20%):
                                                the last 2.5% of S's rows go to F
    F -> S  begun     (assignment)              F starts on it (Algorithm 2 decides when)
    S -> F  do_this   (follow-up, 5%)           for every `begun`, while S has rows to give
    S -> F  cancel    (timer)                   S reached the rows F had not begun: S does them
    F -> S  completed (assignment, done_end)    F's update of [start, done_end) travels along;
                                                an evicted F returns [done_end, end) to S
    S -> F  listening (listens)                 whether S reads reports mid-share: not when it
                                                computes its share in one chunk (F then sends
                                                it no `progress` under that roster)

Exactly once: S alone pushes the update of its rows. It adds F's update only for an assignment
F said `begun` for before S cancelled it; a `begun` that crosses S's `cancel` is ignored, F
stops on seeing the cancel, and any update it still sends is dropped. A begun assignment whose
helper leaves the roster or overruns its deadline is taken back (`reclaim`) the same way. So
each row's update is added once, by S, whatever order the messages arrive in.

Times (`timer`, `now`) are seconds on a clock all workers share (wall time, NTP-synchronised
across machines); the thesis's timers need only coarse agreement (they compare 20% of an
iteration). Nothing here reads a clock: callers pass `now`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from orchestrator.straggler.spec import StragglerSpec

log = logging.getLogger(__name__)

# from a peer over the wire: a bool is no number, and a timer is finite
Clock = Annotated[int, Field(ge=0, strict=True)]
Row = Annotated[int, Field(ge=0, strict=True)]
Id = Annotated[int, Field(ge=0, strict=True)]  # an assignment or a roster version
Timer = Annotated[float, Field(allow_inf_nan=False, strict=True)]


class _Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    clock: Clock  # the helpee's iteration (for `progress`: the sender's)


class Progress(_Message):
    """A potential helper reached its progress checkpoint of `clock` at `timer`."""

    type: Literal["progress"] = "progress"
    timer: Timer


class Listening(_Message):
    """Whether the sender reads progress reports while it computes its own rows, under the
    roster members of `clock` (its share, and so its chunking, depends on them); sent to its
    helpers when that changes. False when it computes its share in one chunk: it checks its
    inboxes only after the whole share, when it has nothing left to offer, so a report to it
    is a wasted message."""

    type: Literal["listening"] = "listening"
    listens: bool


class DoThis(_Message):
    """Rows [start, end) of the sender's share (of `rows` rows) of `clock` under roster
    `roster_version`, offered as `assignment` (unique per sender and epoch) at `timer`."""

    type: Literal["do_this"] = "do_this"
    assignment: Id
    roster_version: Id = 0
    start: Row
    end: Row
    rows: Annotated[int, Field(ge=1, strict=True)]
    timer: Timer

    @model_validator(mode="after")
    def _range(self) -> DoThis:
        if not self.start < self.end <= self.rows:
            raise ValueError(f"need start < end <= rows, got {self.start}, {self.end}, {self.rows}")
        return self


class Begun(_Message):
    """The sender has started on `assignment`."""

    type: Literal["begun"] = "begun"
    assignment: Id


class Cancel(_Message):
    """The sender withdraws `assignments` (offers it had no `begun` for) at `timer`."""

    type: Literal["cancel"] = "cancel"
    timer: Timer
    assignments: tuple[Id, ...]


class Completed(_Message):
    """`assignment` [start, end) is done up to `done_end`; [done_end, end) goes back to the
    helpee (the helper is leaving). The update of the done rows travels with the message."""

    type: Literal["completed"] = "completed"
    assignment: Id
    roster_version: Id = 0  # the offer's: whose rows were computed
    start: Row
    end: Row
    done_end: Row
    loss_sum: float = 0.0

    @model_validator(mode="after")
    def _range(self) -> Completed:
        if not self.start <= self.done_end <= self.end:
            raise ValueError("need start <= done_end <= end")
        return self


PeerMessage = Annotated[
    Progress | Listening | DoThis | Begun | Cancel | Completed, Field(discriminator="type")
]
PEER_MESSAGE: TypeAdapter[PeerMessage] = TypeAdapter(PeerMessage)


class AssignmentState(StrEnum):
    """A reassigned range, seen by its helpee. Transitions (`TRANSITIONS`):

    sent -> begun        the helper said `begun` before the helpee cancelled
    sent -> cancelled    the helpee got there first: it sent `cancel` and does the rows itself
    begun -> completed   the helper's update was accepted (a returned tail goes back)
    begun -> reclaimed   the helper left the roster or overran: the helpee does the rows
    """

    SENT = "sent"
    BEGUN = "begun"
    CANCELLED = "cancelled"
    COMPLETED = "completed"
    RECLAIMED = "reclaimed"


TRANSITIONS: dict[AssignmentState, frozenset[AssignmentState]] = {
    AssignmentState.SENT: frozenset({AssignmentState.BEGUN, AssignmentState.CANCELLED}),
    AssignmentState.BEGUN: frozenset({AssignmentState.COMPLETED, AssignmentState.RECLAIMED}),
    AssignmentState.CANCELLED: frozenset(),  # late `begun`/`completed` are dropped
    AssignmentState.COMPLETED: frozenset(),
    AssignmentState.RECLAIMED: frozenset(),  # a late `completed` is dropped
}


@dataclass
class Assignment:
    """One range [start, end) of the helpee's rows offered to `helper`."""

    id: int
    helper: str
    start: int
    end: int
    sent_at: float
    state: AssignmentState = AssignmentState.SENT
    begun_at: float | None = None
    done_end: int | None = None  # once completed: [start, done_end) was done by the helper

    def move(self, to: AssignmentState) -> None:
        if to not in TRANSITIONS[self.state]:
            raise ValueError(f"assignment {self.id}: illegal move {self.state} -> {to}")
        self.state = to

    @property
    def rows(self) -> int:
        return self.end - self.start


def progress_difference(
    report: Progress, *, clock: int, fraction: float, checkpoint: float, now: float,
    avg_iteration_s: float,
) -> float:  # fmt: skip
    """Algorithm 1: how far (in iterations) the reporter is ahead of this worker, which is at
    `fraction` of iteration `clock`. Positive: this worker is behind."""
    completion_diff = (report.clock + checkpoint) - (clock + fraction)
    time_diff = now - report.timer  # the reporter kept going since it sent the report
    return completion_diff + time_diff / avg_iteration_s


class OwnWork:
    """The helpee side of one iteration: this worker's `rows` rows of `clock`.

    The worker takes chunks from the front (`next_chunk`); do-this assignments are cut from the
    back. When the front meets the back, `cancel_unbegun` withdraws what no helper has begun
    and hands those ranges back to the front. The iteration's rows are all accounted for when
    `finished`: every row done here or in an accepted `completed`.
    """

    def __init__(
        self,
        spec: StragglerSpec,
        *,
        clock: int,
        rows: int,
        started_at: float,
        avg_iteration_s: float | None,
        first_assignment: int = 0,
        min_assignment_rows: int = 1,
        roster_version: int = 0,
    ) -> None:
        if rows < 1:
            raise ValueError("an iteration needs at least one row")
        self.spec = spec
        self.clock = clock
        self.rows = rows
        self.started_at = started_at
        self.avg_iteration_s = avg_iteration_s
        self.min_assignment_rows = max(1, min_assignment_rows)  # smaller does not pay
        self.roster_version = roster_version  # the roster the rows are cut by
        self.front = 0  # rows [0, front) are taken by this worker
        self.tail = rows  # rows [tail, rows) are offered to helpers
        self.taken_back: list[tuple[int, int]] = []  # cancelled, reclaimed or returned ranges
        self.assignments: dict[int, Assignment] = {}
        self._next_id = first_assignment
        self.done_rows = 0  # rows this worker finished
        self.helped_rows = 0  # rows whose update came from a helper
        self.dropped = 0  # late or unexpected messages ignored
        self.progress_sent = False
        self.cancelled = False  # `cancel_unbegun` ran
        self.cancelled_at: float | None = None

    # -- this worker's own progress -------------------------------------------------------

    def next_chunk(self, max_rows: int) -> tuple[int, int] | None:
        """The next rows for this worker, or None when it has none left to take right now."""
        if self.front < self.tail:
            start = self.front
            self.front = min(self.tail, start + max_rows)
            return start, self.front
        max_rows = max(1, max_rows)
        if self.taken_back:
            start, end = self.taken_back.pop()
            if end - start > max_rows:
                self.taken_back.append((start + max_rows, end))
                end = start + max_rows
            return start, end
        return None

    def record_done(self, rows: int) -> None:
        self.done_rows += rows

    @property
    def own_range_done(self) -> bool:
        """The front met the back: this worker took every row it did not give away."""
        return self.front >= self.tail

    @property
    def next_id(self) -> int:
        return self._next_id

    def fraction(self) -> float:
        """How far through the iteration this worker is, counting rows given to helpers."""
        open_states = (AssignmentState.SENT, AssignmentState.BEGUN)
        given = sum(
            a.rows if a.state in open_states else (a.done_end or a.start) - a.start
            for a in self.assignments.values()
            if a.state in open_states or a.state is AssignmentState.COMPLETED
        )
        return min(1.0, (self.done_rows + given) / self.rows)

    def finished(self) -> bool:
        """Every row is done here or by a helper whose update was accepted."""
        open_states = (AssignmentState.SENT, AssignmentState.BEGUN)
        return (
            self.own_range_done
            and not self.taken_back
            and not any(a.state in open_states for a in self.assignments.values())
        )

    def waiting_on(self) -> set[str]:
        """Helpers whose begun assignments are not completed yet."""
        return {a.helper for a in self.assignments.values() if a.state is AssignmentState.BEGUN}

    # -- messages from helpers -------------------------------------------------------------

    def on_progress(self, helper: str, report: Progress, now: float) -> DoThis | None:
        """Algorithm 1 and the trigger: an initial assignment for `helper`, or None."""
        avg = self.avg_iteration_s
        if avg is None:  # first iteration: estimate from this one so far
            elapsed, fraction = now - self.started_at, self.fraction()
            avg = elapsed / fraction if fraction > 0 and elapsed > 0 else None
        if avg is None or avg <= 0 or self.cancelled:
            return None
        behind = progress_difference(
            report,
            clock=self.clock,
            fraction=self.fraction(),
            checkpoint=self.spec.progress_checkpoint,
            now=now,
            avg_iteration_s=avg,
        )
        if behind <= self.spec.trigger_threshold:
            return None
        if any(
            a.helper == helper and a.state is AssignmentState.SENT
            for a in self.assignments.values()
        ):
            return None  # one unanswered offer per helper at a time
        return self._assign(helper, self.spec.initial_assignment, now)

    def on_begun(self, helper: str, msg: Begun, now: float) -> DoThis | None:
        """The helper started: mark it, and offer a follow-up while there is work to give."""
        a = self._own(helper, msg.assignment, msg.clock)
        if a is None or a.state is not AssignmentState.SENT:
            self.dropped += 1  # crossed our cancel (or a duplicate): we do those rows
            return None
        a.move(AssignmentState.BEGUN)
        a.begun_at = now
        if self.cancelled:
            return None
        return self._assign(helper, self.spec.follow_up_assignment, now)

    def on_completed(self, helper: str, msg: Completed) -> bool:
        """Accept the helper's update of [start, done_end) if the assignment is begun and
        still ours to accept; returns whether the caller must add the update."""
        a = self._own(helper, msg.assignment, msg.clock)
        if a is None:
            self.dropped += 1
            return False
        same = (msg.start, msg.end, msg.roster_version) == (a.start, a.end, self.roster_version)
        if a.state is not AssignmentState.BEGUN or not same:
            self.dropped += 1  # not what we offered (or offered by another roster's rows)
            return False
        a.move(AssignmentState.COMPLETED)
        a.done_end = msg.done_end
        if msg.done_end < a.end:
            self.taken_back.append((msg.done_end, a.end))  # a leaving helper returned it
        self.helped_rows += msg.done_end - a.start
        return True

    # -- this worker's decisions -----------------------------------------------------------

    def progress_due(self) -> bool:
        """Whether to send `progress` to the helpees now (once, at the checkpoint)."""
        if self.progress_sent or self.fraction() < self.spec.progress_checkpoint:
            return False
        self.progress_sent = True
        return True

    def cancel_unbegun(self, now: float) -> dict[str, Cancel]:
        """At the end of the own range: withdraw every offer no helper has begun; their rows
        come back to this worker. Returns one `cancel` per helper concerned."""
        self.cancelled, self.cancelled_at = True, now
        withdrawn: dict[str, list[int]] = {}
        for a in self.assignments.values():
            if a.state is AssignmentState.SENT:
                a.move(AssignmentState.CANCELLED)
                self.taken_back.append((a.start, a.end))
                withdrawn.setdefault(a.helper, []).append(a.id)
        return {
            h: Cancel(clock=self.clock, timer=now, assignments=tuple(ids))
            for h, ids in withdrawn.items()
        }

    def reclaim(self, now: float, alive: set[str] | frozenset[str]) -> list[Assignment]:
        """Take back begun assignments whose helper is not in `alive` or overran its deadline:
        `help_timeout_iterations` average iterations (in a first iteration, the time the own
        rows took stands in for the average), and at least `help_timeout_min_s`."""
        avg = self.avg_iteration_s
        if avg is None and self.cancelled_at is not None:
            avg = self.cancelled_at - self.started_at
        timeout = self.spec.help_timeout_min_s
        if avg is not None:
            timeout = max(timeout, self.spec.help_timeout_iterations * avg)
        out = []
        for a in self.assignments.values():
            if a.state is not AssignmentState.BEGUN:
                continue
            assert a.begun_at is not None
            if a.helper not in alive or now - a.begun_at > timeout:
                a.move(AssignmentState.RECLAIMED)
                self.taken_back.append((a.start, a.end))
                out.append(a)
        return out

    def _assign(self, helper: str, fraction: float, now: float) -> DoThis | None:
        size = max(self.min_assignment_rows, round(fraction * self.rows))
        if self.tail - self.front < 2 * size:
            return None  # too little left: giving it away would only add waiting
        self.tail -= size
        a = Assignment(self._next_id, helper, self.tail, self.tail + size, now)
        self._next_id += 1
        self.assignments[a.id] = a
        return DoThis(
            clock=self.clock,
            assignment=a.id,
            start=a.start,
            end=a.end,
            rows=self.rows,
            timer=now,
            roster_version=self.roster_version,
        )

    def _own(self, helper: str, assignment: int, clock: int) -> Assignment | None:
        a = self.assignments.get(assignment)
        if a is None or a.helper != helper or clock != self.clock:
            return None
        return a


class HelpDecision(StrEnum):
    """Algorithm 2's answer to a `do_this`."""

    DISCARD = "discard"  # withdrawn (older than a cancel) or for an iteration ahead of ours
    HELP_NOW = "help_now"  # an older iteration, or our own rows are done
    SAVE = "save"  # same iteration, own rows not done: decide at the end of them


class HelpDesk:
    """The helper side: Algorithm 2, and the cancellations that withdraw offers.

    A `cancel` names the offers it withdraws (those its sender had no `begun` for), which is
    Algorithm 2's "timestamp <= last cancellation" test made exact: an offer this worker has
    begun but whose `begun` crossed the cancel is named too, so the helper stops on it.
    """

    def __init__(self) -> None:
        # helpee -> (clock, assignments withdrawn at that clock)
        self._cancelled: dict[str, tuple[int, set[int]]] = {}
        self._saved: list[tuple[str, DoThis]] = []

    def on_do_this(self, helpee: str, msg: DoThis, *, clock: int, own_done: bool) -> HelpDecision:
        """Algorithm 2 for a `do_this` from `helpee`, this worker being at `clock`."""
        if not self.wanted(helpee, msg) or msg.clock > clock:
            return HelpDecision.DISCARD
        if msg.clock < clock or own_done:
            return HelpDecision.HELP_NOW
        self._saved.append((helpee, msg))
        return HelpDecision.SAVE

    def on_cancel(self, helpee: str, msg: Cancel) -> None:
        clock, ids = self._cancelled.get(helpee, (msg.clock, set()))
        if msg.clock > clock:
            clock, ids = msg.clock, set()  # offers of older clocks are settled by now
        if msg.clock == clock:
            ids.update(msg.assignments)
        self._cancelled[helpee] = (clock, ids)

    def wanted(self, helpee: str, msg: DoThis) -> bool:
        """False once a `cancel` from the helpee withdrew the offer. A cancel of a later clock
        settles every older offer: the helpee finished that clock, so it withdrew them all."""
        clock, ids = self._cancelled.get(helpee, (-1, set()))
        return msg.clock > clock or (msg.clock == clock and msg.assignment not in ids)

    def take_saved(self) -> list[tuple[str, DoThis]]:
        """At the end of this worker's own rows: the saved offers still wanted, oldest first."""
        saved, self._saved = self._saved, []
        return [(h, m) for h, m in saved if self.wanted(h, m)]

    def forget(self) -> None:
        """Drop everything (a new epoch: every earlier offer is void)."""
        self._cancelled.clear()
        self._saved.clear()
