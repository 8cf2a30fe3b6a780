"""A parameter server: owns some partitions, applies pushes exactly once, answers pulls.

`partition_state.PartitionStore` holds the state and decides (pure, no sockets); `ParamServer`
serves it on the message loop of `server_loop.ServerLoop` (a thread on a ZMQ ROUTER socket that
parses, authenticates and renders); `snapshots` puts a partition on the wire for a hand-off or
a restore.

Consistency: a pull names the minimum clock it must see (BSP: t-1; SSP with slack s: t-s-1).
It is answered once every registered worker's pushes for clocks 0..min_clock to that partition
are applied; until then it is held, and re-checked after each push to the partition (no
polling). Pushes are additive deltas identified by (worker, clock, partition): a repeat is
acknowledged and not applied again, so workers may resend after a timeout.

Failure semantics: state lives in memory only; a stopped server loses it and the requests it
was holding (workers see a timeout). Every update an ActivePS applies is streamed to the
partition's BackupPS, which holds clocks back under the ceiling the elasticity controller
raises, so a roll-back (`restore_owners`) or a checkpoint (`partition_states`) sees every
partition at one common clock.

The module is about 850 lines: `ParamServer`'s public methods are short, thread-safe wrappers
that take its one lock and call the two `PartitionStore`s (owned and backed up); splitting
them across classes would spread that lock discipline with them. (The request handlers of
gradient clipping, `_on_norm` and `_on_clip`, could move to a mixin of their own.)

Hand-off (`ParamServer.handoff_to`): a partition's values, its applied (worker, clock) set and
its ownership version travel to another server in one authenticated `handoff` message. While
the hand-off is in flight the partition is frozen (its requests are parked, `_park`); once
the receiver acknowledges, the sender drops it and answers its requests, parked ones too, with
`moved:<version>:<new owner>` (`parse_moved`). Since the applied set moves with the values, a
push applied before the hand-off and replayed to the new owner is still a duplicate.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from orchestrator.agileml import chunks, wire
from orchestrator.agileml.clipping import coefficient_of, coefficient_tensors
from orchestrator.agileml.errors import (
    HandoffError,
    OwnershipConflictError,
    PartitionError,
)
from orchestrator.agileml.partition_state import (
    PartitionSnapshot,
    PartitionStore,
    PushOutcome,
)
from orchestrator.agileml.rejections import (
    RejectedError,
    RejectReason,
    moved_detail,
)
from orchestrator.agileml.reply_copies import ReplyCopies
from orchestrator.agileml.roster import Roster
from orchestrator.agileml.server_loop import (
    Reply,
    ServerLoop,
    ServerStats,
)
from orchestrator.agileml.snapshots import snapshot_fields, snapshot_from_wire
from orchestrator.agileml.updates import RuleFactory
from orchestrator.agileml.wire import Header, MessageKind

log = logging.getLogger(__name__)

HANDOFF_TIMEOUT_SECONDS = 10.0  # handoff_to waits this long for the receiver's ack
#: Requests kept for one partition while it is handed off (a worker has a few in flight);
#: more are refused with `moving`, as all were before parking.
MAX_PARKED = 64


@dataclass(frozen=True)
class HandoffResult:
    """An acknowledged hand-off: `new_owner` now serves `partition` at `version`."""

    partition: int
    new_owner: str
    version: int


@dataclass(frozen=True)
class _Parked:
    """A request that came while its partition was handed off (see `ParamServer._park`)."""

    identity: bytes
    header: Header
    tensors: dict[str, torch.Tensor]


@dataclass(frozen=True)
class _HeldPull:
    identity: bytes
    seq: int
    min_clock: int  # a `norm` request's: the clock it asks about
    epoch: int | None = None  # the request's epoch (None: unchecked)
    norm: bool = False  # a `norm` request (clipping), held until its clock is complete
    bf16: bool = False  # the values in bfloat16 (the pull's detail: `wire.PULL_BF16`)
    whole: bool = False  # the reply in one message, never chunked (`Header.whole_reply`)


class ParamServer(ServerLoop):
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
    Malformed or unauthenticated messages never change state (`ServerLoop` refuses them).
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
        chunk_bytes: int | None = None,
    ) -> None:
        super().__init__(
            node_id,
            job_id=job_id,
            token=token,
            host=host,
            port=port,
            max_message_bytes=max_message_bytes,
            control=control,
            chunk_bytes=chunk_bytes,
        )
        self._store = PartitionStore()
        # copies of partitions this server backs up: off the workers' path, so it keeps no
        # spare sums (a reliable node may back up the whole model)
        self._backup = PartitionStore(spare_sums=0)
        self._backups: dict[int, str] = {}  # partition -> endpoint of its BackupPS
        self._held: dict[int, list[_HeldPull]] = {}
        # what pull replies send: frozen, reused; in bfloat16 to the workers that ask for it
        # (`wire_precision`), float32 to the others (the final weights are read so)
        self._reply_copies = {
            torch.float32: ReplyCopies(),
            torch.bfloat16: ReplyCopies(torch.bfloat16),
        }
        self._moving: set[int] = set()  # hand-off in flight: frozen
        # requests for a partition in flight, answered when its hand-off settles (`_park`)
        self._parked: dict[int, list[_Parked]] = {}
        # partition -> receiver of a hand-off whose ack never came (still frozen; see handoff_to)
        self._unsettled: dict[int, str] = {}
        # partition -> (sender, snapshot version, version taken at) of the last hand-off taken
        self._taken: dict[int, tuple[str, int, int]] = {}
        self._moved: dict[int, tuple[str, int]] = {}  # handed off: (new owner, version)
        self._stream_seq = 0
        self._handoff_seq = 0
        self.epoch = 0
        # pulls for computing clocks past `horizon` wait (None: no limit); see `set_horizon`
        self.horizon: int | None = None
        self.slack = 0

    # -- state (thread-safe) --------------------------------------------------------------

    def set_update_rules(self, rules: RuleFactory) -> None:
        """How complete clocks update partitions added or taken over from now on (default:
        pushes are deltas, added as they are; see `updates`)."""
        with self._lock:
            self._store.set_rules(rules)
            self._backup.set_rules(rules)

    def set_clipping(self, on: bool) -> None:
        """Clip gradients by their global norm: a complete clock waits for its coefficient
        (see `clipping`)."""
        with self._lock:
            self._store.set_clipping(on)
            self._backup.set_clipping(on)

    def add_partition(
        self,
        p: int,
        values: torch.Tensor,
        *,
        version: int = 0,
        rule_state: bytes = b"",
        clock: int = -1,
    ) -> None:
        """Take ownership of partition p with the given initial values and ownership version
        (and, resuming a checkpoint, its optimizer state and clock)."""
        with self._lock:
            self._store.add(p, values, version=version, rule_state=rule_state, clock=clock)
            self._moved.pop(p, None)
            self._taken.pop(p, None)

    def add_backup(
        self, p: int, values: torch.Tensor, *, rule_state: bytes = b"", clock: int = -1
    ) -> None:
        """Back up partition p, starting from these values (the owner's initial values)."""
        with self._lock:
            self._backup.add(p, values, rule_state=rule_state, clock=clock)

    def keep_only(self, owned: Collection[int], backed: Collection[int]) -> None:
        """Drop the partitions owned or backed up here that are not listed: the job's start
        says all a node holds (a start retried with another plan leaves nothing stale)."""
        with self._lock:
            for p in self._store.owned():
                if p not in owned:
                    self._store.drop_partition(p, 0)
                    self._forget_copies(p)
                    self._post([  # refused: their workers retry the step
                        (h.identity, self._encode(MessageKind.ERROR, h.seq, partition=p,
                                                  detail="not owned here"))
                        for h in self._held.pop(p, [])
                    ])  # fmt: skip
                self._post(self._unpark(p, "not owned here"))
            for p in self._backup.owned():
                if p not in backed:
                    self._backup.drop_partition(p, 0)

    def partition_states(
        self, clock: int, *, backup: bool
    ) -> dict[int, tuple[torch.Tensor, bytes]]:
        """Each backed-up (`backup`) or owned partition's values and optimizer state at
        `clock`, for a checkpoint: the BackupPSs' ceiling, or in stage 1 the clock the horizon
        holds the workers at.

        Raises:
            PartitionError: a partition is not at `clock`.
        """
        with self._lock:
            if backup:
                return {p: self._backup.state_at(p, clock) for p in self._backed_here()}
            return {p: self._store.state_at(p, clock) for p in self._store.owned()}

    def set_backups(self, backups: Mapping[int, str]) -> None:
        """Name the BackupPS endpoint of each partition (a partition's own server: none).

        From now on, every update applied to an owned partition whose BackupPS is elsewhere is
        streamed to it once its clock completes.
        """
        with self._lock:
            self._backups = dict(backups)
            for p in self._backup.owned():
                if self._backups.get(p) != self.endpoint:
                    self._backup.drop_partition(p, 0)  # backed up elsewhere now: stale here

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
                self._post(self._release_held(p))
            for p in self._store.owned():
                self._queue_stream(p)  # the change may have completed clocks

    def set_horizon(self, horizon: int, slack: int) -> None:
        """Let workers compute clocks up to `horizon` (never lowered); a pull of min clock m
        computes clock m + slack + 1. Held pulls now within it are answered."""
        with self._lock:
            self.slack = slack
            self.horizon = max(horizon, self.horizon if self.horizon is not None else horizon)
            for p in list(self._held):
                self._post(self._release_held(p))

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

    def set_backup_ceiling(self, clock: int) -> None:
        """Keep backed-up partitions at no clock past `clock` (raised, never lowered): clocks
        past it are summed and held back, so a roll-back can restore every partition at one
        common clock (see `backup_progress`, `restore_owners`)."""
        with self._lock:
            self._backup.set_ceiling(clock)

    def backup_progress(self) -> dict[int, tuple[int, int]]:
        """(applied through, complete through) of each backed-up partition: it can be
        restored at any clock between the two."""
        with self._lock:
            store = self._backup
            out = {}
            for p in self._backed_here():
                applied = store.consistent_clock(p)
                out[p] = (-1 if applied is None else applied, store.complete_through(p))
            return out

    def _backed_here(self) -> list[int]:
        """The backed-up partitions whose BackupPS this server is (a copy it keeps as a
        ParamServ's, with no BackupPS named, counts too)."""
        return [
            p for p in self._backup.owned() if self._backups.get(p, self.endpoint) == self.endpoint
        ]

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

        While in flight, requests for p are parked (`_park`). After the ack they get
        `moved:<version>:<new owner>`, and so do pulls that were held. If this
        server is p's BackupPS (a ParamServ handing p to a new ActivePS), it keeps the handed
        state as its backup copy, and the receiver streams from there.

        A hand-off whose outcome is unknown may be sent again to the same receiver: it takes
        a partition once and acknowledges a repeat (see `_on_handoff`).

        Raises:
            PartitionError: p is not owned here, a hand-off of p is already in flight, or one
                to another receiver has an unknown outcome.
            HandoffError: the receiver refused (`outcome_unknown=False`: this server still
                owns and serves p, unchanged), or no valid ack came within `timeout_s`
                (`outcome_unknown=True`: p stays frozen, since the receiver may have taken it;
                hand it off to the same receiver again, or, once that receiver is fenced off,
                call `resume_partition(p)`).
        """
        with self._lock:
            unsettled = self._unsettled.get(p)
            if p in self._moving and unsettled is None:
                raise PartitionError(f"partition {p} is already being handed off", partition=p)
            if unsettled not in (None, endpoint):
                raise PartitionError(
                    f"partition {p}: the hand-off to {unsettled} has an unknown outcome; "
                    "hand it there again, or resume it once that receiver is fenced off",
                    partition=p,
                )
            self._unsettled.pop(p, None)
            snapshot = self._store.export_partition(p)
            self_backup = self._backups.get(p) == self.endpoint
            if self_backup:  # its copy here learns waiting clocks' coefficients (clipping)
                snapshot = replace(snapshot, pending=self._store.complete_unapplied(p))
            self._moving.add(p)
            self._handoff_seq += 1
            seq = self._handoff_seq
        try:
            header, _ = self._request(
                endpoint,
                MessageKind.HANDOFF,
                seq,
                snapshot_fields(snapshot),
                MessageKind.HANDOFF_ACK,
                timeout_s,
                p,
            )
        except HandoffError as exc:
            if not exc.outcome_unknown:
                self.resume_partition(p)
            else:
                with self._lock:
                    if p in self._moving:  # not resumed or restored meanwhile
                        self._unsettled[p] = endpoint
                        self._post(self._unpark(p, str(RejectReason.MOVING)))  # retried
            raise
        except Exception:  # framing or socket set-up: nothing reached the receiver
            self.resume_partition(p)
            raise
        new_owner, version = header.sender, header.clock or 0
        with self._lock:
            if p not in self._moving:  # resumed or restored here meanwhile: it serves p again
                log.warning("a hand-off was acknowledged after its partition was resumed or "
                            "restored here; kept here", extra={"node": self.node_id,
                            "partition": p, "to": new_owner})  # fmt: skip
                raise HandoffError(p, "resumed here meanwhile")
            detail = moved_detail(new_owner, version)
            try:
                if self_backup:
                    self._backup.import_partition(snapshot, restore=True)
                self._store.drop_partition(p, version)
                self._forget_copies(p)
                self._moving.discard(p)
                self._moved[p] = (new_owner, version)
                refused = self._held.pop(p, [])
                self._stats = replace(self._stats, rejected=self._stats.rejected + len(refused))
                self._post([
                    (h.identity, self._encode(MessageKind.ERROR, h.seq, partition=p, detail=detail))
                    for h in refused
                ])  # fmt: skip
            finally:  # the receiver has p either way: nothing parked is kept waiting
                self._post(self._unpark(p, detail))
            self._stats = replace(self._stats, handoffs_sent=self._stats.handoffs_sent + 1)
        log.info(
            "partition handed off",
            extra={"node": self.node_id, "partition": p, "to": new_owner, "version": version},
        )
        return HandoffResult(p, new_owner, version)

    def resume_partition(self, p: int) -> None:
        """Serve p again after a hand-off whose outcome was unknown: safe once no request can
        reach the receiver's copy (it was never named an owner; fence it off first)."""
        with self._lock:
            self._moving.discard(p)
            self._unsettled.pop(p, None)
            self._post(self._unpark(p))

    def unsettled(self) -> dict[int, str]:
        """Partitions frozen by a hand-off whose outcome is unknown, and their receivers."""
        with self._lock:
            return dict(self._unsettled)

    def restore_owners(
        self,
        epoch: int,
        owners: Mapping[int, str],
        versions: Mapping[int, int],
        *,
        clock: int | None = None,
        timeout_s: float = HANDOFF_TIMEOUT_SECONDS,
    ) -> dict[int, tuple[int, int]]:
        """Roll back: send this server's backup of each partition in `owners` to its owner,
        each as of `clock` (see `backup_progress`; None: as far as it is applied).

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
            store = self._backup
            # each partition exactly at `clock`, or (no common clock) at its own last complete
            # one: the clock reported is then the one the owner will hold
            targets = {p: store.complete_through(p) if clock is None else clock for p in owners}
            for p, target in targets.items():
                store.check_rewind(p, target)  # all, before any changes
            for p, target in targets.items():
                store.rewind_to(p, target)
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
                    self._post(self._restore_locked(snap, epoch))
                    version = self._store.version(p)
            else:
                self._handoff_seq += 1
                header, _ = self._request(
                    endpoint,
                    MessageKind.RESTORE,
                    self._handoff_seq,
                    snapshot_fields(snap, epoch=epoch),
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
        self._unsettled.pop(p, None)
        self._taken.pop(p, None)
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
        return replies + self._unpark(p)  # under the new epoch: older ones are refused

    # -- serving loop ---------------------------------------------------------------------

    def _dispatch(
        self, identity: bytes, header: Header, tensors: dict[str, torch.Tensor]
    ) -> list[Reply]:
        if header.kind in (MessageKind.PULL, MessageKind.PUSH, MessageKind.NORM, MessageKind.CLIP):
            self._check_epoch(header)
            if header.partition in self._moving:
                return self._park(header.partition, _Parked(identity, header, tensors))
        if header.kind is MessageKind.PULL:
            return self._on_pull(identity, header)
        if header.kind is MessageKind.NORM:
            return self._on_norm(identity, header)
        if header.kind is MessageKind.CLIP:
            return self._on_clip(identity, header, tensors)
        if header.kind is MessageKind.PUSH:
            return self._on_push(identity, header, tensors)
        if header.kind is MessageKind.HANDOFF:
            return self._on_handoff(identity, header, tensors)
        if header.kind is MessageKind.RESTORE:
            return self._on_restore(identity, header, tensors)
        if header.kind is MessageKind.REPLICATE:
            return self._on_replicate(identity, header, tensors)
        raise RejectedError(RejectReason.UNEXPECTED_KIND, str(header.kind))

    def _admit_chunks(self, header: Header) -> None:
        """Pushes may come in chunks, to a partition served here or moving (parked whole)."""
        if header.kind is not MessageKind.PUSH:
            super()._admit_chunks(header)
        self._check_epoch(header)
        p = header.partition
        if p in self._moving:
            return  # parked whole
        self._check_serving(p)
        assert p is not None and header.chunk is not None
        size = self._store.live_values(p)[0].numel()
        if header.chunk[1] != size:
            raise RejectedError(RejectReason.BAD_DELTA, f"{header.chunk[1]} values, want {size}")

    def _check_epoch(self, header: Header) -> None:
        if header.epoch is None or header.epoch == self.epoch:
            return
        if header.epoch < self.epoch:
            raise RejectedError(
                RejectReason.STALE_EPOCH, wire_detail=f"{RejectReason.STALE_EPOCH}:{self.epoch}"
            )
        raise RejectedError(RejectReason.FUTURE_EPOCH, f"server at epoch {self.epoch}")

    def _park(self, p: int, request: _Parked) -> list[Reply]:
        """Keep a request for partition p while it is handed off: a worker that asked again
        every few ms would send its push (and MAC it) over and over, taking the cores the
        hand-off needs. It is answered once the hand-off settles: `moved` (the worker asks
        the new owner), or served here if p is resumed. A frozen partition whose hand-off has
        an unknown outcome, or one with `MAX_PARKED` waiting, refuses with `moving`."""
        parked = self._parked.setdefault(p, [])
        if p in self._unsettled or len(parked) >= MAX_PARKED:
            raise RejectedError(RejectReason.MOVING, f"partition {p}")
        # a copy: a push from this node's own worker views the worker's buffer (inproc, zero
        # copy), which it may fill again before the hand-off settles
        tensors = {k: v.clone() for k, v in request.tensors.items()}
        parked.append(replace(request, tensors=tensors))
        return []

    def _unpark(self, p: int, detail: str | None = None) -> list[Reply]:
        """The requests parked for p: refused with `detail`, or (None) handled now (one that
        fails is refused; the others are answered still)."""
        replies: list[Reply] = []
        for r in self._parked.pop(p, []):
            if detail is not None:
                replies.append(self._reject_locked(r.identity, r.header.seq, detail, r.header))
                continue
            try:
                replies += self._answer_locked(r.identity, r.header, r.tensors)
            except Exception as exc:  # noqa: BLE001 - one request never loses the others
                log.exception("a parked request failed", extra={"node": self.node_id})
                why = f"parked request failed: {type(exc).__name__}"
                replies.append(self._reject_locked(r.identity, r.header.seq, why, r.header))
        return replies

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
        p = snapshot.partition
        taken = self._taken.get(p)
        resent = taken is not None and taken[:2] == (header.sender, snapshot.version)
        if taken is not None and resent and self._store.owns(p):
            # a resent hand-off whose ack was lost: taken once, acknowledged again
            ack = self._encode(MessageKind.HANDOFF_ACK, header.seq, partition=p, clock=taken[2])
            return [(identity, ack)]
        try:
            version = self._store.import_partition(snapshot)
        except OwnershipConflictError as exc:
            raise RejectedError(RejectReason.STALE_VERSION, str(exc)) from exc
        except PartitionError as exc:
            raise RejectedError(RejectReason.BAD_SNAPSHOT, str(exc)) from exc
        self._taken[p] = (header.sender, snapshot.version, version)
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
        coef = coefficient_of(tensors) if set(tensors) == {"delta", "coef"} else None
        if set(tensors) - {"delta", "coef"} or (coef is None and "coef" in tensors):
            raise RejectedError(RejectReason.BAD_DELTA, "want `delta` and maybe `coef`")
        outcome = self._backup.apply_chunk(p, header.clock, header.workers, delta, coef)
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
        bf16 = header.detail == wire.PULL_BF16
        whole = header.whole_reply is True
        pull = _HeldPull(identity, header.seq, min_clock, header.epoch, bf16=bf16, whole=whole)
        if self._answerable(p, pull):
            return [self._pull_reply(p, pull)]
        self._held.setdefault(p, []).append(pull)
        return []

    def _on_norm(self, identity: bytes, header: Header) -> list[Reply]:
        p = header.partition
        self._check_clipping()
        self._check_serving(p)
        assert p is not None
        if header.clock is None or header.clock < 0:
            raise RejectedError(RejectReason.BAD_CLOCK, "norm without a clock")
        request = _HeldPull(identity, header.seq, header.clock, header.epoch, norm=True)
        if self._answerable(p, request):
            return [self._pull_reply(p, request)]
        self._held.setdefault(p, []).append(request)
        return []

    def _on_clip(
        self, identity: bytes, header: Header, tensors: dict[str, torch.Tensor]
    ) -> list[Reply]:
        p = header.partition
        self._check_clipping()
        self._check_serving(p)
        assert p is not None
        coef = coefficient_of(tensors) if set(tensors) == {"coef"} else None
        if header.clock is None or header.clock < 0 or coef is None:
            raise RejectedError(RejectReason.BAD_DELTA, "want a clock and a `coef` in [0, 1]")
        roster = self._store.roster
        clock = header.clock
        members = () if roster is None else (*roster.members(clock), *roster.members(clock + 1))
        if header.sender not in members:
            raise RejectedError(RejectReason.UNKNOWN_WORKER, f"{header.sender} at clock {clock}")
        if not self._store.set_coefficient(p, clock, coef):
            raise RejectedError(RejectReason.BAD_CLOCK, f"clock {clock} is not complete")
        ack = self._encode(MessageKind.CLIP_ACK, header.seq, partition=p, clock=header.clock)
        replies: list[Reply] = [(identity, ack), *self._release_held(p)]
        self._queue_stream(p)
        return replies

    def _check_clipping(self) -> None:
        if not self._store.clipping:
            raise RejectedError(RejectReason.UNEXPECTED_KIND, "this job does not clip")

    def _answerable(self, p: int, pull: _HeldPull) -> bool:
        """Consistent enough, and for a clock within the horizon (a `norm`: complete)."""
        if pull.norm:
            return self._store.norm_answer(p, pull.min_clock) is not None
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
                tensors={"delta": chunk.delta}
                | ({} if chunk.coef is None else coefficient_tensors(chunk.coef)),
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
        if pull.norm:
            answer = self._store.norm_answer(p, pull.min_clock)
            assert answer is not None  # answerable
            frames = self._encode(
                MessageKind.NORM_REPLY,
                pull.seq,
                partition=p,
                clock=pull.min_clock,
                tensors=answer.tensors(),
            )
            return pull.identity, frames
        self._stats = replace(self._stats, pulls_answered=self._stats.pulls_answered + 1)
        consistent = self._store.consistent_clock(p)
        values, generation = self._store.live_values(p)
        copies = self._reply_copies[torch.bfloat16 if pull.bf16 else torch.float32]
        clock = pull.min_clock if consistent is None else consistent
        tensors = {"values": copies.copy_of(p, values, generation)}
        if not pull.whole and chunks.chunked(tensors, self._chunk_bytes):  # signed as sent
            fields = self._header(MessageKind.PULL_REPLY, pull.seq, partition=p, clock=clock)
            reply = chunks.ChunkedMessage(
                fields,
                "values",
                tensors["values"],
                self._token,
                chunk_bytes=self._chunk_bytes,
                frame=copies.tracked(p),
            )
            return pull.identity, reply
        frames = self._encode(
            MessageKind.PULL_REPLY,
            pull.seq,
            tensors=tensors,
            zero_copy=True,
            partition=p,
            clock=clock,
        )
        return pull.identity, copies.track(p, frames)

    def _forget_copies(self, p: int) -> None:
        for copies in self._reply_copies.values():
            copies.forget(p)
        self._assembler.forget(p)
