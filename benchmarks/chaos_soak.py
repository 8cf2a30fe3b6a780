"""The chaos soak (issue #19): the offline world and the AgileML runtime through a seeded
random stream of faults, with the invariants checked. Prints one JSON object; progress on
stderr.

Two parts, run one after the other (2 cores cannot run both without starving one):

- the control plane (`benchmarks.chaos.world`): controller processes under the fleet's lease,
  a persistent redis-server and a moto EC2 server with several budgeted jobs; controller
  deaths inside EC2 calls, Redis SIGKILLs mid-tick, EC2 errors (capacity, throttling, 5xx),
  evictions whose notice comes on time, twice, late or never, clock jumps, instance agents
  SIGKILLed while their instances stay up, a second controller beside the leader (and one of
  another id), a controller restarted with a rewound clock, and decisions lagging up to an
  hour apart. Checks: no orphan instance, every instance billed exactly once over its life
  (and none unrecorded), no job over budget, every job ended (succeeded, or with its
  reason), no tick stuck, no instance paid for past its graces without a live agent, no EC2
  mutation by a process without the lease, no other id admitted, takeovers within the
  lease's time to live, no clock run back, no job's spend going down;
- the runtime (`benchmarks.chaos.runtime`): AgileML jobs of real node processes on the
  additive probe; SIGKILLs of workers, ActivePSs and the reliable node (BackupPS), notices on
  time, twice, or cut short by the kill. Checks: the final parameters bit for bit those of
  every clock applied once (lost or doubled updates counted), aborts with their reason, no
  job stuck (a watchdog).

    python -m benchmarks.chaos_soak [--faults 1000] [--runtime-faults 100] [--seed 1]
    python -m benchmarks.chaos_soak --short    # the slow suite's: 60 + 6 faults, about a minute

Recovery: seconds (wall) from a fault to the next good controller tick (control plane) or
the next completed clock (runtime), per kind and over all.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

from benchmarks.chaos.faults import FaultLog, percentile
from benchmarks.chaos.runtime import RuntimeOptions, run_runtime
from benchmarks.chaos.world import WorldOptions, run_world
from orchestrator.lifecycle import exit_on_signals


def progress(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def soak(
    faults: int, runtime_faults: int, seed: int, max_wall_s: float, jobs: int = 4
) -> dict[str, Any]:
    """Both parts; `faults` in all, `runtime_faults` of them in the runtime part."""
    progress(f"control plane: {faults - runtime_faults} faults, {jobs} jobs at a time")
    world_log = FaultLog()
    world = run_world(WorldOptions(faults=faults - runtime_faults, jobs=jobs, seed=seed,
                                   max_wall_s=max_wall_s), log=world_log)  # fmt: skip
    progress(f"control plane done in {world['wall_s']} s; runtime: {runtime_faults} faults")
    runtime_log = FaultLog()
    runtime = run_runtime(
        RuntimeOptions(faults=runtime_faults, seed=seed, max_wall_s=max_wall_s), runtime_log
    )
    progress(f"runtime done in {runtime['wall_s']} s")
    log = FaultLog()
    log.merge(world_log)
    log.merge(runtime_log)
    every = [s for values in log.recovery_s.values() for s in values]
    return {
        "faults": log.total,
        "by_kind": dict(sorted(log.by_kind.items())),
        "lost_updates": runtime["lost_updates"],
        "double_applied": runtime["double_applied"],
        "orphans": world["orphans"],
        "over_budget_usd": world["over_budget_usd"],
        "unbilled_or_double_billed": world["unbilled_or_double_billed"],
        "hung": world["hung"] + runtime["hung"],
        "ended_without_reason": world["no_reason"] + runtime["no_reason"],
        "unexpected_aborts": runtime["unexpected_aborts"],
        "paid_without_agent": world["paid_without_agent"],
        "acted_without_lease": world["acted_without_lease"],
        "other_id_admitted": world["other_id_admitted"],
        "slow_takeovers": world["slow_takeovers"],
        "no_leader": world["no_leader"],
        "clock_ran_back": world["clock_ran_back"],
        "spend_went_down": world["spend_went_down"],
        "takeover_s": world["takeover_s"],
        "recovery_s_p50": percentile(every, 50),
        "recovery_s_p99": percentile(every, 99),
        "recovery_s_by_kind": {
            kind: {"n": len(v), "p50": percentile(v, 50), "p99": percentile(v, 99)}
            for kind, v in sorted(log.recovery_s.items())
        },
        "control_plane": world,
        "runtime": runtime,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=1000, help="faults in all")
    parser.add_argument("--runtime-faults", type=int, default=100, help="of them, in the runtime")
    parser.add_argument("--jobs", type=int, default=4, help="control-plane jobs at a time")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-wall-s", type=float, default=1800.0, help="per part")
    parser.add_argument("--short", action="store_true", help="the slow suite's: 60 + 6 faults")
    args = parser.parse_args(argv)
    if args.short:
        args.faults, args.runtime_faults, args.jobs = 66, 6, 3
    if not 0 <= args.runtime_faults <= args.faults:
        parser.error("--runtime-faults must be between 0 and --faults")
    exit_on_signals()
    logging.basicConfig(level=logging.CRITICAL)  # the faults' own error logs are expected
    result = soak(args.faults, args.runtime_faults, args.seed, args.max_wall_s, args.jobs)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
