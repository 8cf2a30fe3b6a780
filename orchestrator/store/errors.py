"""Errors of the store package.

Every failure of a `Store` (Redis's included) surfaces as one of these; nothing is retried behind
the caller's back.

* `StoreUnavailableError`: Redis cannot be reached (also a `UserError`: the CLI prints the fix).
* `ConflictError`: a versioned write lost a race; re-read the record and decide again.
* `IllegalTransitionError`: a job lifecycle move the transition table forbids; nothing changed.
* `LedgerConflictError`: a second, different charge for an interval already billed.
* `NotFoundError`: no job or instance with that id.
"""

from __future__ import annotations

from orchestrator.errors import OrchestratorError, UserError


class StoreError(OrchestratorError):
    """Base of store errors (including Redis replies the store did not expect)."""


class StoreUnavailableError(StoreError, UserError):
    """Redis did not answer: refused, unreachable, or timed out.

    A timeout after a command was sent leaves it unknown whether that write was applied; every
    write of the store is version-checked or idempotent, so re-reading after Redis is back tells.

    Attributes:
        url: the Redis URL, password redacted.
        cause: the underlying error's text.
    """

    def __init__(self, url: str, cause: str) -> None:
        self.url = url
        self.cause = cause
        super().__init__(
            f"cannot reach Redis at {url}: {cause}",
            fix="start Redis (`redis-server`, or `sudo systemctl start redis-server`), or set "
            "ORCHESTRATOR_REDIS_URL to the URL of a running server.",
        )


class ConflictError(StoreError):
    """A versioned write lost a race: the record changed since the caller read it.

    Nothing was written. Re-read the record and decide again.

    Attributes:
        key: the Redis key of the record (`MemoryStore` names the same key).
        expected_version: the version the caller based its write on (None: "must not exist").
        actual_version: the version found (None: the record does not exist).
    """

    def __init__(self, key: str, expected_version: int | None, actual_version: int | None) -> None:
        self.key = key
        self.expected_version = expected_version
        self.actual_version = actual_version
        expected = "no record" if expected_version is None else f"version {expected_version}"
        actual = "no record" if actual_version is None else f"version {actual_version}"
        super().__init__(
            f"concurrent write to {key}: expected {expected}, found {actual}; "
            "re-read it and decide again"
        )


class IllegalTransitionError(StoreError):
    """A job lifecycle move that `ALLOWED_TRANSITIONS` forbids. The record is unchanged.

    Attributes:
        job_id: the job.
        from_state: the job's current state.
        to_state: the state asked for.
    """

    def __init__(self, job_id: str, from_state: str, to_state: str) -> None:
        self.job_id = job_id
        self.from_state = from_state
        self.to_state = to_state
        super().__init__(f"job {job_id!r} cannot go from {from_state} to {to_state}")


class LedgerConflictError(StoreError):
    """An instance interval already billed was appended again with different contents.

    A replay of the same entry (e.g. by a restarted controller) is not an error; a different
    charge for the same (instance, start) is, because one of the two bills is wrong. Nothing was
    written.

    Attributes:
        job_id, instance_id, start_s: the interval's identity.
    """

    def __init__(self, job_id: str, instance_id: str, start_s: float) -> None:
        self.job_id = job_id
        self.instance_id = instance_id
        self.start_s = start_s
        super().__init__(
            f"job {job_id!r}: instance {instance_id!r} already has a different ledger entry "
            f"starting at {start_s!r}"
        )


class NotFoundError(StoreError):
    """No record with that id.

    Attributes:
        kind: "job" or "instance".
        record_id: the id asked for.
    """

    def __init__(self, kind: str, record_id: str) -> None:
        self.kind = kind
        self.record_id = record_id
        super().__init__(f"no {kind} {record_id!r} in the store")
