"""Run many strategies from many random start times over price history and summarise them
(the Proteus evaluation method, seed 002 §4.5.2: 1000 random start points)."""

from __future__ import annotations

import difflib
import json
import math
import multiprocessing as mp
import os
import signal
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from orchestrator.bidbrain.baselines import (
    CheapestFailoverPolicy,
    OnDemandPolicy,
    UniformProgressPolicy,
)
from orchestrator.bidbrain.errors import DeadlineError
from orchestrator.bidbrain.model import AppParams, JobSpec
from orchestrator.bidbrain.policy import BidBrainSettings
from orchestrator.market.billing import billing_model
from orchestrator.market.catalog import Catalog, InstanceType
from orchestrator.market.errors import UnknownInstanceTypeError
from orchestrator.market.eviction import AvailabilityTrace
from orchestrator.market.prices import to_datetime
from orchestrator.market.trace_source import TracePriceSource, bundled_prices_dir
from orchestrator.sim.engine import Run, RuntimeParams
from orchestrator.sim.results import RunResult
from orchestrator.sim.strategies import Strategy, get_strategies, run_oracle
from orchestrator.sim.world import World
from orchestrator.units import MAX_WORK_RATE, SECONDS_PER_HOUR

DEFAULT_STRATEGIES = (
    "on-demand",
    "standard-checkpoint",
    "standard-agileml",
    "cheapest-failover",
    "bidbrain",
    "oracle",
)


#: A GPU model's work rate (reference GPUs per GPU).
WorkRate = Annotated[float, Field(gt=0, le=MAX_WORK_RATE, allow_inf_nan=False)]


class SimConfig(BaseModel):
    """One `orchestrator simulate` invocation (every number finite)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    prices: tuple[Path, ...]
    availability: Path | None = None
    strategies: Annotated[tuple[str, ...], Field(min_length=1)] = DEFAULT_STRATEGIES
    job_hours: Annotated[float, Field(gt=0, le=24 * 14)] = 20.0
    nodes: Annotated[int, Field(gt=0, le=4096)] = 16
    starts: Annotated[int, Field(gt=0, le=100_000)] = 1000
    seed: Annotated[int, Field(ge=0)] = 1  # numpy's generators take no negative seed
    billing: str = "per-second"
    reference_type: str = "p3.2xlarge"
    max_scale: Annotated[float, Field(ge=1.0, le=16.0)] = 1.0
    budget_usd: Annotated[float, Field(gt=0)] | None = None
    deadline_hours: Annotated[float, Field(gt=0, le=24 * 14 * 10)] | None = Field(
        None, description="each job's deadline, hours after its start"
    )
    reliable_type: str = "m5.xlarge"
    reliable_count: Annotated[int, Field(ge=0, le=64)] = 1  # as a submitted job's
    time_value_usd_per_hour: Annotated[float, Field(ge=0)] | None = None
    app: AppParams = AppParams()
    runtime: RuntimeParams = RuntimeParams()
    bidbrain: BidBrainSettings = BidBrainSettings()
    workers: Annotated[int, Field(ge=1, le=64)] | None = None
    gpu_work_rates: dict[str, WorkRate] | None = Field(
        None, description="work rate per GPU model, merged over the catalog's (V100 = 1.0)"
    )
    true_work_rates: dict[str, WorkRate] | None = Field(
        None,
        description="the job's real rate per GPU model where it differs from the stated ones "
        "(gpu_work_rates, else the catalog's): instances work at these; strategies that learn "
        "rates find them out, the others decide on the stated ones",
    )

    @field_validator("reference_type")
    @classmethod
    def _reference_gpu_type(cls, value: str) -> str:
        if not _catalog_type(value).is_gpu:
            raise ValueError(f"{value} has no GPU; the job's work is measured in GPUs of a type")
        return value

    @field_validator("reliable_type")
    @classmethod
    def _reliable_type(cls, value: str) -> str:
        _catalog_type(value)
        return value

    @field_validator("gpu_work_rates", "true_work_rates")
    @classmethod
    def _known_gpu_models(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        known = Catalog.load().gpu_work_rates
        for model in value or {}:
            if model not in known:
                close = difflib.get_close_matches(model, known, n=1)
                hint = f"did you mean {close[0]}? " if close else ""
                raise ValueError(
                    f"{model} is no GPU model of the catalog; {hint}known: {', '.join(known)}"
                )
        return value


def _catalog_type(name: str) -> InstanceType:
    """The catalog's entry, or a ValueError with its message (and the known types when it
    suggests none), so that the error names the setting or option, not only the type."""
    catalog = Catalog.load()
    try:
        return catalog.get(name)
    except UnknownInstanceTypeError as exc:
        known = "" if "Did you mean" in exc.message else f" Known: {', '.join(catalog.names())}"
        raise ValueError(exc.message + known) from None


def sim_config(settings: Mapping[str, Any]) -> SimConfig:
    """The config of a run from a file's settings with the command line's over them (the
    bundled us-east-1 prices when none are given); strategy and billing names checked.

    Raises:
        pydantic.ValidationError: a setting is invalid (the caller names its option).
        UserError: an unknown strategy or billing model (listing the valid ones).
    """
    # model_validate, not SimConfig(**...): a config file's key may be no string (`1: 2`)
    config = SimConfig.model_validate({"prices": (bundled_prices_dir("us-east-1"),), **settings})
    billing_model(config.billing)
    get_strategies(list(config.strategies))
    if "uniform-progress" in config.strategies and config.deadline_hours is None:
        raise DeadlineError(
            "the uniform-progress strategy needs a deadline",
            fix="pass --deadline-hours (e.g. 26 for a 20-hour job)",
            field="--deadline-hours",
        )
    return config


@dataclass
class StrategySummary:
    """Aggregates of one strategy over all starts (see `summarise`)."""

    cost_vs_ondemand: float
    runtime_vs_ondemand: float
    free_compute_fraction: float
    evictions_mean: float
    cost_usd_mean: float
    cost_usd_total: float
    cost_usd_p50: float
    cost_usd_p95: float
    completed_fraction: float
    decisions_mean: float
    deadline_met_fraction: float = math.nan  # NaN (null in JSON): no deadline

    def as_dict(self) -> dict[str, float | None]:
        return {k: _round(v) for k, v in self.__dict__.items()}


@dataclass
class SimReport:
    config: SimConfig
    ondemand_cost_usd: float
    strategies: dict[str, StrategySummary]
    paired_wins: dict[str, float] = field(default_factory=dict)
    per_start_cost_per_work: dict[str, list[float]] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "starts": self.config.starts,
            "billing": self.config.billing,
            "job_hours": self.config.job_hours,
            "nodes": self.config.nodes,
            "reference_type": self.config.reference_type,
            "ondemand_cost_usd": _round(self.ondemand_cost_usd),
            "strategies": {k: v.as_dict() for k, v in self.strategies.items()},
            "bidbrain_cheaper_paired": {k: _round(v) for k, v in self.paired_wins.items()},
        }


def _round(v: float) -> float | None:
    """Six decimals; None (JSON null) for a figure with no value, such as the cost per work of
    runs that did no work (NaN and Infinity are not JSON)."""
    return round(v, 6) if math.isfinite(v) else None


# -- world loading ------------------------------------------------------------------------


def load_world(config: SimConfig, catalog: Catalog | None = None) -> World:
    """Read the traces and the catalog. Raises UserError on bad input (file named)."""
    catalog = catalog or Catalog.load()
    source = TracePriceSource(config.prices)
    history = source.all()
    trace = (
        AvailabilityTrace.read(config.availability)
        if config.availability is not None
        else AvailabilityTrace.bundled()
    )
    ref = catalog.get(config.reference_type)
    ref_markets = [m for m in history if m.instance_type == ref.name]
    if not ref_markets:
        from orchestrator.errors import UserError

        raise UserError(
            f"the price data holds no {ref.name} market",
            fix="pass --reference-type with a type present in the price files, "
            f"e.g. one of {history.instance_types()}",
            field="--reference-type",
        )
    return World.build(
        history,
        catalog,
        trace,
        primary_region=ref_markets[0].region,
        gpu_work_rates=work_rates(config, catalog),
    )


def work_rates(config: SimConfig, catalog: Catalog) -> dict[str, float] | None:
    """The catalog's work rates with the config's overrides, or None for the catalog's own."""
    if not config.gpu_work_rates:
        return None
    return {**catalog.gpu_work_rates, **config.gpu_work_rates}


def true_rates(config: SimConfig, catalog: Catalog) -> dict[str, float] | None:
    """The job's real rates (the stated ones with `true_work_rates` over them), or None when
    they are the stated ones."""
    if not config.true_work_rates:
        return None
    return {**(work_rates(config, catalog) or catalog.gpu_work_rates), **config.true_work_rates}


def job_for(config: SimConfig, world: World) -> JobSpec:
    rates = work_rates(config, world.catalog)
    rate = world.catalog.work_rate(config.reference_type, rates)
    return JobSpec(
        name="sim",
        work_gpu_hours=config.nodes * rate * config.job_hours,
        max_work_rate=config.nodes * rate * config.max_scale,
        budget_usd=config.budget_usd,
        reliable_type=config.reliable_type,
        reliable_count=config.reliable_count,
        time_value_usd_per_hour=config.time_value_usd_per_hour,
        app=config.app,
        gpu_work_rates=rates,
    )


def start_times(config: SimConfig, world: World) -> np.ndarray:
    first, last = world.start_range(config.job_hours)
    rng = np.random.default_rng(config.seed)
    return (
        np.sort(rng.uniform(first, last, size=config.starts))
        if config.starts > 1
        else np.array([rng.uniform(first, last)])
    )


# -- one start, every strategy -------------------------------------------------------------

_WORLD: World | None = None
_CONFIG: SimConfig | None = None


def run_start(
    world: World,
    config: SimConfig,
    strategies: Sequence[Strategy],
    index: int,
    start_s: float,
    keep_ledger: bool,
) -> dict[str, RunResult]:
    """Every strategy from the same start time, over the same replayed capacity evictions."""
    job = job_for(config, world)
    if config.deadline_hours is not None:
        job = job.model_copy(
            update={"deadline_s": start_s + config.deadline_hours * SECONDS_PER_HOUR}
        )
    billing = billing_model(config.billing)
    horizon = config.runtime.max_runtime_factor * config.job_hours * SECONDS_PER_HOUR + 3600.0
    removals = world.removal_events(world.table.markets, start_s, horizon, (config.seed, index))
    truth = true_rates(config, world.catalog)
    results: dict[str, RunResult] = {}
    for k, strat in enumerate(strategies):
        if strat.policy is None:
            results[strat.name] = run_oracle(world, job, start_s, keep_ledger, truth)
            continue
        kwargs = dict(strat.policy_kwargs)
        if strat.policy in (OnDemandPolicy, CheapestFailoverPolicy, UniformProgressPolicy):
            kwargs["reference_type"] = config.reference_type
        if strat.policy is UniformProgressPolicy:  # its changeover delay d
            kwargs["changeover_s"] = config.runtime.boot_s + config.runtime.restart_s
            kwargs["spot_retry_s"] = config.runtime.capacity_cooldown_s
        table, strat_job = world.table, job
        if strat.knows_true_rates and truth is not None:
            table = table.with_work_rates(world.catalog, truth)
            strat_job = job.model_copy(update={"gpu_work_rates": truth})
        policy = strat.policy(
            table,
            billing=config.billing,
            price_model=world.price_model_at(start_s),
            capacity_model=world.capacity_model(),
            settings=config.bidbrain,
            catalog=world.catalog,
            rng=np.random.default_rng([config.seed, index, 100 + k]),
            **kwargs,
        )
        run = Run(
            world,
            policy=policy,
            runtime=strat.runtime,
            billing=billing,
            job=strat_job,
            start_s=start_s,
            params=config.runtime,
            removal_events=removals,
            keep_ledger=keep_ledger,
            periodic_decisions=strat.periodic_decisions,
            acts_on_notice=strat.acts_on_notice,
            true_work_rates=truth,
            learns_rates=strat.learns_rates,
        )
        results[strat.name] = run.run()
    return results


def _worker(args: tuple[int, float, bool]) -> tuple[int, dict[str, RunResult]]:
    assert _WORLD is not None and _CONFIG is not None
    index, start_s, keep_ledger = args
    strategies = get_strategies(list(_CONFIG.strategies))
    return index, run_start(_WORLD, _CONFIG, strategies, index, start_s, keep_ledger)


def iter_results(
    config: SimConfig, world: World, *, keep_ledger: bool = False
) -> Iterator[tuple[int, dict[str, RunResult]]]:
    """Yield (start index, results by strategy) as they finish, in parallel over the cores."""
    global _WORLD, _CONFIG
    starts = start_times(config, world)
    get_strategies(list(config.strategies))  # fail fast on a bad name
    tasks = [(i, float(t), keep_ledger) for i, t in enumerate(starts)]
    workers = config.workers or min(os.cpu_count() or 1, 8)
    _WORLD, _CONFIG = world, config
    for t in sorted({s for s in starts}):  # fit the price models once, before forking
        world.price_model_at(float(t))
    if workers <= 1 or len(tasks) < 4:
        for task in tasks:
            yield _worker(task)
        return
    ctx = mp.get_context("fork")
    with ctx.Pool(workers, initializer=_default_signals) as pool:
        yield from pool.imap_unordered(
            _worker, tasks, chunksize=max(1, len(tasks) // (workers * 8))
        )
        # done: the workers leave by themselves (`terminate`, what leaving the block does,
        # once left a worker blocked on the task queue's lock and the run hung at its end)
        pool.close()
        pool.join()


def _default_signals() -> None:
    """A pool worker dies at SIGTERM as Python's default has it: the console script's
    handler (`lifecycle.exit_on_signals`, inherited through fork) would have it unwind
    instead, which `Pool.terminate` does not wait for."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


# -- summary ------------------------------------------------------------------------------


def simulate(
    config: SimConfig,
    *,
    world: World | None = None,
    ledger_out: IO[str] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> SimReport:
    """Run every strategy from `config.starts` start times; write the ledger if asked."""
    world = world or load_world(config)
    job = job_for(config, world)
    ref = world.catalog.get(config.reference_type)
    od_cost = config.nodes * ref.on_demand_price(world.primary_region) * config.job_hours
    od_cost_per_work = od_cost / job.work_gpu_hours
    names = list(config.strategies)
    per_work: dict[str, list[float]] = {n: [math.nan] * config.starts for n in names}
    results: dict[str, list[RunResult]] = {n: [] for n in names}
    results_iter = iter_results(config, world, keep_ledger=ledger_out is not None)
    for done, (index, by_strategy) in enumerate(results_iter, start=1):
        for name, r in by_strategy.items():
            results[name].append(r)
            per_work[name][index] = (
                r.cost_usd / r.work_done_gpu_hours if r.work_done_gpu_hours > 0 else math.inf
            )
            if ledger_out is not None:
                _write_ledger(ledger_out, name, index, r)
        if on_progress:
            on_progress(done, config.starts)
    summaries = {
        n: summarise(
            results[n], per_work[n], od_cost_per_work, config.job_hours, job.work_gpu_hours
        )
        for n in names
    }
    wins = {}
    if "bidbrain" in per_work:
        bb = np.array(per_work["bidbrain"])
        for n in names:
            if n != "bidbrain":
                wins[n] = float(np.mean(bb < np.array(per_work[n])))
    return SimReport(config, od_cost, summaries, wins, per_work)


def summarise(
    runs: list[RunResult],
    cost_per_work: list[float],
    od_cost_per_work: float,
    job_hours: float,
    work_gpu_hours: float,
) -> StrategySummary:
    """cost_vs_ondemand is the mean over starts of cost per unit of work relative to on-demand
    (for a job that finished, its cost over the on-demand job's cost). A run that hit the
    runtime cap is charged per unit of the work it did; `completed_fraction` says how many did.
    Costs in USD are per whole job (extrapolated per unit of work for a run that gave up).
    free_compute_fraction is the share of the compute held (instance time × work rate) that was
    not billed: under hourly-refund, the partial hours that evictions made free."""
    cpw = np.array(cost_per_work, dtype=np.float64)
    job_cost = cpw * work_gpu_hours
    compute = sum(r.compute_s for r in runs)
    return StrategySummary(
        cost_vs_ondemand=float(np.mean(cpw / od_cost_per_work)),
        runtime_vs_ondemand=float(
            np.mean([r.runtime_s / SECONDS_PER_HOUR / job_hours for r in runs])
        ),
        free_compute_fraction=sum(r.free_compute_s for r in runs) / compute if compute else 0.0,
        evictions_mean=float(np.mean([r.evictions for r in runs])),
        cost_usd_mean=float(np.mean(job_cost)),
        cost_usd_total=float(sum(r.cost_usd for r in runs)),
        cost_usd_p50=float(np.percentile(job_cost, 50)),
        cost_usd_p95=float(np.percentile(job_cost, 95)),
        completed_fraction=float(np.mean([r.completed for r in runs])),
        decisions_mean=float(np.mean([r.decisions for r in runs])),
        deadline_met_fraction=float(np.mean([bool(r.deadline_met) for r in runs]))
        if runs and runs[0].deadline_met is not None
        else math.nan,
    )


def _iso(t: float) -> str:
    return to_datetime(t).isoformat().replace("+00:00", "Z")


def _write_ledger(out: IO[str], strategy: str, index: int, r: RunResult) -> None:
    for line in r.ledger:
        out.write(
            json.dumps(
                {
                    "strategy": strategy,
                    "start_index": index,
                    "instance_id": f"{strategy}/{index}/{line.instance_id}",
                    "instance_type": line.instance_type,
                    "zone": line.zone,
                    "market": line.market,
                    "count": line.count,
                    "start": _iso(line.start_s),
                    "end": _iso(line.end_s),
                    "start_s": line.start_s,
                    "end_s": line.end_s,
                    "price_usd_per_hour": line.price_usd_per_hour,
                    "billed_s": line.billed_s,
                    "charged_usd": line.charged_usd,
                    "reason": line.reason,
                }
            )
            + "\n"
        )
