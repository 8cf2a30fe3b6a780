"""A worker's requests to the parameter servers: rounds of pulls or pushes sent together,
their replies filed as they come, retries of what may be retried, and one socket per server
(its own node's over `inproc://`). `Worker` builds on it; the rules are in `worker`'s docstring.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from orchestrator.agileml import chunks, wire
from orchestrator.agileml.clipping import (
    answer_from_tensors,
    coefficient,
    coefficient_tensors,
)
from orchestrator.agileml.errors import AgileMLError, WireError, WorkerError
from orchestrator.agileml.partitions import PartitionLayout, PartitionTable
from orchestrator.agileml.rejections import RejectReason, parse_moved
from orchestrator.agileml.roster import Roster
from orchestrator.agileml.wire import MessageKind

log = logging.getLogger(__name__)

PULL_TIMEOUT_SECONDS = 30.0  # a pull may legitimately wait for the slowest worker
RETRY_DELAY_SECONDS = 0.002  # before asking again about a partition in flight
WAIT_SLICE_MS = 20  # how often a waiting worker checks its abort callback

# partition, kind, clock, tensors, the worker identity it is sent as
Request = tuple[int, MessageKind, int, dict[str, torch.Tensor], str]


@dataclass(frozen=True)
class WorkerSpec:
    """The plan for one worker; validated on construction of the `Worker`.

    `slack` is the SSP staleness bound s: at clock t the worker must see every update up to
    clock t-s-1. `slack=0` is BSP.
    """

    worker_id: str
    job_id: str
    batch_size: int
    slack: int = 0
    seed: int = 0
    request_timeout_s: float = PULL_TIMEOUT_SECONDS
    # overlap communication with computation (`streams`): compute on the first pulled
    # partitions while the rest arrive, push each partition as soon as its gradients are in
    overlap: bool = False
    # micro-batches per share of an iteration (gradient accumulation; `TrainingSpec.accumulate`)
    accumulate: int = 1
    # the forward and loss under autocast to bfloat16 (`TrainingSpec.precision`)
    precision: str = "fp32"
    # what its pushes and pulls carry: `bf16` rounds each partition's gradient, and has the
    # servers round the values they send, to bfloat16 (half the bytes; `TrainingSpec`)
    wire_precision: str = "fp32"
    # clip each clock's gradient to this global norm (`clipping`; needs slack 0); None: no
    clip_grad_norm: float | None = None
    # the job's iterations: no share past them is fetched ahead (`loading`)
    iterations: int = 1 << 62


@dataclass
class Round:
    """Requests of one kind sent together (an iteration's pulls, or its pushes) and their
    replies; requests may join while earlier ones are answered (pushes leave as backward
    produces them)."""

    want: MessageKind
    expected: int = 0  # requests planned: the "pushing" phase comes after half are sent
    requests: list[Request] = field(default_factory=list)
    results: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    waiting: int = 0  # sent and not answered yet
    first_reply_at: float | None = None
    on_reply: Callable[[int, dict[str, torch.Tensor]], None] | None = None
    waited_s: float = 0.0  # spent in `_wait` calls made `within` this round


class StaleViewError(AgileMLError):
    """The worker's view is out of date: the job rolled back (redo from the new view's restart
    clock), the roster changed under this clock (`roster_version`: the servers' version; redo
    the clock on it), or the caller aborted."""

    def __init__(self, message: str, *, roster_version: int | None = None) -> None:
        self.roster_version = roster_version
        super().__init__(message)


class ServerRequests:
    """The request side of a `Worker` (a mixin: the worker sets the attributes below)."""

    spec: WorkerSpec
    layout: PartitionLayout
    table: PartitionTable
    endpoints: dict[str, str]
    local_endpoints: dict[str, str]
    epoch: int | None
    roster: Roster | None
    _token: bytes
    _abort: Callable[[], bool]
    _ctx: zmq.Context[Any] | None
    _sockets: dict[str, zmq.Socket[Any]]
    _seq: int
    _first_reply_at: float | None
    # requests sent and not answered: seq -> (their round, index in it)
    _outstanding: dict[int, tuple[Round, int]]
    _assembler: chunks.Assembler

    def _phase(self, name: str) -> None:
        """The fault-injection hook of the phase `name` (the worker's)."""
        raise NotImplementedError

    def _help_peers(self) -> None:
        """FlexRR: handle what came to the worker's inbox while it waits (the worker's)."""
        raise NotImplementedError

    def _peer_inbox(self) -> zmq.Socket[Any] | None:
        """FlexRR's inbox, to poll while waiting (the worker's; None without FlexRR)."""
        raise NotImplementedError

    def _round_trip(
        self, requests: list[Request], want: MessageKind
    ) -> dict[int, dict[str, torch.Tensor]]:
        """Send all requests at once, then wait for every reply; returns tensors per partition
        (of the last request to each partition)."""
        batch = Round(want, expected=len(requests))
        for request in requests:
            self._submit(batch, request)
        self._wait_for(batch)
        self._first_reply_at = batch.first_reply_at
        return batch.results

    def _clip_round(self, clock: int, partitions: int) -> None:
        """Gradient clipping (see `clipping`): ask every partition for clock `clock`'s squared
        norm (or its coefficient), and send the coefficient to those that lack it.

        Raises: as `run`.
        """
        max_norm = self.spec.clip_grad_norm
        if max_norm is None or clock < 0:
            return
        me = self.spec.worker_id
        replies = self._round_trip(
            [(p, MessageKind.NORM, clock, {}, me) for p in range(partitions)],
            MessageKind.NORM_REPLY,
        )
        try:
            answers = [answer_from_tensors(replies[p]) for p in range(partitions)]
        except ValueError as exc:
            raise WorkerError(me, f"bad norm reply: {exc}") from exc
        waiting = [p for p, a in enumerate(answers) if a.sq_norm is not None]
        if not waiting:
            return
        known = [a.coef for a in answers if a.coef is not None]
        if known:
            coef = known[0]
        else:
            if len(waiting) < partitions:  # applied long ago elsewhere (see KEEP_APPLIED)
                log.warning("clipping a redone clock without some partitions' norms",
                            extra={"clock": clock, "worker": me})  # fmt: skip
            coef = coefficient([a.sq_norm or 0.0 for a in answers], max_norm)
        self._round_trip(
            [(p, MessageKind.CLIP, clock, coefficient_tensors(coef), me) for p in waiting],
            MessageKind.CLIP_ACK,
        )

    def _submit(self, batch: Round, request: Request) -> None:
        """Send `request` as part of `batch`."""
        i = len(batch.requests)
        if i == batch.expected // 2 and i > 0 and batch.want is MessageKind.PUSH_ACK:
            self._phase("pushing")
        batch.requests.append(request)
        self._resend(batch, i)

    def _resend(self, batch: Round, i: int) -> None:
        self._seq += 1
        self._send(batch.requests[i], self._seq)
        self._outstanding[self._seq] = (batch, i)
        batch.waiting += 1

    def _wait_for(self, batch: Round) -> None:
        """Wait until every request of `batch` is answered (helping FlexRR peers meanwhile)."""
        self._wait(lambda: not batch.waiting, help_peers=True)

    def _wait(
        self, done: Callable[[], bool], within: Round | None = None, *, help_peers: bool = False
    ) -> None:
        """Receive replies (into their rounds) until `done()`; with `help_peers`, FlexRR's
        inbox is served meanwhile. `within`: a round waited for in several calls (a streaming
        pull, between layers), whose waits share one `request_timeout_s`.

        Raises: as `run`.
        """
        started = time.monotonic()
        budget = self.spec.request_timeout_s - (within.waited_s if within is not None else 0.0)
        helped = self._receive_until(done, started + budget, help_peers)
        if within is not None:
            within.waited_s += time.monotonic() - started - helped

    def _receive_until(self, done: Callable[[], bool], deadline: float, help_peers: bool) -> float:
        """The loop of `_wait`; returns the seconds spent helping peers (not counted against
        `deadline`)."""
        helped_s = 0.0
        poller = zmq.Poller()
        polled: set[zmq.Socket[Any]] = set()
        inbox = self._peer_inbox() if help_peers else None
        if inbox is not None:
            poller.register(inbox, zmq.POLLIN)
            polled.add(inbox)
        while not done():
            if self._abort():
                raise StaleViewError(f"worker {self.spec.worker_id}: aborted by its node")
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                raise WorkerError(self.spec.worker_id, "timeout")
            for sock in self._sockets.values():  # a `moved` reply may have added one
                if sock not in polled:
                    poller.register(sock, zmq.POLLIN)
                    polled.add(sock)
            for sock, _ in poller.poll(min(remaining_ms, WAIT_SLICE_MS)):
                if sock is inbox:
                    helped_from = time.monotonic()
                    self._help_peers()  # FlexRR: help peers while we wait
                    helped = time.monotonic() - helped_from
                    deadline += helped  # helping is not the servers' time
                    helped_s += helped
                    continue
                while sock.poll(0):
                    reply = self._receive(sock)
                    if reply is not None:
                        self._on_reply(*reply)
        return helped_s

    def _on_reply(self, header: wire.Header, tensors: dict[str, torch.Tensor]) -> None:
        """File a reply with its round; retry what may be retried. Raises: as `run`."""
        entry = self._outstanding.pop(header.seq, None)
        if entry is None:
            return  # a late reply to an earlier, abandoned request
        batch, i = entry
        batch.waiting -= 1
        p = batch.requests[i][0]
        if header.kind is MessageKind.ERROR:
            self._retry_or_raise(p, header.detail or "error")
            self._resend(batch, i)
            return
        if header.kind is not batch.want or header.partition != p:
            raise WorkerError(self.spec.worker_id, f"unexpected {header.kind} reply")
        if batch.first_reply_at is None:
            batch.first_reply_at = time.perf_counter()
        batch.results[p] = tensors
        if batch.on_reply is not None:
            batch.on_reply(p, tensors)

    def _retry_or_raise(self, p: int, detail: str) -> None:
        """Decide about an error reply for partition p: return to retry, raise otherwise."""
        moved = parse_moved(detail)
        if moved is not None:
            owner, version = moved
            if owner not in self.endpoints:
                raise WorkerError(self.spec.worker_id, f"partition {p} moved to unknown {owner}")
            if version > self.table.get(p).version:
                self.table.set(p, owner, version)
            return
        reason = detail.partition(":")[0]
        if reason == RejectReason.STALE_EPOCH:
            raise StaleViewError(f"worker {self.spec.worker_id}: {detail}")
        if reason == RejectReason.STALE_ROSTER:
            wanted = detail.partition(":")[2]
            raise StaleViewError(
                f"worker {self.spec.worker_id}: {detail}",
                roster_version=int(wanted) if wanted.isdigit() else None,
            )
        if reason in (RejectReason.MOVING, RejectReason.FUTURE_EPOCH):
            time.sleep(RETRY_DELAY_SECONDS)
            return
        owner = self.table.owner(p)
        raise WorkerError(self.spec.worker_id, detail, endpoint=self.endpoints.get(owner))

    def _send(self, request: Request, seq: int) -> None:
        p, kind, clock, tensors, identity = request
        fields: dict[str, Any] = {
            "kind": kind,
            "job_id": self.spec.job_id,
            "sender": identity,
            "seq": seq,
            "partition": p,
            "clock": clock,
        }
        if self.epoch is not None:
            fields["epoch"] = self.epoch
        if kind is MessageKind.PUSH and self.roster is not None:
            fields["roster_version"] = self.roster.version
        if kind is MessageKind.PULL and self._bf16_on_wire(p):
            fields["detail"] = wire.PULL_BF16
        if kind is MessageKind.PULL and self._inproc(p):
            fields["whole_reply"] = True  # by reference in process: nothing to overlap
        sock = self._socket(self.table.owner(p))
        # pushes frame the fresh gradient in place; nothing changes it after this
        # a push to the worker's own node goes whole: by reference, nothing to overlap
        whole = kind is not MessageKind.PUSH or self._inproc(p)
        message = chunks.message(fields, tensors, self._token, whole=whole)
        try:
            chunks.send(sock, [], message)
        except zmq.Again as exc:
            raise WorkerError(self.spec.worker_id, "timeout") from exc

    def _inproc(self, p: int) -> bool:
        """Whether partition p's owner is this worker's own node (reached in process)."""
        return self.endpoints.get(self.table.owner(p)) in self.local_endpoints

    def _bf16_on_wire(self, p: int) -> bool:
        """Whether partition p's pushes and pulls travel in bfloat16: with `wire_precision`
        bf16, unless it holds buffers' values (a counter would drift by the rounding of its
        pushed shares, and past 256 be rounded in the model)."""
        return self.spec.wire_precision == "bf16" and not self.layout.holds_buffers(p)

    def _receive(self, sock: zmq.Socket[Any]) -> tuple[wire.Header, dict[str, torch.Tensor]] | None:
        """The next reply on `sock`, whole: None for a chunk of one not complete yet (a
        chunked reply's values are lent until the next pull round resets the assembler)."""
        try:
            frames = sock.recv_multipart(copy=False)
            header, tensors = wire.decode([f.buffer for f in frames], self._token)
            if header.chunk is None or header.seq not in self._outstanding:
                return header, tensors  # a late one is dropped by `_on_reply`
            return self._assembler.add(header.seq, header, tensors, pool_key=header.partition)
        except WireError as exc:
            raise WorkerError(self.spec.worker_id, f"bad reply: {exc.reason}") from exc

    def _socket(self, owner: str) -> zmq.Socket[Any]:
        sock = self._sockets.get(owner)
        if sock is None:
            if owner not in self.endpoints:
                raise WorkerError(self.spec.worker_id, f"no endpoint for server {owner!r}")
            assert self._ctx is not None
            endpoint = self.endpoints[owner]
            inproc = self.local_endpoints.get(endpoint)
            ctx = wire.process_context() if inproc is not None else self._ctx
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)  # no limit on the messages queued: a large push or
            sock.setsockopt(zmq.RCVHWM, 0)  # pull reply is many chunks (`chunks`)
            # a send to a closed inproc peer blocks (over TCP it queues): time it out instead
            sock.setsockopt(zmq.SNDTIMEO, int(self.spec.request_timeout_s * 1000))
            sock.connect(inproc or endpoint)
            self._sockets[owner] = sock
        return sock

    def close(self) -> None:
        """Close the sockets (a later `step` opens new ones)."""
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()
        self._assembler.clear()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
