"""What BidBrain reasons about: the job's application parameters, allocations and footprints.

Specs (`AppParams`, `JobSpec`, `AllocationRequest`) are validated immutable models; live state
(`HeldAllocation`, `Footprint`) is what the controller or the simulator holds right now.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from orchestrator.market.prices import Market

#: Default value of an hour of the job's time, as a fraction of what its max throughput costs
#: per hour on-demand. Measured on the 2020 traces: 0 lets BidBrain leave evicted nodes
#: unreplaced in a job's last hours (runtime 1.28x on-demand for 0.1% less cost); 2% brings
#: the runtime to ~1.03x at no measurable cost.
DEFAULT_TIME_VALUE_FRACTION = 0.02


#: The most an overhead of `AppParams` may be: a day.
MAX_OVERHEAD_S = 86_400.0


class AppParams(BaseModel):
    """The application characteristics of Table 4.2 (seed 002 §4.3.1).

    The paper set them by hand; the runtime will measure them from telemetry (later issues) and
    these are the fallbacks. Defaults:

    * `phi` 1.0: first-order scalability coefficient; constant, so it scales W but never changes
      which allocation wins.
    * `add_overhead_s` (σ) 240 s: a new spot node is billed but not yet productive while EC2
      fulfils and boots it (~2-3 min) and AgileML hands it its data assignment (~1 min, §4.2.3:
      new nodes load data in the background, others do not slow down).
    * `eviction_overhead_s` (λ) 30 s: cluster-wide progress lost per eviction with warning;
      AgileML hands state to survivors inside the 2-minute notice (§4.5.5 reports a blip of
      one iteration).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    # strict: numbers, never `true`; the overheads at most a day (no node boots for longer)
    phi: Annotated[float, Field(gt=0, le=1, strict=True)] = 1.0
    add_overhead_s: Annotated[float, Field(ge=0, le=MAX_OVERHEAD_S, strict=True)] = 240.0
    eviction_overhead_s: Annotated[float, Field(ge=0, le=MAX_OVERHEAD_S, strict=True)] = 30.0


class JobSpec(BaseModel):
    """A training job as BidBrain sees it: how much work, how fast at most, within what budget.

    Work is measured in reference-GPU-hours (one V100 for an hour = 1.0 at ν = 1).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = "job"
    work_gpu_hours: Annotated[float, Field(gt=0)]
    max_work_rate: Annotated[float, Field(gt=0)] = Field(
        description="upper bound on Σ k·ν held at once (reference GPUs' worth of throughput)"
    )
    budget_usd: Annotated[float, Field(gt=0)] | None = None
    reliable_type: str = "m5.xlarge"
    reliable_count: Annotated[int, Field(ge=0)] = 1
    time_value_usd_per_hour: Annotated[float, Field(ge=0)] | None = Field(
        None,
        description="what finishing an hour sooner is worth; BidBrain adds it to the cost rate "
        "of every footprint so that it keeps refilling near the end of a job. None: 2% of what "
        "the job's max throughput costs per hour on-demand (DEFAULT_TIME_VALUE_FRACTION)",
    )
    app: AppParams = AppParams()
    gpu_work_rates: dict[str, float] | None = None
    deadline_s: float | None = Field(
        None,
        description="when the work must be done (epoch seconds); BidBrain keeps a safety net "
        "of on-demand GPUs for when the slack left runs out",
    )

    @model_validator(mode="after")
    def _finite(self) -> JobSpec:
        if not math.isfinite(self.work_gpu_hours):
            raise ValueError("work_gpu_hours must be finite")
        if self.deadline_s is not None and not math.isfinite(self.deadline_s):
            raise ValueError("deadline_s must be finite")
        return self


class AllocationRequest(BaseModel):
    """Ask the cloud for `count` instances of one market at one max price.

    `max_price_usd_per_hour` None means on-demand (reliable); for spot it is the bid.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    instance_type: str
    zone: str
    count: Annotated[int, Field(gt=0)]
    max_price_usd_per_hour: Annotated[float, Field(gt=0.001)] | None = None
    reliable: bool = False
    expected_cost_per_work: float | None = None

    @property
    def market(self) -> Market:
        return Market(self.instance_type, self.zone)


@dataclass
class HeldAllocation:
    """An allocation the job holds now: instances of one market bought at one time and bid."""

    allocation_id: str
    market: Market
    count: int
    work_rate_per_instance: float
    price_usd_per_hour: float
    started_s: float
    max_price_usd_per_hour: float | None = None
    reliable: bool = False
    ready: bool = True

    @property
    def bid_delta_usd(self) -> float:
        if self.max_price_usd_per_hour is None:
            return math.inf
        return self.max_price_usd_per_hour - self.price_usd_per_hour


@dataclass
class Footprint:
    """The set of allocations a job holds (reliable ones included)."""

    allocations: list[HeldAllocation] = field(default_factory=list)

    @property
    def spot(self) -> list[HeldAllocation]:
        return [a for a in self.allocations if not a.reliable]

    @property
    def work_rate(self) -> float:
        return sum(a.count * a.work_rate_per_instance for a in self.allocations)

    @property
    def cost_rate_usd_per_hour(self) -> float:
        return sum(a.count * a.price_usd_per_hour for a in self.allocations)
