"""`ControllerJob`: one job as the controller keeps it between its ticks.

Its submission is typed once (the store keeps the JSON the API validated; a tick used to
validate it again every time), and it owns the job's BidBrain state: the renewal points of its
allocations, the prices its last decision recorded (the dashboard's series grows only when
one changes) and when each market last took one of its instances back. The controller builds
it at the job's first tick after it starts (so a restarted controller rebuilds it from the
store) and drops it when the job ends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from orchestrator.bidbrain.inputs import RenewalSchedule
from orchestrator.bidbrain.policy import BidBrainSettings
from orchestrator.jobspec import JobSubmission
from orchestrator.market.billing import EndReason
from orchestrator.market.prices import Market
from orchestrator.store.models import InstanceRecord, JobRecord


@dataclass
class ControllerJob:
    """One job's typed submission and BidBrain state (see the module docstring)."""

    job_id: str
    submission: JobSubmission
    renewals: RenewalSchedule
    prices_seen: dict[str, float] = field(default_factory=dict)
    # market -> when it last evicted one of the job's instances; None: not read yet
    _evictions: dict[Market, float] | None = None

    @classmethod
    def of(cls, record: JobRecord, settings: BidBrainSettings) -> ControllerJob:
        """The job of a store record (its spec validated, once)."""
        return cls(
            record.job_id, JobSubmission.model_validate(record.spec), RenewalSchedule(settings)
        )

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

    def prices_changed(self, seen: dict[str, float]) -> bool:
        """Whether the decision saw other prices than the last one recorded (kept if so)."""
        if seen == self.prices_seen:
            return False
        self.prices_seen = seen
        return True


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
