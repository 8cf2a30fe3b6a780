"""The controller's Prometheus metrics, read from the store at scrape time: every metric name
and what it means is here (`METRIC_NAMES`; dashboards/grafana is checked against it)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from orchestrator.api.health import TickHealth
from orchestrator.api.views import EventTallies, JobFacts, fleet_facts, tier_of
from orchestrator.store import JobState, Store, StoreError

logger = logging.getLogger(__name__)


def _families() -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
    """The metric families of one scrape, empty; names follow Prometheus conventions (base
    units in the name, `_total` added to counters on exposition)."""
    job = ["job_id"]
    gauge, counter = GaugeMetricFamily, CounterMetricFamily
    return {
        "store_up": gauge("orchestrator_store_up", "1 if Redis answered this scrape, else 0"),
        "ticks": counter("orchestrator_controller_ticks", "Controller ticks that worked"),
        "tick_failures": counter(
            "orchestrator_controller_tick_failures", "Controller ticks that failed"
        ),
        "leader": gauge(
            "orchestrator_controller_leader",
            "1 while this controller process holds the fleet's lease, 0 as a standby",
        ),
        "jobs": gauge("orchestrator_jobs", "Jobs by lifecycle state", labels=["state"]),
        "spent": gauge(
            "orchestrator_job_spent_usd",
            "Spend so far: billed plus accrued on running instances",
            labels=job,
        ),
        "budget": gauge("orchestrator_job_budget_usd", "The budget", labels=job),
        "projected": gauge(
            "orchestrator_job_projected_cost_usd",
            "Expected total cost at completion (BidBrain's latest decision; an ended job's: "
            "what it cost)",
            labels=job,
        ),
        "cost_per_work": gauge(
            "orchestrator_job_cost_per_work_usd",
            "Spend per reference-GPU-hour of work done so far",
            labels=job,
        ),
        "expected_cost_per_work": gauge(
            "orchestrator_job_expected_cost_per_work_usd",
            "Expected cost per reference-GPU-hour of the footprint BidBrain chose last",
            labels=job,
        ),
        "work": gauge(
            "orchestrator_job_work_done_gpu_hours",
            "Work done, in reference-GPU-hours",
            labels=job,
        ),
        "work_total": gauge(
            "orchestrator_job_work_gpu_hours", "The job's work, in reference-GPU-hours", labels=job
        ),
        "evictions": counter(
            "orchestrator_job_evictions",
            "Instances the cloud took back; warned: an interruption notice came first",
            labels=["job_id", "warned"],
        ),
        "launches": counter("orchestrator_job_launches", "Instances launched", labels=job),
        "launch_failures": counter(
            "orchestrator_job_launch_failures",
            "Launch requests the cloud refused (capacity errors and others), by error code",
            labels=["job_id", "code"],
        ),
        "alive": gauge(
            "orchestrator_instances_alive",
            "Instances not ended, by job, tier (reliable: on-demand; transient: spot), "
            "lifecycle, type and zone",
            labels=["job_id", "tier", "lifecycle", "instance_type", "zone"],
        ),
        "price": gauge(
            "orchestrator_spot_price_usd_per_hour",
            "Spot price of each market a running job's BidBrain considered (latest seen); "
            "held: some job holds instances there",
            labels=["instance_type", "zone", "held"],
        ),
        "iterations": counter(
            "orchestrator_job_training_iterations",
            "Training iterations (clocks) completed, as the runtime last reported",
            labels=job,
        ),
        "loss": gauge(
            "orchestrator_job_training_loss", "The model's loss, as last reported", labels=job
        ),
        "evaluation": gauge(
            "orchestrator_job_evaluation",
            "The job's evaluate() on held-out data during training (eval_every): each metric "
            "of the newest evaluation",
            labels=[*job, "metric"],
        ),
        "evaluation_iteration": gauge(
            "orchestrator_job_evaluation_iteration",
            "The iterations the newest evaluation's weights had trained",
            labels=job,
        ),
        "reassigned": counter(
            "orchestrator_job_reassigned_work",
            "Work units FlexRR moved from stragglers to faster workers",
            labels=job,
        ),
        "transitions": counter(
            "orchestrator_job_stage_transitions",
            "AgileML stage transitions (ParamServ, ActivePS, ... as the footprint changed)",
            labels=job,
        ),
    }


#: Every metric name /metrics exports (dashboards/grafana is checked against it).
METRIC_NAMES = tuple(sorted(f.name for f in _families().values()))


class StoreCollector:
    """Prometheus collector reading jobs, instances, events, prices and training reports from
    the store (`views.JobFacts`).

    Each scrape reads every job's event log (with `tallies`, only what it gained since the
    last read), latest training report and latest price snapshot, and the alive instances of
    all jobs at once. If Redis cannot be read, the scrape still succeeds, with
    `orchestrator_store_up 0` and no job series.
    """

    def __init__(
        self,
        store: Store,
        tallies: EventTallies | None = None,
        tick_health: Callable[[], TickHealth] | None = None,
    ) -> None:
        self._store = store
        self._tallies = tallies
        self._tick_health = tick_health  # the controller's, when it runs in this process

    def describe(self) -> Iterator[Metric]:
        """The families, without reading the store (called once at registration)."""
        yield from _families().values()

    def collect(self) -> Iterator[Metric]:
        """Read the store and yield every family with its samples."""
        m = _families()
        if self._tick_health is not None:
            health = self._tick_health()
            m["ticks"].add_metric([], float(health.ticks))
            m["tick_failures"].add_metric([], float(health.failures))
            m["leader"].add_metric([], 1.0 if health.leader else 0.0)
        try:
            facts = fleet_facts(self._store, self._tallies)
            prices = {
                f.job.job_id: self._store.latest_prices(f.job.job_id)
                for f in facts
                if f.job.state is JobState.RUNNING
            }
        except StoreError:
            logger.warning("metrics scrape could not read the store", exc_info=True)
            m["store_up"].add_metric([], 0.0)
            yield m["store_up"]
            return
        m["store_up"].add_metric([], 1.0)
        by_state = Counter(f.job.state for f in facts)
        for state in JobState:
            m["jobs"].add_metric([state.value], float(by_state[state]))
        held: set[str] = set()
        for f in facts:
            _add_job_samples(m, f)
            held |= {f"{r.instance_type}@{r.zone}" for r in f.alive}
        latest: dict[str, float] = {}
        for snapshot in prices.values():
            if snapshot is not None:
                latest.update(snapshot.prices)
        for market, price in sorted(latest.items()):
            instance_type, _, zone = market.partition("@")
            m["price"].add_metric([instance_type, zone, str(market in held).lower()], price)
        yield from m.values()


def _add_job_samples(m: dict[str, Any], f: JobFacts) -> None:
    job = [f.job.job_id]
    m["spent"].add_metric(job, f.spent_usd)
    m["budget"].add_metric(job, f.job.budget_usd)
    m["work"].add_metric(job, f.job.work_done_gpu_hours)
    for family, value in (
        ("work_total", f.work_gpu_hours),
        ("projected", f.projected_cost_usd),
        ("cost_per_work", f.cost_per_work_usd),
        ("expected_cost_per_work", f.expected_cost_per_work_usd),
    ):
        if value is not None:
            m[family].add_metric(job, value)
    m["evictions"].add_metric([*job, "true"], float(f.evictions_warned))
    m["evictions"].add_metric([*job, "false"], float(f.evictions_unwarned))
    m["launches"].add_metric(job, float(f.launches))
    for code, count in sorted(f.launch_failures.items()):
        m["launch_failures"].add_metric([*job, code], float(count))
    alive = Counter((tier_of(r), r.lifecycle, r.instance_type, r.zone) for r in f.alive)
    for labels, count in sorted(alive.items()):
        m["alive"].add_metric([*job, *labels], float(count))
    if f.training is not None:
        m["iterations"].add_metric(job, float(f.training.iteration))
        m["reassigned"].add_metric(job, float(f.training.reassigned))
        m["transitions"].add_metric(job, float(f.training.stage_transitions))
        if f.training.loss is not None:
            m["loss"].add_metric(job, f.training.loss)
        evaluation = f.training.evaluation
        if evaluation is not None:
            m["evaluation_iteration"].add_metric(job, float(evaluation.iteration))
            for metric, value in sorted(evaluation.metrics.items()):
                m["evaluation"].add_metric([*job, metric], value)
