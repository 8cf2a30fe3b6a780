"""A stateless AgileML worker: pull the model, compute a gradient, push the update.

The worker keeps no model state between iterations, only its clock: each iteration pulls every
partition from its owner (waiting, under BSP/SSP, until the others are close enough), loads them
into a scratch model, computes the gradient on a minibatch of its shard, and pushes
`delta = -lr * grad` per partition tagged with its clock. The minibatch of clock t is a function
of (seed, worker, t), so a redone iteration computes the same update, and the server's
(worker, clock, partition) deduplication keeps it from being applied twice.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import zmq
from torch import nn

from orchestrator.agileml import wire
from orchestrator.agileml.errors import WireError, WorkerError
from orchestrator.agileml.partitions import PartitionLayout, PartitionTable
from orchestrator.agileml.wire import MessageKind

DEFAULT_REQUEST_TIMEOUT_SECONDS = 30.0  # a pull may legitimately wait for the slowest worker

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_Request = tuple[int, MessageKind, int, dict[str, torch.Tensor]]  # partition, kind, clock, tensors


@dataclass(frozen=True)
class WorkerSpec:
    """The plan for one worker; validated on construction of the `Worker`.

    `slack` is the SSP staleness bound s: at clock t the worker must see every update up to
    clock t-s-1. `slack=0` is BSP.
    """

    worker_id: str
    job_id: str
    batch_size: int
    lr: float
    slack: int = 0
    seed: int = 0
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_SECONDS


class Worker:
    """Runs iterations against the parameter servers named by a `PartitionTable`.

    Not thread-safe: call `run` from one thread; the ZMQ sockets live only inside `run`.

    Failure semantics: if a server refuses a request or does not answer within
    `request_timeout_s`, `run` raises `WorkerError` and the clock stays at the failed
    iteration. Pushes already acknowledged for that clock are applied; calling `run` again
    redoes the iteration with the same minibatch, and the servers ignore the repeated pushes.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        token: bytes,
        layout: PartitionLayout,
        table: PartitionTable,
        endpoints: Mapping[str, str],
        model_factory: Callable[[], nn.Module],
        data: tuple[torch.Tensor, torch.Tensor],
        loss_fn: LossFn,
    ) -> None:
        if spec.batch_size < 1 or spec.lr <= 0 or spec.slack < 0:
            raise ValueError(f"invalid worker spec: {spec}")
        if len(data[0]) != len(data[1]) or len(data[0]) == 0:
            raise ValueError("data must be two non-empty tensors of the same length")
        self.spec = spec
        self._token = token
        self.layout = layout
        self.table = table
        self.endpoints = dict(endpoints)
        self._model = model_factory()
        layout.gather(self._model)  # raises PartitionError if the factory does not fit
        self._x, self._y = data
        self._loss_fn = loss_fn
        self.clock = 0
        self._seq = 0

    def run(self, iterations: int) -> list[float]:
        """Run `iterations` iterations; returns each one's minibatch loss (before its update).

        Raises:
            WorkerError: a request was refused or timed out, or a partition's owner has no
                endpoint (see the class docstring).
            PartitionError: a partition has no owner, or a pulled partition has the wrong size.
        """
        torch.set_num_threads(1)
        ctx: zmq.Context[Any] = zmq.Context()
        sockets: dict[str, zmq.Socket[Any]] = {}
        try:
            losses = []
            for _ in range(iterations):
                losses.append(self._iteration(ctx, sockets))
                self.clock += 1
            return losses
        finally:
            for sock in sockets.values():
                sock.close(linger=0)
            ctx.term()

    # -- one iteration --------------------------------------------------------------------

    def _iteration(self, ctx: zmq.Context[Any], sockets: dict[str, zmq.Socket[Any]]) -> float:
        n = self.layout.num_partitions
        min_clock = self.clock - self.spec.slack - 1
        pulls: list[_Request] = [(p, MessageKind.PULL, min_clock, {}) for p in range(n)]
        replies = self._round_trip(ctx, sockets, pulls, MessageKind.PULL_REPLY)
        parts = []
        for p in range(n):
            values = replies[p].get("values")
            if values is None or values.dtype != torch.float32:
                raise WorkerError(self.spec.worker_id, f"bad pull reply for partition {p}")
            parts.append(values)
        self.layout.scatter(self._model, parts)  # raises PartitionError on a wrong size

        x, y = self._minibatch()
        self._model.zero_grad(set_to_none=True)
        loss = self._loss_fn(self._model(x), y)
        loss.backward()
        grads = self.layout.gather_grads(self._model)
        pushes: list[_Request] = [
            (p, MessageKind.PUSH, self.clock, {"delta": -self.spec.lr * g})
            for p, g in enumerate(grads)
        ]
        self._round_trip(ctx, sockets, pushes, MessageKind.PUSH_ACK)
        return float(loss.item())

    def _minibatch(self) -> tuple[torch.Tensor, torch.Tensor]:
        key = f"{self.spec.seed}/{self.spec.worker_id}/{self.clock}".encode()
        gen = torch.Generator().manual_seed(zlib.crc32(key))
        idx = torch.randint(0, len(self._x), (self.spec.batch_size,), generator=gen)
        return self._x[idx], self._y[idx]

    def _round_trip(
        self,
        ctx: zmq.Context[Any],
        sockets: dict[str, zmq.Socket[Any]],
        requests: list[_Request],
        want: MessageKind,
    ) -> dict[int, dict[str, torch.Tensor]]:
        """Send all requests at once, then wait for every reply; returns tensors per partition."""
        outstanding: dict[int, tuple[int, str]] = {}  # seq -> (partition, owner)
        for p, kind, clock, tensors in requests:
            owner = self.table.owner(p)
            sock = self._socket(ctx, sockets, owner)
            self._seq += 1
            fields = {
                "kind": kind,
                "job_id": self.spec.job_id,
                "sender": self.spec.worker_id,
                "seq": self._seq,
                "partition": p,
                "clock": clock,
            }
            sock.send_multipart(wire.encode(fields, tensors, self._token))
            outstanding[self._seq] = (p, owner)

        poller = zmq.Poller()
        for owner in {o for _, o in outstanding.values()}:
            poller.register(sockets[owner], zmq.POLLIN)
        deadline = time.monotonic() + self.spec.request_timeout_s
        results: dict[int, dict[str, torch.Tensor]] = {}
        while outstanding:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                raise WorkerError(self.spec.worker_id, "timeout")
            for sock, _ in poller.poll(remaining_ms):
                header, tensors = self._receive(sock)
                if header.seq not in outstanding:
                    continue  # a late reply to an earlier, abandoned request
                p, owner = outstanding[header.seq]
                if header.kind is MessageKind.ERROR:
                    raise WorkerError(
                        self.spec.worker_id,
                        header.detail or "error",
                        endpoint=self.endpoints[owner],
                    )
                if header.kind is not want or header.partition != p:
                    raise WorkerError(self.spec.worker_id, f"unexpected {header.kind} reply")
                del outstanding[header.seq]
                results[p] = tensors
        return results

    def _receive(self, sock: zmq.Socket[Any]) -> tuple[wire.Header, dict[str, torch.Tensor]]:
        try:
            return wire.decode(sock.recv_multipart(), self._token)
        except WireError as exc:
            raise WorkerError(self.spec.worker_id, f"bad reply: {exc.reason}") from exc

    def _socket(
        self, ctx: zmq.Context[Any], sockets: dict[str, zmq.Socket[Any]], owner: str
    ) -> zmq.Socket[Any]:
        sock = sockets.get(owner)
        if sock is None:
            if owner not in self.endpoints:
                raise WorkerError(self.spec.worker_id, f"no endpoint for server {owner!r}")
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.endpoints[owner])
            sockets[owner] = sock
        return sock
