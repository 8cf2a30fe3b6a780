"""FlexRR in an AgileML worker: its own rows in chunks, with RapidReassignment between chunks.

A worker computes its share of each clock's global batch chunk by chunk (about
`checks_per_iteration` chunks) and checks its peer inboxes after every chunk, and its `work`
inbox while it waits on servers (see `peers`). As a helpee it offers the end of its rows to
helpers that report more progress (`straggler.protocol.OwnWork`); as a helper it computes
offered rows of its helpees (Algorithm 2, `HelpDesk`) on the parameters it has loaded and sends
their gradient back. The helpee adds accepted gradients to its own before it pushes, so the
servers' exactly-once accounting per (worker, clock, partition) is unchanged: a helped row's
update reaches the servers once, inside its owner's push.

With injected stragglers (`StragglerSpec.injected`), each chunk's work is also emulated by a
`Pacer` sleep, with or without reassignment (`flexrr: false` gives plain BSP/SSP under the same
pattern).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlparse

import torch
import zmq

from orchestrator.agileml.errors import AgileMLError
from orchestrator.agileml.peers import PeerInboxes, PeerLink
from orchestrator.agileml.roster import Roster
from orchestrator.straggler.groups import helpee_groups, helper_groups
from orchestrator.straggler.patterns import Pacer
from orchestrator.straggler.protocol import (
    Begun,
    Cancel,
    Completed,
    DoThis,
    HelpDecision,
    HelpDesk,
    Listening,
    OwnWork,
    PeerMessage,
    Progress,
)
from orchestrator.straggler.spec import StragglerSpec

if TYPE_CHECKING:
    from orchestrator.agileml.partitions import PartitionLayout


class Worker(Protocol):
    """What FlexRR needs of the AgileML worker it runs for (`agileml.worker.Worker`): its
    partition layout, and computing, stashing and taking the gradients of rows of a share."""

    layout: PartitionLayout
    device: torch.device

    @property
    def dataset_rows(self) -> int: ...
    @property
    def batch_rows(self) -> int: ...
    @property
    def micro_batches(self) -> int: ...
    def share_rows(self, identity: str, clock: int) -> int: ...
    def backward_first_rows(self, n: int) -> float: ...
    def backward_rows(
        self, identity: str, clock: int, start: int, end: int
    ) -> tuple[float, bool]: ...
    def preload(self, identity: str, clock: int, fraction: float) -> None: ...
    def stash_grads(self) -> list[torch.Tensor | None]: ...
    def restore_grads(self, stash: list[torch.Tensor | None]) -> None: ...
    def take_grads(self) -> list[torch.Tensor]: ...
    def check_abort(self) -> None: ...


log = logging.getLogger(__name__)

AVERAGE_WEIGHT = 0.3  # of the newest iteration in the running average iteration time
WAIT_POLL_MS = 5  # how long a worker waiting on its helpers sleeps on its inbox

# the larger of the two chunks timed to size chunks: a wide base, because the first iteration
# runs while the other nodes load and a noisy per-row slope splits a share that should stay whole
# (on the 5M-parameter MLR, a 32-row base split one worker's share of 128 rows in two, and every
# BSP clock waited for its second pass over the 20 MB gradient)
CALIBRATION_ROWS = 128

_Groups = dict[str, tuple[str, ...]]  # worker -> its helpers (or helpees)


@dataclass
class ReassignStats:
    """What reassignment did in this worker (summed over iterations)."""

    own_rows: int = 0  # rows of this worker's shares (all iterations)
    rows_helped_by_others: int = 0  # of those, rows whose update came from a helper
    rows_helped_for_others: int = 0  # rows this worker computed for helpees (accepted or not)
    offers: int = 0  # do_this sent
    cancelled_offers: int = 0
    reclaimed: int = 0  # begun assignments taken back
    returned: int = 0  # assignments this worker gave back unfinished (leaving)
    aborted_help: int = 0  # help stopped by a cancel
    dropped_messages: int = 0  # late, foreign-epoch or unexpected messages
    busy_s: float = 0.0  # computing and emulated work, own and help
    preload_hits: int = 0
    preload_misses: int = 0
    iterations: int = 0
    progress_skipped: int = 0  # reports not sent: the helpee was ahead, or reads none

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.__dict__.items()}


class HelpAborted(AgileMLError):
    """Internal: the helpee withdrew the offer being worked on."""


class Reassigner:
    """FlexRR for one worker (see the module docstring). Driven by the `Worker` on its thread.

    Failure semantics: an epoch change (roll-back) voids every offer in flight on both sides;
    a helper that dies mid-help has its range taken back by the helpee after the deadline (or
    when the roll-back comes first); a helper that is leaving returns the unfinished rows.
    """

    def __init__(
        self,
        spec: StragglerSpec,
        *,
        worker_id: str,
        link: PeerLink | None,
        leaving: Callable[[], bool] = lambda: False,
        now: Callable[[], float] = time.time,
    ) -> None:
        """`link` carries the peer messages; None (or `spec.flexrr` false) only paces."""
        self.spec = spec
        self.worker_id = worker_id
        self._now = now
        self._leaving = leaving
        self.link = link if spec.flexrr else None
        self.desk = HelpDesk()
        self.stats = ReassignStats()
        self._pacer: Pacer | None = None
        self.epoch = -1
        self.peers: dict[str, PeerInboxes] = {}  # worker -> its FlexRR inboxes
        self._roster: Roster | None = None
        self._groups: dict[
            tuple[str, ...], tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]
        ] = {}
        self._own: OwnWork | None = None
        self._next_assignment = 0
        self._help_results: list[tuple[list[torch.Tensor], float]] = []
        self._pending: deque[tuple[str, DoThis]] = deque()
        self._helping = False
        self._avg_iteration_s: float | None = None
        self._last_start: float | None = None
        self._clock = 0  # the worker's clock, for Algorithm 2
        self._min_chunk_rows: int | None = None  # from `_calibrate`
        self._last_clock = -2  # of the last `compute_own`
        # (clock, peers that reported reaching their progress checkpoint of that clock)
        self._ahead: tuple[int, set[str]] = (-1, set())
        # helpees that said they read no reports (`Listening`) -> the members of the clock they
        # said it for: their share, and so their chunking, holds only while those do
        self._deaf: dict[str, tuple[str, ...]] = {}
        # what this worker last told its helpers: (members, helpers, listens)
        self._told: tuple[tuple[str, ...], frozenset[str], bool] | None = None

    @property
    def socket(self) -> zmq.Socket[Any] | None:
        """The `work` inbox, for the worker to poll while it waits on servers (progress
        reports have their own, read only in `check`)."""
        return self.link.inbox if self.link is not None else None

    def update_view(
        self, *, epoch: int, roster: Roster | None, peers: dict[str, PeerInboxes]
    ) -> None:
        """Follow the job's view; a new epoch voids every offer in flight."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.desk.forget()
            self._own = None
            self._pending.clear()
            self._help_results.clear()
            self._last_start = None
            self._ahead = (-1, set())  # reports of the voided run say nothing now
            self._deaf.clear()  # a `Listening` of the voided run may be lost: assume listening
            self._told = None
        self._roster = roster
        self.peers = dict(peers)
        if self.link is not None:
            self.link.forget_except({e for p in peers.values() for e in (p.work, p.progress)})

    # -- the worker's own rows ---------------------------------------------------------------

    def compute_own(self, w: Worker, clock: int) -> tuple[float, int, list[list[torch.Tensor]]]:
        """Compute (or have helped) every row of this worker's share of `clock`; gradients of
        the rows done here accumulate in the model. Returns (loss sum, rows, the helpers'
        gradient partitions to add).

        Raises:
            StaleViewError: the worker's abort callback fired (via `Worker.check_abort`).
        """
        self._clock = clock
        rows = w.share_rows(self.worker_id, clock)
        now = self._now()
        own = self._begin_own(w, clock, rows, now)
        self._tell_listening(clock, rows, w.micro_batches)
        self._preload(w, clock)
        own_end_at: float | None = None
        try:
            loss, own_end_at = self._work_own_rows(w, own)
        finally:
            self._close_own(own)
        self._log_iteration(own, now, own_end_at)
        self.stats.own_rows += rows
        self.stats.rows_helped_by_others += own.helped_rows
        self.stats.dropped_messages += own.dropped
        self.stats.offers += len(own.assignments)
        self.stats.iterations += 1
        results, self._help_results = self._help_results, []
        return loss + sum(s for _, s in results), rows, [g for g, _ in results]

    def _begin_own(self, w: Worker, clock: int, rows: int, now: float) -> OwnWork:
        """Time the iteration average (not across a redo or a gap), calibrate chunks once, and
        start the bookkeeping of this worker's own rows of `clock`."""
        if clock != self._last_clock + 1:
            self._last_start = None  # a redo or a gap: not an iteration's length
            self._ahead = (-1, set())  # and who was ahead before the redo may not be now
        self._last_clock = clock
        if self._last_start is not None:
            took = now - self._last_start
            avg = self._avg_iteration_s
            self._avg_iteration_s = took if avg is None else avg + AVERAGE_WEIGHT * (took - avg)
        self._last_start = now
        self._ensure_pacer(rows)
        min_chunk_rows = self.calibrate(w)
        own = OwnWork(
            self.spec,
            clock=clock,
            rows=rows,
            started_at=now,
            avg_iteration_s=self._avg_iteration_s,
            first_assignment=self._next_assignment,
            min_assignment_rows=min_chunk_rows,
            roster_version=self._roster.version if self._roster is not None else 0,
        )
        self._own, self._help_results = own, []
        return own

    def _work_own_rows(self, w: Worker, own: OwnWork) -> tuple[float, float | None]:
        """Compute chunks of the own rows, checking the inbox between them, until every row is
        done here or by a helper; returns (loss sum, when the own range was done)."""
        clock, rows = own.clock, own.rows
        chunk = self._chunk_rows(rows, w.micro_batches)
        loss = 0.0
        own_end_at: float | None = None
        while True:
            w.check_abort()
            span = own.next_chunk(chunk)
            if span is None and own.own_range_done and not own.cancelled:
                own_end_at = self._now()
                self.check(w)  # a `begun` already here keeps its assignment
                for helper, cancel in own.cancel_unbegun(self._now()).items():
                    self.stats.cancelled_offers += len(cancel.assignments)
                    self._send(helper, cancel)
                # Algorithm 2, end of own rows: the saved offers are helped right after this
                # worker's push (its own update should not wait for them), at the next check
                self._pending.extend(self.desk.take_saved())
                continue
            if span is not None:
                from_front = span[1] <= own.tail  # taken-back ranges lie past the tail
                fraction = (span[0] / rows, span[1] / rows) if from_front else None
                loss += self._work(w, self.worker_id, clock, span, fraction)
                own.record_done(span[1] - span[0])
                self.check(w)  # first: the helpees' own reports decide whom ours goes to
                if own.progress_due():
                    self._report_progress(clock)
                continue
            if own.finished():
                return loss, own_end_at
            members = set(self._roster.members(clock)) if self._roster is not None else set()
            for a in own.reclaim(self._now(), frozenset(members & set(self.peers))):
                self.stats.reclaimed += 1
                log.debug("took back a begun assignment", extra={"helper": a.helper, "id": a.id})
            self.check(w, WAIT_POLL_MS)

    def _log_iteration(self, own: OwnWork, started: float, own_end_at: float | None) -> None:
        if not log.isEnabledFor(logging.DEBUG):
            return
        end = self._now()
        log.debug(
            "iteration rows done",
            extra={
                "clock": own.clock,
                "rows": own.rows,
                "helped": own.helped_rows,
                "offers": len(own.assignments),
                "took_s": round(end - started, 4),
                "waited_s": round(end - (own_end_at or end), 4),
                "multiplier": self._pacer.multiplier(own.clock, 0, 1) if self._pacer else 1.0,
            },
        )

    def _close_own(self, own: OwnWork) -> None:
        """The iteration's rows are settled, or given up (StaleViewError): withdraw what no
        helper has begun, and never reuse its assignment ids."""
        if not own.cancelled:
            for helper, cancel in own.cancel_unbegun(self._now()).items():
                self._send(helper, cancel)
        self._next_assignment = own.next_id
        self._own = None  # offers of this clock are helped from the next check on

    def at_clock(self, clock: int) -> None:
        """The worker starts (pulling for) `clock`: offers of earlier clocks are help-now."""
        self._clock = clock

    # -- messages ----------------------------------------------------------------------------

    def check(self, w: Worker, timeout_ms: int = 0) -> None:
        """A message check: handle the progress reports that came, then everything in the
        work inbox (waiting up to `timeout_ms` for the first message there), then any help that
        is due."""
        if self.link is None:
            return
        self._drain(w, 0, progress=True)
        self._drain(w, timeout_ms, progress=False)
        self._help_pending(w)

    def _drain(self, w: Worker, timeout_ms: int, *, progress: bool) -> None:
        """Handle the messages of one inbox, waiting up to `timeout_ms` for the first."""
        assert self.link is not None
        while (got := self.link.receive(timeout_ms, progress=progress)) is not None:
            timeout_ms = 0
            sender, epoch, message, tensors = got
            if epoch != self.epoch:
                self.stats.dropped_messages += 1
                continue
            self._handle(w, sender, message, tensors)

    def _handle(
        self, w: Worker, sender: str, message: PeerMessage, tensors: dict[str, torch.Tensor]
    ) -> None:
        own = self._own
        helpers, helpees = self._groups_at(message.clock)
        if isinstance(message, Listening):
            if message.listens or self._roster is None:
                self._deaf.pop(sender, None)
            else:
                self._deaf[sender] = self._roster.members(message.clock)
        elif isinstance(message, Progress):
            self._note_ahead(sender, message.clock)
            # a report of an earlier clock was sent before this worker's last pull: the helper
            # has waited on the servers since, not gone on computing, so it says nothing about
            # who is behind now
            current = own is not None and message.clock >= own.clock
            if own is not None and current and sender in helpers.get(self.worker_id, ()):
                offer = own.on_progress(sender, message, self._now())
                if offer is not None:
                    self._send(sender, offer)
        elif isinstance(message, DoThis):
            if sender not in helpees.get(self.worker_id, ()) or self._leaving():
                self.stats.dropped_messages += 1  # not ours to help (the helpee will cancel)
                return
            own_done = own is None or own.clock < self._clock or own.own_range_done
            decision = self.desk.on_do_this(sender, message, clock=self._clock, own_done=own_done)
            if decision is HelpDecision.HELP_NOW:
                self._pending.append((sender, message))
        elif isinstance(message, Begun):
            if own is None or own.clock != message.clock:
                self.stats.dropped_messages += 1
                return
            follow_up = own.on_begun(sender, message, self._now())
            if follow_up is not None:
                self._send(sender, follow_up)
        elif isinstance(message, Cancel):
            self.desk.on_cancel(sender, message)
        elif isinstance(message, Completed):
            grads = self._gradient(w, tensors)
            if own is None or own.clock != message.clock or grads is None:
                self.stats.dropped_messages += 1
                return
            if own.on_completed(sender, message):
                self._help_results.append((grads, message.loss_sum))

    def _gradient(self, w: Worker, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor] | None:
        sizes = [w.layout.size(p) for p in range(w.layout.num_partitions)]
        grads = [tensors.get(f"g{p}") for p in range(len(sizes))]
        if len(tensors) != len(sizes) or any(
            g is None or g.dtype != torch.float32 or g.numel() != n
            for g, n in zip(grads, sizes, strict=True)
        ):
            return None
        return [g.reshape(-1) for g in grads if g is not None]

    # -- helping -------------------------------------------------------------------------

    def _help_pending(self, w: Worker) -> None:
        """Help with the pending offers that are due: all of them between iterations; while
        this worker's own rows of a clock are open, only offers of older clocks (those first
        wait until its own update is pushed)."""
        if self._helping:
            return  # help runs one at a time; the rest waits in `_pending`
        keep: deque[tuple[str, DoThis]] = deque()
        while self._pending:
            helpee, offer = self._pending.popleft()
            if self._own is not None and self._own.clock == self._clock <= offer.clock:
                keep.append((helpee, offer))
            elif self.desk.wanted(helpee, offer):
                self._help(w, helpee, offer)
        self._pending.extendleft(reversed(keep))

    def _help(self, w: Worker, helpee: str, offer: DoThis) -> None:
        """Compute `offer`'s rows of `helpee` and send their gradient back."""
        try:
            rows = w.share_rows(helpee, offer.clock)
        except AgileMLError:
            rows = -1
        version = self._roster.version if self._roster is not None else 0
        if rows != offer.rows or offer.roster_version != version or helpee not in self.peers:
            # rows cut by another roster than ours, or a helpee we cannot answer: say nothing,
            # and the helpee does them itself when it reaches them
            self.stats.dropped_messages += 1
            return
        if self._leaving():
            return
        self._helping = True
        stash = w.stash_grads()
        done_end, loss = offer.start, 0.0
        try:
            self._send(helpee, Begun(clock=offer.clock, assignment=offer.assignment))
            chunk = self._chunk_rows(offer.rows, w.micro_batches)
            while done_end < offer.end:
                if self._leaving():
                    self.stats.returned += 1
                    break
                span = (done_end, min(offer.end, done_end + chunk))
                loss += self._work(w, helpee, offer.clock, span, None)
                self.stats.rows_helped_for_others += span[1] - span[0]
                done_end = span[1]
                self.check(w)
                if not self.desk.wanted(helpee, offer):
                    raise HelpAborted(f"{helpee} cancelled assignment {offer.assignment}")
            grads = w.take_grads()
            done = Completed(
                clock=offer.clock,
                assignment=offer.assignment,
                roster_version=offer.roster_version,
                start=offer.start,
                end=offer.end,
                done_end=done_end,
                loss_sum=loss,
            )
            self._send(helpee, done, {f"g{p}": g for p, g in enumerate(grads)})
        except HelpAborted:
            self.stats.aborted_help += 1
        finally:
            w.restore_grads(stash)
            self._helping = False

    # -- pieces ------------------------------------------------------------------------------

    def _work(
        self,
        w: Worker,
        identity: str,
        clock: int,
        span: tuple[int, int],
        own_fraction: tuple[float, float] | None,
    ) -> float:
        """Compute rows `span` of `identity`'s share of `clock` (and emulate their work)."""
        t0 = time.perf_counter()
        loss, hit = w.backward_rows(identity, clock, *span)
        if identity != self.worker_id:
            if hit:
                self.stats.preload_hits += 1
            else:
                self.stats.preload_misses += 1
        if self._pacer is not None and self._roster is not None:
            members = self._roster.members(clock)
            me = self.worker_id
            rank = members.index(me) if me in members else 0
            self._pacer.work(
                span[1] - span[0],
                clock=self._clock,
                rank=rank,
                workers=len(members),
                owner_rank=members.index(identity) if identity in members else rank,
                own_fraction=own_fraction,
            )
        self.stats.busy_s += time.perf_counter() - t0
        return loss

    def _chunk_rows(self, rows: int, micro_batches: int) -> int:
        """Rows per chunk for a share of `rows`: `checks_per_iteration` chunks, or fewer so that
        a chunk is not smaller than the calibrated minimum; a share under twice the minimum
        stays whole (the last, rounded-down chunk may still be smaller than the others). With
        gradient accumulation no chunk is larger than one of the share's `micro_batches`: they
        bound what one backward holds."""
        chunks = min(self.spec.checks_per_iteration, rows // (self._min_chunk_rows or 1))
        return min(math.ceil(rows / max(chunks, 1)), math.ceil(rows / micro_batches))

    def calibrate(self, w: Worker) -> int:
        """The calibrated minimum chunk (`_calibrate`, once); a node calibrates while it
        loads, so that a joiner's first clock does not wait on it (else the first iteration
        does)."""
        if self._min_chunk_rows is None:
            self._min_chunk_rows = self._calibrate(w)
        return self._min_chunk_rows

    def _calibrate(self, w: Worker) -> int:
        """The smallest chunk whose fixed cost stays within `max_chunk_overhead` of its work.

        Times the forward/backward of the data set's first row and of its first
        `CALIBRATION_ROWS` (best of 3, gradients discarded; on a CPU in the thread's CPU time,
        which the other processes of a shared machine do not inflate as they do a wall-clock
        slope) and fits t(rows) = fixed + rows x per_row; injected work adds to per_row.
        """
        # never over a step's batch, nor (accumulating) over one of its micro-batches
        big = min(w.dataset_rows, CALIBRATION_ROWS, math.ceil(w.batch_rows / w.micro_batches))
        if big < 2:
            return 1
        now = time.thread_time if w.device.type == "cpu" else time.perf_counter
        stash = w.stash_grads()
        try:
            timed = {}
            for n in (1, big):
                best = math.inf
                for _ in range(3):
                    t0 = now()
                    w.backward_first_rows(n)
                    best = min(best, now() - t0)
                timed[n] = best
            w.take_grads()
        finally:
            w.restore_grads(stash)
        per_row = max((timed[big] - timed[1]) / (big - 1), 1e-9)
        fixed = max(timed[1] - per_row, 0.0)
        if self.spec.injected is not None:
            per_row += self.spec.injected.row_ms / 1000
        min_rows = max(1, math.ceil(fixed / (self.spec.max_chunk_overhead * per_row)))
        log.info(
            "chunk size calibrated",
            extra={"fixed_ms": round(fixed * 1000, 3), "per_row_ms": round(per_row * 1000, 4),
                   "min_chunk_rows": min_rows},
        )  # fmt: skip
        return min_rows

    def _ensure_pacer(self, rows: int) -> None:
        injected = self.spec.injected
        if injected is not None and self._pacer is None:
            nominal_s = rows * injected.row_ms / 1000
            self._pacer = Pacer(injected, worker=self.worker_id, nominal_iteration_s=nominal_s)

    def _preload(self, w: Worker, clock: int) -> None:
        """Cache the input rows of this clock's helpees (all, or the tail offers come from)."""
        if self.link is None:
            return
        _, helpees = self._groups_at(clock)
        keep = 1.0 if self.spec.preload == "all" else self.spec.preload_tail_fraction
        for helpee in helpees.get(self.worker_id, ()):
            w.preload(helpee, clock, keep)

    def _report_progress(self, clock: int) -> None:
        """Tell the helpees how far this worker is, but not those that said they read no
        reports (`Listening`), nor those that reported reaching their own progress checkpoint
        of `clock` first. Reports are most of FlexRR's cost when nobody straggles. The
        trade-off of the second rule: such a helpee was ahead of this worker at its
        checkpoint; if it stalls in its last quarter, only the helpers that reached the
        checkpoint before it report to it (and may be offered its tail), not the slower ones.
        Both are reset on a roll-back, the second on a redo too.
        """
        _, helpees = self._groups_at(clock)
        report = Progress(clock=clock, timer=self._now())
        ahead = self._ahead[1] if self._ahead[0] == clock else set()
        members = self._roster.members(clock) if self._roster is not None else ()
        for helpee in helpees.get(self.worker_id, ()):
            if helpee in ahead or self._deaf.get(helpee) == members:
                self.stats.progress_skipped += 1
                continue
            self._send(helpee, report)

    def _tell_listening(self, clock: int, rows: int, micro_batches: int) -> None:
        """Tell this clock's helpers whether we read their reports (see `Listening`), when
        that, the helpers or the members changed. A lost message fails safe: a helper takes
        a `listens: false` for the members of its clock only, and reports otherwise."""
        if self.link is None or self._roster is None:
            return
        members = self._roster.members(clock)
        helpers, _ = self._groups_at(clock)
        mine = frozenset(helpers.get(self.worker_id, ()))
        # more than one chunk: checks in between
        listens = self._chunk_rows(rows, micro_batches) < rows
        if self._told == (members, mine, listens):
            return
        for helper in sorted(mine):
            self._send(helper, Listening(clock=clock, listens=listens))
        self._told = (members, mine, listens)

    def _note_ahead(self, peer: str, clock: int) -> None:
        """`peer` reached its progress checkpoint of `clock` (only the newest clock is kept)."""
        if clock > self._ahead[0]:
            self._ahead = (clock, set())
        if clock == self._ahead[0]:
            self._ahead[1].add(peer)

    def _groups_at(self, clock: int) -> tuple[_Groups, _Groups]:
        """(helpers, helpees) of every member at `clock`, by the roster and peer hosts."""
        if self._roster is None:
            return {}, {}
        members = self._roster.members(clock)
        groups = self._groups.get(members)
        if groups is None:
            machines = {m: urlparse(e.work).hostname or m for m, e in self.peers.items()}
            helpers = helper_groups(members, machines, self.spec.helper_group_size)
            groups = (helpers, helpee_groups(helpers))
            if all(m in self.peers for m in members):  # complete: safe to keep
                self._groups = {members: groups}
        return groups

    def _send(
        self, peer: str, message: PeerMessage, tensors: dict[str, torch.Tensor] | None = None
    ) -> None:
        inboxes = self.peers.get(peer)
        if self.link is None or inboxes is None:
            return
        about_reports = isinstance(message, (Progress, Listening))
        endpoint = inboxes.progress if about_reports else inboxes.work
        self.link.send(endpoint, message, epoch=self.epoch, tensors=tensors)

    def summary(self) -> dict[str, float]:
        """The counters of `stats`, with the messages the inbox refused (bad MAC or form)."""
        refused = self.link.refused_in if self.link is not None else 0
        return {**self.stats.as_dict(), "refused_messages": float(refused)}

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None
