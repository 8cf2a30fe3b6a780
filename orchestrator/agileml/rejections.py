"""Why a parameter server refuses a well-formed, authenticated request, as its `error` reply's
`detail` says it: the reasons, and the `moved:<version>:<new owner>` detail a former owner sends
for a handed-off partition."""

from __future__ import annotations

from enum import StrEnum

MOVED_PREFIX = "moved"


class RejectReason(StrEnum):
    """Why a well-formed, authenticated request was refused (sent back in `detail`)."""

    WRONG_JOB = "wrong_job"
    UNEXPECTED_KIND = "unexpected_kind"
    NOT_OWNER = "not_owner"  # this server does not hold the partition (it may have moved)
    UNKNOWN_WORKER = "unknown_worker"  # only registered workers may push
    BAD_DELTA = "bad_delta"  # missing "delta" tensor, or wrong dtype/shape
    BAD_CLOCK = "bad_clock"  # a push without a clock, or with a negative one
    MOVING = "moving"  # the partition is being handed off right now; retry shortly
    MOVED = "moved"  # handed off; the reply's detail is `moved:<version>:<new owner>`
    BAD_SNAPSHOT = "bad_snapshot"  # a handoff whose tensors or worker list are malformed
    STALE_VERSION = "stale_version"  # a handoff older than what the receiver holds or held
    STALE_EPOCH = "stale_epoch"  # made before a roll-back; detail `stale_epoch:<epoch>`
    FUTURE_EPOCH = "future_epoch"  # the server has not entered the request's epoch yet; retry
    STALE_ROSTER = "stale_roster"  # computed on an older roster; detail `stale_roster:<version>`
    JOB_CODE_FAILED = "job_code_failed"  # the job's optimizer or scheduler raised applying it


#: Refusals that are part of normal elastic operation (the worker retries or re-syncs).
ROUTINE_REJECTIONS = frozenset(
    {
        RejectReason.MOVING,
        RejectReason.MOVED,
        RejectReason.FUTURE_EPOCH,
        RejectReason.STALE_EPOCH,
        RejectReason.STALE_ROSTER,
    }
)


#: Refusals of a request that the worker would send again the same (a retry cannot help):
#: the job fails with them (`control.JobFailed`, cause "refused").
FINAL_REJECTIONS = frozenset(
    {
        RejectReason.WRONG_JOB,
        RejectReason.UNEXPECTED_KIND,
        RejectReason.BAD_DELTA,
        RejectReason.BAD_CLOCK,
    }
)


class RejectedError(Exception):
    """Internal: a request the store refuses; becomes an `error` reply. State is unchanged.

    `wire_detail` is what the reply's `detail` says (default: the reason alone).
    """

    def __init__(
        self, reason: RejectReason, detail: str = "", *, wire_detail: str | None = None
    ) -> None:
        self.reason = reason
        self.wire_detail = wire_detail or str(reason)
        super().__init__(f"{reason}: {detail}" if detail else str(reason))


def moved_detail(new_owner: str, version: int) -> str:
    """The `detail` of the error a former owner sends for a handed-off partition."""
    return f"{MOVED_PREFIX}:{version}:{new_owner}"


def parse_moved(detail: str | None) -> tuple[str, int] | None:
    """(new owner, version) from a `moved` error detail; None for any other detail."""
    if not detail:
        return None
    prefix, _, rest = detail.partition(":")
    version, _, owner = rest.partition(":")
    if prefix != MOVED_PREFIX or not version.isdigit() or not owner:
        return None
    return owner, int(version)
