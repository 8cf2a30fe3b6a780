"""A raw wire client for the AgileML server tests: a DEALER socket speaking the wire format as
one sender, plus a maker that closes every socket at the end of a test."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import zmq

from orchestrator.agileml import wire
from orchestrator.agileml.wire import Header, MessageKind

REPLY_TIMEOUT_MS = 3000
HELD_CHECK_MS = 300  # long enough that a wrongly answered pull would have arrived


class WireClient:
    """Sends requests as `sender` of job `job_id`, signed with `token` (each overridable per
    message, to forge one), and reads the replies."""

    def __init__(
        self, ctx: zmq.Context[Any], endpoint: str, sender: str, *, job_id: str, token: bytes
    ) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.sender, self.seq = sender, 0
        self.job_id, self.token = job_id, token

    def send(
        self,
        kind: MessageKind,
        tensors: dict[str, torch.Tensor] | None = None,
        *,
        token: bytes | None = None,
        job_id: str | None = None,
        tamper: Callable[[list[bytes]], list[bytes]] | None = None,
        **fields: Any,
    ) -> int:
        self.seq += 1
        header = {
            "kind": kind,
            "job_id": job_id or self.job_id,
            "sender": self.sender,
            "seq": self.seq,
            **fields,
        }
        frames = wire.encode(header, tensors or {}, token or self.token)
        self.sock.send_multipart(tamper(frames) if tamper else frames)  # type: ignore[arg-type]
        return self.seq

    def recv(self, timeout_ms: int = REPLY_TIMEOUT_MS) -> tuple[Header, dict[str, torch.Tensor]]:
        assert self.sock.poll(timeout_ms), "no reply"
        return wire.decode(self.sock.recv_multipart(), self.token)

    def request(
        self, kind: MessageKind, tensors: dict[str, torch.Tensor] | None = None, **fields: Any
    ) -> tuple[Header, dict[str, torch.Tensor]]:
        """Send, then the reply to this very request."""
        seq = self.send(kind, tensors, **fields)
        header, out = self.recv()
        assert header.seq == seq
        return header, out

    def push(self, clock: int, delta: torch.Tensor, partition: int = 0, **fields: Any) -> Header:
        """Push `delta` for `clock`; the header of the next reply (a forged push may get an
        answer that cannot name its request)."""
        self.send(MessageKind.PUSH, {"delta": delta}, partition=partition, clock=clock, **fields)
        return self.recv()[0]

    def silent(self, timeout_ms: int = HELD_CHECK_MS) -> bool:
        return not self.sock.poll(timeout_ms)


class WireClients:
    """Makes clients on one context; `close` closes every socket and the context."""

    def __init__(self, *, job_id: str, token: bytes) -> None:
        self.context: zmq.Context[Any] = zmq.Context()
        self.job_id, self.token = job_id, token
        self.made: list[WireClient] = []

    def __call__(self, endpoint: str, sender: str) -> WireClient:
        client = WireClient(self.context, endpoint, sender, job_id=self.job_id, token=self.token)
        self.made.append(client)
        return client

    def close(self) -> None:
        for client in self.made:
            client.sock.close(linger=0)
        self.context.term()
