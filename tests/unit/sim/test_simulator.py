"""The cost simulator in-process: determinism, on-demand exactness, ledger = report = recomputed
bill, completion, billing-model effects, budgets, and common random numbers for evictions."""

from __future__ import annotations

import io
import json
import math
from collections import defaultdict

import numpy as np
import pytest

from orchestrator.market.trace_source import bundled_prices_dir
from orchestrator.sim.ledger import verify_ledger
from orchestrator.sim.runner import (
    DEFAULT_STRATEGIES,
    SimConfig,
    load_world,
    run_start,
    simulate,
    start_times,
)
from orchestrator.sim.strategies import get_strategies
from orchestrator.sim.world import World

BILLINGS = ("per-second", "hourly-refund")


def config(**overrides) -> SimConfig:
    """A small job: 4 h × 8 p3.2xlarge of work, 5 starts, serial."""
    base = dict(
        prices=(bundled_prices_dir("us-east-1"),),
        job_hours=4.0,
        nodes=8,
        starts=5,
        seed=3,
        workers=1,
    )
    base.update(overrides)
    return SimConfig(**base)


@pytest.fixture(scope="module")
def world() -> World:
    return load_world(config())


def ledger_totals(text: str) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if line.strip():
            row = json.loads(line)
            totals[row["strategy"]] += row["charged_usd"]
    return dict(totals)


# -- determinism --------------------------------------------------------------------------


def test_same_seed_gives_identical_report(world):
    cfg = config(starts=3, seed=7)
    first = json.dumps(simulate(cfg, world=world).as_dict(), sort_keys=True)
    second = json.dumps(simulate(cfg, world=load_world(cfg)).as_dict(), sort_keys=True)
    assert first == second


def test_different_seed_gives_a_different_report(world):
    a = simulate(config(starts=3, seed=7), world=world).as_dict()
    b = simulate(config(starts=3, seed=8), world=world).as_dict()
    assert a["strategies"] != b["strategies"]


def test_start_times_are_fixed_by_the_seed(world):
    cfg = config(starts=4, seed=11)
    np.testing.assert_array_equal(start_times(cfg, world), start_times(cfg, world))
    assert not np.array_equal(start_times(cfg, world), start_times(config(starts=4), world))


def test_parallel_workers_give_the_same_report_as_serial(world):
    serial = simulate(config(starts=4, workers=1), world=world).as_dict()
    parallel = simulate(config(starts=4, workers=2), world=world).as_dict()
    assert parallel == serial


# -- on-demand reference ------------------------------------------------------------------


def test_on_demand_costs_nodes_times_price_times_hours_with_runtime_ratio_one(world):
    cfg = config(strategies=("on-demand",))
    price = world.catalog.get("p3.2xlarge").on_demand_price("us-east-1")
    expected = cfg.nodes * price * cfg.job_hours
    strategies = get_strategies(["on-demand"])
    for i, t in enumerate(start_times(cfg, world)):
        run = run_start(world, cfg, strategies, i, float(t), keep_ledger=False)["on-demand"]
        assert run.completed
        assert run.cost_usd == pytest.approx(expected, rel=1e-12, abs=0)
        assert run.runtime_s == pytest.approx(cfg.job_hours * 3600.0, rel=1e-12, abs=0)
        assert run.evictions == 0
    report = simulate(cfg, world=world)
    summary = report.strategies["on-demand"]
    assert report.ondemand_cost_usd == pytest.approx(expected, rel=1e-12, abs=0)
    assert summary.cost_vs_ondemand == pytest.approx(1.0, rel=1e-12, abs=0)
    assert summary.runtime_vs_ondemand == pytest.approx(1.0, rel=1e-12, abs=0)
    assert summary.cost_usd_total == pytest.approx(expected * cfg.starts, rel=1e-12, abs=0)
    assert summary.cost_usd_p50 == pytest.approx(expected, rel=1e-12, abs=0)
    assert summary.cost_usd_p95 == pytest.approx(expected, rel=1e-12, abs=0)


# -- ledger -------------------------------------------------------------------------------


@pytest.mark.parametrize("billing", BILLINGS)
def test_ledger_sums_to_the_report_and_verify_ledger_recomputes_it(world, tmp_path, billing):
    cfg = config(billing=billing)
    buf = io.StringIO()
    report = simulate(cfg, world=world, ledger_out=buf)
    totals = ledger_totals(buf.getvalue())
    assert set(totals) == set(cfg.strategies)
    for name, summary in report.strategies.items():
        assert summary.cost_usd_total > 0, name
        assert totals[name] == pytest.approx(summary.cost_usd_total, rel=1e-6), name

    path = tmp_path / "ledger.jsonl"
    path.write_text(buf.getvalue())
    check = verify_ledger(path, world.history, billing=billing, report=report.as_dict())
    assert check.lines == len(buf.getvalue().splitlines())
    assert check.price_mismatches == 0
    assert set(check.recomputed_usd) == set(cfg.strategies)
    assert set(check.reported_usd) == set(cfg.strategies)
    assert check.max_relative_error < 1e-6, check.render()


def test_ledger_lines_lie_within_their_run_and_have_nonnegative_charges(world):
    buf = io.StringIO()
    simulate(config(starts=2), world=world, ledger_out=buf)
    for line in buf.getvalue().splitlines():
        row = json.loads(line)
        assert row["end_s"] >= row["start_s"], row
        assert row["charged_usd"] >= 0, row
        assert row["billed_s"] >= 0, row
        assert row["count"] > 0, row


# -- completion and billing effects --------------------------------------------------------


@pytest.mark.parametrize("billing", BILLINGS)
def test_every_strategy_finishes_every_run_of_a_4h_8_node_job(world, billing):
    report = simulate(config(billing=billing), world=world)
    assert tuple(report.strategies) == DEFAULT_STRATEGIES
    for name, summary in report.strategies.items():
        assert summary.completed_fraction == 1.0, name
        assert math.isfinite(summary.cost_vs_ondemand), name


def test_no_run_finishes_faster_than_the_jobs_max_throughput_allows(world):
    """With --max-scale 1 the job's work rate is capped at --nodes reference GPUs
    (JobSpec.max_work_rate), so no strategy can beat on-demand's runtime."""
    cfg = config()
    strategies = get_strategies(list(cfg.strategies))
    nominal_s = cfg.job_hours * 3600.0
    too_fast = []
    for i, t in enumerate(start_times(cfg, world)):
        for name, run in run_start(world, cfg, strategies, i, float(t), False).items():
            if run.completed and run.runtime_s < nominal_s * (1 - 1e-9):
                too_fast.append((name, i, round(run.runtime_s / nominal_s, 3)))
    assert not too_fast, f"(strategy, start, runtime / nominal) faster than possible: {too_fast}"


def test_hourly_refund_gives_bidbrain_free_compute_and_on_demand_none(world):
    report = simulate(config(billing="hourly-refund"), world=world)
    assert report.strategies["bidbrain"].free_compute_fraction > 0
    assert report.strategies["on-demand"].free_compute_fraction == 0
    assert report.strategies["oracle"].free_compute_fraction == 0


def test_per_second_billing_gives_no_free_compute_to_any_strategy(world):
    report = simulate(config(billing="per-second"), world=world)
    for name, summary in report.strategies.items():
        assert summary.free_compute_fraction == 0, name


def test_oracle_is_no_dearer_than_bidbrain_under_per_second_billing(world):
    report = simulate(config(), world=world)
    assert (
        report.strategies["oracle"].cost_vs_ondemand
        <= report.strategies["bidbrain"].cost_vs_ondemand
    )


# -- budget -------------------------------------------------------------------------------

#: The 4 h × 8-GPU job costs about $30 on spot; $20 cannot finish it.
SMALL_BUDGET_USD = 20.0


def test_small_budget_stops_bidbrain_before_the_job_is_done(world):
    cfg = config(strategies=("bidbrain",), budget_usd=SMALL_BUDGET_USD)
    report = simulate(cfg, world=world)
    assert report.strategies["bidbrain"].completed_fraction < 1.0


def test_small_budget_bounds_bidbrain_average_spend(world):
    cfg = config(strategies=("bidbrain",), budget_usd=SMALL_BUDGET_USD)
    summary = simulate(cfg, world=world).strategies["bidbrain"]
    mean_spend = summary.cost_usd_total / cfg.starts
    assert mean_spend <= SMALL_BUDGET_USD * 1.05, (
        f"bidbrain spent ${mean_spend:.2f} per run on a ${SMALL_BUDGET_USD:.0f} budget"
    )


def test_small_budget_bounds_bidbrain_spend_in_every_run(world):
    """Each run may overshoot by at most one decision interval of its footprint (< 5% here)."""
    cfg = config(strategies=("bidbrain",), budget_usd=SMALL_BUDGET_USD)
    strategies = get_strategies(["bidbrain"])
    costs = [
        run_start(world, cfg, strategies, i, float(t), keep_ledger=False)["bidbrain"].cost_usd
        for i, t in enumerate(start_times(cfg, world))
    ]
    over = [round(c, 2) for c in costs if c > SMALL_BUDGET_USD * 1.05]
    assert not over, f"runs spent {over} on a ${SMALL_BUDGET_USD} budget"


# -- common random numbers ----------------------------------------------------------------


def test_removal_events_are_identical_for_the_same_seed(world):
    cfg = config()
    start = float(start_times(cfg, world)[0])
    markets = world.table.markets
    a = world.removal_events(markets, start, 10 * 3600.0, seed=(1, 0))
    b = world.removal_events(markets, start, 10 * 3600.0, seed=(1, 0))
    assert list(a) == list(b) == list(markets)
    assert any(len(s.times_s) for s in a.values())
    for m in markets:
        np.testing.assert_array_equal(a[m].times_s, b[m].times_s)
        np.testing.assert_array_equal(a[m].probs, b[m].probs)
        assert a[m].seed == b[m].seed
        assert np.all(np.diff(a[m].times_s) >= 0)
        assert np.all((a[m].times_s >= start) & (a[m].times_s <= start + 10 * 3600.0))


def test_removal_events_differ_for_a_different_seed(world):
    start = float(start_times(config(), world)[0])
    markets = world.table.markets
    a = world.removal_events(markets, start, 10 * 3600.0, seed=(1, 0))
    b = world.removal_events(markets, start, 10 * 3600.0, seed=(1, 1))
    assert any(not np.array_equal(a[m].times_s, b[m].times_s) for m in markets)


def test_eviction_after_is_the_same_for_the_same_slot_and_time(world):
    start = float(start_times(config(), world)[0])
    markets = world.table.markets
    a = world.removal_events(markets, start, 20 * 3600.0, seed=(1, 0))
    b = world.removal_events(markets, start, 20 * 3600.0, seed=(1, 0))
    finite = 0
    for m in markets:
        for slot in range(5):
            for t in (start, start + 1800.0, start + 3 * 3600.0):
                first = a[m].eviction_after(t, slot)
                assert a[m].eviction_after(t, slot) == first  # same stream, called again
                assert b[m].eviction_after(t, slot) == first  # a fresh stream, same seed
                if math.isfinite(first):
                    finite += 1
                    assert first > t
                    assert first in a[m].times_s
    assert finite > 0


def test_eviction_after_respects_the_before_bound(world):
    start = float(start_times(config(), world)[0])
    market = world.table.markets[0]
    stream = world.removal_events([market], start, 20 * 3600.0, seed=(1, 0))[market]
    first = stream.eviction_after(start, 0)
    assert math.isfinite(first)
    assert stream.eviction_after(start, 0, before_s=first) == math.inf
    assert stream.eviction_after(start, 0, before_s=first + 1.0) == first


def test_all_strategies_of_one_start_see_the_same_removal_streams(world, monkeypatch):
    """run_start builds the removal streams once per start and hands them to every run."""
    cfg = config(strategies=("standard-agileml", "bidbrain"))
    seen = []
    real = World.removal_events

    def spy(self, markets, start_s, horizon_s, seed):
        seen.append((start_s, horizon_s, tuple(seed)))
        return real(self, markets, start_s, horizon_s, seed)

    monkeypatch.setattr(World, "removal_events", spy)
    t = float(start_times(cfg, world)[0])
    run_start(world, cfg, get_strategies(list(cfg.strategies)), 0, t, keep_ledger=False)
    assert seen == [(t, seen[0][1], (cfg.seed, 0))]


def test_run_report_follows_the_dashboard_contract_and_matches_the_runs(world, tmp_path):
    """`simulate --plot report.html`: every strategy replayed from the first start is a job of
    the dashboard; spend ends at the run's cost, nodes and evictions come from its ledger."""
    from orchestrator.sim.dashboard import run_dashboards, write_run_report
    from orchestrator.sim.runner import run_start, start_times
    from orchestrator.sim.strategies import get_strategies

    cfg = config(starts=1)
    start_s = float(start_times(cfg, world)[0])
    results = run_start(world, cfg, get_strategies(list(cfg.strategies)), 0, start_s, True)
    data = run_dashboards(results, world, cfg, start_s, budget_usd=100.0)
    assert [j["job_id"] for j in data["fleet"]["jobs"]][0] == "bidbrain"
    assert set(data["jobs"]) == set(results)
    for name, r in results.items():
        page = data["jobs"][name]
        assert set(page) == {"now_s", "job", "spend", "prices", "nodes", "marks", "training",
                             "events"}  # fmt: skip
        assert page["spend"][-1]["spent_usd"] == pytest.approx(r.cost_usd, rel=1e-9, abs=1e-9)
        evicted = [n for n in page["nodes"] if n["end_reason"] == "evicted"]
        assert len(page["marks"]) == len(evicted)
        assert all(n["launched_at"] <= n["ended_at"] for n in page["nodes"])
    held = [p for p in data["job"]["prices"] if p["held"]]
    assert held and all(p["points"] for p in held)
    path = tmp_path / "report.html"
    write_run_report(cfg, world, 100.0, path)
    html = path.read_text()
    assert '<script id="dashboard-data"' in html and 'src="static/' not in html
