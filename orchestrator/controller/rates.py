"""The job's learned work rates, as the controller decides with them (`bidbrain.rates`).

Every instance that worked for a job is a measurement: the work recorded for it in the store
over its useful hours (`Store.record_instance_work`: the instance agents' count offline, the
runtime's on AWS). The belief is rebuilt from the store's records at each decision, so a
restarted controller decides as the one before it did; nothing of it is kept in memory but
what was last announced.

When the rates a job is decided with change (by more than `ANNOUNCE_CHANGE`), a
`WorkRatesEvent` says so: the dashboard shows learned against catalog rates from it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from orchestrator.bidbrain.model import JobSpec
from orchestrator.bidbrain.rates import RateBelief, WorkMeasurement, learned_belief
from orchestrator.market.catalog import Catalog
from orchestrator.store import InstanceWork, NotFoundError, Store
from orchestrator.store.events import LearnedRate, WorkRatesEvent

#: A learned rate is announced again once it moved by this fraction.
ANNOUNCE_CHANGE = 0.01


def measurements(
    types: Mapping[str, str | None], work: Mapping[str, InstanceWork]
) -> Iterator[WorkMeasurement]:
    """Each instance's recorded work over its useful hours (`types`: instance id -> its type;
    instances of no known type, or with no hours, measure nothing)."""
    for instance_id, done in work.items():
        kind = types.get(instance_id)
        if kind is not None and done.hours > 0:
            yield WorkMeasurement(kind, done.hours, done.work_gpu_hours, done.gpus)


@dataclass
class JobRates:
    """What rate learning keeps of one job (kept by the job's owner): the rates last
    announced, and its instances' types (read once each)."""

    announced: dict[str, float] | None = None
    types: dict[str, str | None] = field(default_factory=dict)  # None: no such instance


class RateLearning:
    """Learned rates for the controller's decisions (see the module docstring)."""

    def __init__(self, store: Store, catalog: Catalog) -> None:
        self.store = store
        self.catalog = catalog

    def belief(self, job_id: str, spec: JobSpec, kept: JobRates) -> RateBelief | None:
        """The job's belief now; None when nothing was measured yet."""
        work = self.store.instance_work(job_id)
        if not work:
            return None
        found = measurements(self._types_of(kept, work), work)
        belief = learned_belief(self.catalog, spec.gpu_work_rates, found)
        return belief if belief.learned() else None

    def spec_for(self, job_id: str, spec: JobSpec, now_s: float, kept: JobRates) -> JobSpec:
        """`spec` with the rates learned so far (as is before any were); a change is
        announced with a `WorkRatesEvent`."""
        belief = self.belief(job_id, spec, kept)
        if belief is None:
            return spec
        rates = belief.rates()
        if self._moved(kept.announced, rates):
            self.store.append_event(_event(job_id, now_s, belief))
            kept.announced = rates
        return spec.model_copy(update={"gpu_work_rates": rates})

    def _types_of(self, kept: JobRates, instance_ids: Iterable[str]) -> dict[str, str | None]:
        """The instances' types, read from the store the first time each is seen (an
        instance is recorded at its launch, before anything can report its work)."""
        types = kept.types
        for instance_id in instance_ids:
            if instance_id not in types:
                try:
                    types[instance_id] = self.store.get_instance(instance_id).instance_type
                except NotFoundError:
                    types[instance_id] = None
        return types

    @staticmethod
    def _moved(before: Mapping[str, float] | None, now: Mapping[str, float]) -> bool:
        if before is None or before.keys() != now.keys():
            return True
        return any(abs(now[m] / before[m] - 1.0) > ANNOUNCE_CHANGE for m in now)


def _event(job_id: str, now_s: float, belief: RateBelief) -> WorkRatesEvent:
    rates = {}
    for model, est in belief.learned().items():
        low, high = est.interval
        rates[model] = LearnedRate(
            prior=est.prior_rate,
            learned=est.rate,
            low=low,
            high=high,
            observed_hours=est.observed_hours,
        )
    return WorkRatesEvent(job_id=job_id, at_s=now_s, rates=rates)
