"""What a request does to the store: submit a job, cancel one, read its cost.

The routes (`app.py`) only parse and render; these decide, talking only to the `Store` (the
only state: any number of API processes may serve the same Redis).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from typing import Any

from orchestrator.api.views import read_facts
from orchestrator.errors import UserError
from orchestrator.jobspec import JobSubmission, check_deadline
from orchestrator.store import (
    ConflictError,
    JobRecord,
    JobState,
    StateEvent,
    Store,
    StoreError,
)

logger = logging.getLogger(__name__)

#: Re-reads of a job whose version changed under a cancel. Each lost race means the controller
#: moved the job in between (a handful of writes per job per tick), so 5 is plenty.
CANCEL_ATTEMPTS = 5
#: Fresh ids tried when a random job id is taken (2^32 ids: a second collision means a bug).
JOB_ID_ATTEMPTS = 3
#: The state a cancel moves each cancellable state to.
CANCEL_TARGET: dict[JobState, JobState] = {
    JobState.QUEUED: JobState.CANCELLED,  # nothing launched yet: done at once
    JobState.RUNNING: JobState.CANCELLING,  # the controller releases instances, then ends it
}


class JobEndedError(UserError):
    """A cancel of a job already in a terminal state; nothing changed.

    Attributes:
        job_id: the job.
        state: its terminal state.
    """

    def __init__(self, job_id: str, state: JobState) -> None:
        self.job_id = job_id
        self.state = state
        super().__init__(
            f"job {job_id!r} has already ended ({state.value}): there is nothing to cancel",
            fix="nothing to do; submit it again if you want it to run",
        )


def new_job_id() -> str:
    """A fresh random job id, `job-<8 hex digits>`."""
    return f"job-{secrets.token_hex(4)}"


def submit_job(
    store: Store,
    submission: JobSubmission,
    *,
    now_s: float,
    new_id: Callable[[], str] = new_job_id,
) -> JobRecord:
    """Store `submission` as a new queued job (version 0) and log a `state` event.

    The job is created atomically; the event is appended after it and is best effort (if Redis
    fails in between, the job exists without its first event, and the failure is logged).

    Raises:
        DeadlineError: the deadline cannot be met, or could cost more than the budget
            (`jobspec.check_deadline`; nothing created).
        ConflictError: `JOB_ID_ATTEMPTS` fresh ids were all taken (nothing created).
        StoreUnavailableError: Redis cannot be reached (the job may or may not exist: a lost
            reply; the client sees 503 and may list jobs to check).
    """
    check_deadline(submission, now_s)  # before deadline_hours becomes deadline: its error
    submission = submission.with_deadline_at(now_s)  # names the field the user set
    spec = submission.model_dump(mode="json")
    for attempt in range(1, JOB_ID_ATTEMPTS + 1):
        record = JobRecord.submit(new_id(), spec, submission.budget_usd, now_s)
        try:
            store.create_job(record)
        except ConflictError:
            if attempt == JOB_ID_ATTEMPTS:
                raise
            logger.warning("job id taken, drawing another", extra={"job_id": record.job_id})
            continue
        logger.info(
            "job submitted",
            extra={
                "job_id": record.job_id,
                "job_name": record.name,
                "budget_usd": record.budget_usd,
            },
        )
        _append_state_event(store, record, None, "submitted", now_s)
        return record
    raise AssertionError("unreachable")  # pragma: no cover


def cancel_job(
    store: Store, job_id: str, *, now_s: float, attempts: int = CANCEL_ATTEMPTS
) -> JobRecord:
    """Cancel a job: queued -> cancelled, running -> cancelling; a cancelling job is left as is.

    Each attempt reads the job and moves it with `Store.transition` at the version read, so a
    concurrent move by the controller is never overwritten: the cancel re-reads and decides
    again, up to `attempts` times. A `state` event is logged after a move (best effort).

    Returns:
        The job after the cancel (cancelled, or cancelling for the controller to finish).

    Raises:
        NotFoundError: no such job.
        JobEndedError: the job is in a terminal state (nothing changed).
        ConflictError: the job changed under every one of the `attempts` (nothing changed).
    """
    last_conflict: ConflictError | None = None
    for _ in range(attempts):
        job = store.get_job(job_id)
        if job.state is JobState.CANCELLING:
            return job  # asked before; the controller is finishing it
        target = CANCEL_TARGET.get(job.state)
        if target is None:
            raise JobEndedError(job_id, job.state)
        try:
            updated = store.transition(
                job_id,
                target,
                expected_version=job.version,
                now_s=now_s,
                message="cancelled by the user",
            )
        except ConflictError as exc:
            logger.info("job changed under a cancel; re-reading", extra={"job_id": job_id})
            last_conflict = exc
            continue
        logger.info("job cancel", extra={"job_id": job_id, "to_state": target.value})
        _append_state_event(store, updated, job.state, "cancelled by the user", now_s)
        return updated
    assert last_conflict is not None
    raise last_conflict


def job_cost(store: Store, job_id: str) -> dict[str, Any]:
    """The job's spend, budget, latest projected cost, eviction count and ledger size.

    `projected_usd` is the `projected_cost_usd` field of the latest `decision` event (None if
    there is none, or it carries no number); once the job has ended, what it cost. Reads the
    job's whole event log.

    Raises:
        NotFoundError: no such job.
    """
    facts = read_facts(store, store.get_job(job_id))
    job = facts.job
    return {
        "job_id": job.job_id,
        "spent_usd": facts.spent_usd,  # billed + accrued on its running instances
        "billed_usd": job.spent_usd,
        "budget_usd": job.budget_usd,
        "remaining_usd": max(0.0, job.budget_usd - facts.spent_usd),
        "projected_usd": facts.projected_cost_usd,
        "evictions": facts.evictions,
        "ledger_entries": len(store.ledger(job_id)),
    }


def _append_state_event(
    store: Store, job: JobRecord, from_state: JobState | None, reason: str, now_s: float
) -> None:
    """Log the job's move to its current state; a failure is logged, not raised."""
    event = StateEvent(
        job_id=job.job_id,
        at_s=now_s,
        state=job.state,
        from_state=from_state,
        message=reason,
        by="api",
    )
    try:
        store.append_event(event)
    except StoreError:
        logger.warning("could not log a state event", extra={"job_id": job.job_id}, exc_info=True)
