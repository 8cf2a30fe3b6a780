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
from collections.abc import Iterable
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
    ServerError,
    WireError,
    WireReason,
)
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
    applied: set[tuple[str, int]] = field(default_factory=set)  # (worker, clock)
    frontier: dict[str, int] = field(default_factory=dict)  # worker -> all clocks <= this applied
    version: int = 0  # ownership version: bumped by every hand-off


@dataclass(frozen=True)
class PartitionSnapshot:
    """Everything a new owner needs to serve a partition exactly as the old one did.

    `values` is a private float32 copy; `applied` the (worker, clock) pushes already in it;
    `version` the ownership version at export (the receiver will hold `version + 1`);
    `workers` the workers registered at the sender (the receiver registers them too).
    """

    partition: int
    values: torch.Tensor
    applied: frozenset[tuple[str, int]]
    version: int
    workers: tuple[str, ...] = ()


class PartitionStore:
    """The partitions a server owns and the updates applied to them. Not thread-safe."""

    def __init__(self) -> None:
        self._parts: dict[int, _Partition] = {}
        self._given_away: dict[int, int] = {}  # partition -> the version its new owner holds
        self.workers: set[str] = set()

    def add(self, p: int, values: torch.Tensor, *, version: int = 0) -> None:
        """Take ownership of partition p with these values (copied to a float32 vector)."""
        self._parts[p] = _Partition(
            values.detach().reshape(-1).to(torch.float32).clone(), version=version
        )

    def version(self, p: int) -> int:
        """The ownership version of partition p. Raises PartitionError if not owned here."""
        return self._get(p).version

    def export_partition(self, p: int) -> PartitionSnapshot:
        """A snapshot of partition p (copies); the store keeps owning and serving it.

        Raises:
            PartitionError: p is not owned here.
        """
        part = self._get(p)
        return PartitionSnapshot(
            p,
            part.values.clone(),
            frozenset(part.applied),
            part.version,
            tuple(sorted(self.workers)),
        )

    def import_partition(self, snapshot: PartitionSnapshot) -> int:
        """Take ownership of a handed-off partition; returns its new version (snapshot's + 1).

        The applied set comes along, so replayed pushes stay duplicates; the snapshot's workers
        are registered. A snapshot is refused if it is older than what this store holds (it
        must be newer than the owned version) or last gave away (it must be at least that).

        Raises:
            OwnershipConflictError: the snapshot is stale; nothing changed.
            PartitionError: malformed snapshot (values not 1-D float32, or a negative clock);
                nothing changed.
        """
        p = snapshot.partition
        owned = self._parts.get(p)
        floor = owned.version + 1 if owned is not None else self._given_away.get(p, 0)
        if snapshot.version < floor:
            current = owned.version if owned is not None else floor
            raise OwnershipConflictError(p, snapshot.version, current)
        values = snapshot.values
        if values.dtype != torch.float32 or values.dim() != 1:
            raise PartitionError(
                f"snapshot values: {values.dtype} {tuple(values.shape)}", partition=p
            )
        if any(clock < 0 for _, clock in snapshot.applied):
            raise PartitionError("snapshot has a negative clock", partition=p)
        part = _Partition(values.clone(), set(snapshot.applied), version=snapshot.version + 1)
        for worker in {w for w, _ in part.applied}:
            front = -1
            while (worker, front + 1) in part.applied:
                front += 1
            part.frontier[worker] = front
        self.workers.update(snapshot.workers)
        self._parts[p] = part
        self._given_away.pop(p, None)
        return part.version

    def drop_partition(self, p: int, new_version: int) -> None:
        """Stop owning p after its hand-off; remembers `new_version` to refuse stale imports.

        Raises:
            PartitionError: p is not owned here.
        """
        self._get(p)
        del self._parts[p]
        self._given_away[p] = new_version

    def owned(self) -> list[int]:
        return sorted(self._parts)

    def register_workers(self, ids: Iterable[str]) -> None:
        self.workers.update(ids)

    def values(self, p: int) -> torch.Tensor:
        """A copy of partition p. Raises PartitionError if this store does not own it."""
        return self._get(p).values.clone()

    def apply_push(self, p: int, worker: str, clock: int, delta: torch.Tensor) -> PushOutcome:
        """Add `delta` to partition p once per (worker, clock).

        Raises:
            RejectedError: not owned, unknown worker, negative clock, or a delta of the wrong
                dtype or shape; nothing changed.
        """
        part = self._parts.get(p)
        if part is None:
            raise RejectedError(RejectReason.NOT_OWNER, f"partition {p}")
        if worker not in self.workers:
            raise RejectedError(RejectReason.UNKNOWN_WORKER, worker)
        if clock < 0:
            raise RejectedError(RejectReason.BAD_CLOCK, f"clock {clock}")
        if delta.dtype != torch.float32 or delta.shape != part.values.shape:
            raise RejectedError(
                RejectReason.BAD_DELTA,
                f"{delta.dtype} {tuple(delta.shape)}, want float32 {tuple(part.values.shape)}",
            )
        if (worker, clock) in part.applied:
            return PushOutcome.DUPLICATE
        part.values += delta
        part.applied.add((worker, clock))
        front = part.frontier.get(worker, -1)
        while (worker, front + 1) in part.applied:
            front += 1
        part.frontier[worker] = front
        return PushOutcome.APPLIED

    def consistent_clock(self, p: int) -> int | None:
        """The highest c such that every registered worker's pushes 0..c to p are applied.

        None if no worker is registered (every pull is then answerable). Raises PartitionError.
        """
        part = self._get(p)
        if not self.workers:
            return None
        return min(part.frontier.get(w, -1) for w in self.workers)

    def ready(self, p: int, min_clock: int) -> bool:
        """Whether a pull of p that must see clocks up to `min_clock` can be answered now."""
        c = self.consistent_clock(p)
        return c is None or c >= min_clock

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


Reply = tuple[bytes, list[bytes]]


class ParamServer:
    """A parameter server thread on a ROUTER socket at `tcp://<host>:<port>` (0: random port).

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
    ) -> None:
        self.node_id = node_id
        self.job_id = job_id
        self._token = token
        self._address = f"tcp://{host}:{port}"
        self._max_message_bytes = max_message_bytes
        self._store = PartitionStore()
        self._held: dict[int, list[_HeldPull]] = {}
        self._moving: set[int] = set()  # hand-off in flight: frozen
        self._moved: dict[int, tuple[str, int]] = {}  # handed off: (new owner, version)
        self._outbox: list[Reply] = []  # replies from other threads, sent by the serve thread
        self._handoff_seq = 0
        self._stats = ServerStats()
        self._lock = threading.Lock()
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

    def owned(self) -> list[int]:
        """The partitions this server holds (including one whose hand-off is in flight)."""
        with self._lock:
            return self._store.owned()

    def snapshot(self, p: int) -> PartitionSnapshot:
        """A snapshot of partition p (as `PartitionStore.export_partition`)."""
        with self._lock:
            return self._store.export_partition(p)

    def handoff_to(
        self, p: int, endpoint: str, *, timeout_s: float = HANDOFF_TIMEOUT_SECONDS
    ) -> HandoffResult:
        """Hand partition p to the server at `endpoint`; on its ack, stop serving p.

        While in flight, pulls and pushes for p get a `moving` error (retryable). After the
        ack they get `moved:<version>:<new owner>`, and so do pulls that were held.

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
            self._moving.add(p)
            self._handoff_seq += 1
            seq = self._handoff_seq
        try:
            new_owner, version = self._send_handoff(snapshot, endpoint, seq, timeout_s)
        except HandoffError as exc:
            if not exc.outcome_unknown:
                self.resume_partition(p)
            raise
        with self._lock:
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

    def _send_handoff(
        self, snapshot: PartitionSnapshot, endpoint: str, seq: int, timeout_s: float
    ) -> tuple[str, int]:
        p = snapshot.partition
        workers, tensors = snapshot_to_wire(snapshot)
        frames = self._encode(
            MessageKind.HANDOFF, seq, partition=p, workers=workers, tensors=tensors
        )
        ctx: zmq.Context[Any] = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(endpoint)
            sock.send_multipart(frames)
            deadline = time.monotonic() + timeout_s
            while (remaining_ms := int((deadline - time.monotonic()) * 1000)) > 0:
                if not sock.poll(remaining_ms):
                    break
                try:
                    header, reply = wire.decode(sock.recv_multipart(), self._token)
                except WireError as exc:
                    raise HandoffError(p, str(exc.reason), outcome_unknown=True) from exc
                if header.seq != seq:
                    continue
                if header.kind is MessageKind.ERROR:
                    raise HandoffError(p, header.detail or "error")
                version = reply.get("version")
                if (
                    header.kind is not MessageKind.HANDOFF_ACK
                    or header.partition != p
                    or version is None
                    or version.dtype != torch.int64
                    or version.shape != (1,)
                ):
                    raise HandoffError(p, f"unexpected {header.kind} reply", outcome_unknown=True)
                return header.sender, int(version.item())
            raise HandoffError(p, "timeout", outcome_unknown=True)
        finally:
            sock.close(linger=0)
            ctx.term()

    def register_workers(self, ids: Iterable[str]) -> None:
        """Allow these workers to push; pulls then wait for their pushes too."""
        with self._lock:
            self._store.register_workers(ids)

    def state(self, p: int) -> torch.Tensor:
        """A copy of partition p's current values. Raises PartitionError if not owned here."""
        with self._lock:
            return self._store.values(p)

    def stats(self) -> ServerStats:
        with self._lock:
            held = sum(len(v) for v in self._held.values())
            return replace(self._stats, pulls_held=held)

    # -- serving loop ---------------------------------------------------------------------

    def _serve(self) -> None:
        sock = self._sock
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                with self._lock:
                    outbox, self._outbox = self._outbox, []
                for identity, frames in outbox:
                    sock.send_multipart([identity, *frames])
                if not poller.poll(POLL_INTERVAL_MS):
                    continue
                while True:
                    try:
                        msg = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    for identity, frames in self._handle(msg):
                        sock.send_multipart([identity, *frames])
        except Exception:
            log.exception("param server crashed", extra={"node": self.node_id})
        finally:
            sock.close(linger=0)
            self._sock = None

    def _handle(self, msg: list[bytes]) -> list[Reply]:
        """Process one ROUTER message; returns the replies to send. Never raises."""
        if len(msg) < 2:
            return self._drop("no frames after identity")
        identity, frames = msg[0], msg[1:]
        try:
            header, tensors = wire.decode(
                frames, self._token, max_message_bytes=self._max_message_bytes
            )
        except WireError as exc:
            if exc.reason is WireReason.BAD_JSON:
                return self._drop(str(exc))
            return [self._reject(identity, _best_effort_seq(frames[0]), str(exc.reason))]
        with self._lock:
            try:
                if header.job_id != self.job_id:
                    raise RejectedError(RejectReason.WRONG_JOB, header.job_id)
                if header.kind is MessageKind.PULL:
                    return self._on_pull(identity, header)
                if header.kind is MessageKind.PUSH:
                    return self._on_push(identity, header, tensors)
                if header.kind is MessageKind.HELLO:
                    return [(identity, self._encode(MessageKind.HELLO, header.seq))]
                if header.kind is MessageKind.HANDOFF:
                    return self._on_handoff(identity, header, tensors)
                raise RejectedError(RejectReason.UNEXPECTED_KIND, str(header.kind))
            except RejectedError as exc:
                return [self._reject_locked(identity, header.seq, exc.wire_detail, header)]

    def _check_serving(self, p: int | None) -> None:
        """Raise the right RejectedError unless this server serves p right now."""
        if p is not None and p in self._moving:
            raise RejectedError(RejectReason.MOVING, f"partition {p}")
        if p is not None and p not in self._store.owned() and p in self._moved:
            owner, version = self._moved[p]
            raise RejectedError(
                RejectReason.MOVED, f"partition {p}", wire_detail=moved_detail(owner, version)
            )
        if p is None or p not in self._store.owned():
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
        self._moved.pop(snapshot.partition, None)
        self._stats = replace(self._stats, handoffs_received=self._stats.handoffs_received + 1)
        log.info(
            "partition taken over",
            extra={"node": self.node_id, "partition": snapshot.partition, "from": header.sender},
        )
        ack = self._encode(
            MessageKind.HANDOFF_ACK,
            header.seq,
            partition=snapshot.partition,
            tensors={"version": torch.tensor([version], dtype=torch.int64)},
        )
        return [(identity, ack)]

    def _on_pull(self, identity: bytes, header: Header) -> list[Reply]:
        p = header.partition
        self._check_serving(p)
        assert p is not None
        min_clock = header.clock if header.clock is not None else -1
        if self._store.ready(p, min_clock):
            return [self._pull_reply(p, _HeldPull(identity, header.seq, min_clock))]
        self._held.setdefault(p, []).append(_HeldPull(identity, header.seq, min_clock))
        return []

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
        outcome = self._store.apply_push(p, header.sender, header.clock, delta)
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
        return replies

    def _release_held(self, p: int) -> list[Reply]:
        held = self._held.get(p, [])
        ready = [h for h in held if self._store.ready(p, h.min_clock)]
        if ready:
            self._held[p] = [h for h in held if h not in ready]
        return [self._pull_reply(p, h) for h in ready]

    def _pull_reply(self, p: int, pull: _HeldPull) -> Reply:
        self._stats = replace(self._stats, pulls_answered=self._stats.pulls_answered + 1)
        consistent = self._store.consistent_clock(p)
        frames = self._encode(
            MessageKind.PULL_REPLY,
            pull.seq,
            partition=p,
            clock=pull.min_clock if consistent is None else consistent,
            tensors={"values": self._store.values(p)},
        )
        return pull.identity, frames

    def _encode(
        self,
        kind: MessageKind,
        seq: int,
        *,
        tensors: dict[str, torch.Tensor] | None = None,
        **fields: Any,
    ) -> list[bytes]:
        header = {"kind": kind, "job_id": self.job_id, "sender": self.node_id, "seq": seq, **fields}
        return wire.encode(header, tensors or {}, self._token)

    def _reject(self, identity: bytes, seq: int, reason: str) -> Reply:
        with self._lock:
            return self._reject_locked(identity, seq, reason, None)

    def _reject_locked(
        self, identity: bytes, seq: int, reason: str, header: Header | None
    ) -> Reply:
        self._stats = replace(self._stats, rejected=self._stats.rejected + 1)
        log.warning(
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


def snapshot_to_wire(snapshot: PartitionSnapshot) -> tuple[list[str], dict[str, torch.Tensor]]:
    """The `workers` header list and the tensors of a `handoff` message for `snapshot`."""
    workers = sorted(set(snapshot.workers) | {w for w, _ in snapshot.applied})
    index = {w: i for i, w in enumerate(workers)}
    pairs = sorted((index[w], clock) for w, clock in snapshot.applied)
    applied = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)
    version = torch.tensor([snapshot.version], dtype=torch.int64)
    return workers, {"values": snapshot.values, "applied": applied, "version": version}


def snapshot_from_wire(header: Header, tensors: dict[str, torch.Tensor]) -> PartitionSnapshot:
    """Parse an authenticated `handoff` message. Raises RejectedError(BAD_SNAPSHOT)."""
    values, applied, version = (tensors.get(k) for k in ("values", "applied", "version"))
    workers = header.workers or ()
    if (
        header.partition is None
        or len(tensors) != 3
        or values is None
        or values.dtype != torch.float32
        or values.dim() != 1
        or applied is None
        or applied.dtype != torch.int64
        or applied.dim() != 2
        or applied.shape[1] != 2
        or version is None
        or version.dtype != torch.int64
        or version.shape != (1,)
    ):
        raise RejectedError(RejectReason.BAD_SNAPSHOT, "want values, applied (k, 2), version")
    pairs = [(int(i), int(c)) for i, c in applied.tolist()]
    if any(not 0 <= i < len(workers) or c < 0 for i, c in pairs):
        raise RejectedError(RejectReason.BAD_SNAPSHOT, "worker index or clock out of range")
    return PartitionSnapshot(
        header.partition,
        values,
        frozenset((workers[i], c) for i, c in pairs),
        int(version.item()),
        tuple(workers),
    )


def _best_effort_seq(raw: bytes) -> int:
    """The `seq` of an unauthenticated header if it has a usable one (for the error reply)."""
    try:
        seq = json.loads(raw).get("seq")
    except (ValueError, AttributeError):
        return 0
    return seq if isinstance(seq, int) and seq >= 0 else 0
