"""Deadlines (issue #20): BidBrain with its safety net against Can't Be Late's Uniform Progress.

Runs `orchestrator simulate` with on-demand, uniform-progress, bidbrain and the oracle on 20 h
jobs, per-second billing, 300 starts (seed 1), on each region's bundled 2020 prices and the p3
capacity trace, for each case NODES:DEADLINE_HOURS (default: 16 GPUs with a 26 h deadline, as
the issue asks; 1 GPU, the single-instance setting of the paper; 16 GPUs with a tight 21 h
deadline, where BidBrain's safety net must act). Prints one JSON object: per case, region and
strategy, the fraction of deadlines met, the cost against on-demand and against the oracle.

    python -m benchmarks.deadlines [--starts 300] [--cases 16:26,1:26,16:21] [--regions R1,R2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from benchmarks.sim_runs import simulate_json
from orchestrator.lifecycle import exit_on_signals

STRATEGIES = "on-demand,uniform-progress,bidbrain,oracle"


def simulate(
    region: str, starts: int, nodes: int, deadline_hours: float, seed: int
) -> dict[str, Any]:
    """One `orchestrator simulate --json` run; its report."""
    options = ["--nodes", str(nodes), "--deadline-hours", str(deadline_hours)]
    return simulate_json(region, strategies=STRATEGIES, starts=starts, seed=seed, options=options)


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """Per strategy: deadlines met, cost vs on-demand and vs the oracle, runtime."""
    s = report["strategies"]
    oracle = s["oracle"]["cost_vs_ondemand"]
    return {
        name: {
            "deadline_met_fraction": v["deadline_met_fraction"],
            "cost_vs_ondemand": v["cost_vs_ondemand"],
            "cost_vs_oracle": round(v["cost_vs_ondemand"] / oracle, 4) if oracle else None,
            "runtime_vs_ondemand": v["runtime_vs_ondemand"],
            "cost_usd_p95": v["cost_usd_p95"],
        }
        for name, v in s.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=300)
    parser.add_argument("--cases", default="16:26,1:26,16:21", help="NODES:DEADLINE_HOURS,...")
    parser.add_argument("--regions", default="us-east-1,us-west-2")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    exit_on_signals()
    out: dict[str, Any] = {"starts": args.starts, "job_hours": 20, "cases": {}}
    for case in args.cases.split(","):
        nodes, deadline = case.split(":")
        for region in args.regions.split(","):
            started = time.perf_counter()
            report = simulate(region, args.starts, int(nodes), float(deadline), args.seed)
            name = f"{nodes} GPUs, deadline {deadline} h"
            out["cases"].setdefault(name, {})[region] = {
                **summary(report),
                "wall_s": round(time.perf_counter() - started, 1),
            }
            print(f"[deadlines] {name}, {region} done", file=sys.stderr, flush=True)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
