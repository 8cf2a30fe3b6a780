"""The checks every `Store` implementation makes before it changes anything.

`RedisStore` and `MemoryStore` both call these, so that they refuse the same arguments with the
same errors, and name a ledger entry and log a refused transition the same way.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence

from orchestrator.store.errors import IllegalTransitionError, NotFoundError
from orchestrator.store.models import (
    INSTANCE_ENDED,
    RECORD_ID_PATTERN,
    InstanceRecord,
    JobRecord,
    LedgerEntry,
)

_ID_RE = re.compile(RECORD_ID_PATTERN)
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9._-]+$")


def check_id(kind: str, record_id: str) -> str:
    """`record_id`, if a record could have it.

    Raises:
        NotFoundError: it could not (an id that could not have been stored cannot be found,
            and must not reach a Redis key).
    """
    if not _ID_RE.match(record_id):
        raise NotFoundError(kind, record_id)
    return record_id


def check_namespace(namespace: str) -> str:
    """`namespace`, if it can prefix keys.

    Raises:
        ValueError: it holds something other than letters, digits, ".", "_" and "-".
    """
    if not _NAMESPACE_RE.match(namespace):
        raise ValueError(f"namespace {namespace!r} must match {_NAMESPACE_RE.pattern}")
    return namespace


def check_new_job(record: JobRecord) -> None:
    """Spend enters only through `append_ledger`, so a new job has spent nothing.

    Raises:
        ValueError: `record.spent_usd` is not 0.
    """
    if record.spent_usd != 0.0:
        raise ValueError(
            f"job {record.job_id!r}: a new job's spent_usd must be 0 (got "
            f"{record.spent_usd}); spend is recorded through append_ledger"
        )


def check_work_done(work_done_gpu_hours: float) -> float:
    """The work done as a float.

    Raises:
        ValueError: it is negative or not finite.
    """
    if not math.isfinite(work_done_gpu_hours) or work_done_gpu_hours < 0:
        raise ValueError(f"work_done_gpu_hours must be finite and >= 0: {work_done_gpu_hours}")
    return float(work_done_gpu_hours)


def check_finite(name: str, value: float) -> float:
    """`value`, if it is a finite number.

    Raises:
        ValueError: it is not.
    """
    if isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return value


def check_count(count: int | None) -> None:
    """Raises ValueError if a read's `count` is given and not positive."""
    if count is not None and count <= 0:
        raise ValueError(f"count must be positive: {count}")


def claim_ttl_ms(key: str, owner: str, ttl_s: float) -> int:
    """A claim's time to live in whole milliseconds (at least 1), as Redis's `SET PX` takes it.

    Raises:
        ValueError: `key` or `owner` is empty, or `ttl_s` is not positive and finite.
    """
    if not key or not owner:
        raise ValueError("claim key and owner must be non-empty")
    if not (math.isfinite(ttl_s) and ttl_s > 0):
        raise ValueError(f"ttl_s must be positive and finite: {ttl_s}")
    return max(1, round(ttl_s * 1000))


def ledger_identity(entry: LedgerEntry) -> str:
    """What identifies a ledger entry within its job: `"{instance_id}@{start_s!r}"`."""
    return f"{entry.instance_id}@{entry.start_s!r}"


def check_bill(instance: InstanceRecord, bill: Sequence[LedgerEntry]) -> None:
    """The entries of an instance's bill are its own, in its job.

    Raises:
        ValueError: naming the first entry that is not.
    """
    for entry in bill:
        if (entry.job_id, entry.instance_id) != (instance.job_id, instance.instance_id):
            raise ValueError(
                f"a bill of instance {instance.instance_id} (job {instance.job_id}) holds a "
                f"charge of instance {entry.instance_id} (job {entry.job_id})"
            )


def ended_record(current: InstanceRecord, ended_at: float, reason: str) -> InstanceRecord:
    """`current` as `end_instance` leaves it: state `INSTANCE_ENDED`, `ended_at`, `reason`.

    Raises:
        ValueError: `ended_at` is before `current.launched_at` (pydantic's ValidationError).
    """
    return InstanceRecord.model_validate(
        current.model_dump() | {"state": INSTANCE_ENDED, "ended_at": ended_at, "end_reason": reason}
    )


def refused_transition(
    log: logging.Logger, job_id: str, from_state: str, to_state: str, now_s: float
) -> IllegalTransitionError:
    """Log a refused job transition (with its fields) and return the error to raise."""
    log.warning(
        "refused illegal job transition",
        extra={"job_id": job_id, "from_state": from_state, "to_state": to_state, "at_s": now_s},
    )
    return IllegalTransitionError(job_id, from_state, to_state)
