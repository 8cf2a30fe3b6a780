"""Worker-to-worker messages (FlexRR) over the runtime's authenticated wire.

Each worker binds two PULL inboxes and sends through one PUSH socket per peer endpoint: messages
are one-way, and ZMQ keeps each sender-to-inbox stream in order, which RapidReassignment relies
on (a `do_this` always arrives before the `cancel` that withdraws it: both go to `work`). Sends
never block: a message to a peer that is gone, or whose queue is full, is dropped, and the
protocol's deadlines and cancellations cover the loss.

The two inboxes (`PeerInboxes`): `work` takes the messages a worker acts on at once, even while
it waits on the servers (an offer is help it can do in that idle time); `progress` takes the
progress reports (and `listening`, which says whether to send them), which matter only while
the worker still computes its own rows and are read between its chunks. A report therefore
never wakes a waiting worker. Reports were the largest part of FlexRR's cost when nobody
straggles (each worker reported to up to `helper_group_size - 1` helpees every iteration;
without them the digits CNN's compute phase measured ~6 ms per iteration instead of ~10 on 2
shared cores): most are now skipped (`reassign.Reassigner._report_progress`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import zmq
from pydantic import BaseModel, ConfigDict, ValidationError

from orchestrator.agileml import wire
from orchestrator.agileml.drops import DropLog
from orchestrator.agileml.errors import WireError
from orchestrator.agileml.wire import MessageKind
from orchestrator.straggler.protocol import PEER_MESSAGE, PeerMessage

log = logging.getLogger(__name__)

SEND_QUEUE_MESSAGES = 1000  # per peer; beyond it messages are dropped, never waited on


class PeerInboxes(BaseModel):
    """Where a worker takes FlexRR messages (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    work: str  # offers, begun, cancel, completed
    progress: str  # progress reports, listening


class PeerLink:
    """One worker's inbox and its sockets to peers. Not thread-safe: use from one thread."""

    def __init__(self, worker_id: str, *, job_id: str, token: bytes, host: str = "127.0.0.1"):
        self.worker_id, self.job_id, self._token = worker_id, job_id, token
        self._ctx: zmq.Context[Any] = zmq.Context()
        self.inbox = self._bind(host)  # `work`: the worker polls it while it waits
        self.progress_inbox = self._bind(host)
        self.endpoints = PeerInboxes(
            work=self.inbox.getsockopt_string(zmq.LAST_ENDPOINT),
            progress=self.progress_inbox.getsockopt_string(zmq.LAST_ENDPOINT),
        )
        self._out: dict[str, zmq.Socket[Any]] = {}
        self._seq = 0
        self.sent = self.dropped_out = self.refused_in = 0
        self._drops = DropLog(log, "dropped a peer message", worker=worker_id)

    def _bind(self, host: str) -> zmq.Socket[Any]:
        sock = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind_to_random_port(f"tcp://{host}")
        return sock

    def send(
        self,
        endpoint: str,
        message: PeerMessage,
        *,
        epoch: int,
        tensors: Mapping[str, torch.Tensor] | None = None,
    ) -> bool:
        """Queue `message` for the peer at `endpoint`; False if it had to be dropped."""
        sock = self._out.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, SEND_QUEUE_MESSAGES)
            sock.connect(endpoint)
            self._out[endpoint] = sock
        self._seq += 1
        fields = {
            "kind": MessageKind.PEER,
            "job_id": self.job_id,
            "sender": self.worker_id,
            "seq": self._seq,
            "clock": message.clock,
            "epoch": epoch,
        }
        body = wire.json_body(message.model_dump(mode="json"))
        frames = wire.encode(fields, {**body, **(tensors or {})}, self._token)
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped_out += 1
            return False
        self.sent += 1
        return True

    def receive(
        self, timeout_ms: int = 0, *, progress: bool = False
    ) -> tuple[str, int, PeerMessage, dict[str, torch.Tensor]] | None:
        """The next valid message of the `work` inbox (or of `progress`) as (sender, epoch,
        message, tensors), waiting up to `timeout_ms`; None if there is none.
        Unauthenticated or malformed messages are dropped (and counted), never acted on."""
        inbox = self.progress_inbox if progress else self.inbox
        while inbox.poll(timeout_ms):
            timeout_ms = 0
            frames = inbox.recv_multipart()
            try:
                header, tensors = wire.decode(frames, self._token)
                if header.kind is not MessageKind.PEER or header.epoch is None:
                    raise WireError(wire.WireReason.SCHEMA, "not a peer message")
                message = PEER_MESSAGE.validate_python(wire.parse_json_body(tensors))
            except (WireError, ValidationError) as exc:
                self.refused_in += 1
                self._drops.drop(str(exc))
                continue
            tensors.pop("body", None)
            return header.sender, header.epoch, message, tensors
        return None

    def forget_except(self, endpoints: set[str]) -> None:
        """Close the sockets to peers no longer listed (their queued messages are dropped)."""
        for endpoint in [e for e in self._out if e not in endpoints]:
            self._out.pop(endpoint).close(linger=0)

    def close(self) -> None:
        for sock in self._out.values():
            sock.close(linger=0)
        self._out.clear()
        self.inbox.close(linger=0)
        self.progress_inbox.close(linger=0)
        self._ctx.term()
