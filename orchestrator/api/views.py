"""What the dashboard, the run report and the Prometheus metrics show about jobs, read from the
store in one place (`orchestrator/dashboard/static/CONTRACT.md` describes the JSON).

`JobFacts` folds a job's event log (`EventTally`: BidBrain's latest decision, evictions, warned
or not, launches and launch failures); with the alive instances and the latest training report
it is everything the fleet view and `/metrics` need. `fleet_facts` reads every job's: the alive
instances once for all jobs, and, with an `EventTallies` (the API keeps one), only the events
appended since the last read of each log. `job_dashboard` adds the series one job's page draws.
Reads only; nothing here writes.
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from dataclasses import dataclass, field, fields, replace
from typing import Any

from orchestrator.store.events import (
    DecisionEvent,
    Event,
    EvictionEvent,
    LaunchEvent,
    LaunchFailedEvent,
    LearnedRate,
    NoticeEvent,
    ReconcileEvent,
    ReleaseEvent,
    StallEvent,
    StateEvent,
    WorkRatesEvent,
)
from orchestrator.store.models import (
    InstanceRecord,
    JobRecord,
    PipelineStageReport,
    TrainingReport,
)
from orchestrator.store.protocol import Store

#: Points kept of a long series (evenly thinned, the last point always kept).
MAX_SERIES_POINTS = 400
#: Events listed on a job's page, newest first.
EVENTS_SHOWN = 100


def tier_of(record: InstanceRecord) -> str:
    """`reliable` (on-demand) or `transient` (spot), the AgileML tiers."""
    return "reliable" if record.lifecycle == "on-demand" else "transient"


@dataclass
class EventTally:
    """What a job's event log says, folded one event at a time (`add`): so a reader can fold
    in only the events appended since `last_id`, the newest it has seen."""

    projected_cost_usd: float | None = None
    projected_finish_at: float | None = None
    expected_cost_per_work_usd: float | None = None
    evictions_warned: int = 0
    evictions_unwarned: int = 0
    launches: int = 0
    launch_failures: Counter[str] = field(default_factory=Counter)  # by error code
    warned_instances: set[str] = field(default_factory=set)
    noticed: set[str] = field(default_factory=set)  # instances given an interruption notice
    work_rates: dict[str, LearnedRate] = field(default_factory=dict)  # learned, per GPU model
    last_id: str = "-"

    def add(self, events: list[tuple[str, Event]]) -> None:
        """Fold in `events` (the log's next ones, oldest first)."""
        for event_id, event in events:
            match event:
                case DecisionEvent():
                    self.projected_cost_usd = event.projected_cost_usd
                    self.projected_finish_at = event.projected_finish_at
                    self.expected_cost_per_work_usd = event.expected_cost_per_work
                case NoticeEvent(notice="interruption"):
                    self.noticed.add(event.instance_id)
                case EvictionEvent() if event.instance_id in self.noticed:
                    self.evictions_warned += 1
                    self.warned_instances.add(event.instance_id)
                case EvictionEvent():
                    self.evictions_unwarned += 1
                case LaunchEvent():
                    self.launches += 1
                case LaunchFailedEvent():
                    self.launch_failures[event.code or "unknown"] += 1
                case WorkRatesEvent():
                    self.work_rates = dict(event.rates)
            self.last_id = event_id

    def copy(self) -> EventTally:
        return replace(
            self,
            launch_failures=Counter(self.launch_failures),
            warned_instances=set(self.warned_instances),
            noticed=set(self.noticed),
        )


class EventTallies:
    """Each job's `EventTally` as this process last folded it: a read folds in only the events
    appended to the job's log since, not the whole log again (it grows by a decision per job
    per tick). The logs are append-only; a job submitted again under the same id (another
    `submitted_at`) starts over; a log trimmed past `EVENTS_MAXLEN` keeps counting what was
    trimmed. Per process (each API process keeps its own) and thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, _Kept] = {}

    def read(self, store: Store, job: JobRecord) -> EventTally:
        """The job's tally now. Never changed afterwards (a newer read makes a new one), so
        the caller may keep it; it must not change it."""
        with self._lock:
            kept = self._jobs.get(job.job_id)
            if kept is None or kept.submitted_at != job.submitted_at:
                kept = self._jobs[job.job_id] = _Kept(job.submitted_at)
        with kept.lock:  # one reader folds a job's new events at a time
            new = store.events(job.job_id, since_id=kept.tally.last_id)
            if new:
                tally = kept.tally.copy()
                tally.add(new)
                kept.tally = tally
            return kept.tally


@dataclass
class _Kept:
    """A job's tally in `EventTallies`."""

    submitted_at: float
    tally: EventTally = field(default_factory=EventTally)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(kw_only=True)
class JobFacts(EventTally):
    """One job's numbers: its event log's tally, its alive instances, its latest training."""

    job: JobRecord
    alive: list[InstanceRecord]
    training: TrainingReport | None = None
    # billed plus what its alive instances had run up at the controller's last tick
    spent_usd: float = 0.0

    @classmethod
    def read(
        cls,
        store: Store,
        job: JobRecord,
        events: list[tuple[str, Event]],
        instances: list[InstanceRecord] | None = None,
    ) -> JobFacts:
        """From the job's whole event log. `instances`: the job's instances (all of them, or
        the alive ones), when the caller has read them already."""
        tally = EventTally()
        tally.add(events)
        return cls.of(store, job, tally, instances)

    @classmethod
    def of(
        cls,
        store: Store,
        job: JobRecord,
        tally: EventTally,
        instances: list[InstanceRecord] | None = None,
    ) -> JobFacts:
        """From the job's event log already folded (shared with `tally`: read-only)."""
        alive = (
            store.list_instances(job.job_id, alive_only=True)
            if instances is None
            else [r for r in instances if r.ended_at is None]
        )
        folded = {f.name: getattr(tally, f.name) for f in fields(EventTally)}
        spent = store.live_spend_usd(job.job_id)
        if job.state.is_terminal:  # its last decision's projection is moot: it cost this
            folded |= {"projected_cost_usd": spent, "projected_finish_at": job.updated_at}
        return cls(job=job, alive=alive, training=store.latest_training(job.job_id),
                   spent_usd=spent, **folded)  # fmt: skip

    @property
    def evictions(self) -> int:
        return self.evictions_warned + self.evictions_unwarned

    @property
    def work_gpu_hours(self) -> float | None:
        return _number(self.job.spec.get("work_gpu_hours"))

    @property
    def cost_per_work_usd(self) -> float | None:
        """Spent per reference-GPU-hour of work done (None before any work)."""
        done = self.job.work_done_gpu_hours
        return self.spent_usd / done if done > 0 else None

    def summary(self) -> dict[str, Any]:
        """JOB_SUMMARY of the contract."""
        job, tiers = self.job, Counter(tier_of(r) for r in self.alive)
        return {
            "job_id": job.job_id,
            "name": job.name,
            "state": job.state.value,
            "budget_usd": job.budget_usd,
            "spent_usd": self.spent_usd,
            "billed_usd": job.spent_usd,
            "work_gpu_hours": self.work_gpu_hours,
            "work_done_gpu_hours": job.work_done_gpu_hours,
            "projected_cost_usd": self.projected_cost_usd,
            "projected_finish_at": self.projected_finish_at,
            "cost_per_work_usd": self.cost_per_work_usd,
            "expected_cost_per_work_usd": self.expected_cost_per_work_usd,
            "nodes_alive": {"reliable": tiers["reliable"], "transient": tiers["transient"]},
            "evictions": self.evictions,
            "launch_failures": sum(self.launch_failures.values()),
            "iterations": None if self.training is None else self.training.iteration,
            "loss": None if self.training is None else self.training.loss,
            "evaluation": _evaluation(self.training),
            "updated_at": job.updated_at,
        }


def read_facts(store: Store, job: JobRecord) -> JobFacts:
    return JobFacts.read(store, job, store.events(job.job_id))


def fleet_facts(store: Store, tallies: EventTallies | None = None) -> list[JobFacts]:
    """Every job's facts, oldest submission first: the alive instances of all jobs in one
    read (not one per job), and with `tallies` only the events each log gained since."""
    jobs = store.list_jobs()
    alive: defaultdict[str, list[InstanceRecord]] = defaultdict(list)
    for record in store.list_instances(alive_only=True):
        alive[record.job_id].append(record)
    facts = []
    for job in jobs:
        if tallies is None:
            facts.append(JobFacts.read(store, job, store.events(job.job_id), alive[job.job_id]))
        else:
            facts.append(JobFacts.of(store, job, tallies.read(store, job), alive[job.job_id]))
    return facts


def fleet(store: Store, now_s: float, tallies: EventTallies | None = None) -> dict[str, Any]:
    """`GET /v1/dashboard`: every job's summary."""
    return {"now_s": now_s, "jobs": [facts.summary() for facts in fleet_facts(store, tallies)]}


def job_dashboard(store: Store, job_id: str, now_s: float) -> dict[str, Any]:
    """`GET /v1/jobs/{job_id}/dashboard`: the job's summary and the series its page draws.

    Raises:
        NotFoundError: no such job.
    """
    job = store.get_job(job_id)
    events = store.events(job_id)
    nodes = store.list_instances(job_id)
    facts = JobFacts.read(store, job, events, nodes)
    held = {f"{r.instance_type}@{r.zone}" for r in facts.alive if tier_of(r) == "transient"}
    return {
        "now_s": now_s,
        "job": facts.summary(),
        "spend": _thin([_spend_point(e) for _, e in events if isinstance(e, DecisionEvent)]),
        "prices": _price_series(store, job_id, held),
        "nodes": [_node(r, facts.warned_instances) for r in nodes],
        "marks": [m for _, e in events if (m := _mark(e, facts.warned_instances)) is not None],
        "training": _thin(
            [
                {
                    "t": r.at_s,
                    "iteration": r.iteration,
                    "loss": r.loss,
                    "reassigned": r.reassigned,
                    "stage_transitions": r.stage_transitions,
                    "evaluation": _evaluation(r),
                }
                for r in store.training(job_id)
            ]
        ),
        "pipeline": [st.model_dump(mode="json") for st in _stages(facts.training)],
        "work_rates": [
            {"gpu_model": model, **rate.model_dump(mode="json")}
            for model, rate in sorted(facts.work_rates.items())
        ],
        "events": [
            {"id": eid, "t": e.at_s, "kind": e.kind.value, "text": describe_event(e)}
            for eid, e in reversed(events[-EVENTS_SHOWN:])
        ],
    }


def _evaluation(report: TrainingReport | None) -> dict[str, Any] | None:
    """The newest evaluation of held-out data a report carries (`eval_every`), as JSON."""
    if report is None or report.evaluation is None:
        return None
    return report.evaluation.model_dump(mode="json")


def _stages(latest: TrainingReport | None) -> tuple[PipelineStageReport, ...]:
    """A pipeline job's stages as last reported (none for a data-parallel job)."""
    return () if latest is None else latest.stages


def describe_event(event: Event) -> str:
    """One line for the events table."""
    match event:
        case DecisionEvent():
            text = (
                f"spent ${_money(event.spent_usd)}, projected "
                f"${_money(event.projected_cost_usd)}, expected "
                f"${_money(event.expected_cost_per_work)}/GPU-h"
            )
            if event.acquire:
                text += f"; acquire {'; '.join(event.acquire)}"
            if event.release:
                text += f"; release {'; '.join(event.release)}"
            return text
        case LaunchEvent():
            where = f"{event.instance_type}@{event.zone}"
            return f"{event.instance_id} launched ({where}, {event.lifecycle})"
        case LaunchFailedEvent():
            return f"launch in {event.market} refused: {event.code}"
        case EvictionEvent():
            return f"{event.instance_id} ({event.instance_type}@{event.zone}) evicted"
        case NoticeEvent():
            return f"{event.notice} notice for {event.instance_id}"
        case ReleaseEvent():
            why = f": {event.detail}" if event.detail else ""
            return f"{event.instance_id} released ({event.reason}){why}"
        case StateEvent():
            return f"state {event.state.value}" + (f": {event.message}" if event.message else "")
        case ReconcileEvent():
            return f"{event.instance_id}: {event.action} (found running, not in the records)"
        case StallEvent():
            return (
                f"no progress for {event.stalled_s / 60:.0f} min at iteration {event.iteration}"
                f": released {len(event.released)} instances (stall {event.attempt} of "
                f"{event.attempts}); {event.reason}"
            )
        case WorkRatesEvent():
            return "learned work rates: " + "; ".join(
                f"{model} {r.learned:.3g} (prior {r.prior:.3g}, 90% {r.low:.3g}-{r.high:.3g}, "
                f"{r.observed_hours:.1f} h measured)"
                for model, r in sorted(event.rates.items())
            )


def _spend_point(event: DecisionEvent) -> dict[str, Any]:
    return {
        "t": event.at_s,
        "spent_usd": event.spent_usd,
        "work_done_gpu_hours": event.work_done_gpu_hours,
        "projected_cost_usd": event.projected_cost_usd,
        "expected_cost_per_work_usd": event.expected_cost_per_work,
    }


def _price_series(store: Store, job_id: str, held: set[str]) -> list[dict[str, Any]]:
    points: dict[str, list[list[float]]] = {}
    for snapshot in store.prices(job_id):
        for market, price in snapshot.prices.items():
            series = points.setdefault(market, [])
            if not series or series[-1][1] != price:
                series.append([snapshot.at_s, price])
    return [
        {"market": market, "held": market in held, "points": _thin(series)}
        for market, series in sorted(points.items())
    ]


def _node(record: InstanceRecord, warned: set[str]) -> dict[str, Any]:
    return {
        "instance_id": record.instance_id,
        "instance_type": record.instance_type,
        "zone": record.zone,
        "tier": tier_of(record),
        "launched_at": record.launched_at,
        "ended_at": record.ended_at,
        "end_reason": record.end_reason,
        "warned": record.instance_id in warned,
    }


def _mark(event: Event, warned: set[str]) -> dict[str, Any] | None:
    match event:
        case EvictionEvent():
            note = "warned" if event.instance_id in warned else "no warning"
            detail = f"{event.instance_type}@{event.zone}, {note}"
            return {"t": event.at_s, "kind": "eviction", "instance_id": event.instance_id,
                    "detail": detail}  # fmt: skip
        case LaunchFailedEvent():
            detail = f"{event.market}: {event.code}"
            return {"t": event.at_s, "kind": "launch_failed", "instance_id": None,
                    "detail": detail}  # fmt: skip
        case NoticeEvent():
            return {"t": event.at_s, "kind": "notice", "instance_id": event.instance_id,
                    "detail": event.notice}  # fmt: skip
    return None


def _thin(points: list[Any]) -> list[Any]:
    """At most MAX_SERIES_POINTS, evenly spaced, keeping the last."""
    if len(points) <= MAX_SERIES_POINTS:
        return points
    step = len(points) / (MAX_SERIES_POINTS - 1)
    return [points[int(i * step)] for i in range(MAX_SERIES_POINTS - 1)] + [points[-1]]


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _money(value: object) -> str:
    number = _number(value)
    return "?" if number is None else f"{number:,.2f}"
