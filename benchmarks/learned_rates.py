"""Learned work rates (issue #20): what a wrong prior costs and how much learning recovers.

For each case GPU_MODEL=FACTOR (the job's true rate on that GPU model is FACTOR times the
catalog's), runs `orchestrator simulate --true-work-rates` on 20 h jobs of 16 GPUs, per-second
billing, 300 starts (seed 1), each region's bundled 2020 prices and the p3 capacity trace, with
three BidBrains: `bidbrain-static` (decides on the catalog's rates: the wrong prior),
`bidbrain` (learns the rates from its instances' work) and `bidbrain-true-rates` (told the true
rates at the start), and the oracle. The gap recovered is
(static - learned) / (static - true rates), in cost against on-demand; null when the wrong
prior costs nothing (the model is not one BidBrain would use either way).

    python -m benchmarks.learned_rates [--starts 300] [--cases V100=0.5,...] [--regions R1,R2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from benchmarks.sim_runs import simulate_json
from orchestrator.lifecycle import exit_on_signals
from orchestrator.market.catalog import Catalog

STRATEGIES = "bidbrain-static,bidbrain,bidbrain-true-rates,oracle"
DEFAULT_CASES = "V100=0.5,V100=1.5,K80=0.5,K80=1.5"
#: A wrong prior that costs less than this (in cost against on-demand) is no gap to recover.
MIN_GAP = 1e-3


def simulate(region: str, starts: int, true_rates: str, seed: int) -> dict[str, Any]:
    """One `orchestrator simulate --json` run; its report."""
    options = ["--nodes", "16", "--true-work-rates", true_rates]
    return simulate_json(region, strategies=STRATEGIES, starts=starts, seed=seed, options=options)


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """Cost against on-demand per strategy, and the share of the wrong prior's gap recovered."""
    s = report["strategies"]
    cost = {name: v["cost_vs_ondemand"] for name, v in s.items()}
    gap = cost["bidbrain-static"] - cost["bidbrain-true-rates"]
    recovered = None
    if gap > MIN_GAP:
        recovered = round((cost["bidbrain-static"] - cost["bidbrain"]) / gap, 4)
    return {
        "cost_vs_ondemand": cost,
        "runtime_vs_ondemand": {name: v["runtime_vs_ondemand"] for name, v in s.items()},
        "completed_fraction": {name: v["completed_fraction"] for name, v in s.items()},
        "wrong_prior_gap": round(gap, 6),
        "gap_recovered": recovered,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=300)
    parser.add_argument("--cases", default=DEFAULT_CASES, help="GPU_MODEL=FACTOR,...")
    parser.add_argument("--regions", default="us-east-1,us-west-2")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    exit_on_signals()
    catalog = Catalog.load()
    out: dict[str, Any] = {"starts": args.starts, "job_hours": 20, "nodes": 16, "cases": {}}
    for case in args.cases.split(","):
        model, factor = case.split("=")
        true_rate = round(catalog.gpu_work_rates[model] * float(factor), 6)
        name = f"{model} at {factor}x the catalog ({true_rate})"
        for region in args.regions.split(","):
            started = time.perf_counter()
            report = simulate(region, args.starts, f"{model}={true_rate}", args.seed)
            out["cases"].setdefault(name, {})[region] = {
                **summary(report),
                "wall_s": round(time.perf_counter() - started, 1),
            }
            print(f"[learned_rates] {name}, {region} done", file=sys.stderr, flush=True)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
