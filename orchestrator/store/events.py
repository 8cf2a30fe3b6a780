"""A job's event log: one typed model per kind of entry.

The controller and the API write these; the dashboard, `/metrics`, the run report and the CLI
read them. Each kind has its own fields, so a writer cannot name a field the readers do not
know (the dashboard once showed "state None" because the API wrote `to_state` where the
dashboard read `state`). The log is for audit and display, never for decisions.

`parse_event` also reads entries written before the kinds were typed (a `fields` mapping), so
a controller upgraded in place still shows its old events.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from orchestrator.store.models import Count, JobState, RecordId
from orchestrator.units import INT64_MAX


class EventKind(StrEnum):
    """What an event records."""

    EVICTION = "eviction"  # the cloud took an instance back
    LAUNCH = "launch"  # an instance was launched
    LAUNCH_FAILED = "launch_failed"  # a launch request was refused or timed out
    RELEASE = "release"  # the controller terminated an instance
    DECISION = "decision"  # the policy chose a footprint
    STATE = "state"  # the job changed lifecycle state
    NOTICE = "notice"  # an interruption notice arrived
    RECONCILE = "reconcile"  # the controller corrected its records from what the cloud reports
    WORK_RATES = "work_rates"  # the rates the job is decided with changed (learned)
    STALL = "stall"  # a training job made no progress: its instances were released


class _EventBase(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    job_id: RecordId
    at_s: float


class StateEvent(_EventBase):
    """The job moved to `state` (`from_state` when the writer knew it)."""

    kind: Literal[EventKind.STATE] = EventKind.STATE
    state: JobState
    from_state: JobState | None = None
    message: str = ""
    by: Literal["controller", "api"] = "controller"


class DecisionEvent(_EventBase):
    """BidBrain decided: what the job had spent and done, what it expects, what it changed.
    Costs are None when the policy saw no finite cost (no market, no work rate)."""

    kind: Literal[EventKind.DECISION] = EventKind.DECISION
    spent_usd: float
    work_done_gpu_hours: float
    expected_cost_per_work: float | None = None  # USD per reference-GPU-hour
    projected_cost_usd: float | None = None
    projected_finish_at: float | None = None  # epoch seconds
    acquire: tuple[str, ...] = ()  # "2xp3.2xlarge@us-east-1b"
    release: tuple[str, ...] = ()  # allocation ids
    reason: str = ""  # why, when the policy said (the deadline's safety net, the budget)


class LearnedRate(BaseModel):
    """One GPU model's rate for a job: its prior (the catalog's, or the job's stated rate),
    what was learned (the posterior median), its 90% interval and the hours measured."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    prior: float
    learned: float
    low: float
    high: float
    observed_hours: float


class WorkRatesEvent(_EventBase):
    """The job's learned work rates changed (per GPU model; only models measured)."""

    kind: Literal[EventKind.WORK_RATES] = EventKind.WORK_RATES
    rates: dict[str, LearnedRate]


class LaunchEvent(_EventBase):
    """An instance was launched (or, with `adopted`, found running and recorded)."""

    kind: Literal[EventKind.LAUNCH] = EventKind.LAUNCH
    instance_id: str
    instance_type: str
    zone: str
    lifecycle: Literal["spot", "on-demand"]
    max_price_usd_per_hour: float | None = None


class LaunchFailedEvent(_EventBase):
    """The cloud refused a launch in `market` (`type@zone`) with `code`."""

    kind: Literal[EventKind.LAUNCH_FAILED] = EventKind.LAUNCH_FAILED
    market: str
    code: str


class EvictionEvent(_EventBase):
    """The cloud took the instance back."""

    kind: Literal[EventKind.EVICTION] = EventKind.EVICTION
    instance_id: str
    instance_type: str
    zone: str


class NoticeEvent(_EventBase):
    """An interruption notice or rebalance recommendation for the instance arrived."""

    kind: Literal[EventKind.NOTICE] = EventKind.NOTICE
    instance_id: str
    notice: Literal["interruption", "rebalance"]
    action: str | None = None  # terminate | stop | hibernate, for an interruption


class ReleaseEvent(_EventBase):
    """The controller terminated the instance (`reason`: an `EndReason` value; `detail`:
    why, when not the job's end or its decision, e.g. its node stopped working)."""

    kind: Literal[EventKind.RELEASE] = EventKind.RELEASE
    instance_id: str
    reason: str
    detail: str = ""


class StallEvent(_EventBase):
    """A training job trained no iteration for `stalled_s` market seconds while its instances
    ran: they were released (`released`), the `attempt`-th time; `reason` says what was seen
    (the runtime's view, an agent's last log line)."""

    kind: Literal[EventKind.STALL] = EventKind.STALL
    attempt: Annotated[int, Field(ge=1, le=INT64_MAX)]
    attempts: Annotated[int, Field(ge=1, le=INT64_MAX)]  # the attempt that fails the job
    stalled_s: Annotated[float, Field(ge=0)]
    iteration: Count
    released: tuple[RecordId, ...] = ()
    reason: str = ""


class ReconcileEvent(_EventBase):
    """The controller corrected its records: `adopt` = an instance EC2 runs under our tag
    that the store did not know (launched just before a crash)."""

    kind: Literal[EventKind.RECONCILE] = EventKind.RECONCILE
    action: Literal["adopt"]
    instance_id: str


Event = Annotated[
    StateEvent
    | DecisionEvent
    | LaunchEvent
    | LaunchFailedEvent
    | EvictionEvent
    | NoticeEvent
    | ReleaseEvent
    | ReconcileEvent
    | StallEvent
    | WorkRatesEvent,
    Field(discriminator="kind"),
]
EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)


def event_json(event: Event) -> str:
    """The stored form of an event."""
    return event.model_dump_json()


def parse_event(text: str) -> Event:
    """An event from its stored JSON (this module's form, or the older `fields` form).

    Raises:
        ValueError: not an event (pydantic's ValidationError is a ValueError).
    """
    data = json.loads(text)
    if isinstance(data, dict) and isinstance(data.get("fields"), dict):
        data = _from_fields(data)
    return EVENT_ADAPTER.validate_python(data)


#: Field names of the untyped form -> this module's, per kind.
_RENAMED = {
    EventKind.STATE: {"to_state": "state", "reason": "message"},
    EventKind.LAUNCH: {"max_price": "max_price_usd_per_hour"},
}


def _from_fields(data: dict[str, Any]) -> dict[str, Any]:
    """Flatten an entry written before the kinds were typed: `{job_id, kind, at_s, fields}`."""
    kind = EventKind(data["kind"])
    renamed = _RENAMED.get(kind, {})
    out: dict[str, Any] = {"job_id": data["job_id"], "kind": kind, "at_s": data["at_s"]}
    for name, value in data["fields"].items():
        out[renamed.get(name, name)] = value
    if kind is EventKind.DECISION:
        for name in ("acquire", "release"):
            out[name] = tuple(p for p in str(out.get(name) or "").split(";") if p)
    return out
