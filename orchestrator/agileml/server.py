"""A parameter server: owns some partitions, applies pushes exactly once, answers pulls.

`PartitionStore` holds the state and decides (pure, no sockets); `ParamServer` runs a thread
with a ZMQ ROUTER socket that only parses, authenticates and renders messages around it.

Consistency: a pull names the minimum clock it must see (BSP: t-1; SSP with slack s: t-s-1).
It is answered once every registered worker's pushes for clocks 0..min_clock to that partition
are applied; until then it is held, and re-checked after each push to the partition (no
polling). Pushes are additive deltas identified by (worker, clock, partition): a repeat is
acknowledged and not applied again, so workers may resend after a timeout.

Failure semantics of this slice: state lives in memory only; a stopped server loses it and the
requests it was holding (workers see a timeout). Replication to BackupPSs comes later.

Hand-off (`ParamServer.handoff_to`): a partition's values, its applied (worker, clock) set and
its ownership version travel to another server in one authenticated `handoff` message. While
the hand-off is in flight the partition is frozen (requests get `moving`, workers retry); once
the receiver acknowledges, the sender drops it and answers its requests with
`moved:<version>:<new owner>` (`parse_moved`). Since the applied set moves with the values, a
push applied before the hand-off and replayed to the new owner is still a duplicate.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

import torch
import zmq

from orchestrator.agileml import wire
from orchestrator.agileml.errors import (
    HandoffError,
    OwnershipConflictError,
    PartitionError,
    RosterError,
    ServerError,
    WireError,
    WireReason,
)
from orchestrator.agileml.roster import Roster
from orchestrator.agileml.wire import Header, MessageKind

log = logging.getLogger(__name__)

POLL_INTERVAL_MS = 50  # how often the server thread checks for stop() while idle
STOP_TIMEOUT_SECONDS = 5.0  # stop() gives the thread this long to exit
HANDOFF_TIMEOUT_SECONDS = 10.0  # handoff_to waits this long for the receiver's ack
MOVED_PREFIX = "moved"


class RejectReason(StrEnum):
    """Why a well-formed, authenticated request was refused (sent back in `detail`)."""

    WRONG_JOB = "wrong_job"
    UNEXPECTED_KIND = "unexpected_kind"
    NOT_OWNER = "not_owner"  # this server does not hold the partition (it may have moved)
    UNKNOWN_WORKER = "unknown_worker"  # only registered workers may push
    BAD_DELTA = "bad_delta"  # missing "delta" tensor, or wrong dtype/shape
    BAD_CLOCK = "bad_clock"  # a push without a clock, or with a negative one
    MOVING = "moving"  # the partition is being handed off right now; retry shortly
    MOVED = "moved"  # handed off; the reply's detail is `moved:<version>:<new owner>`
    BAD_SNAPSHOT = "bad_snapshot"  # a handoff whose tensors or worker list are malformed
    STALE_VERSION = "stale_version"  # a handoff older than what the receiver holds or held
    STALE_EPOCH = "stale_epoch"  # made before a roll-back; detail `stale_epoch:<epoch>`
    FUTURE_EPOCH = "future_epoch"  # the server has not entered the request's epoch yet; retry
    STALE_ROSTER = "stale_roster"  # computed on an older roster; detail `stale_roster:<version>`


# Refusals that are part of normal elastic operation (the worker retries or re-syncs).
_ROUTINE_REJECTIONS = frozenset(
    {
        RejectReason.MOVING,
        RejectReason.MOVED,
        RejectReason.FUTURE_EPOCH,
        RejectReason.STALE_EPOCH,
        RejectReason.STALE_ROSTER,
    }
)


class RejectedError(Exception):
    """Internal: a request the store refuses; becomes an `error` reply. State is unchanged.

    `wire_detail` is what the reply's `detail` says (default: the reason alone).
    """

    def __init__(
        self, reason: RejectReason, detail: str = "", *, wire_detail: str | None = None
    ) -> None:
        self.reason = reason
        self.wire_detail = wire_detail or str(reason)
        super().__init__(f"{reason}: {detail}" if detail else str(reason))


def moved_detail(new_owner: str, version: int) -> str:
    """The `detail` of the error a former owner sends for a handed-off partition."""
    return f"{MOVED_PREFIX}:{version}:{new_owner}"


def parse_moved(detail: str | None) -> tuple[str, int] | None:
    """(new owner, version) from a `moved` error detail; None for any other detail."""
    if not detail:
        return None
    prefix, _, rest = detail.partition(":")
    version, _, owner = rest.partition(":")
    if prefix != MOVED_PREFIX or not version.isdigit() or not owner:
        return None
    return owner, int(version)


class PushOutcome(StrEnum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"  # already applied earlier; acknowledged, not re-applied


@dataclass
class _Partition:
    values: torch.Tensor
    # (worker, clock) pushes applied but not implied by `consistent` (pruned as it advances)
    applied: set[tuple[str, int]] = field(default_factory=set)
    version: int = 0  # ownership version: bumped by every hand-off
    consistent: int = -1  # every roster member's pushes for clocks <= this are applied
    # updates applied here but not yet streamed to the BackupPS: clock -> (sum, workers)
    pending: dict[int, tuple[torch.Tensor, set[str]]] = field(default_factory=dict)
    generation: int = 0  # bumped by every change of `values`


@dataclass(frozen=True)
class PendingChunk:
    """The summed update of some workers to one partition for one clock."""

    clock: int
    delta: torch.Tensor
    workers: frozenset[str]


@dataclass(frozen=True)
class PartitionSnapshot:
    """Everything a new owner needs to serve a partition exactly as the old one did.

    `values` is a private float32 copy; `applied` the (worker, clock) pushes in it beyond what
    `consistent` implies (every roster member's pushes up to `consistent` are in it);
    `version` the ownership version at export (the receiver will hold `version + 1`);
    `workers` the roster members at the sender's next clock (a receiver without a roster adopts
    them); `pending` the updates in `values` that the BackupPS does not have yet.
    """

    partition: int
    values: torch.Tensor
    applied: frozenset[tuple[str, int]]
    version: int
    workers: tuple[str, ...] = ()
    consistent: int = -1
    pending: tuple[PendingChunk, ...] = ()


class PartitionStore:
    """The partitions a server owns (or backs up) and the updates applied to them.

    Which workers must push each clock comes from the `Roster`; a clock of a partition is
    complete once all of them have pushed it, and `consistent_clock` is the highest clock up to
    which all are complete. Not thread-safe.
    """

    def __init__(self) -> None:
        self._parts: dict[int, _Partition] = {}
        self._given_away: dict[int, int] = {}  # partition -> the version its new owner holds
        self.roster: Roster | None = None

    @property
    def workers(self) -> tuple[str, ...]:
        """The roster members of clock 0 (empty without a roster)."""
        return self.roster.members(0) if self.roster is not None else ()

    def add(self, p: int, values: torch.Tensor, *, version: int = 0) -> None:
        """Take ownership of partition p with these values (copied to a float32 vector)."""
        self._parts[p] = _Partition(
            values.detach().reshape(-1).to(torch.float32).clone(), version=version
        )
        self._given_away.pop(p, None)

    def set_roster(self, roster: Roster) -> None:
        """Adopt `roster`; partitions whose next clocks are now complete advance.

        Membership may change only at clocks nothing has been pushed for yet: a push of a
        later clock was computed on a share of the global batch that the change redraws.

        Raises:
            RosterError: the change comes too late for some partition (schedule it later);
                nothing changed.
        """
        self.check_roster(roster)
        self.roster = roster
        for part in self._parts.values():
            self._advance(part)

    def check_roster(self, roster: Roster) -> int | None:
        """The first clock `roster` changes; raises RosterError as `set_roster` would."""
        old = self.roster
        changed_from = old.first_difference(roster) if old is not None else None
        if changed_from is not None:
            for p, part in self._parts.items():
                latest = max([part.consistent, *(c for _, c in part.applied)])
                if latest >= changed_from:
                    raise RosterError(
                        f"partition {p} already has pushes of clock {latest}; a roster change "
                        f"from clock {changed_from} comes too late. To fix: schedule it after "
                        f"clock {latest}."
                    )
        return changed_from

    def is_stale(self, roster_version: int, clock: int) -> bool:
        """Whether a push of `clock` computed on roster `roster_version` missed a change that
        redraws that clock's shares."""
        roster = self.roster
        return roster is not None and any(
            v > roster_version and c <= clock for v, c in roster.changes
        )

    def worker_progress(self, p: int, worker: str) -> tuple[int, int, int]:
        """(frontier, latest, latest of anyone) at partition p: all of `worker`'s pushes up to
        `frontier` are applied, none after `latest`, and nobody's after the third (-1: none).
        Raises PartitionError."""
        part = self._get(p)
        roster = self.roster
        frontier = latest = -1
        if roster is not None:
            latest = roster.last_clock_of(worker, part.consistent)
            frontier = part.consistent
        mine = sorted(c for w, c in part.applied if w == worker)
        if mine:
            latest = max(latest, mine[-1])
        while (worker, frontier + 1) in part.applied:
            frontier += 1
        anyone = max([part.consistent, *(c for _, c in part.applied)])
        return frontier, latest, anyone

    def register_workers(self, ids: Iterable[str]) -> None:
        """Add workers to the roster from clock 0 (before training starts)."""
        self.set_roster(Roster.starting(tuple(set(self.workers) | set(ids))))

    def version(self, p: int) -> int:
        """The ownership version of partition p. Raises PartitionError if not owned here."""
        return self._get(p).version

    def owned(self) -> list[int]:
        return sorted(self._parts)

    def owns(self, p: int) -> bool:
        return p in self._parts

    def values(self, p: int) -> torch.Tensor:
        """A copy of partition p. Raises PartitionError if this store does not own it."""
        return self._get(p).values.clone()

    def live_values(self, p: int) -> tuple[torch.Tensor, int]:
        """Partition p's values without a copy, and their generation (it changes with them):
        read them under the caller's lock only."""
        part = self._get(p)
        return part.values, part.generation

    def export_partition(self, p: int) -> PartitionSnapshot:
        """A snapshot of partition p (copies); the store keeps owning and serving it.

        Raises:
            PartitionError: p is not owned here.
        """
        part = self._get(p)
        pending = tuple(
            PendingChunk(c, d.clone(), frozenset(ws)) for c, (d, ws) in sorted(part.pending.items())
        )
        members = self.roster.members(part.consistent + 1) if self.roster is not None else ()
        return PartitionSnapshot(
            p,
            part.values.clone(),
            frozenset(part.applied),
            part.version,
            tuple(members),
            part.consistent,
            pending,
        )

    def import_partition(self, snapshot: PartitionSnapshot, *, restore: bool = False) -> int:
        """Take ownership of a partition from a snapshot; returns its new version.

        A hand-off (`restore=False`) must be newer than what this store holds (version above the
        owned one) and not older than what it last gave away; a restore from a BackupPS replaces
        the partition whatever its version. The applied set comes along, so replayed pushes stay
        duplicates. A store without a roster adopts the snapshot's workers from clock 0.

        Raises:
            OwnershipConflictError: a stale hand-off; nothing changed.
            PartitionError: malformed snapshot (values not 1-D float32, a negative clock, or a
                pending chunk of another size); nothing changed.
        """
        p = snapshot.partition
        owned = self._parts.get(p)
        floor = owned.version + 1 if owned is not None else self._given_away.get(p, 0)
        if snapshot.version < floor and not restore:
            current = owned.version if owned is not None else floor
            raise OwnershipConflictError(p, snapshot.version, current)
        values = snapshot.values
        if values.dtype != torch.float32 or values.dim() != 1:
            raise PartitionError(
                f"snapshot values: {values.dtype} {tuple(values.shape)}", partition=p
            )
        if any(clock < 0 for _, clock in snapshot.applied) or snapshot.consistent < -1:
            raise PartitionError("snapshot has a negative clock", partition=p)
        if any(c.delta.shape != values.shape for c in snapshot.pending):
            raise PartitionError("snapshot pending chunk of the wrong size", partition=p)
        version = max(snapshot.version, floor - 1) + 1
        part = _Partition(
            values.clone(),
            set(snapshot.applied),
            version=version,
            consistent=snapshot.consistent,
            pending={c.clock: (c.delta.clone(), set(c.workers)) for c in snapshot.pending},
        )
        if self.roster is None:
            self.roster = Roster.starting(snapshot.workers)
        self._parts[p] = part
        self._given_away.pop(p, None)
        self._advance(part)
        return part.version

    def drop_partition(self, p: int, new_version: int) -> None:
        """Stop owning p after its hand-off; remembers `new_version` to refuse stale imports.

        Raises:
            PartitionError: p is not owned here.
        """
        self._get(p)
        del self._parts[p]
        self._given_away[p] = new_version

    def is_applied(self, p: int, worker: str, clock: int) -> bool:
        """Whether the push (worker, clock) is in partition p. Raises PartitionError."""
        part = self._get(p)
        return self._applied(part, worker, clock)

    def apply_push(
        self, p: int, worker: str, clock: int, delta: torch.Tensor, *, track_pending: bool = False
    ) -> PushOutcome:
        """Add `delta` to partition p once per (worker, clock).

        `track_pending` also sums it into the updates still to stream to the BackupPS.

        Raises:
            RejectedError: not owned, a worker not in the roster at `clock`, a negative clock,
                or a delta of the wrong dtype or shape; nothing changed.
        """
        part = self._parts.get(p)
        if part is None:
            raise RejectedError(RejectReason.NOT_OWNER, f"partition {p}")
        if clock < 0:
            raise RejectedError(RejectReason.BAD_CLOCK, f"clock {clock}")
        if self.roster is None or worker not in self.roster.members(clock):
            raise RejectedError(RejectReason.UNKNOWN_WORKER, f"{worker} at clock {clock}")
        if delta.dtype != torch.float32 or delta.shape != part.values.shape:
            raise RejectedError(
                RejectReason.BAD_DELTA,
                f"{delta.dtype} {tuple(delta.shape)}, want float32 {tuple(part.values.shape)}",
            )
        if self._applied(part, worker, clock):
            return PushOutcome.DUPLICATE
        part.values += delta
        part.generation += 1
        part.applied.add((worker, clock))
        if track_pending:
            total, who = part.pending.get(clock, (None, set()))
            part.pending[clock] = (delta.clone() if total is None else total.add_(delta), who)
            who.add(worker)
        self._advance(part)
        return PushOutcome.APPLIED

    def apply_chunk(
        self, p: int, clock: int, workers: Iterable[str], delta: torch.Tensor
    ) -> PushOutcome:
        """Apply a streamed update (the sum of `workers`' pushes for `clock`) once.

        Raises:
            RejectedError: not held here, bad delta, or a chunk only partly applied before;
                nothing changed.
        """
        part = self._parts.get(p)
        if part is None:
            raise RejectedError(RejectReason.NOT_OWNER, f"no backup of partition {p}")
        if clock < 0:
            raise RejectedError(RejectReason.BAD_CLOCK, f"clock {clock}")
        if delta.dtype != torch.float32 or delta.shape != part.values.shape:
            raise RejectedError(RejectReason.BAD_DELTA, f"{delta.dtype} {tuple(delta.shape)}")
        who = set(workers)
        done = {w for w in who if self._applied(part, w, clock)}
        if done == who:
            return PushOutcome.DUPLICATE
        if done:
            raise RejectedError(
                RejectReason.BAD_DELTA, f"clock {clock}: {sorted(done)} of {sorted(who)} applied"
            )
        part.values += delta
        part.generation += 1
        part.applied.update((w, clock) for w in who)
        self._advance(part)
        return PushOutcome.APPLIED

    def take_streamable(self, p: int) -> list[PendingChunk]:
        """Remove and return partition p's pending updates of complete clocks, oldest first."""
        part = self._get(p)
        ready = sorted(c for c in part.pending if c <= part.consistent)
        out = []
        for c in ready:
            delta, who = part.pending.pop(c)
            out.append(PendingChunk(c, delta, frozenset(who)))
        return out

    def clear_pending(self, p: int) -> None:
        """Forget partition p's unstreamed updates (its BackupPS already has its whole state)."""
        self._get(p).pending.clear()

    def consistent_clock(self, p: int) -> int | None:
        """The highest c such that every roster member's pushes 0..c to p are applied.

        None if there is no roster (every pull is then answerable). Raises PartitionError.
        """
        part = self._get(p)
        return None if self.roster is None else part.consistent

    def ready(self, p: int, min_clock: int) -> bool:
        """Whether a pull of p that must see clocks up to `min_clock` can be answered now."""
        c = self.consistent_clock(p)
        return c is None or c >= min_clock

    def _applied(self, part: _Partition, worker: str, clock: int) -> bool:
        if (worker, clock) in part.applied:
            return True
        return (
            clock <= part.consistent
            and self.roster is not None
            and worker in self.roster.members(clock)
        )

    def _advance(self, part: _Partition) -> None:
        roster = self.roster
        if roster is None:
            return
        while True:
            members = roster.members(part.consistent + 1)
            if not members or any((w, part.consistent + 1) not in part.applied for w in members):
                break
            part.consistent += 1
            part.applied.difference_update((w, part.consistent) for w in members)

    def _get(self, p: int) -> _Partition:
        part = self._parts.get(p)
        if part is None:
            raise PartitionError(f"partition {p} is not owned here", partition=p)
        return part


@dataclass(frozen=True)
class ServerStats:
    """Counters of a server since it started."""

    pushes_applied: int = 0
    pushes_duplicate: int = 0
    pulls_answered: int = 0
    pulls_held: int = 0  # held right now, waiting for slower workers
    rejected: int = 0  # got an `error` reply (bad MAC, schema, not owner, ...)
    dropped: int = 0  # unparseable; no reply
    handoffs_sent: int = 0  # partitions handed to another server (acknowledged)
    handoffs_received: int = 0  # partitions taken over from another server
    chunks_streamed: int = 0  # coalesced updates sent to BackupPSs
    chunks_backed: int = 0  # coalesced updates applied to this server's backup copies
    restores: int = 0  # partitions replaced by a BackupPS's copy (roll-back)


@dataclass(frozen=True)
class HandoffResult:
    """An acknowledged hand-off: `new_owner` now serves `partition` at `version`."""

    partition: int
    new_owner: str
    version: int


@dataclass(frozen=True)
class _HeldPull:
    identity: bytes
    seq: int
    min_clock: int
    epoch: int | None = None  # the request's epoch (None: unchecked)


Frames = list[bytes | memoryview]
Reply = tuple[bytes, Frames]


class ParamServer:
    """A parameter server thread on a ROUTER socket at `tcp://<host>:<port>` (0: random port).

    Roles (one server may play several, per partition): it *owns* partitions (a ParamServ, or
    an ActivePS when the partition has a BackupPS elsewhere, see `set_backups`) and it *backs
    up* partitions owned elsewhere (a BackupPS, see `add_backup`). An owner streams, for each
    clock its partition completes, the sum of that clock's pushes to the partition's BackupPS
    (one `replicate` message: updates coalesced across workers), in the background.

    `horizon` (set by the elasticity controller) bounds the clocks workers may compute: pulls
    beyond it wait, so a roster change scheduled past it reaches every server before any worker
    computes a clock it affects.

    `epoch` counts roll-backs: a `restore` from a BackupPS sets a new epoch, and requests that
    name an older epoch are refused (`stale_epoch:<epoch>`), so no update computed before the
    roll-back lands after it. Requests without an epoch are not checked.

    Use as a context manager, or call `start()` and `stop()`. Public methods are thread-safe.
    Malformed or unauthenticated messages never change state: they get an `error` reply with
    the reason in `detail`, or are dropped if the header is not even JSON; both are counted.
    """

    def __init__(
        self,
        node_id: str,
        *,
        job_id: str,
        token: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES,
        control: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> None:
        self.node_id = node_id
        self.job_id = job_id
        self._token = token
        self._address = f"tcp://{host}:{port}"
        self._max_message_bytes = max_message_bytes
        self._control = control  # the node agent's handler of `control` ops it owns
        self._store = PartitionStore()
        self._backup = PartitionStore()  # copies of partitions this server backs up
        self._backups: dict[int, str] = {}  # partition -> endpoint of its BackupPS
        self._held: dict[int, list[_HeldPull]] = {}
        # partition -> (generation, the live tensor, a frozen copy) for pull replies
        self._reply_values: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}
        self._moving: set[int] = set()  # hand-off in flight: frozen
        self._moved: dict[int, tuple[str, int]] = {}  # handed off: (new owner, version)
        self._outbox: list[Reply] = []  # replies from other threads, sent by the serve thread
        self._stream_out: list[tuple[str, Frames]] = []  # (backup endpoint, frames)
        self._unacked: dict[int, int] = {}  # replicate seq -> partition
        self._stream_seq = 0
        self._handoff_seq = 0
        self.epoch = 0
        # pulls for computing clocks past `horizon` wait (None: no limit); see `set_horizon`
        self.horizon: int | None = None
        self.slack = 0
        self._stats = ServerStats()
        self._lock = threading.Lock()
        self._acked = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._ctx: zmq.Context[Any] | None = None
        self._sock: zmq.Socket[Any] | None = None
        self._thread: threading.Thread | None = None
        self.endpoint = ""

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> ParamServer:
        """Bind the socket and start serving. Raises ServerError if binding fails."""
        if self._thread is not None:
            raise ServerError(f"server {self.node_id} already started")
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(self._address)
        except zmq.ZMQError as exc:
            sock.close()
            self._ctx.term()
            raise ServerError(f"server {self.node_id}: cannot bind {self._address}: {exc}") from exc
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name=f"ps-{self.node_id}", daemon=True)
        self._thread.start()
        log.info("param server started", extra={"node": self.node_id, "endpoint": self.endpoint})
        return self

    def stop(self, timeout_s: float = STOP_TIMEOUT_SECONDS) -> None:
        """Stop serving and close the socket. Held pulls are dropped (their workers time out).

        Raises:
            ServerError: the thread did not exit within `timeout_s`.
        """
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise ServerError(f"server {self.node_id} did not stop within {timeout_s}s")
        self._thread = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def __enter__(self) -> ParamServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- state (thread-safe) --------------------------------------------------------------

    def add_partition(self, p: int, values: torch.Tensor, *, version: int = 0) -> None:
        """Take ownership of partition p with the given initial values and ownership version."""
        with self._lock:
            self._store.add(p, values, version=version)
            self._moved.pop(p, None)

    def add_backup(self, p: int, values: torch.Tensor) -> None:
        """Back up partition p, starting from these values (the owner's initial values)."""
        with self._lock:
            self._backup.add(p, values)

    def set_backups(self, backups: Mapping[int, str]) -> None:
        """Name the BackupPS endpoint of each partition (a partition's own server: none).

        From now on, every update applied to an owned partition whose BackupPS is elsewhere is
        streamed to it once its clock completes.
        """
        with self._lock:
            self._backups = dict(backups)

    def set_roster(self, roster: Roster) -> None:
        """Adopt `roster` for owned and backed-up partitions; held pulls that are now
        answerable are answered.

        Raises:
            RosterError: it would add a worker to an already completed clock; nothing changed.
        """
        with self._lock:
            for store in (self._store, self._backup):
                store.check_roster(roster)  # both, before changing anything
            self._store.set_roster(roster)
            self._backup.set_roster(roster)
            for p in list(self._held):
                self._outbox.extend(self._release_held(p))
            for p in self._store.owned():
                self._queue_stream(p)  # the change may have completed clocks

    def set_horizon(self, horizon: int, slack: int) -> None:
        """Let workers compute clocks up to `horizon` (never lowered); a pull of min clock m
        computes clock m + slack + 1. Held pulls now within it are answered."""
        with self._lock:
            self.slack = slack
            self.horizon = max(horizon, self.horizon if self.horizon is not None else horizon)
            for p in list(self._held):
                self._outbox.extend(self._release_held(p))

    def set_epoch(self, epoch: int) -> None:
        """Enter `epoch` (never goes back): requests of older epochs are refused from now on."""
        with self._lock:
            self.epoch = max(self.epoch, epoch)

    def register_workers(self, ids: Iterable[str]) -> None:
        """Allow these workers to push from clock 0; pulls then wait for their pushes too."""
        with self._lock:
            self._store.register_workers(ids)
            self._backup.register_workers(ids)

    def owned(self) -> list[int]:
        """The partitions this server holds (including one whose hand-off is in flight)."""
        with self._lock:
            return self._store.owned()

    def backed(self) -> list[int]:
        """The partitions this server keeps backup copies of."""
        with self._lock:
            return self._backup.owned()

    def snapshot(self, p: int) -> PartitionSnapshot:
        """A snapshot of partition p (as `PartitionStore.export_partition`)."""
        with self._lock:
            return self._store.export_partition(p)

    def state(self, p: int) -> torch.Tensor:
        """A copy of partition p's current values. Raises PartitionError if not owned here."""
        with self._lock:
            return self._store.values(p)

    def backup_state(self, p: int) -> torch.Tensor:
        """A copy of this server's backup of partition p. Raises PartitionError if none."""
        with self._lock:
            return self._backup.values(p)

    def consistent_clocks(self, *, backup: bool = False) -> dict[int, int]:
        """The consistent clock of each owned (or, with `backup`, backed-up) partition."""
        with self._lock:
            store = self._backup if backup else self._store
            clocks = {p: store.consistent_clock(p) for p in store.owned()}
            return {p: -1 if c is None else c for p, c in clocks.items()}

    def worker_progress(self, worker: str) -> dict[int, tuple[int, int, int]]:
        """(frontier, latest) of `worker` at each owned partition (see PartitionStore)."""
        with self._lock:
            return {p: self._store.worker_progress(p, worker) for p in self._store.owned()}

    def stats(self) -> ServerStats:
        with self._lock:
            held = sum(len(v) for v in self._held.values())
            return replace(self._stats, pulls_held=held)

    def flush(self, timeout_s: float = HANDOFF_TIMEOUT_SECONDS) -> bool:
        """Wait until every streamed update is acknowledged by its BackupPS (end of life).

        Returns False if some are still unacknowledged after `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        with self._acked:
            while self._unacked or self._stream_out:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._acked.wait(remaining)
            return True

    # -- hand-off and restore ---------------------------------------------------------------

    def handoff_to(
        self, p: int, endpoint: str, *, timeout_s: float = HANDOFF_TIMEOUT_SECONDS
    ) -> HandoffResult:
        """Hand partition p to the server at `endpoint`; on its ack, stop serving p.

        While in flight, pulls and pushes for p get a `moving` error (retryable). After the
        ack they get `moved:<version>:<new owner>`, and so do pulls that were held. If this
        server is p's BackupPS (a ParamServ handing p to a new ActivePS), it keeps the handed
        state as its backup copy, and the receiver streams from there.

        Raises:
            PartitionError: p is not owned here, or a hand-off of p is already in flight.
            HandoffError: the receiver refused (`outcome_unknown=False`: this server still
                owns and serves p, unchanged), or no valid ack came within `timeout_s`
                (`outcome_unknown=True`: p stays frozen, since the receiver may have taken it;
                check the receiver, then call `resume_partition(p)` if it did not).
        """
        with self._lock:
            if p in self._moving:
                raise PartitionError(f"partition {p} is already being handed off", partition=p)
            snapshot = self._store.export_partition(p)
            self_backup = self._backups.get(p) == self.endpoint
            if self_backup:
                snapshot = replace(snapshot, pending=())
            self._moving.add(p)
            self._handoff_seq += 1
            seq = self._handoff_seq
        try:
            header, _ = self._request(
                endpoint,
                MessageKind.HANDOFF,
                seq,
                _snapshot_fields(snapshot),
                MessageKind.HANDOFF_ACK,
                timeout_s,
                p,
            )
        except HandoffError as exc:
            if not exc.outcome_unknown:
                self.resume_partition(p)
            raise
        new_owner, version = header.sender, header.clock or 0
        with self._lock:
            if self_backup:
                self._backup.import_partition(snapshot, restore=True)
            self._store.drop_partition(p, version)
            self._moving.discard(p)
            self._moved[p] = (new_owner, version)
            detail = moved_detail(new_owner, version)
            for held in self._held.pop(p, []):
                self._stats = replace(self._stats, rejected=self._stats.rejected + 1)
                frames = self._encode(MessageKind.ERROR, held.seq, partition=p, detail=detail)
                self._outbox.append((held.identity, frames))
            self._stats = replace(self._stats, handoffs_sent=self._stats.handoffs_sent + 1)
        log.info(
            "partition handed off",
            extra={"node": self.node_id, "partition": p, "to": new_owner, "version": version},
        )
        return HandoffResult(p, new_owner, version)

    def resume_partition(self, p: int) -> None:
        """Serve p again after a hand-off whose outcome was unknown and that did not happen."""
        with self._lock:
            self._moving.discard(p)

    def restore_owners(
        self,
        epoch: int,
        owners: Mapping[int, str],
        versions: Mapping[int, int],
        *,
        timeout_s: float = HANDOFF_TIMEOUT_SECONDS,
    ) -> dict[int, tuple[int, int]]:
        """Roll back: send this server's backup of each partition in `owners` to its owner.

        The owner (this server too, when its endpoint is named) replaces its copy, enters
        `epoch`, and refuses requests of older epochs. Updates streamed from an older epoch
        after this call are refused too. Returns each partition's (consistent clock as
        restored, ownership version at its owner: above `versions[p]`, the partition's
        current ownership version, so that `moved` replies keep working).

        Raises:
            PartitionError: a partition is not backed up here; nothing was sent.
            HandoffError: an owner refused or did not answer within `timeout_s`.
        """
        with self._lock:
            self.epoch = max(self.epoch, epoch)
            snapshots = {
                p: replace(self._backup.export_partition(p), pending=(), version=versions[p])
                for p in owners
            }
        out = {}
        for p, endpoint in sorted(owners.items()):
            snap = snapshots[p]
            if endpoint == self.endpoint:
                with self._lock:
                    self._outbox.extend(self._restore_locked(snap, epoch))
                    version = self._store.version(p)
            else:
                self._handoff_seq += 1
                header, _ = self._request(
                    endpoint,
                    MessageKind.RESTORE,
                    self._handoff_seq,
                    _snapshot_fields(snap, epoch=epoch),
                    MessageKind.RESTORE_ACK,
                    timeout_s,
                    p,
                )
                version = header.clock or 0
            out[p] = (snap.consistent, version)
        return out

    def _restore_locked(self, snapshot: PartitionSnapshot, epoch: int) -> list[Reply]:
        """Replace a partition with a BackupPS's copy and enter `epoch`; returns replies to
        the pulls that were held (all refused: they belong to the old epoch)."""
        p = snapshot.partition
        self._store.import_partition(snapshot, restore=True)
        self._store.clear_pending(p)
        self._moving.discard(p)
        self._moved.pop(p, None)
        self._stats = replace(self._stats, restores=self._stats.restores + 1)
        replies: list[Reply] = []
        self.epoch = max(self.epoch, epoch)
        detail = f"{RejectReason.STALE_EPOCH}:{self.epoch}"
        for q in list(self._held):
            keep = []
            for h in self._held[q]:
                if h.epoch is not None and h.epoch < self.epoch:
                    frames = self._encode(MessageKind.ERROR, h.seq, partition=q, detail=detail)
                    replies.append((h.identity, frames))
                else:
                    keep.append(h)
            self._held[q] = keep
        return replies

    def _request(
        self,
        endpoint: str,
        kind: MessageKind,
        seq: int,
        fields_and_tensors: tuple[dict[str, Any], dict[str, torch.Tensor]],
        want: MessageKind,
        timeout_s: float,
        p: int,
    ) -> tuple[Header, dict[str, torch.Tensor]]:
        """One request to another server on a private socket; raises HandoffError."""
        fields, tensors = fields_and_tensors
        frames = self._encode(kind, seq, partition=p, tensors=tensors, **fields)
        ctx: zmq.Context[Any] = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(endpoint)
            sock.send_multipart(frames)
            try:
                got = wire.await_reply(sock, seq, self._token, timeout_s)
            except WireError as exc:
                raise HandoffError(p, str(exc.reason), outcome_unknown=True) from exc
            if got is None:
                raise HandoffError(p, "timeout", outcome_unknown=True)
            header, reply = got
            if header.kind is MessageKind.ERROR:
                raise HandoffError(p, header.detail or "error")
            if header.kind is not want or header.partition != p:
                raise HandoffError(p, f"unexpected {header.kind} reply", outcome_unknown=True)
            return header, reply
        finally:
            sock.close(linger=0)
            ctx.term()

    # -- serving loop ---------------------------------------------------------------------

    def _serve(self) -> None:
        sock = self._sock
        assert sock is not None and self._ctx is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        backup_socks: dict[str, zmq.Socket[Any]] = {}
        try:
            while not self._stop.is_set():
                with self._lock:
                    outbox, self._outbox = self._outbox, []
                    stream, self._stream_out = self._stream_out, []
                for identity, frames in outbox:
                    sock.send_multipart([identity, *frames], copy=False)
                for endpoint, frames in stream:
                    dealer = backup_socks.get(endpoint)
                    if dealer is None:
                        dealer = self._ctx.socket(zmq.DEALER)
                        dealer.setsockopt(zmq.LINGER, 0)
                        dealer.connect(endpoint)
                        poller.register(dealer, zmq.POLLIN)
                        backup_socks[endpoint] = dealer
                    dealer.send_multipart(frames, copy=False)
                events = dict(poller.poll(POLL_INTERVAL_MS))
                for dealer in backup_socks.values():
                    if dealer in events:
                        self._drain_acks(dealer)
                if sock not in events:
                    continue
                while True:
                    try:
                        msg = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    for identity, frames in self._handle(msg):
                        sock.send_multipart([identity, *frames], copy=False)
        except Exception:
            log.exception("param server crashed", extra={"node": self.node_id})
        finally:
            for dealer in backup_socks.values():
                dealer.close(linger=0)
            sock.close(linger=0)
            self._sock = None

    def _drain_acks(self, dealer: zmq.Socket[Any]) -> None:
        while True:
            try:
                frames = dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                header, _ = wire.decode(frames, self._token)
            except WireError:
                continue
            with self._acked:
                self._unacked.pop(header.seq, None)
                if header.kind is MessageKind.ERROR:
                    log.warning(
                        "backup refused a streamed update",
                        extra={"node": self.node_id, "detail": header.detail},
                    )
                self._acked.notify_all()

    def _handle(self, msg: list[zmq.Frame]) -> list[Reply]:
        """Process one ROUTER message; returns the replies to send. Never raises."""
        if len(msg) < 2:
            return self._drop("no frames after identity")
        identity, frames = msg[0].bytes, [f.buffer for f in msg[1:]]
        try:
            header, tensors = wire.decode(
                frames, self._token, max_message_bytes=self._max_message_bytes
            )
        except WireError as exc:
            if exc.reason is WireReason.BAD_JSON:
                return self._drop(str(exc))
            return [self._reject(identity, _best_effort_seq(bytes(frames[0])), str(exc.reason))]
        if header.kind is MessageKind.CONTROL and header.job_id == self.job_id:
            return self._on_control(identity, header, tensors)
        with self._lock:
            try:
                if header.job_id != self.job_id:
                    raise RejectedError(RejectReason.WRONG_JOB, header.job_id)
                if header.kind in (MessageKind.PULL, MessageKind.PUSH):
                    self._check_epoch(header)
                if header.kind is MessageKind.PULL:
                    return self._on_pull(identity, header)
                if header.kind is MessageKind.PUSH:
                    return self._on_push(identity, header, tensors)
                if header.kind is MessageKind.HELLO:
                    return [(identity, self._encode(MessageKind.HELLO, header.seq))]
                if header.kind is MessageKind.HANDOFF:
                    return self._on_handoff(identity, header, tensors)
                if header.kind is MessageKind.RESTORE:
                    return self._on_restore(identity, header, tensors)
                if header.kind is MessageKind.REPLICATE:
                    return self._on_replicate(identity, header, tensors)
                raise RejectedError(RejectReason.UNEXPECTED_KIND, str(header.kind))
            except RejectedError as exc:
                return [self._reject_locked(identity, header.seq, exc.wire_detail, header)]

    def _check_epoch(self, header: Header) -> None:
        if header.epoch is None or header.epoch == self.epoch:
            return
        if header.epoch < self.epoch:
            raise RejectedError(
                RejectReason.STALE_EPOCH, wire_detail=f"{RejectReason.STALE_EPOCH}:{self.epoch}"
            )
        raise RejectedError(RejectReason.FUTURE_EPOCH, f"server at epoch {self.epoch}")

    def _on_control(
        self, identity: bytes, header: Header, tensors: dict[str, torch.Tensor]
    ) -> list[Reply]:
        """Hand a control op to the node agent on a thread of its own (ops may take a while)."""
        try:
            body = wire.parse_json_body(tensors)
        except WireError as exc:
            return [self._reject(identity, header.seq, str(exc.reason))]
        handler = self._control
        if handler is None or not isinstance(body, dict):
            return [self._reject(identity, header.seq, str(RejectReason.UNEXPECTED_KIND))]

        def run() -> None:
            try:
                result = {"ok": True, **handler(body)}
            except Exception as exc:  # reported to the controller, which decides what next
                log.warning("control op failed", extra={"node": self.node_id, "op": body})
                result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            frames = self._encode(
                MessageKind.CONTROL_REPLY, header.seq, tensors=wire.json_body(result)
            )
            with self._lock:
                self._outbox.append((identity, frames))

        threading.Thread(target=run, name=f"control-{self.node_id}", daemon=True).start()
        return []

    def _check_serving(self, p: int | None) -> None:
        """Raise the right RejectedError unless this server serves p right now."""
        if p is not None and p in self._moving:
            raise RejectedError(RejectReason.MOVING, f"partition {p}")
        if p is not None and not self._store.owns(p) and p in self._moved:
            owner, version = self._moved[p]
            raise RejectedError(
                RejectReason.MOVED, f"partition {p}", wire_detail=moved_detail(owner, version)
            )
        if p is None or not self._store.owns(p):
            raise RejectedError(RejectReason.NOT_OWNER, f"partition {p}")

    def _on_handoff(
        self, identity: bytes, header: Header, tensors: dict[str, torch.Tensor]
    ) -> list[Reply]:
        snapshot = snapshot_from_wire(header, tensors)
        try:
            version = self._store.import_partition(snapshot)
        except OwnershipConflictError as exc:
            raise RejectedError(RejectReason.STALE_VERSION, str(exc)) from exc
        except PartitionError as exc:
            raise RejectedError(RejectReason.BAD_SNAPSHOT, str(exc)) from exc
        p = snapshot.partition
        self._moved.pop(p, None)
        if self._backups.get(p) in (None, self.endpoint):
            self._store.clear_pending(p)  # a ParamServ (or the BackupPS itself) streams nothing
        self._stats = replace(self._stats, handoffs_received=self._stats.handoffs_received + 1)
        log.info(
            "partition taken over",
            extra={"node": self.node_id, "partition": p, "from": header.sender},
        )
        ack = self._encode(MessageKind.HANDOFF_ACK, header.seq, partition=p, clock=version)
        self._queue_stream(p)
        return [(identity, ack)]

    def _on_restore(
        self, identity: bytes, header: Header, tensors: dict[str, torch.Tensor]
    ) -> list[Reply]:
        snapshot = snapshot_from_wire(header, tensors)
        if header.epoch is None or header.epoch < self.epoch:
            raise RejectedError(RejectReason.STALE_EPOCH, f"restore for epoch {header.epoch}")
        try:
            replies = self._restore_locked(snapshot, header.epoch)
        except PartitionError as exc:
            raise RejectedError(RejectReason.BAD_SNAPSHOT, str(exc)) from exc
        version = self._store.version(snapshot.partition)
        ack = self._encode(
            MessageKind.RESTORE_ACK, header.seq, partition=snapshot.partition, clock=version
        )
        return [(identity, ack), *replies]

    def _on_replicate(
        self, identity: bytes, header: Header, tensors: dict[str, torch.Tensor]
    ) -> list[Reply]:
        p, delta = header.partition, tensors.get("delta")
        if p is None or header.clock is None or delta is None or not header.workers:
            raise RejectedError(RejectReason.BAD_DELTA, "want partition, clock, workers, delta")
        if header.epoch is not None and header.epoch < self.epoch:
            raise RejectedError(RejectReason.STALE_EPOCH, f"update of epoch {header.epoch}")
        outcome = self._backup.apply_chunk(p, header.clock, header.workers, delta)
        if outcome is PushOutcome.APPLIED:
            self._stats = replace(self._stats, chunks_backed=self._stats.chunks_backed + 1)
        ack = self._encode(
            MessageKind.REPLICATE_ACK,
            header.seq,
            partition=p,
            clock=header.clock,
            detail=str(outcome),
        )
        return [(identity, ack)]

    def _on_pull(self, identity: bytes, header: Header) -> list[Reply]:
        p = header.partition
        self._check_serving(p)
        assert p is not None
        min_clock = header.clock if header.clock is not None else -1
        pull = _HeldPull(identity, header.seq, min_clock, header.epoch)
        if self._answerable(p, pull):
            return [self._pull_reply(p, pull)]
        self._held.setdefault(p, []).append(pull)
        return []

    def _answerable(self, p: int, pull: _HeldPull) -> bool:
        """Consistent enough, and for a clock within the horizon."""
        computing = pull.min_clock + self.slack + 1
        within = self.horizon is None or computing <= self.horizon
        return within and self._store.ready(p, pull.min_clock)

    def _on_push(
        self, identity: bytes, header: Header, tensors: dict[str, torch.Tensor]
    ) -> list[Reply]:
        p = header.partition
        if p is None:
            raise RejectedError(RejectReason.NOT_OWNER, "push without a partition")
        self._check_serving(p)
        if header.clock is None:
            raise RejectedError(RejectReason.BAD_CLOCK, "push without a clock")
        delta = tensors.get("delta")
        if delta is None or len(tensors) != 1:
            raise RejectedError(RejectReason.BAD_DELTA, "want exactly one tensor named 'delta'")
        if header.roster_version is not None and self._store.is_stale(
            header.roster_version, header.clock
        ):
            version = self._store.roster.version if self._store.roster else 0
            raise RejectedError(
                RejectReason.STALE_ROSTER, wire_detail=f"{RejectReason.STALE_ROSTER}:{version}"
            )
        streams = self._backups.get(p) not in (None, self.endpoint)
        outcome = self._store.apply_push(
            p, header.sender, header.clock, delta, track_pending=streams
        )
        if outcome is PushOutcome.APPLIED:
            self._stats = replace(self._stats, pushes_applied=self._stats.pushes_applied + 1)
        else:
            self._stats = replace(self._stats, pushes_duplicate=self._stats.pushes_duplicate + 1)
        ack = self._encode(
            MessageKind.PUSH_ACK, header.seq, partition=p, clock=header.clock, detail=str(outcome)
        )
        replies: list[Reply] = [(identity, ack)]
        if outcome is PushOutcome.APPLIED:
            replies.extend(self._release_held(p))
            self._queue_stream(p)
        return replies

    def _queue_stream(self, p: int) -> None:
        """Queue the complete clocks of owned partition p for its BackupPS (if elsewhere)."""
        backup = self._backups.get(p)
        if backup in (None, self.endpoint) or not self._store.owns(p):
            return
        for chunk in self._store.take_streamable(p):
            self._stream_seq += 1
            frames = self._encode(
                MessageKind.REPLICATE,
                self._stream_seq,
                partition=p,
                clock=chunk.clock,
                workers=sorted(chunk.workers),
                epoch=self.epoch,
                tensors={"delta": chunk.delta},
            )
            self._unacked[self._stream_seq] = p
            self._stream_out.append((backup, frames))
            self._stats = replace(self._stats, chunks_streamed=self._stats.chunks_streamed + 1)

    def _release_held(self, p: int) -> list[Reply]:
        held = self._held.get(p, [])
        if not self._store.owns(p):
            return []
        ready = [h for h in held if self._answerable(p, h)]
        if ready:
            self._held[p] = [h for h in held if h not in ready]
        return [self._pull_reply(p, h) for h in ready]

    def _pull_reply(self, p: int, pull: _HeldPull) -> Reply:
        self._stats = replace(self._stats, pulls_answered=self._stats.pulls_answered + 1)
        consistent = self._store.consistent_clock(p)
        values, generation = self._store.live_values(p)
        cached = self._reply_values.get(p)
        if cached is None or cached[0] != generation or cached[1] is not values:
            # one frozen copy per state, shared by every pull of it (workers pull together)
            cached = (generation, values, values.clone())
            self._reply_values[p] = cached
        frames = self._encode(
            MessageKind.PULL_REPLY,
            pull.seq,
            partition=p,
            clock=pull.min_clock if consistent is None else consistent,
            tensors={"values": cached[2]},
            zero_copy=True,
        )
        return pull.identity, frames

    def _encode(
        self,
        kind: MessageKind,
        seq: int,
        *,
        tensors: dict[str, torch.Tensor] | None = None,
        zero_copy: bool = False,
        **fields: Any,
    ) -> list[bytes | memoryview]:
        header = {"kind": kind, "job_id": self.job_id, "sender": self.node_id, "seq": seq, **fields}
        return wire.encode(header, tensors or {}, self._token, zero_copy=zero_copy)

    def _reject(self, identity: bytes, seq: int, reason: str) -> Reply:
        with self._lock:
            return self._reject_locked(identity, seq, reason, None)

    def _reject_locked(
        self, identity: bytes, seq: int, reason: str, header: Header | None
    ) -> Reply:
        self._stats = replace(self._stats, rejected=self._stats.rejected + 1)
        routine = reason.partition(":")[0] in _ROUTINE_REJECTIONS
        log.log(
            logging.DEBUG if routine else logging.WARNING,
            "param server rejected a message",
            extra={"node": self.node_id, "reason": reason, "sender": header and header.sender},
        )
        partition = header.partition if header is not None else None
        return identity, self._encode(MessageKind.ERROR, seq, partition=partition, detail=reason)

    def _drop(self, why: str) -> list[Reply]:
        with self._lock:
            self._stats = replace(self._stats, dropped=self._stats.dropped + 1)
        log.warning("param server dropped a message", extra={"node": self.node_id, "why": why})
        return []


def _snapshot_fields(
    snapshot: PartitionSnapshot, **extra: Any
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    workers, tensors = snapshot_to_wire(snapshot)
    return {"workers": workers, **extra}, tensors


def snapshot_to_wire(snapshot: PartitionSnapshot) -> tuple[list[str], dict[str, torch.Tensor]]:
    """The `workers` header list and the tensors of a `handoff`/`restore` for `snapshot`."""
    names = set(snapshot.workers) | {w for w, _ in snapshot.applied}
    for chunk in snapshot.pending:
        names |= chunk.workers
    workers = sorted(names)
    index = {w: i for i, w in enumerate(workers)}

    def pairs(items: Iterable[tuple[str, int]]) -> torch.Tensor:
        rows = sorted((index[w], clock) for w, clock in items)
        return torch.tensor(rows, dtype=torch.int64).reshape(-1, 2)

    size = snapshot.values.shape[0]
    pending = (
        torch.stack([c.delta for c in snapshot.pending])
        if snapshot.pending
        else torch.empty(0, size, dtype=torch.float32)
    )
    return workers, {
        "values": snapshot.values,
        "applied": pairs(snapshot.applied),
        "version": torch.tensor([snapshot.version], dtype=torch.int64),
        "consistent": torch.tensor([snapshot.consistent], dtype=torch.int64),
        "pending": pending,
        "pending_clocks": torch.tensor([c.clock for c in snapshot.pending], dtype=torch.int64),
        "pending_pairs": pairs((w, c.clock) for c in snapshot.pending for w in c.workers),
    }


_SNAPSHOT_TENSORS = (
    "values",
    "applied",
    "version",
    "consistent",
    "pending",
    "pending_clocks",
    "pending_pairs",
)


def snapshot_from_wire(header: Header, tensors: dict[str, torch.Tensor]) -> PartitionSnapshot:
    """Parse an authenticated `handoff` or `restore` message. Raises RejectedError(BAD_SNAPSHOT)."""
    bad = RejectedError(RejectReason.BAD_SNAPSHOT, "want the snapshot tensors (see MessageKind)")
    if header.partition is None or set(tensors) != set(_SNAPSHOT_TENSORS):
        raise bad
    values, applied, version, consistent, pending, p_clocks, p_pairs = (
        tensors[k] for k in _SNAPSHOT_TENSORS
    )
    workers = header.workers or ()
    if (
        values.dtype != torch.float32
        or values.dim() != 1
        or any(t.dtype != torch.int64 or t.dim() != 2 for t in (applied, p_pairs))
        or any(t.shape[1] != 2 for t in (applied, p_pairs))
        or any(t.dtype != torch.int64 or t.shape != (1,) for t in (version, consistent))
        or pending.dtype != torch.float32
        or pending.dim() != 2
        or pending.shape[1] != values.shape[0]
        or p_clocks.dtype != torch.int64
        or p_clocks.shape != (pending.shape[0],)
    ):
        raise bad

    def named(t: torch.Tensor) -> list[tuple[str, int]]:
        rows = [(int(i), int(c)) for i, c in t.tolist()]
        if any(not 0 <= i < len(workers) or c < 0 for i, c in rows):
            raise RejectedError(RejectReason.BAD_SNAPSHOT, "worker index or clock out of range")
        return [(workers[i], c) for i, c in rows]

    by_clock: dict[int, set[str]] = {}
    for w, c in named(p_pairs):
        by_clock.setdefault(c, set()).add(w)
    clocks = [int(c) for c in p_clocks.tolist()]
    if len(set(clocks)) != len(clocks) or set(by_clock) - set(clocks):
        raise RejectedError(RejectReason.BAD_SNAPSHOT, "pending clocks do not match their pairs")
    return PartitionSnapshot(
        header.partition,
        values,
        frozenset(named(applied)),
        int(version.item()),
        tuple(workers),
        int(consistent.item()),
        tuple(
            PendingChunk(c, pending[i].clone(), frozenset(by_clock.get(c, ())))
            for i, c in enumerate(clocks)
        ),
    )


def _best_effort_seq(raw: bytes) -> int:
    """The `seq` of an unauthenticated header if it has a usable one (for the error reply)."""
    try:
        seq = json.loads(raw).get("seq")
    except (ValueError, AttributeError):
        return 0
    return seq if isinstance(seq, int) and seq >= 0 else 0
