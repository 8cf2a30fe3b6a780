"""The budget under lag (issue #32): how far a job's spend goes past its budget when the
controller's decisions come late.

A $10 job with more work than its budget buys (200 GPU-hours on p3 types, us-east-1's replayed
2020 prices) is decided for every GAP simulated seconds (the decision interval is 120 s; a
lagging controller ticks later) until it ends; the memory store and cloud, no evictions. Prints
per gap the job's end state and its spend over the budget (%). Issue #32's target: 3,600 s gaps
stay within budget.

    python -m benchmarks.budget_lag [--gaps 120,900,1200,1800,3600] [--budget 10]
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from orchestrator.cloud.memory import InMemoryCloud, InMemoryEC2
from orchestrator.controller.wiring import build_controller
from orchestrator.jobspec import JobSubmission
from orchestrator.market.prices import to_epoch_seconds
from orchestrator.market.trace_source import TracePriceSource, bundled_prices_dir
from orchestrator.settings import Settings
from orchestrator.store import JobRecord, MemoryStore

T0 = to_epoch_seconds("2020-02-03T00:00:00Z")
MAX_HOURS = 72.0


def run(gap_s: float, budget_usd: float) -> dict[str, Any]:
    """One job decided for every `gap_s` until it ends (or `MAX_HOURS`)."""
    now = [T0]
    store = MemoryStore()
    cloud = InMemoryCloud("us-east-1", "lag", ec2=InMemoryEC2(clock=lambda: now[0]))
    prices = TracePriceSource([bundled_prices_dir("us-east-1")])
    ctl = build_controller(Settings(), store=store, cloud=cloud, prices=prices)
    sub = JobSubmission(name="lag", budget_usd=budget_usd, work_gpu_hours=200.0, max_gpus=8.0,
                        instance_types=("p3.2xlarge", "p3.8xlarge"))  # fmt: skip
    store.create_job(JobRecord.submit("job-1", sub.model_dump(mode="json"), budget_usd, T0))
    while now[0] < T0 + MAX_HOURS * 3600.0:
        ctl.tick(now[0])
        if store.get_job("job-1").state.is_terminal:
            break
        now[0] += gap_s
    job = store.get_job("job-1")
    spent = ctl.spend_usd("job-1", now[0])  # billed, and accrued on any still running
    return {
        "gap_s": gap_s,
        "state": str(job.state),
        "hours": round((now[0] - T0) / 3600.0, 2),
        "spent_usd": round(spent, 4),
        "over_budget_pct": round(100.0 * max(spent - budget_usd, 0.0) / budget_usd, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gaps", default="120,900,1200,1800,3600")
    parser.add_argument("--budget", type=float, default=10.0)
    args = parser.parse_args(argv)
    runs = [run(float(g), args.budget) for g in args.gaps.split(",")]
    json.dump({"budget_usd": args.budget, "runs": runs}, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
