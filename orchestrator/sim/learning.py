"""Work rates learned during a simulated run: each GPU instance's work is measured and folded
into the job's `RateBelief` (`bidbrain.rates`), and the policy decides with the result.

A simulated instance's measurement is exact (its true rate times the hours it worked since the
last one; the simulator has no stragglers or noisy neighbours), from σ after its launch until
the decision, or until it ends.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from orchestrator.bidbrain.rates import MIN_OBSERVATION_HOURS, WorkMeasurement, learned_belief
from orchestrator.market.catalog import Catalog
from orchestrator.market.prices import Market
from orchestrator.units import SECONDS_PER_HOUR


class Measured(Protocol):
    """An instance as the learner measures it (`SimInstance` has these)."""

    @property
    def instance_id(self) -> str: ...
    @property
    def market(self) -> Market: ...
    @property
    def work_rate(self) -> float: ...  # its true rate (reference GPUs)
    @property
    def ready_s(self) -> float: ...


class RateLearner:
    """One run's belief about its job's rates, from the rates the job states (or the
    catalog's) as prior."""

    def __init__(self, catalog: Catalog, stated_rates: Mapping[str, float] | None) -> None:
        self.catalog = catalog
        self.belief = learned_belief(catalog, stated_rates, ())
        self._measured_until: dict[str, float] = {}

    def measure(self, inst: Measured, until_s: float) -> None:
        """Fold in the work `inst` did since it was last measured (nothing before it was
        ready; a CPU instance measures nothing)."""
        since = max(inst.ready_s, self._measured_until.get(inst.instance_id, inst.ready_s))
        hours = (until_s - since) / SECONDS_PER_HOUR
        if hours < MIN_OBSERVATION_HOURS:  # too short to count: measured with the next one
            return
        self._measured_until[inst.instance_id] = until_s
        self.belief = self.belief.measured(
            self.catalog, WorkMeasurement(inst.market.instance_type, hours, inst.work_rate * hours)
        )

    def forget(self, instance_id: str) -> None:
        """An instance that ended is measured no more."""
        self._measured_until.pop(instance_id, None)

    def rates(self) -> dict[str, float]:
        """The per-GPU-model rates to decide with now."""
        return self.belief.rates()
