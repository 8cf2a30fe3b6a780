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
