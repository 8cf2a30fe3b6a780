"""The simulator's run report: the dashboard page (the controller's, `orchestrator/dashboard/`)
drawn from simulated runs instead of a live store.

Every strategy is replayed from one start time with its ledger kept; each becomes a "job" of
the page's fleet (its id is the strategy's name), and each job's page shows its spend over time
against the on-demand cost, its nodes by tier with evictions marked, and the spot prices of
the markets the strategies used. Simulated runs have no training loss and no event log, so
those panels stay empty. The JSON follows `dashboard/static/CONTRACT.md`, with every job's page
embedded under `jobs` so the report can switch between strategies offline.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from orchestrator.dashboard.page import dashboard_html
from orchestrator.errors import UserError
from orchestrator.market.prices import Market
from orchestrator.sim.results import LedgerLine, RunResult
from orchestrator.sim.runner import SimConfig, job_for, run_start, start_times
from orchestrator.sim.strategies import get_strategies
from orchestrator.sim.world import World


def write_run_report(config: SimConfig, world: World, ondemand_cost_usd: float, path: Path) -> str:
    """Replay every strategy from the first start time and write the report to `path`;
    returns the start time it shows (ISO 8601).

    Raises:
        UserError: the file cannot be written.
    """
    start_s = float(start_times(config, world)[0])
    strategies = get_strategies(list(config.strategies))
    results = run_start(world, config, strategies, 0, start_s, keep_ledger=True)
    data = run_dashboards(results, world, config, start_s, ondemand_cost_usd)
    page = dashboard_html(data)
    try:
        path.write_text(page)
    except OSError as exc:
        raise UserError(
            f"cannot write the report {path}: {exc.strerror}",
            field="--plot",
            fix="pass a path in a folder you can write to",
        ) from None
    from orchestrator.market.prices import to_datetime

    return to_datetime(start_s).isoformat()


def run_dashboards(
    results: Mapping[str, RunResult],
    world: World,
    config: SimConfig,
    start_s: float,
    budget_usd: float,
) -> dict[str, Any]:
    """`{"fleet", "job", "jobs"}`: one job per strategy (BidBrain's first when it ran); the
    budget line is `budget_usd` (the on-demand cost of the job)."""
    work = job_for(config, world).work_gpu_hours
    end_s = max(start_s + r.runtime_s for r in results.values())
    markets = sorted(
        {(line.instance_type, line.zone) for r in results.values() for line in r.ledger}
    )
    prices = _prices(world, markets, start_s, end_s)
    jobs = {
        name: _job_page(name, r, work, budget_usd, start_s, prices) for name, r in results.items()
    }
    order = sorted(jobs, key=lambda n: (n != "bidbrain", n))
    return {
        "fleet": {"now_s": end_s, "jobs": [jobs[n]["job"] for n in order]},
        "job": jobs[order[0]],
        "jobs": jobs,
    }


def _job_page(
    name: str,
    r: RunResult,
    work: float,
    budget_usd: float,
    start_s: float,
    prices: list[dict[str, Any]],
) -> dict[str, Any]:
    end_s = start_s + r.runtime_s
    lines = sorted(r.ledger, key=lambda line: (line.end_s, line.start_s))
    spend: list[dict[str, float | None]] = [{"t": start_s, "spent_usd": 0.0}]
    spent = 0.0
    for line in lines:
        spent += line.charged_usd * line.count
        spend.append({"t": line.end_s, "spent_usd": spent})
    for point in spend:
        point.update(work_done_gpu_hours=None, projected_cost_usd=None,
                     expected_cost_per_work_usd=None)  # fmt: skip
    nodes = _nodes(lines)
    marks = [
        {"t": n["ended_at"], "kind": "eviction", "instance_id": n["instance_id"],
         "detail": f"{n['instance_type']}@{n['zone']}, simulated"}
        for n in nodes
        if n["end_reason"] == "evicted"
    ]  # fmt: skip
    held = {f"{n['instance_type']}@{n['zone']}" for n in nodes if n["tier"] == "transient"}
    summary = {
        "job_id": name,
        "name": name,
        "state": "succeeded" if r.completed else "failed",
        "budget_usd": budget_usd,
        "spent_usd": r.cost_usd,
        "work_gpu_hours": work,
        "work_done_gpu_hours": r.work_done_gpu_hours,
        "projected_cost_usd": None,
        "projected_finish_at": None,
        "cost_per_work_usd": r.cost_usd / r.work_done_gpu_hours if r.work_done_gpu_hours else None,
        "expected_cost_per_work_usd": None,
        "nodes_alive": {"reliable": 0, "transient": 0},
        "evictions": r.evictions,
        "launch_failures": 0,
        "iterations": None,
        "loss": None,
        "updated_at": end_s,
    }
    return {
        "now_s": end_s,
        "job": summary,
        "spend": spend,
        "prices": [{**p, "held": p["market"] in held} for p in prices],
        "nodes": nodes,
        "marks": sorted(marks, key=lambda m: m["t"]),
        "training": [],
        "events": [],
    }


def _nodes(lines: list[LedgerLine]) -> list[dict[str, Any]]:
    """One node per instance: from its first billed second to its last, ended by the reason
    of its last interval."""
    by_instance: dict[str, list[LedgerLine]] = defaultdict(list)
    for line in lines:
        by_instance[line.instance_id].append(line)
    nodes = []
    for instance_id, own in by_instance.items():
        last = max(own, key=lambda line: line.end_s)
        nodes.append(
            {
                "instance_id": instance_id,
                "instance_type": last.instance_type,
                "zone": last.zone,
                "tier": "reliable" if last.market == "on-demand" else "transient",
                "launched_at": min(line.start_s for line in own),
                "ended_at": last.end_s,
                "end_reason": last.reason,
                "warned": False,
            }
        )
    return sorted(nodes, key=lambda n: (n["launched_at"], n["instance_id"]))


def _prices(
    world: World, markets: list[tuple[str, str]], start_s: float, end_s: float
) -> list[dict[str, Any]]:
    series = []
    for instance_type, zone in markets:
        market = Market(instance_type, zone)
        if market not in set(world.history):
            continue  # an on-demand type with no spot prices
        history = world.history[market]
        first = history.price_at(start_s)
        points = [] if first is None else [[start_s, first]]
        t = history.next_change_after(start_s)
        while t is not None and t <= end_s:
            price = history.price_at(t)
            if price is not None and (not points or points[-1][1] != price):
                points.append([t, price])
            t = history.next_change_after(t)
        series.append({"market": str(market), "held": False, "points": points})
    return series
