"""What a simulated run reports: its result and, when kept, its ledger lines (`sim.engine`
makes them; the runner, the report and the dashboard read them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LedgerLine:
    """One billed instance interval (`count` instances, 1 except for the oracle)."""

    instance_id: str
    instance_type: str
    zone: str
    start_s: float
    end_s: float
    price_usd_per_hour: float
    billed_s: float
    charged_usd: float
    reason: str
    market: str  # "spot" or "on-demand"
    count: float = 1.0


@dataclass
class RunResult:
    """What one run cost and did."""

    start_s: float
    completed: bool
    runtime_s: float
    cost_usd: float
    work_done_gpu_hours: float
    evictions: int
    compute_s: float  # reference-GPU-seconds of instances held
    free_compute_s: float  # of those, the ones that were not billed
    decisions: int
    ledger: list[LedgerLine] = field(default_factory=list)
    deadline_met: bool | None = None  # None: the job had no deadline
