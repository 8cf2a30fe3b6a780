"""Errors of the agileml package.

* `WireError`: a message that failed to decode or authenticate; nothing was acted on.
* `PartitionError`: a partition or layout operation that is not allowed; nothing changed.
* `OwnershipConflictError`: a versioned partition move lost a race; nothing changed.
* `ServerError`: a parameter server that could not start or stop in time.
* `WorkerError`: a worker request that a server refused or that timed out; the iteration did
  not complete, but pushes already acknowledged stay applied (exactly once).
"""

from __future__ import annotations

from enum import StrEnum

from orchestrator.errors import OrchestratorError


class AgileMLError(OrchestratorError):
    """Base of agileml errors."""


class WireReason(StrEnum):
    """Why a message was rejected by `wire.decode` (or refused by `wire.encode`)."""

    BAD_JSON = "bad_json"  # the header frame is not UTF-8 JSON
    SCHEMA = "schema"  # the header does not match the `Header` model
    UNKNOWN_KIND = "unknown_kind"  # `kind` is not a `MessageKind`
    VERSION = "version"  # `v` is not `PROTOCOL_VERSION`
    DTYPE = "dtype"  # a tensor dtype outside the allowlist
    BUFFER_COUNT = "buffer_count"  # number of buffer frames != number of tensor specs
    BUFFER_SIZE = "buffer_size"  # a buffer's length != dtype itemsize x prod(shape)
    TOO_LARGE = "too_large"  # the whole message is over the size limit
    BAD_MAC = "bad_mac"  # missing or wrong HMAC: wrong token or tampered message
    NO_FRAMES = "no_frames"  # an empty multipart message


class WireError(AgileMLError):
    """A message that cannot be trusted or understood. The receiver must not act on it.

    Attributes:
        reason: the machine-readable cause.
        detail: a human-readable explanation (never contains the token).
    """

    def __init__(self, reason: WireReason, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"wire error ({reason}): {detail}" if detail else f"wire error ({reason})")


class PartitionError(AgileMLError):
    """An unknown partition, an unowned partition, or a model that does not fit the layout.

    Attributes:
        partition: the partition at fault, when there is one.
    """

    def __init__(self, message: str, *, partition: int | None = None) -> None:
        self.partition = partition
        super().__init__(message)


class OwnershipConflictError(PartitionError):
    """A move based on a stale view of a partition's owner; re-read the table and decide again.

    Attributes:
        expected_version: the version the caller based its move on.
        actual_version: the partition's current version.
    """

    def __init__(self, partition: int, expected_version: int, actual_version: int) -> None:
        self.expected_version = expected_version
        self.actual_version = actual_version
        super().__init__(
            f"partition {partition}: expected owner version {expected_version}, "
            f"found {actual_version}; re-read the table",
            partition=partition,
        )


class ServerError(AgileMLError):
    """A parameter server failed to bind, or its thread did not stop within the time bound."""


class WorkerError(AgileMLError):
    """A request of a worker failed.

    Attributes:
        worker_id: the worker.
        reason: the server's error detail, "timeout", or a wire reason.
        endpoint: the server concerned, when known.
    """

    def __init__(self, worker_id: str, reason: str, *, endpoint: str | None = None) -> None:
        self.worker_id = worker_id
        self.reason = reason
        self.endpoint = endpoint
        where = f" from {endpoint}" if endpoint else ""
        super().__init__(f"worker {worker_id!r}: request failed{where}: {reason}")


class ElasticityError(AgileMLError):
    """A node set or role request the elasticity planner cannot serve; nothing was decided.

    Example: no reliable node at all ("AgileML needs at least one reliable node: BackupPSs and
    ParamServs live there. To fix: add an on-demand node to the job.").
    """


class NoReliableNodeError(ElasticityError):
    """No reliable node is left (or there never was one): the partitions' reliable copies
    live there, so the job cannot go on; the elasticity controller aborts it."""


class PartitionsLostError(AgileMLError):
    """Partitions are gone with their owner and no BackupPS holds them (stage 1): the job
    cannot go on; the elasticity controller aborts it instead of waiting."""


class RecoveryError(AgileMLError):
    """The job could not be reconfigured after a node failure (its partitions restored, but
    the roster or their owners not settled): nothing would retry it, so the elasticity
    controller aborts the job with this reason instead of leaving it stalled."""


class IllegalNodeTransitionError(ElasticityError):
    """A membership move that the lifecycle table does not allow; the node's state is unchanged.

    Attributes:
        node_id: the node.
        from_state: its current state (None: the node is unknown).
        to_state: the refused target state.
    """

    def __init__(self, node_id: str, from_state: str | None, to_state: str) -> None:
        self.node_id = node_id
        self.from_state = from_state
        self.to_state = to_state
        super().__init__(f"node {node_id!r}: illegal transition {from_state} -> {to_state}")


class HandoffError(AgileMLError):
    """A partition hand-off that did not complete.

    Attributes:
        partition: the partition.
        reason: the receiver's error detail, a wire reason, or "timeout".
        outcome_unknown: True after a timeout: the receiver may or may not hold the partition,
            so the sender keeps it frozen (see `ParamServer.handoff_to`). False: the receiver
            refused it and the sender still owns and serves it, unchanged.
    """

    def __init__(self, partition: int, reason: str, *, outcome_unknown: bool = False) -> None:
        self.partition = partition
        self.reason = reason
        self.outcome_unknown = outcome_unknown
        super().__init__(f"hand-off of partition {partition} failed: {reason}")


class RosterError(AgileMLError):
    """A malformed roster, or a change that would add a worker to a clock already complete."""
