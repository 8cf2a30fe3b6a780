"""The strategies the simulator compares: a policy (who buys what) plus a runtime (how the job
survives evictions). Registered by name; an unknown name lists the valid ones."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from orchestrator.bidbrain.baselines import (
    CheapestFailoverPolicy,
    OnDemandPolicy,
    StandardPolicy,
    UniformProgressPolicy,
)
from orchestrator.bidbrain.errors import UnknownPolicyError
from orchestrator.bidbrain.model import JobSpec
from orchestrator.bidbrain.policy import BidBrainPolicy, Policy
from orchestrator.market.billing import EndReason
from orchestrator.sim.results import LedgerLine, RunResult
from orchestrator.sim.world import World
from orchestrator.units import SECONDS_PER_HOUR


@dataclass(frozen=True)
class Strategy:
    """A named pairing of an acquisition policy and a runtime."""

    name: str
    policy: type[Policy] | None  # None: computed in closed form (the oracle)
    runtime: str
    policy_kwargs: tuple[tuple[str, Any], ...] = ()
    periodic_decisions: bool = False
    acts_on_notice: bool = False
    learns_rates: bool = False  # decides with the work rates its instances measured
    knows_true_rates: bool = False  # told the job's true rates at the start (a reference)
    description: str = ""


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy(
            "on-demand",
            OnDemandPolicy,
            "on-demand",
            description="the reference GPUs on-demand for the whole job",
        ),
        Strategy(
            "standard-checkpoint",
            StandardPolicy,
            "checkpoint",
            (("with_reliable_tier", False),),
            description="cheapest spot market per work, bid on-demand, checkpoint/restart",
        ),
        Strategy(
            "standard-agileml",
            StandardPolicy,
            "agileml",
            description="the same bidding with the AgileML elastic runtime",
        ),
        Strategy(
            "cheapest-failover",
            CheapestFailoverPolicy,
            "gang-checkpoint",
            description="SkyPilot managed jobs: cheapest zone, relaunch on preemption",
        ),
        Strategy(
            "uniform-progress",
            UniformProgressPolicy,
            "gang-notice-checkpoint",
            periodic_decisions=True,
            description="Can't Be Late (NSDI'24): Uniform Progress to a deadline, one zone",
        ),
        Strategy(
            "bidbrain",
            BidBrainPolicy,
            "agileml",
            periodic_decisions=True,
            acts_on_notice=True,
            learns_rates=True,
            description="Proteus: BidBrain cost-per-work bidding with AgileML, on learned rates",
        ),
        Strategy(
            "bidbrain-static",
            BidBrainPolicy,
            "agileml",
            periodic_decisions=True,
            acts_on_notice=True,
            description="BidBrain on the job's stated (catalog) rates, never learning",
        ),
        Strategy(
            "bidbrain-true-rates",
            BidBrainPolicy,
            "agileml",
            periodic_decisions=True,
            acts_on_notice=True,
            knows_true_rates=True,
            description="hindsight reference: BidBrain told the job's true rates at the start",
        ),
        Strategy(
            "oracle",
            None,
            "oracle",
            description="hindsight lower bound: cheapest market every instant, no overheads",
        ),
    )
}


def get_strategies(names: list[str]) -> list[Strategy]:
    """Raises UnknownPolicyError for a name that is not registered (listing the valid ones)."""
    out = []
    for n in names:
        if n not in STRATEGIES:
            import difflib

            close = difflib.get_close_matches(n, STRATEGIES, n=1)
            hint = f"Did you mean {close[0]!r}? " if close else ""
            raise UnknownPolicyError(
                f"unknown strategy {n!r}",
                fix=f"{hint}valid strategies: {', '.join(STRATEGIES)}",
                field="--strategy",
            )
        out.append(STRATEGIES[n])
    return out


def run_oracle(
    world: World,
    job: JobSpec,
    start_s: float,
    keep_ledger: bool,
    true_work_rates: Mapping[str, float] | None = None,
) -> RunResult:
    """Perfect hindsight: at every instant hold `max_work_rate` of the market that is cheapest
    per unit of work (at the job's true rates), with no start-up, eviction or reliable-tier
    cost.

    Per-second billing at the market price; under hourly-refund it is the same integral (it does
    not chase refunds), so it bounds BidBrain there only approximately.
    """
    table = world.table
    if true_work_rates is not None:
        table = table.with_work_rates(world.catalog, true_work_rates)
    series = [world.history[m] for m in table.markets]
    gpu = table.work_rate > 0
    times = np.unique(np.concatenate([s.times_s for s in series]))
    t = start_s
    work_left_s = job.work_gpu_hours * SECONDS_PER_HOUR
    rate = job.max_work_rate
    cost = 0.0
    ledger: list[LedgerLine] = []
    i = int(np.searchsorted(times, t, side="right"))
    while work_left_s > 1e-9:
        prices = np.array([s.price_at(t) or math.nan for s in series])
        per_work = np.where(
            gpu & np.isfinite(prices), prices / np.where(gpu, table.work_rate, 1), np.inf
        )
        best = int(np.argmin(per_work))
        nxt = float(times[i]) if i < len(times) else math.inf
        finish = t + work_left_s / rate
        end = min(nxt, finish)
        hours = (end - t) / SECONDS_PER_HOUR
        count = rate / table.work_rate[best]
        charged = float(prices[best]) * count * hours
        cost += charged
        if keep_ledger:
            m = table.markets[best]
            ledger.append(
                LedgerLine(
                    "oracle",
                    m.instance_type,
                    m.zone,
                    t,
                    end,
                    float(prices[best]),
                    end - t,
                    charged,
                    str(EndReason.PRICE_CHANGE if end < finish else EndReason.JOB_FINISHED),
                    "oracle",
                    count,
                )
            )
        # done at `finish`: subtracting the work of (end - t) instead would leave a residue
        # (t is ~1.6e9 s, so end - t is off by up to 1e-7 s) that a next `finish` rounding to
        # `t` could never use up
        work_left_s = 0.0 if end >= finish else work_left_s - rate * (end - t)
        t = end
        i += 1
    compute_s = (t - start_s) * rate
    met = None if job.deadline_s is None else t <= job.deadline_s + 1e-6
    return RunResult(
        start_s, True, t - start_s, cost, job.work_gpu_hours, 0, compute_s, 0.0, 0, ledger, met
    )
