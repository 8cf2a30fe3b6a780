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
from pydantic import BaseModel, ConfigDict, Field, model_validator

from orchestrator.agileml import wire
from orchestrator.agileml.elasticity import NodeTier, StageThresholds
from orchestrator.agileml.errors import AgileMLError, WireError
from orchestrator.agileml.peers import PeerInboxes
from orchestrator.agileml.roster import Roster
from orchestrator.agileml.usercode import MAX_REPORT_CHARS
from orchestrator.agileml.wire import MessageKind
from orchestrator.straggler.spec import StragglerSpec

NodeId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")]
#: How often a control call asks whether the node it waits on is gone.
GONE_CHECK_S = 0.25


class ModelSpec(BaseModel):
    """Which example model to train (see `examples.build_model`).

    `mlr`: multinomial logistic regression (features x classes); `mlp`: one hidden ReLU layer;
    `additive`: a probe whose update per row is the row itself, so the exact final parameters
    are known (for exactly-once checks).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["mlr", "mlp", "additive"] = "mlr"
    features: Annotated[int, Field(ge=1, le=1_000_000)] = 64
    classes: Annotated[int, Field(ge=2, le=100_000)] = 10
    hidden: Annotated[int, Field(ge=1, le=100_000)] = 64


class TrainingSpec(BaseModel):
    """An AgileML job: model, data, optimizer, consistency, and elasticity settings.

    Raises:
        pydantic.ValidationError: naming the field, e.g. a global batch smaller than the
            number of partitions' minimum or a slack below 0, or a number that is not finite.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    job_id: NodeId
    # the user's job file (or directory with job.py) on the nodes' machines (see `jobcode`);
    # None: the built-in example `model` on generated data, trained by SGD with `lr`
    code: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    # the job's data: an S3 prefix (copied to each node once) or a folder on the nodes; the
    # job's dataset() finds it at $ORCHESTRATOR_DATA_DIR (see `orchestrator.artifacts.data`)
    data: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    model: ModelSpec = ModelSpec()
    samples: Annotated[int, Field(ge=1, le=10_000_000)] = 4096
    data_seed: int = 0
    global_batch: Annotated[int, Field(ge=1)] = 256
    lr: Annotated[float, Field(gt=0)] = 0.05
    slack: Annotated[int, Field(ge=0, le=1000)] = 0
    iterations: Annotated[int, Field(ge=1)] = 100
    num_partitions: Annotated[int, Field(ge=1, le=4096)] = 4
    seed: int = 0
    min_nodes: Annotated[int, Field(ge=1)] = 1  # nodes ready before clock 0 starts
    thresholds: StageThresholds = StageThresholds()
    heartbeat_s: Annotated[float, Field(gt=0, le=10)] = 0.1
    failure_timeout_s: Annotated[float, Field(gt=0, le=600)] = 1.0
    # how far ahead of the fastest worker servers let workers compute, at least (more when
    # iterations are short, see `horizon`); joins and evictions take effect just past it, so
    # no worker ever computes a clock on an outdated roster
    horizon_clocks: Annotated[int, Field(ge=2, le=10_000)] = 8
    # workers compute on the first pulled partitions while the rest arrive, and push each
    # partition as soon as backward has its gradients (`agileml.streams`); same gradients.
    # Off by default: no gain measured on a 2-core machine, and a worse eviction blip there
    overlap: bool = False
    # FlexRR (RapidReassignment between workers); `{"flexrr": false}` turns it off
    straggler: StragglerSpec = StragglerSpec()
    # checkpoints (see `checkpoints`): written under `checkpoint_dir` (a directory the reliable
    # nodes and the elasticity controller share) every `checkpoint_every` iterations and every
    # `checkpoint_every_s` seconds (0: not by that measure); `resume_from` a checkpoint to start
    # from instead of the initial model
    checkpoint_dir: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    checkpoint_every: Annotated[int, Field(ge=0)] = 0
    checkpoint_every_s: Annotated[float, Field(ge=0)] = 0.0
    resume_from: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    # the artifact store (location string) that uploaded code (`code` = "sha256:<hex>") is
    # fetched from (see `orchestrator.artifacts.code`)
    code_store: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    # `pipeline`: the job's layers split into stages across its nodes (PipeDream's planner,
    # see `pipeline.hosted`) instead of data-parallel workers; needs `code` whose model() is an
    # nn.Sequential (or has a stages() hook). `schedule` and `stages` (the depth; default: the
    # planner's) apply to pipeline jobs only
    parallelism: Literal["data", "pipeline"] = "data"
    schedule: Literal["flush", "gpipe", "1f1b", "2bw"] = "flush"
    stages: Annotated[int, Field(ge=1, le=1024)] | None = None

    @model_validator(mode="after")
    def _timeouts(self) -> TrainingSpec:
        if self.horizon_clocks <= self.slack + 1:
            raise ValueError(
                f"horizon_clocks ({self.horizon_clocks}) must exceed slack + 1 "
                f"({self.slack + 1}); otherwise workers stall at the horizon"
            )
        if self.parallelism == "pipeline" and self.code is None:
            raise ValueError(
                "parallelism `pipeline` needs the job's code (a job file whose model() is an "
                "nn.Sequential); the built-in example models train data-parallel only"
            )
        if self.parallelism == "data" and (self.stages is not None or self.schedule != "flush"):
            raise ValueError("schedule and stages apply to parallelism `pipeline` only")
        if self.failure_timeout_s <= 2 * self.heartbeat_s:
            raise ValueError(
                f"failure_timeout_s ({self.failure_timeout_s}) must exceed two heartbeats "
                f"(2 x {self.heartbeat_s}); otherwise a live node is taken for dead"
            )
        return self


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


class Leaving(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    op: Literal["leaving"] = "leaving"


class Left(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    op: Literal["left"] = "left"


class JobFailed(BaseModel):
    """The job's own code raised on the node (its model, loss, optimizer or scheduler): a
    deterministic error that no retry fixes, so the job is aborted with it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    op: Literal["job_failed"] = "job_failed"
    error: Annotated[str, Field(min_length=1, max_length=2 * MAX_REPORT_CHARS)]


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
                got = wire.await_reply(sock, self._seq, self._token, slice_s)
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
