"""The control plane of an AgileML job: the training spec, the view nodes train by, and the
messages between nodes and the elasticity controller (JSON bodies of `control` messages).

A node joins (`join`), loads its data and signals `ready`, then sends a `heartbeat` every
`heartbeat_s` with its clock; every reply carries the current `View`. A node warned of its
eviction says `leaving`; once its partitions are handed off and its last clock is pushed, `left`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import zmq
from pydantic import BaseModel, ConfigDict, Field

from orchestrator.agileml import chunks, wire
from orchestrator.agileml.elasticity import NodeTier
from orchestrator.agileml.errors import AgileMLError, WireError
from orchestrator.agileml.peers import PeerInboxes
from orchestrator.agileml.roster import Roster
from orchestrator.agileml.spec import MAX_DEVICES, NodeId, TrainingSpec
from orchestrator.agileml.spec import ModelSpec as ModelSpec  # re-exported
from orchestrator.agileml.usercode import MAX_REPORT_CHARS
from orchestrator.agileml.wire import MessageKind

#: How often a control call asks whether the node it waits on is gone.
GONE_CHECK_S = 0.25


@dataclass(frozen=True)
class TrainingStatus:
    """A job's training as its host hears it (`hosting`): the furthest iteration reported,
    the mean of the latest losses (None before the first), FlexRR's reassigned rows and
    AgileML's stage transitions so far."""

    iteration: int
    loss: float | None
    reassigned_rows: int
    stage_transitions: int


class Adoption(BaseModel):
    """A failed worker's shares of clocks [from_clock, to_clock), computed by `surrogate`
    under the failed worker's identity (its data falls back to a survivor)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    surrogate: NodeId
    from_clock: Annotated[int, Field(ge=0)]
    to_clock: Annotated[int, Field(ge=0)]


def without_failed(
    roster: Roster, adoptions: Mapping[str, Adoption], ranges: Mapping[str, tuple[int, int]]
) -> tuple[Roster, dict[str, Adoption]]:
    """The roster without the failed workers of `ranges` (worker -> the clocks [first, end)
    survivors must redo for it), each leaving at its `end`, and the adoptions that give its
    shares of those clocks to surrogates (spread over the survivors, in worker order).

    An adoption covers only the clocks of [first, end) that the failed worker computes: a
    node evicted (out of the roster) before it died, or a joiner that died before its first
    clock, has no share there, and a surrogate cannot compute a share that does not exist."""
    out = dict(adoptions)
    failed = set(ranges)
    for i, f in enumerate(sorted(ranges)):
        first, end = member_clocks(roster, f, *ranges[f])
        surrogates = [w for w in roster.members(first) if w not in failed]
        roster = roster.without({f}, ranges[f][1])
        if end > first and surrogates:
            out[f] = Adoption(
                surrogate=surrogates[i % len(surrogates)], from_clock=first, to_clock=end
            )
    return roster, out


def member_clocks(roster: Roster, worker: str, first: int, end: int) -> tuple[int, int]:
    """The clocks of [first, end) from the first to the last that `worker` computes under
    `roster` (an empty range at `first` when it computes none of them)."""
    start = roster.first_clock_of(worker, first)
    if start is None or start >= end:
        return first, first
    return start, roster.last_clock_of(worker, end - 1) + 1


class View(BaseModel):
    """What every node trains by. `epoch` changes only on a roll-back, after which workers
    resume at `restart_clock`; roster and owners may change within an epoch."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    epoch: int = 0  # 0: not started yet
    restart_clock: int = 0
    stage: int = 1
    roster: Roster | None = None
    owners: dict[int, str] = {}
    versions: dict[int, int] = {}  # ownership version of each partition, as last known
    endpoints: dict[str, str] = {}  # node id -> parameter-server endpoint
    peers: dict[str, PeerInboxes] = {}  # node id -> its worker's FlexRR inboxes
    backups: dict[int, str] = {}  # partition -> BackupPS endpoint (empty in stage 1)
    adoptions: dict[str, Adoption] = {}  # failed worker -> who computes its last shares
    done: bool = False  # every worker finished the job's iterations
    shutdown: bool = False  # nodes stop their servers and exit


class Join(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    op: Literal["join"] = "join"
    tier: NodeTier
    endpoint: str
    peer_inboxes: PeerInboxes | None = None  # the worker's FlexRR inboxes (None: FlexRR off)


class Ready(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    op: Literal["ready"] = "ready"


class Heartbeat(BaseModel):
    # a field a newer node adds is ignored here, not taken for a bad message (which would
    # leave the node unheard and failed)
    model_config = ConfigDict(frozen=True, extra="ignore")

    op: Literal["heartbeat"] = "heartbeat"
    clock: Annotated[int, Field(ge=0)]  # the clock the node's worker is at (done below it)
    loss: float | None = None  # the loss of the last iteration, if any
    # rows of this node's shares that FlexRR had helpers compute, so far
    reassigned_rows: Annotated[int, Field(ge=0)] = 0
    # rows this node computed so far, and the seconds it spent computing them (its speed)
    rows_computed: Annotated[int, Field(ge=0)] = 0
    compute_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    devices: Annotated[int, Field(ge=1, le=MAX_DEVICES)] = 1  # the devices it trains on now
    # fp16: its worker's loss scale is 2 ** this (`precision.LossScale`); None: not fp16
    loss_scale_exponent: Annotated[int, Field(ge=-64, le=64)] | None = None


class Leaving(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    op: Literal["leaving"] = "leaving"


class Left(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    op: Literal["left"] = "left"


class JobFailed(BaseModel):
    """A deterministic error on the node that no retry fixes, so the job is aborted with it:
    the job's own code raised (its model, loss, optimizer or scheduler; `cause` "job_code"),
    or a parameter server refused the worker's request for good ("refused": a request it
    would send again the same, e.g. a gradient of the wrong size or type)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    op: Literal["job_failed"] = "job_failed"
    error: Annotated[str, Field(min_length=1, max_length=2 * MAX_REPORT_CHARS)]
    cause: Literal["job_code", "refused"] = "job_code"


NodeMessage = Annotated[
    Join | Ready | Heartbeat | Leaving | Left | JobFailed, Field(discriminator="op")
]


class NodeRequest(BaseModel):
    """Envelope for parsing a node's control body."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    message: NodeMessage


class Reply(BaseModel):
    """The controller's answer: the spec once (on join), the view always, or an error."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ok: bool = True
    error: str | None = None
    spec: TrainingSpec | None = None
    view: View | None = None
    # fp16: the lowest loss scale exponent the live nodes reported; a joiner starts there
    # instead of at 2 ** 16 (each of its overflows would skip a step for every worker)
    loss_scale_exponent: int | None = None


def dump(model: BaseModel) -> dict[str, Any]:
    """A JSON-ready dict of a control model."""
    return model.model_dump(mode="json")


class ControlError(AgileMLError):
    """A control call that timed out, or whose answer was refused or malformed.

    Attributes:
        endpoint: the peer.
        reason: "timeout", the peer's error, or a wire reason.
    """

    def __init__(self, endpoint: str, reason: str) -> None:
        self.endpoint = endpoint
        self.reason = reason
        super().__init__(f"control call to {endpoint} failed: {reason}")


class ControlClient:
    """Request/reply `control` messages to peers, one DEALER socket per peer. Not thread-safe:
    use one client per thread."""

    def __init__(self, *, job_id: str, sender: str, token: bytes) -> None:
        self.job_id, self.sender, self._token = job_id, sender, token
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._socks: dict[str, zmq.Socket[Any]] = {}
        self._seq = 0

    def call(
        self,
        endpoint: str,
        body: dict[str, Any],
        timeout_s: float,
        gone: Callable[[], bool] | None = None,
    ) -> dict[str, Any]:
        """Send `body` to `endpoint`; returns the JSON object it answers. `gone` is asked
        while waiting: once it says the node is gone (it stopped heartbeating), the call
        gives up rather than wait out `timeout_s` on a dead node.

        Raises:
            ControlError: no answer within `timeout_s` or from a node `gone` (the socket is
                then reset), or an unauthenticated, malformed or `error` answer.
        """
        sock = self._socks.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self._socks[endpoint] = sock
        self._seq += 1
        header = {
            "kind": MessageKind.CONTROL,
            "job_id": self.job_id,
            "sender": self.sender,
            "seq": self._seq,
        }
        sock.send_multipart(wire.encode(header, wire.json_body(body), self._token))
        deadline, why = time.monotonic() + timeout_s, "timeout"
        try:
            while (left := deadline - time.monotonic()) > 0:
                slice_s = left if gone is None else min(left, GONE_CHECK_S)
                got = chunks.await_reply(sock, self._seq, self._token, slice_s)
                if got is not None:
                    break
                if gone is not None and gone():
                    why = "the node stopped heartbeating"
                    break
            else:
                got = None
        except WireError as exc:
            raise ControlError(endpoint, str(exc.reason)) from exc
        if got is None:
            sock.close(linger=0)  # a late answer must not meet the next call
            del self._socks[endpoint]
            raise ControlError(endpoint, why)
        reply, tensors = got
        if reply.kind is MessageKind.ERROR:
            raise ControlError(endpoint, reply.detail or "error")
        try:
            out = wire.parse_json_body(tensors)
        except WireError as exc:
            raise ControlError(endpoint, str(exc.reason)) from exc
        if not isinstance(out, dict):
            raise ControlError(endpoint, "answer is not a JSON object")
        return out

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(linger=0)
        self._socks.clear()
        self._ctx.term()
