"""Time one BidBrain decision over every candidate (market × bid option × count).

Prints one JSON object: candidates per decision and the median / p95 decision time in ms, for
the bundled us-east-1 markets and for us-east-1 + us-west-2 together.

    python benchmarks/bidbrain_decision.py [--repeats 300]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from orchestrator.bidbrain.model import Footprint, HeldAllocation, JobSpec
from orchestrator.bidbrain.policy import BidBrainPolicy, DecisionInput, MarketTable
from orchestrator.market.catalog import Catalog
from orchestrator.market.eviction import AvailabilityTrace, CapacityHazardModel
from orchestrator.market.prices import Market
from orchestrator.market.trace_source import TracePriceSource, bundled_prices_dir
from orchestrator.sim.world import World


def measure(regions: list[str], repeats: int) -> dict:
    history = TracePriceSource([bundled_prices_dir(r) for r in regions]).all()
    catalog = Catalog.load()
    trace = AvailabilityTrace.bundled()
    world = World.build(history, catalog, trace, primary_region=regions[0])
    table: MarketTable = world.table
    now = history.start_s + 30 * 86400
    policy = BidBrainPolicy(
        table,
        billing="per-second",
        price_model=world.price_model_at(now),
        capacity_model=CapacityHazardModel.from_trace(trace),
    )
    job = JobSpec(work_gpu_hours=320, max_work_rate=16)
    rng = np.random.default_rng(1)
    times_ms = []
    settings = policy.settings
    # market × bid option (the delta grid and the on-demand cap) × count (ladder and "fill")
    candidates = len(table) * (len(settings.bid_deltas_usd) + 1) * (len(settings.counts) + 1)
    for k in range(repeats):
        t = now + k * 600.0
        prices = np.array([history[m].price_at(t) or np.nan for m in table.markets])
        # footprints from empty to nearly full, some allocations at their renewal point
        allocs = [
            HeldAllocation(
                "r", Market("m5.xlarge", table.markets[0].zone), 1, 0.0, 0.192, now, reliable=True
            )
        ]
        for j in range(int(rng.integers(0, 3))):
            i = int(rng.integers(0, len(table)))
            m = table.markets[i]
            if np.isfinite(prices[i]) and table.work_rate[i] > 0:
                allocs.append(
                    HeldAllocation(
                        f"s{j}",
                        m,
                        1,
                        float(table.work_rate[i]),
                        float(prices[i]),
                        now,
                        float(table.on_demand_usd_per_hour[i]),
                    )
                )
        inp = DecisionInput(
            now_s=t,
            job=job,
            work_remaining_gpu_hours=320 - k * 0.5,
            spend_usd=0.0,
            footprint=Footprint(allocs),
            prices_usd_per_hour=prices,
            renewal_due=frozenset(a.allocation_id for a in allocs[1:] if k % 2),
        )
        start = time.perf_counter()
        policy.decide(inp)
        times_ms.append((time.perf_counter() - start) * 1000.0)
    times_ms.sort()
    return {
        "regions": regions,
        "markets": len(table),
        "candidates_per_decision": candidates,
        "decision_ms_median": round(statistics.median(times_ms), 3),
        "decision_ms_p95": round(times_ms[int(0.95 * len(times_ms)) - 1], 3),
        "repeats": repeats,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    result = {
        "us-east-1": measure(["us-east-1"], args.repeats),
        "us-east-1+us-west-2": measure(["us-east-1", "us-west-2"], args.repeats),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
