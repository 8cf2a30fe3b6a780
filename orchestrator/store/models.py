"""What the store keeps: the job lifecycle and the records of jobs, instances, charges and events.

Records are validated, immutable snapshots of what the store held at the moment they were read;
change them only through a `Store` (which bumps versions and keeps indexes consistent).
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from orchestrator.market.billing import BilledInterval
from orchestrator.units import INT64_MAX, SECONDS_PER_HOUR

#: Ids appear inside Redis keys (`{namespace}:job:{job_id}:ledger`), so they may not hold ":"
#: (that could make one job's key collide with another's sub-key).
RECORD_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
RecordId = Annotated[str, StringConstraints(pattern=RECORD_ID_PATTERN)]
NonNegative = Annotated[float, Field(ge=0)]

#: The `InstanceRecord.state` that `Store.end_instance` writes.
INSTANCE_ENDED = "ended"

_RECORD_CONFIG = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
#: A count from outside (a report, an event): 0 up to int64.
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]


class JobState(StrEnum):
    """The lifecycle of a job::

        queued ──► running ──► succeeded
          │           ├──────► failed
          │           ├──────► budget_exhausted
          │           └──────► cancelling ──► cancelled
          │                         └───────► failed
          └──► cancelled

    * queued: submitted; no instance launched yet.
    * running: the controller holds (or is acquiring) instances for it.
    * cancelling: the user cancelled a running job; its instances are being released.
    * succeeded, failed, budget_exhausted, cancelled: terminal; no edge leaves them.

    Every move goes through `Store.transition`, which refuses any edge not in
    `ALLOWED_TRANSITIONS`.
    """

    QUEUED = "queued"
    RUNNING = "running"
    BUDGET_EXHAUSTED = "budget_exhausted"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return not ALLOWED_TRANSITIONS[self]


ALLOWED_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset(
        {
            JobState.RUNNING,  # the controller picked it up and starts acquiring instances
            JobState.CANCELLED,  # cancelled before anything was launched: nothing to release
        }
    ),
    JobState.RUNNING: frozenset(
        {
            JobState.SUCCEEDED,  # all its work is done; instances are released
            JobState.FAILED,  # the training itself failed, or the controller gave up on it
            JobState.BUDGET_EXHAUSTED,  # spend reached the budget before the work was done
            JobState.CANCELLING,  # the user cancelled; instances must be released first
        }
    ),
    JobState.CANCELLING: frozenset(
        {
            JobState.CANCELLED,  # every instance is released
            JobState.FAILED,  # releasing failed in a way the controller cannot recover from
        }
    ),
    JobState.BUDGET_EXHAUSTED: frozenset(),  # terminal: resubmit with a larger budget
    JobState.SUCCEEDED: frozenset(),  # terminal
    JobState.FAILED: frozenset(),  # terminal
    JobState.CANCELLED: frozenset(),  # terminal
}

TERMINAL_STATES: frozenset[JobState] = frozenset(s for s in JobState if s.is_terminal)


def allowed_sources(to_state: JobState) -> frozenset[JobState]:
    """The states from which `to_state` may be entered."""
    return frozenset(s for s, targets in ALLOWED_TRANSITIONS.items() if to_state in targets)


class JobRecord(BaseModel):
    """A job as stored: its submission (id, name, spec, budget) and its live state.

    `version` counts lifecycle writes (creation is whatever the record says, usually 0; every
    `Store.transition` adds 1). `spent_usd` and `work_done_gpu_hours` are counters written
    without it (by `append_ledger` and `update_progress`), so they never make a transition
    lose a race. `spent_usd` is always the sum of the job's ledger.
    """

    model_config = _RECORD_CONFIG

    job_id: RecordId
    name: str
    spec: dict[str, Any] = Field(
        description="the submitted job spec as JSON (e.g. `JobSpec.model_dump(mode='json')`); "
        "the store does not interpret it"
    )
    budget_usd: Annotated[float, Field(gt=0)]
    state: JobState = JobState.QUEUED
    version: Count = 0
    submitted_at: float
    updated_at: float
    spent_usd: NonNegative = 0.0
    work_done_gpu_hours: NonNegative = 0.0
    message: str = ""

    @classmethod
    def submit(
        cls,
        job_id: str,
        spec: dict[str, Any],
        budget_usd: float,
        now_s: float,
        *,
        name: str | None = None,
    ) -> JobRecord:
        """A new queued job, version 0, nothing spent. `name` defaults to `spec["name"]`."""
        return cls(
            job_id=job_id,
            name=name if name is not None else str(spec.get("name", job_id)),
            spec=spec,
            budget_usd=budget_usd,
            submitted_at=now_s,
            updated_at=now_s,
        )


class InstanceRecord(BaseModel):
    """One cloud instance launched for a job. Alive while `ended_at` is None.

    `state` is the cloud's word for it ("pending", "running", ...); `Store.end_instance` sets
    it to `INSTANCE_ENDED` along with `ended_at` and `end_reason` (an `EndReason` value).
    """

    model_config = _RECORD_CONFIG

    instance_id: RecordId
    job_id: RecordId
    allocation_id: str
    instance_type: str
    zone: str
    lifecycle: Literal["spot", "on-demand"]
    max_price_usd_per_hour: NonNegative | None = None
    launched_at: float
    state: str
    ended_at: float | None = None
    end_reason: str | None = None

    @property
    def alive(self) -> bool:
        return self.ended_at is None

    @model_validator(mode="after")
    def _end_is_consistent(self) -> InstanceRecord:
        if (self.ended_at is None) != (self.end_reason is None):
            raise ValueError("ended_at and end_reason are set together or not at all")
        if self.ended_at is not None and self.ended_at < self.launched_at:
            raise ValueError(f"ended_at {self.ended_at} is before launched_at {self.launched_at}")
        return self


class LedgerEntry(BaseModel):
    """One charge: instance `instance_id` ran [start_s, end_s] and was billed `billed_s` seconds
    at `price_usd_per_hour`, i.e. `charged_usd`. `reason` is an `EndReason` value.

    (`instance_id`, `start_s`) identifies the entry: `Store.append_ledger` records it once.
    """

    model_config = _RECORD_CONFIG

    job_id: RecordId
    instance_id: RecordId
    instance_type: str
    zone: str
    start_s: float
    end_s: float
    price_usd_per_hour: NonNegative
    billed_s: NonNegative
    charged_usd: NonNegative
    reason: str

    @model_validator(mode="after")
    def _consistent(self) -> LedgerEntry:
        if self.end_s < self.start_s:
            raise ValueError(f"end_s {self.end_s} is before start_s {self.start_s}")
        expected = self.price_usd_per_hour * self.billed_s / SECONDS_PER_HOUR
        if not math.isclose(self.charged_usd, expected, rel_tol=1e-9, abs_tol=1e-12):
            raise ValueError(
                f"charged_usd {self.charged_usd} != price_usd_per_hour × billed_s / 3600 "
                f"= {expected}"
            )
        return self

    @classmethod
    def from_interval(
        cls,
        interval: BilledInterval,
        *,
        job_id: str,
        instance_id: str,
        instance_type: str,
        zone: str,
    ) -> LedgerEntry:
        """The entry for one line of a `BillingModel`'s bill."""
        return cls(
            job_id=job_id,
            instance_id=instance_id,
            instance_type=instance_type,
            zone=zone,
            start_s=interval.start_s,
            end_s=interval.end_s,
            price_usd_per_hour=interval.price_usd_per_hour,
            billed_s=interval.billed_s,
            charged_usd=interval.charged_usd,
            reason=str(interval.reason),
        )


class PriceSnapshot(BaseModel):
    """The spot prices (USD per instance-hour) of the markets a job's BidBrain considered at
    `at_s`, by market (`type@zone`); written when any of them changed."""

    model_config = _RECORD_CONFIG

    at_s: float
    prices: dict[str, NonNegative]


class InstanceWork(BaseModel):
    """One instance's work for a job so far: `work_gpu_hours` in `hours` of useful time (from
    when it was ready until now, or until it stopped working), done on `gpus` of its GPUs
    (None: all of them). BidBrain learns the job's work rates from these."""

    model_config = _RECORD_CONFIG

    work_gpu_hours: NonNegative
    hours: NonNegative
    gpus: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None


class PipelineStageReport(BaseModel):
    """One stage of a pipeline job as it runs now: its layers (inclusive) and the instances of
    its replicas."""

    model_config = _RECORD_CONFIG

    stage: Count
    first_layer: Count
    last_layer: Count
    nodes: tuple[Annotated[str, Field(max_length=128)], ...] = ()


#: The most metrics an evaluation keeps (the job's evaluate() returns a few).
MAX_METRICS = 32
MetricName = Annotated[str, StringConstraints(min_length=1, max_length=64)]


def _encodes(text: str) -> bool:
    """Whether `text` is valid UTF-8 once encoded (a lone surrogate is not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class Evaluation(BaseModel):
    """What the job's `evaluate(model)` returned for the weights after `iteration`
    iterations (held-out metrics, `eval_every`)."""

    model_config = _RECORD_CONFIG

    iteration: Count
    metrics: Annotated[dict[MetricName, float], Field(max_length=MAX_METRICS)]

    @classmethod
    def of(cls, result: dict[str, Any]) -> Evaluation:
        """From an evaluation result (`{"iteration": n, metric: value, ...}`): the metrics
        that are finite numbers with a name that fits, at most MAX_METRICS of them."""
        metrics = {
            str(k): float(v)
            for k, v in result.items()
            if k != "iteration" and isinstance(v, int | float) and math.isfinite(v)
            and 0 < len(str(k)) <= 64 and str(k).isprintable() and _encodes(str(k))
        }  # fmt: skip
        kept = dict(sorted(metrics.items())[:MAX_METRICS])
        return cls(iteration=int(result["iteration"]), metrics=kept)


class TrainingReport(BaseModel):
    """What a job's training runtime reports (pushed through the controller): its iteration,
    the model's loss, the cumulative FlexRR reassignments and AgileML stage transitions, and,
    for a pipeline job, its stages now."""

    model_config = _RECORD_CONFIG

    at_s: float
    iteration: Count
    loss: Annotated[float, Field(allow_inf_nan=False)] | None = None  # some losses go below 0
    reassigned: Count = 0
    stage_transitions: Count = 0
    stages: Annotated[tuple[PipelineStageReport, ...], Field(max_length=1024)] = ()
    evaluation: Evaluation | None = None  # the newest evaluation of held-out data, if any
