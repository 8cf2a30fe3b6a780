"""Deadlines: the safety net of "Can't Be Late" (Wu et al., NSDI'24) over every market.

A job with a deadline has *slack*: the time left to the deadline minus the time its remaining
work takes at the job's max rate. Slack only shrinks while the job runs below that rate
(evictions, start-ups, markets it chose not to buy). When it falls to the *point of no
return* (what on-demand GPUs bought now need before they work: σ, an eviction's stall λ, and
two decision intervals, the one that sees it and the one that acts), BidBrain stops relying
on spot: it buys on-demand GPUs of the type cheapest per work up to the max rate, keeps the
spot nodes it holds until those are ready (they still progress), then releases them. At the
max rate the slack stays where it is, so the safety net holds to the end. The budget still
binds: what the budget cannot carry is not bought (the submission warned of it).

Pure functions of the decision's input; `BidBrainPolicy.decide` calls them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from orchestrator.bidbrain.model import AllocationRequest, Footprint, HeldAllocation, JobSpec
from orchestrator.market.prices import Market
from orchestrator.units import SECONDS_PER_HOUR


def slack_s(job: JobSpec, now_s: float, work_remaining_gpu_hours: float) -> float:
    """Seconds to spare: to the deadline, minus the remaining work at the max rate (inf: no
    deadline)."""
    if job.deadline_s is None:
        return math.inf
    full_rate_s = work_remaining_gpu_hours * SECONDS_PER_HOUR / (job.app.phi * job.max_work_rate)
    return job.deadline_s - now_s - full_rate_s


def no_return_slack_s(job: JobSpec, decision_interval_s: float) -> float:
    """The slack at which on-demand GPUs must be bought (see the module docstring)."""
    return job.app.add_overhead_s + job.app.eviction_overhead_s + 2.0 * decision_interval_s


def is_pressing(
    job: JobSpec, now_s: float, work_remaining_gpu_hours: float, interval_s: float
) -> bool:
    """Whether the job's slack is down to the point of no return."""
    return slack_s(job, now_s, work_remaining_gpu_hours) <= no_return_slack_s(job, interval_s)


def on_demand_gpus(footprint: Footprint) -> list[HeldAllocation]:
    """The on-demand allocations that do work (the reliable tier's CPU nodes do none)."""
    return [a for a in footprint.allocations if a.reliable and a.work_rate_per_instance > 0]


def on_demand_fill(
    job: JobSpec,
    footprint: Footprint,
    markets: tuple[Market, ...],
    work_rate: np.ndarray,
    on_demand_usd_per_hour: np.ndarray,
    usable: np.ndarray,
    affordable_usd_per_hour: float,
) -> AllocationRequest | None:
    """The on-demand GPUs that bring the held on-demand work rate up to the max rate, of the
    usable market cheapest per work, as many as `affordable_usd_per_hour` pays for (None:
    enough are held, or none can be bought)."""
    held = sum(a.count * a.work_rate_per_instance for a in on_demand_gpus(footprint))
    need = job.max_work_rate - held
    ok = usable & (work_rate > 0)
    if need <= 1e-9 or not ok.any():
        return None
    i, count = cheapest_fill(need, work_rate, on_demand_usd_per_hour, ok)
    if math.isfinite(affordable_usd_per_hour):
        count = min(count, math.floor(affordable_usd_per_hour / on_demand_usd_per_hour[i] + 1e-9))
    if count <= 0:
        return None
    m = markets[i]
    return AllocationRequest(instance_type=m.instance_type, zone=m.zone, count=count, reliable=True)


def cheapest_fill(
    need: float, work_rate: np.ndarray, usd_per_hour: np.ndarray, ok: np.ndarray
) -> tuple[int, int]:
    """The market (index) and count of whole instances that give `need` of work rate for the
    fewest dollars per hour (a type cheap per work but too big for the need can lose)."""
    counts = np.ceil(need / np.where(ok, work_rate, 1.0) - 1e-9)
    cost = np.where(ok, counts * usd_per_hour, np.inf)
    i = int(np.argmin(cost))
    return i, int(counts[i])


def spot_to_release(job: JobSpec, footprint: Footprint) -> tuple[str, ...]:
    """The spot allocations to let go: all of them once ready on-demand GPUs give the max
    rate (before that they still progress)."""
    ready = [a for a in on_demand_gpus(footprint) if a.ready]
    if sum(a.count * a.work_rate_per_instance for a in ready) < job.max_work_rate - 1e-9:
        return ()
    return tuple(a.allocation_id for a in footprint.spot)


@dataclass(frozen=True)
class DeadlineQuote:
    """What a deadline asks of a job, at submission: the latest start-up margin it needs, the
    earliest it can finish, and what meeting the deadline costs at most (spot gone for good:
    all the work on the on-demand fleet the safety net would buy, the reliable tier until the
    deadline, and the budget reserve the policy holds back on both)."""

    earliest_finish_s: float
    worst_cost_usd: float
    gpus_needed: float  # reference GPUs that finish the work by the deadline (inf: none can)


def deadline_quote(
    job: JobSpec,
    now_s: float,
    *,
    fleet_usd_per_hour: float,
    reliable_usd_per_hour: float,
    decision_interval_s: float,
    reserve_s: float,
) -> DeadlineQuote:
    """The quote for `job` submitted at `now_s` (its `deadline_s` set). `fleet_usd_per_hour`:
    the on-demand GPUs that give the job's max rate (`cheapest_fill`). The earliest finish
    counts σ, one eviction's stall λ and a first decision up to an interval late."""
    assert job.deadline_s is not None
    phi = job.app.phi
    margin_s = job.app.add_overhead_s + job.app.eviction_overhead_s + decision_interval_s
    hours_at_max = job.work_gpu_hours / (phi * job.max_work_rate)
    earliest = now_s + margin_s + hours_at_max * SECONDS_PER_HOUR
    window_s = job.deadline_s - now_s - margin_s
    needed = job.work_gpu_hours / (phi * window_s / SECONDS_PER_HOUR) if window_s > 0 else math.inf
    to_deadline_h = max(job.deadline_s - now_s, 0.0) / SECONDS_PER_HOUR
    reserve_h = (decision_interval_s + reserve_s) / SECONDS_PER_HOUR
    worst = (
        fleet_usd_per_hour * hours_at_max
        + reliable_usd_per_hour * to_deadline_h
        + (fleet_usd_per_hour + reliable_usd_per_hour) * reserve_h
    )
    return DeadlineQuote(earliest, worst, needed)
