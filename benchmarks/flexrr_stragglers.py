"""FlexRR under injected stragglers (issue #5): time per iteration of BSP, SSP, BSP+RR, FlexRR
and Ideal, for the Slow Worker pattern (delay 0-400 %) and the Power-Law pattern (alpha 4, 7, 11).
Prints one JSON object; progress goes to stderr.

Every worker is a `python -m orchestrator.agileml.node` process on 127.0.0.1 (8 by default, all
reliable nodes: stage 1, every node a ParamServ). Each row's work is emulated by a sleep of
`--row-ms` (times the pattern's slowdown) plus the real forward/backward of a small MLR model,
so the work is dominated by injected time and 2 cores suffice.

* modes: `bsp` (slack 0), `ssp` (slack 1, as in the thesis), `bsp_rr` (slack 0 with
  RapidReassignment) and `flexrr` (slack 1 with RapidReassignment); the same pattern seed for
  every mode.
* time per iteration: (completion of the last clock - completion of the warm-up clock) /
  measured clocks, where a clock is complete when the last worker pushed it.
* `ideal`: every worker busy all the time with no overhead, for the stragglers the FlexRR run
  met: its busy seconds (compute and emulated work, own rows and help) summed over workers,
  divided by workers x iterations. Slow periods are drawn in wall time, so each run meets its
  own; the FlexRR run's work is the least of the modes' (help runs at the helper's speed).
  `ideal_by_mode` gives the same figure for every mode's run.
* `reassigned_fraction`: of all rows, the share whose update a helper computed (FlexRR mode).

    python -m benchmarks.flexrr_stragglers [--workers 8 --iterations 24 --row-ms 5]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from orchestrator.agileml.control import ModelSpec, TrainingSpec
from orchestrator.agileml.elasticity import NodeTier
from orchestrator.agileml.local import LocalJob, NodeOutcome
from orchestrator.lifecycle import exit_on_signals
from orchestrator.straggler.patterns import InjectedWork, NoStragglers, PowerLaw, SlowWorker
from orchestrator.straggler.spec import StragglerSpec

MODES = {  # name -> (slack, flexrr)
    "bsp": (0, False),
    "ssp": (1, False),
    "bsp_rr": (0, True),
    "flexrr": (1, True),
}
TARGETS = {"flexrr_over_ideal_max": 1.15, "bsp_over_flexrr_at_200": 1.5}
SLOW_WORKER_DELAYS = (0, 100, 200, 400)
POWER_LAW_ALPHAS = (4, 7, 11)
WARMUP_CLOCKS = 2
# The thesis slows each of 128 worker threads with 1% chance at each of 10 points per
# iteration, so nearly every iteration has a slowed worker somewhere. With 8 workers the same
# 1% leaves most iterations clean; 5% restores the thesis's regime (a slowed worker in ~98% of
# iterations: 1 - (1 - (1 - 0.95**10))**8).
SLOW_PROBABILITY = 0.05
TIMEOUT_S = 600.0


def progress(message: str) -> None:
    print(f"[flexrr-bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def seconds_per_iteration(outcomes: dict[str, NodeOutcome], first: int) -> float:
    """Mean seconds per clock from the completion of clock `first` to that of the last."""
    ends: dict[int, float] = {}
    for outcome in outcomes.values():
        for clock, t in outcome.ends:
            ends[clock] = max(ends.get(clock, 0.0), t)
    last = max(ends)
    return (ends[last] - ends[first]) / (last - first)


def run_mode(args: argparse.Namespace, pattern: Any, mode: str, job_id: str) -> dict[str, float]:
    """One job under `pattern` in `mode`; returns its time per iteration, busy seconds per
    worker-iteration and reassigned fraction."""
    slack, flexrr = MODES[mode]
    spec = TrainingSpec(
        job_id=job_id,
        model=ModelSpec(kind="mlr", features=16, classes=4),
        samples=8192,
        global_batch=args.workers * args.rows,
        lr=0.05,
        slack=slack,
        iterations=args.iterations,
        num_partitions=args.workers,
        min_nodes=args.workers,
        straggler=StragglerSpec(
            flexrr=flexrr,
            injected=InjectedWork(pattern=pattern, row_ms=args.row_ms, seed=args.seed),
        ),
    )
    with LocalJob(spec) as job:
        for i in range(args.workers):
            job.add_node(f"w{i:02d}", NodeTier.RELIABLE)
        _, outcomes = job.finish(TIMEOUT_S)
        bad = {n: o.ended for n, o in outcomes.items() if o.ended != "done"}
        if bad:  # raised inside the block: ORCHESTRATOR_KEEP_LOGS=1 keeps (and names) the logs
            raise RuntimeError(f"{job_id}: nodes did not finish: {bad}")
    measured = args.iterations - 1 - WARMUP_CLOCKS
    busy = sum(o.straggler.get("busy_s", 0.0) for o in outcomes.values())
    rows = sum(o.straggler.get("own_rows", 0.0) for o in outcomes.values())
    helped = sum(o.straggler.get("rows_helped_by_others", 0.0) for o in outcomes.values())
    return {
        "s_per_iteration": seconds_per_iteration(outcomes, WARMUP_CLOCKS),
        "busy_per_iteration": busy / (args.workers * args.iterations),
        "reassigned_fraction": helped / rows if rows else 0.0,
        "measured_clocks": float(measured),
    }


def run_pattern(args: argparse.Namespace, pattern: Any, label: str) -> dict[str, Any]:
    """Every mode under one pattern: seconds per iteration by mode, plus `ideal`."""
    out: dict[str, float] = {}
    ideal: dict[str, float] = {}
    reassigned = 0.0
    for mode in MODES:
        r = run_mode(args, pattern, mode, f"flexrr-{label}-{mode}".replace(".", "-"))
        out[mode] = round(r["s_per_iteration"], 4)
        ideal[mode] = round(r["busy_per_iteration"], 4)
        if mode == "flexrr":
            reassigned = r["reassigned_fraction"]
        progress(f"{label} {mode}: {r['s_per_iteration']:.3f} s/iteration")
    out["ideal"] = ideal["flexrr"]
    return {"times": out, "ideal_by_mode": ideal, "reassigned_fraction": round(reassigned, 4)}


def main() -> None:
    exit_on_signals()  # a SIGTERM unwinds: temporary folders and child processes go
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=24)
    parser.add_argument("--rows", type=int, default=100, help="rows per worker per iteration")
    parser.add_argument("--row-ms", type=float, default=5.0, help="emulated work per row")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--probability",
        type=float,
        default=SLOW_PROBABILITY,
        help="Slow Worker: chance per delay point (the thesis: 0.01 with 128 workers)",
    )
    parser.add_argument("--delays", type=int, nargs="*", default=list(SLOW_WORKER_DELAYS))
    parser.add_argument("--alphas", type=float, nargs="*", default=list(POWER_LAW_ALPHAS))
    args = parser.parse_args()
    started = time.monotonic()
    result: dict[str, Any] = {
        "workers": args.workers,
        "iterations": args.iterations,
        "nominal_iteration_s": args.rows * args.row_ms / 1000,
        "slow_worker_probability": args.probability,
        "slow_worker": {},
        "power_law": {},
        "reassigned_fraction": {"slow_worker": {}, "power_law": {}},
        "ideal_by_mode": {"slow_worker": {}, "power_law": {}},
    }
    for delay in args.delays:
        pattern: Any = NoStragglers()
        if delay > 0:
            pattern = SlowWorker(delay_percent=delay, probability=args.probability)
        r = run_pattern(args, pattern, f"slow{delay}")
        result["slow_worker"][str(delay)] = r["times"]
        result["ideal_by_mode"]["slow_worker"][str(delay)] = r["ideal_by_mode"]
        result["reassigned_fraction"]["slow_worker"][str(delay)] = r["reassigned_fraction"]
    for alpha in args.alphas:
        r = run_pattern(args, PowerLaw(alpha=alpha), f"power{alpha:g}")
        result["power_law"][f"{alpha:g}"] = r["times"]
        result["ideal_by_mode"]["power_law"][f"{alpha:g}"] = r["ideal_by_mode"]
        result["reassigned_fraction"]["power_law"][f"{alpha:g}"] = r["reassigned_fraction"]
    ratios = [t["flexrr"] / t["ideal"] for t in result["slow_worker"].values()]
    result["flexrr_over_ideal_max"] = round(max(ratios), 3) if ratios else None
    power = [t["flexrr"] / t["ideal"] for t in result["power_law"].values()]
    result["flexrr_over_ideal_max_power_law"] = round(max(power), 3) if power else None
    at200 = result["slow_worker"].get("200")
    result["bsp_over_flexrr_at_200"] = round(at200["bsp"] / at200["flexrr"], 3) if at200 else None
    result["targets"] = TARGETS
    result["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
