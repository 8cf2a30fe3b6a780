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
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

import torch
import zmq

from orchestrator.agileml import wire
from orchestrator.agileml.errors import PartitionError, ServerError, WireError, WireReason
from orchestrator.agileml.wire import Header, MessageKind

log = logging.getLogger(__name__)

POLL_INTERVAL_MS = 50  # how often the server thread checks for stop() while idle
STOP_TIMEOUT_SECONDS = 5.0  # stop() gives the thread this long to exit


class RejectReason(StrEnum):
    """Why a well-formed, authenticated request was refused (sent back in `detail`)."""

    WRONG_JOB = "wrong_job"
    UNEXPECTED_KIND = "unexpected_kind"
    NOT_OWNER = "not_owner"  # this server does not hold the partition (it may have moved)
    UNKNOWN_WORKER = "unknown_worker"  # only registered workers may push
    BAD_DELTA = "bad_delta"  # missing "delta" tensor, or wrong dtype/shape
    BAD_CLOCK = "bad_clock"  # a push without a clock, or with a negative one


class RejectedError(Exception):
    """Internal: a request the store refuses; becomes an `error` reply. State is unchanged."""

    def __init__(self, reason: RejectReason, detail: str = "") -> None:
        self.reason = reason
        super().__init__(f"{reason}: {detail}" if detail else str(reason))


class PushOutcome(StrEnum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"  # already applied earlier; acknowledged, not re-applied


@dataclass
class _Partition:
    values: torch.Tensor
    applied: set[tuple[str, int]] = field(default_factory=set)  # (worker, clock)
    frontier: dict[str, int] = field(default_factory=dict)  # worker -> all clocks <= this applied


class PartitionStore:
    """The partitions a server owns and the updates applied to them. Not thread-safe."""

    def __init__(self) -> None:
        self._parts: dict[int, _Partition] = {}
        self.workers: set[str] = set()

    def add(self, p: int, values: torch.Tensor) -> None:
        """Take ownership of partition p with these values (copied to a float32 vector)."""
        self._parts[p] = _Partition(values.detach().reshape(-1).to(torch.float32).clone())

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

    def add_partition(self, p: int, values: torch.Tensor) -> None:
        """Take ownership of partition p with the given initial values."""
        with self._lock:
            self._store.add(p, values)

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
                raise RejectedError(RejectReason.UNEXPECTED_KIND, str(header.kind))
            except RejectedError as exc:
                return [self._reject_locked(identity, header.seq, str(exc.reason), header)]

    def _on_pull(self, identity: bytes, header: Header) -> list[Reply]:
        p = header.partition
        if p is None or p not in self._store.owned():
            raise RejectedError(RejectReason.NOT_OWNER, f"partition {p}")
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


def _best_effort_seq(raw: bytes) -> int:
    """The `seq` of an unauthenticated header if it has a usable one (for the error reply)."""
    try:
        seq = json.loads(raw).get("seq")
    except (ValueError, AttributeError):
        return 0
    return seq if isinstance(seq, int) and seq >= 0 else 0
