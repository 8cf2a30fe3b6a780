"""`ControllerJob`: one job as the controller keeps it between its ticks.

Its submission is typed once (the store keeps the JSON the API validated; a tick used to
validate it again every time), and it owns the job's BidBrain state: the renewal points of its
allocations, the prices its last decision recorded (the dashboard's series grows only when
one changes), when each market last took one of its instances back, and how late its
decisions came (the budget's reserve follows the longest recent gap: a controller whose ticks
lag keeps enough back, and releases early). It also holds what the training gate saw of the
job (its progress and its nodes' liveness: `JobWatch`) and the bookkeeping of its learned
rates (`JobRates`), so all the controller keeps of a job lives here, and goes with it. The
controller builds it at the job's first tick after it starts (so a restarted controller
rebuilds it from the store: its spec, its evictions, the times of its last decisions, its
stalls) and drops it when the job ends. The job's runtime (its elasticity controller's
threads and port) is the training host's to start and stop: `controller.training`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from orchestrator.bidbrain.inputs import RenewalSchedule
from orchestrator.bidbrain.policy import BidBrainSettings
from orchestrator.controller.rates import JobRates
from orchestrator.controller.training_gate import JobWatch
from orchestrator.jobspec import STORED, JobSubmission
from orchestrator.market.billing import EndReason
from orchestrator.market.prices import Market
from orchestrator.store.events import DecisionEvent
from orchestrator.store.models import InstanceRecord, JobRecord
from orchestrator.store.protocol import Store

#: The budget's reserve is this many times the longest gap between the job's last decisions:
#: a lagging controller whose next decision also fails (Redis restarting, EC2 erroring, the
#: process restarted) decides two gaps later, and the budget still holds.
LAG_FACTOR = 2.0
#: The gaps kept (one long gap weighs on this many decisions).
LAG_WINDOW = 10


@dataclass
class DecisionLag:
    """How late decisions came: the last one, and the gaps between the last `LAG_WINDOW`."""

    decided_at: float | None = None
    gaps_s: deque[float] = field(default_factory=lambda: deque(maxlen=LAG_WINDOW))

    def reserve_s(self, now_s: float) -> float:
        """The budget's reserve past the next decision that the lag calls for: `LAG_FACTOR`
        times the longest recent gap (the one ending now too)."""
        gaps = list(self.gaps_s)
        if self.decided_at is not None:
            gaps.append(now_s - self.decided_at)
        return LAG_FACTOR * max(gaps, default=0.0)

    def decided(self, now_s: float) -> None:
        """A decision was made at `now_s`."""
        if self.decided_at is not None:
            self.gaps_s.append(max(now_s - self.decided_at, 0.0))
        self.decided_at = now_s


@dataclass
class ControllerJob:
    """One job's typed submission and BidBrain state (see the module docstring)."""

    job_id: str
    submission: JobSubmission
    renewals: RenewalSchedule
    prices_seen: dict[str, float] = field(default_factory=dict)
    # market -> when it last evicted one of the job's instances; None: not read yet
    _evictions: dict[Market, float] | None = None
    lag: DecisionLag = field(default_factory=DecisionLag)  # of the job's decisions here
    watch: JobWatch = field(default_factory=JobWatch)  # its progress and nodes, as seen
    rates: JobRates = field(default_factory=JobRates)  # its learned rates' bookkeeping

    @classmethod
    def of(
        cls, record: JobRecord, settings: BidBrainSettings, decided_at: Sequence[float] = ()
    ) -> ControllerJob:
        """The job of a store record (its spec validated, once), with the times of its last
        decisions (`last_decisions`: a restarted controller knows how late they came)."""
        job = cls(
            record.job_id,
            JobSubmission.model_validate(record.spec, context=STORED),
            RenewalSchedule(settings),
        )
        for at_s in sorted(decided_at):
            job.decided(at_s)  # the deque keeps the last LAG_WINDOW gaps
        job.lag.decided_at = None  # the time the controller was down is not a decision's lag
        return job

    def evicted_at(self, instances: Callable[[], Sequence[InstanceRecord]]) -> dict[Market, float]:
        """When each market last took one of the job's instances back: from the store's
        records the first time (`instances()`: so a restarted controller knows too), then
        kept by `note_eviction` (the job's whole instance history is read once)."""
        if self._evictions is None:
            self._evictions = last_evictions(instances())
        return self._evictions

    def note_eviction(self, ended: InstanceRecord) -> None:
        """An instance of the job was taken back (kept only once `evicted_at` read them)."""
        if self._evictions is not None:
            _note(self._evictions, ended)

    def forget_evictions(self) -> None:
        """Read them from the store again next time (an eviction may have gone unseen)."""
        self._evictions = None

    def lag_reserve_s(self, now_s: float) -> float:
        """The budget's reserve the job's own decisions' lag calls for (`DecisionLag`)."""
        return self.lag.reserve_s(now_s)

    def decided(self, now_s: float) -> None:
        """The job was decided for at `now_s`."""
        self.lag.decided(now_s)

    def prices_changed(self, seen: dict[str, float]) -> bool:
        """Whether the decision saw other prices than the last one recorded (kept if so)."""
        if seen == self.prices_seen:
            return False
        self.prices_seen = seen
        return True


def last_decisions(store: Store, job_id: str) -> list[float]:
    """When the job's last decisions were made (its decision events), oldest first."""
    times = [e.at_s for _, e in store.events(job_id) if isinstance(e, DecisionEvent)]
    return times[-(LAG_WINDOW + 1) :]


def last_evictions(instances: Sequence[InstanceRecord]) -> dict[Market, float]:
    """When each market last took one of these instances back."""
    last: dict[Market, float] = {}
    for rec in instances:
        _note(last, rec)
    return last


def _note(last: dict[Market, float], rec: InstanceRecord) -> None:
    if rec.end_reason == EndReason.EVICTED and rec.ended_at is not None:
        market = Market(rec.instance_type, rec.zone)
        last[market] = max(last.get(market, rec.ended_at), rec.ended_at)
