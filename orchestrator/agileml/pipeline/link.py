"""A pipeline stage's messaging: its PULL inbox and PUSH sockets to its neighbours, its
replicas and the launcher, on the runtime's authenticated wire (`pipe` messages).

Messages of another job id (an earlier attempt) or that do not authenticate are dropped unread;
others are buffered by (detail, minibatch) until asked for. A `rewind` from the launcher
interrupts whatever the stage waits for (`Rewind`).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import zmq

from orchestrator.agileml import wire
from orchestrator.agileml.errors import AgileMLError, WireError
from orchestrator.agileml.wire import MessageKind

RECEIVE_TIMEOUT_S = 60.0


class Rewind(Exception):  # noqa: N818 - a signal to the run loop, not an error
    """The launcher lost another worker: go back to the reliable copy's cut and run on under a
    new job id (see `run_stage`). `body`: job_id, first_minibatch; `cut`: the stage's weights
    (`w`, flat) and optimizer state (`o`, a safetensors blob) at the cut, when there are any."""

    def __init__(self, body: dict[str, Any], cut: dict[str, torch.Tensor]) -> None:
        super().__init__(f"rewind to minibatch {body.get('first_minibatch')}")
        self.body = body
        self.cut = {k: v for k, v in cut.items() if k in ("w", "o")}


class StageLink:
    """The stage's inbox and its sockets to the neighbours and the launcher."""

    def __init__(self, token: bytes, job_id: str, host: str, stage: int, worker: int) -> None:
        self._token, self.stage, self.worker = token, stage, worker
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        port = self.inbox.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self.out: dict[str, zmq.Socket[Any]] = {}
        self.pending: dict[tuple[str, int], tuple[wire.Header, dict[str, torch.Tensor]]] = {}
        self._seq = 0
        self.job_id = job_id  # changes on a rewind: earlier messages are dropped

    def restart(self, job_id: str) -> None:
        """Take messages of `job_id` only, from now on (after a rewind)."""
        self.job_id = job_id
        self.pending.clear()

    def send(
        self,
        endpoint: str,
        detail: str,
        minibatch: int,
        tensors: dict[str, Any],
        *,
        epoch: int | None = None,
    ) -> None:
        sock = self.out.get(endpoint)
        if sock is None:
            sock = self.out[endpoint] = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(endpoint)
        self._seq += 1
        fields = {
            "kind": MessageKind.PIPE,
            "job_id": self.job_id,
            "sender": f"worker{self.worker}",
            "seq": self._seq,
            "clock": minibatch,
            "detail": detail,
        }
        if epoch is not None:
            fields["epoch"] = epoch  # the weight version the input stage used
        sock.send_multipart(wire.encode(fields, tensors, self._token))

    def receive(self, detail: str, minibatch: int) -> tuple[wire.Header, dict[str, torch.Tensor]]:
        """The message `detail` for `minibatch`, buffering others that arrive first."""
        deadline = time.monotonic() + RECEIVE_TIMEOUT_S
        while (detail, minibatch) not in self.pending:
            remaining = int((deadline - time.monotonic()) * 1000)
            if remaining <= 0 or not self.inbox.poll(remaining):
                raise AgileMLError(f"stage {self.stage}: no {detail} for minibatch {minibatch}")
            try:
                header, tensors = wire.decode(self.inbox.recv_multipart(), self._token)
            except WireError:
                continue  # unauthenticated or malformed: dropped unread
            ours = header.job_id == self.job_id  # not an earlier attempt's
            if ours and header.kind is MessageKind.PIPE and header.detail == "rewind":
                try:
                    body = wire.parse_json_body(tensors)
                except WireError:
                    continue  # a malformed rewind: dropped unread
                raise Rewind(body, tensors)
            if (
                ours
                and header.kind is MessageKind.PIPE
                and header.detail
                and header.clock is not None
            ):
                self.pending[(header.detail, header.clock)] = (header, tensors)
        return self.pending.pop((detail, minibatch))

    def close(self) -> None:
        for sock in self.out.values():
            sock.close()
        self.inbox.close(linger=0)
        self.ctx.term()
