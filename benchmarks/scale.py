"""Scale (issue #19 item 3): one controller running many jobs on many instances in the offline
world, with its decision time, tick duration, API latency and Redis memory at each size.
Prints one JSON object on stdout and a table on stderr (with progress).

The world is the demo's (`orchestrator.demo`), minus the training: a real redis-server, a moto
EC2 server on loopback (every EC2 call of the controller is a real boto3 call over HTTP), the
bundled 2020 us-east-1 spot prices replayed from `--start`, and the capacity evictions of the
real p3 trace replayed on the controller's instances (`EvictionReplayer`: notices, then
TerminateInstances), unless `--no-evictions`. The controller is built as `controller start`
builds it (`build_controller`) and ticked on a simulated clock that moves one decision interval
(2 min) per tick. Instances run no process: each GPU instance adds its catalog work rate to its
job once it has been up σ (what the offline fleet's agents report, simulated), and each running
job posts a synthetic training report per tick (so the dashboards and /metrics have a series to
read).

Each job is `--instances-per-job` instances: one reliable on-demand node and `n - 1` one-GPU
spot instances (p3.2xlarge only, `max_gpus = n - 1`, budget and work ample), so 100 jobs hold
1,000 instances. (`--gpu-types` widens the jobs' choice, and BidBrain's decisions with it: more
markets per decision, but then BidBrain picks how many instances make a job's GPUs.) For each
`--jobs` size, in a fresh world:

* fill: ticks until every job holds its instances (the launch storm of a fresh controller);
* `--ticks` measured ticks: tick duration (wall), the part of it spent in EC2 calls (moto
  serves them from a thread of this process, so its own work is in the tick's wall time; on
  AWS it is the API's latency instead), EC2 calls and Redis commands per tick, BidBrain's
  decision time per job (the policy built for the job's markets and `decide`) and the
  controller's whole time per job (decide and act: store reads and writes, launches);
* the API: `--requests` timed GETs (after 2 warm-ups) of each endpoint, served by uvicorn
  (`BackgroundServer`) on 127.0.0.1 with the API token, while nothing else runs;
* Redis: INFO memory `used_memory` and the number of keys.

`scaling` gives, for each figure, log(figure at the largest size / at the smallest) /
log(largest jobs / smallest jobs): about 1 means it grows linearly with the jobs (and the
instances), about 2 quadratically, about 0 not at all. `--profile DIR` writes cProfile files
(and their top functions as text) of the last tick and of each endpoint's work (its handler's
function called in this thread) at the largest size.

    python -m benchmarks.scale [--jobs 10 30 100] [--instances-per-job 10] [--ticks 5]
                               [--requests 50] [--seed 1] [--no-evictions] [--profile DIR]
                               [--gpu-types all | TYPE ...]

The figures are wall times on whatever machine runs this: on a small shared machine they are
noisy (run it twice).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import logging
import math
import pstats
import random
import secrets
import sys
import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import httpx
import redis
from prometheus_client import CollectorRegistry, generate_latest
from pydantic import SecretStr

from orchestrator.api.app import create_app
from orchestrator.api.metrics import StoreCollector
from orchestrator.api.operations import submit_job
from orchestrator.api.serve import BackgroundServer
from orchestrator.api.views import EventTallies, fleet, job_dashboard
from orchestrator.bidbrain.policy import BidBrainPolicy, Decision, DecisionInput, MarketTable
from orchestrator.cloud.local.clock import FakeClock
from orchestrator.cloud.local.evictions import EvictionReplayer
from orchestrator.cloud.local.moto_server import MotoEC2Server
from orchestrator.cloud.local.redis_process import LocalRedis
from orchestrator.controller import core
from orchestrator.controller.core import Controller
from orchestrator.controller.wiring import build_controller
from orchestrator.jobspec import JobSubmission
from orchestrator.lifecycle import exit_on_signals
from orchestrator.market.catalog import Catalog
from orchestrator.market.eviction import AvailabilityTrace
from orchestrator.market.prices import to_epoch_seconds
from orchestrator.market.trace_source import bundled_prices_dir
from orchestrator.settings import ApiSettings, ControllerSettings, Settings
from orchestrator.store import JobState, RedisStore, TrainingReport
from orchestrator.units import SECONDS_PER_HOUR

REGION, CONTROLLER_ID, NAMESPACE = "us-east-1", "scale", "scale"
START = "2020-02-03T00:00:00Z"
#: One V100 per instance: a job's instances are its GPUs plus its reliable node.
GPU_TYPES = ("p3.2xlarge",)
#: Issue #19's target for one BidBrain decision.
DECISION_MS_P95_TARGET = 100.0
ENDPOINTS = ("/v1/jobs", "/v1/dashboard", "/v1/jobs/{job_id}/dashboard", "/metrics")
WARMUP_REQUESTS = 2
#: Synthetic training reports: iterations per reference-GPU-hour of work.
ITERATIONS_PER_GPU_HOUR = 3600


def progress(message: str) -> None:
    print(f"[scale {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class ScaleOptions:
    jobs: int
    instances_per_job: int = 10
    ticks: int = 5
    requests: int = 50
    seed: int = 1
    evictions: bool = True
    start: str = START
    gpu_types: tuple[str, ...] | None = GPU_TYPES  # None: every GPU type priced
    max_fill_ticks: int = 3
    profile_dir: Path | None = None


def percentiles(values: Sequence[float], digits: int = 3) -> dict[str, Any]:
    """p50, p95 and max (nearest rank) and the count; None when there are no values."""
    if not values:
        return {"p50": None, "p95": None, "max": None, "n": 0}
    ordered = sorted(values)

    def rank(q: float) -> float:
        return ordered[max(math.ceil(q / 100.0 * len(ordered)) - 1, 0)]

    return {
        "p50": round(rank(50), digits),
        "p95": round(rank(95), digits),
        "max": round(ordered[-1], digits),
        "n": len(ordered),
    }


class Ec2Calls:
    """Calls and wall seconds of one boto3 client's EC2 API calls, by operation (botocore's
    before-call / after-call events; each page of a paginated call is a call)."""

    def __init__(self, client: Any) -> None:
        self.calls: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)
        client.meta.events.register("before-call.ec2", self._before)
        client.meta.events.register("after-call.ec2", self._after)
        client.meta.events.register("after-call-error.ec2", self._after_error)

    def _before(self, model: Any, context: dict[str, Any], **_: Any) -> None:
        context["scale_t0"] = time.perf_counter()

    def _after(self, model: Any, context: dict[str, Any], **_: Any) -> None:
        self._count(model.name, context)

    def _after_error(self, context: dict[str, Any], **_: Any) -> None:
        self._count("error", context)

    def _count(self, operation: str, context: dict[str, Any]) -> None:
        started = context.pop("scale_t0", None)
        if started is not None:
            self.calls[operation] += 1
            self.seconds[operation] += time.perf_counter() - started

    def take(self) -> tuple[int, float, dict[str, int]]:
        """(calls, seconds, calls by operation) since the last take."""
        out = (sum(self.calls.values()), sum(self.seconds.values()), dict(self.calls))
        self.calls.clear()
        self.seconds.clear()
        return out


@dataclass
class DecisionTimes:
    """BidBrain's time per job decision: the policy built for the job's table, and decide."""

    total_ms: list[float] = field(default_factory=list)
    decide_ms: list[float] = field(default_factory=list)
    job_ms: list[float] = field(default_factory=list)  # the controller's whole `_run_job`
    markets: int = 0  # the most markets a decision weighed
    recording: bool = False

    def policy_class(self) -> type[BidBrainPolicy]:
        times = self

        class TimedPolicy(BidBrainPolicy):
            def __init__(self, table: MarketTable, **kwargs: Any) -> None:
                started = time.perf_counter()
                super().__init__(table, **kwargs)
                self._built_ms = (time.perf_counter() - started) * 1000.0

            def decide(self, inp: DecisionInput) -> Decision:
                started = time.perf_counter()
                decision = super().decide(inp)
                ms = (time.perf_counter() - started) * 1000.0
                if times.recording:
                    times.markets = max(times.markets, len(self.table))
                    times.decide_ms.append(ms)
                    times.total_ms.append(ms + self._built_ms)
                return decision

        return TimedPolicy

    def wrap_jobs(self, controller: Controller) -> None:
        """Time the controller's per-job step (an attribute of this controller object only)."""
        run_job = controller._run_job  # noqa: SLF001 - a benchmark's probe

        def timed(*args: Any, **kwargs: Any) -> None:
            started = time.perf_counter()
            try:
                run_job(*args, **kwargs)
            finally:
                if self.recording:
                    self.job_ms.append((time.perf_counter() - started) * 1000.0)

        controller._run_job = timed  # type: ignore[method-assign]  # noqa: SLF001


@dataclass
class _World:
    options: ScaleOptions
    store: RedisStore
    redis: redis.Redis
    clock: FakeClock
    controller: Controller
    replayer: EvictionReplayer | None
    ec2: Ec2Calls
    times: DecisionTimes
    settings: Settings
    token: str
    catalog: Catalog = field(default_factory=Catalog.load)
    work: dict[str, float] = field(default_factory=dict)

    @property
    def target_instances(self) -> int:
        return self.options.jobs * self.options.instances_per_job


@contextlib.contextmanager
def offline_world(options: ScaleOptions) -> Iterator[_World]:
    """Redis, moto, the controller (timed), the eviction replayer and the jobs, submitted;
    everything stopped on exit."""
    token = secrets.token_hex(16)
    settings = Settings(
        controller_id=CONTROLLER_ID,
        region=REGION,
        api=ApiSettings(token=SecretStr(token)),
        controller=ControllerSettings(
            prices=(bundled_prices_dir(REGION),), replay_start=options.start
        ),
    )
    times = DecisionTimes()
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(LocalRedis())
        aws = stack.enter_context(MotoEC2Server(reset_on_start=True))
        seed_moto(aws.endpoint_url, options.seed)
        store = RedisStore.connect(server.url, namespace=NAMESPACE)
        stack.callback(store.close)
        raw = redis.Redis.from_url(server.url)
        stack.callback(raw.close)
        clock = FakeClock(to_epoch_seconds(options.start))
        client = aws.client()
        ec2 = Ec2Calls(client)
        stack.enter_context(mock.patch.object(core, "BidBrainPolicy", times.policy_class()))
        controller = build_controller(settings, store=store, client=client)
        times.wrap_jobs(controller)
        replayer = None
        if options.evictions:
            replayer = EvictionReplayer(
                aws.client(), CONTROLLER_ID, AvailabilityTrace.bundled(), clock,
                seed=options.seed, on_notice=controller.notify,
            )  # fmt: skip
        world = _World(options, store, raw, clock, controller, replayer, ec2, times, settings,
                       token)  # fmt: skip
        _submit(world)
        yield world


def seed_moto(endpoint_url: str, seed: int) -> None:
    """Seed moto's ids (instance ids are random; the eviction replayer's draws follow the
    order it sees instances in, by id), so that a run replays the same evictions."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(f"{endpoint_url}/moto-api/seed?a={seed}", data=b"")
    with opener.open(request, timeout=10.0) as reply:
        reply.read()


def _submit(world: _World) -> None:
    rng = random.Random(world.options.seed)
    gpus = world.options.instances_per_job - 1
    for i in range(world.options.jobs):
        work = rng.uniform(5_000.0, 10_000.0)  # no job ends during the run
        job = JobSubmission(name=f"scale-{i}", budget_usd=round(work * 50.0, 2),
                            work_gpu_hours=round(work, 1), max_gpus=float(gpus),
                            instance_types=world.options.gpu_types)  # fmt: skip
        submit_job(world.store, job, now_s=world.clock.now(), new_id=lambda i=i: f"job-{i:04d}")


def _agents(world: _World, dt_s: float) -> None:
    """The instances' simulated work (GPU instances up σ add their work rate) and one
    training report per running job."""
    now = world.clock.now()
    alive: dict[str, list[Any]] = defaultdict(list)
    for rec in world.store.list_instances(alive_only=True):
        alive[rec.job_id].append(rec)
    for job in world.store.list_jobs([JobState.RUNNING]):
        sigma = float(job.spec.get("app", {}).get("add_overhead_s", 240.0))
        rate = sum(
            world.catalog.work_rate(r.instance_type)
            for r in alive[job.job_id]
            if now - r.launched_at >= sigma
        )
        done = world.work.get(job.job_id, 0.0) + rate * dt_s / SECONDS_PER_HOUR
        world.work[job.job_id] = done
        world.store.update_progress(job.job_id, done, now)
        iteration = int(done * ITERATIONS_PER_GPU_HOUR)
        loss = 2.3 * math.exp(-done / 50.0) + 0.05
        world.store.append_training(
            job.job_id, TrainingReport(at_s=now, iteration=iteration, loss=round(loss, 6))
        )


def _commands(world: _World) -> int:
    return int(world.redis.info("stats")["total_commands_processed"])


def _alive(world: _World) -> int:
    return len(world.store.list_instances(alive_only=True))


def _step(world: _World) -> None:
    """Between two ticks: the clock moves one decision interval, evictions due happen, the
    instances report their work."""
    interval = world.controller.settings.decision_interval_s
    world.clock.advance(interval)
    if world.replayer is not None:
        world.replayer.step()
    _agents(world, interval)


def fill(world: _World) -> dict[str, Any]:
    """Tick until every job holds its instances (at most `max_fill_ticks` ticks)."""
    seconds: list[float] = []
    calls = 0
    ec2_s = 0.0
    for k in range(world.options.max_fill_ticks):
        if k > 0:
            _step(world)
        world.ec2.take()
        started = time.perf_counter()
        world.controller.tick(world.clock.now())
        seconds.append(time.perf_counter() - started)
        n, s, _ = world.ec2.take()
        calls, ec2_s = calls + n, ec2_s + s
        alive = _alive(world)
        progress(f"  fill tick {k + 1}: {seconds[-1]:.1f} s, {alive} instances alive")
        if alive >= world.target_instances:
            break
    return {
        "ticks": len(seconds),
        "s": round(sum(seconds), 2),
        "ec2_calls": calls,
        "ec2_s": round(ec2_s, 2),
        "instances_alive": _alive(world),
    }


def measure_ticks(world: _World, profile: Path | None) -> dict[str, Any]:
    """`ticks` ticks, each after a step of the world; the last one profiled into `profile`."""
    tick_s: list[float] = []
    ec2_s: list[float] = []
    ec2_calls: list[int] = []
    commands: list[int] = []
    by_operation: dict[str, int] = defaultdict(int)
    launched = evicted = 0
    world.times.recording = True
    for k in range(world.options.ticks):
        _step(world)
        world.ec2.take()
        before = _commands(world)
        last = k == world.options.ticks - 1
        profiler = cProfile.Profile() if profile is not None and last else None
        started = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        report = world.controller.tick(world.clock.now())
        if profiler is not None:
            profiler.disable()
        tick_s.append(time.perf_counter() - started)
        commands.append(_commands(world) - before - 1)  # not the INFO itself
        n, s, ops = world.ec2.take()
        ec2_calls.append(n)
        ec2_s.append(s)
        for op, count in ops.items():
            by_operation[op] += count
        launched += len(report.launched)
        evicted += len(report.evicted)
        if (k + 1) % max(world.options.ticks // 5, 1) == 0:
            progress(f"  tick {k + 1}/{world.options.ticks}: {tick_s[-1]:.2f} s, "
                     f"{evicted} evicted and {launched} launched so far")  # fmt: skip
        if profiler is not None and profile is not None:
            _write_profile(profiler, profile)
    world.times.recording = False
    ticks = len(tick_s)
    return {
        "tick_s": percentiles(tick_s),
        "tick_ec2_s": percentiles(ec2_s),
        "tick_other_s": percentiles([t - e for t, e in zip(tick_s, ec2_s, strict=True)]),
        "ec2_calls_per_tick": round(sum(ec2_calls) / ticks, 1) if ticks else None,
        "ec2_calls_by_operation": dict(sorted(by_operation.items())),
        "redis_commands_per_tick": round(sum(commands) / ticks, 1) if ticks else None,
        "decision_ms": percentiles(world.times.total_ms),
        "markets_per_decision": world.times.markets,
        "decide_only_ms": percentiles(world.times.decide_ms),
        "job_step_ms": percentiles(world.times.job_ms),
        "launched": launched,
        "evicted": evicted,
    }


def measure_api(world: _World, requests: int, profile_dir: Path | None) -> dict[str, Any]:
    """Latency of each endpoint over `requests` GETs (uvicorn on 127.0.0.1), in ms."""
    app = create_app(world.store, world.settings, clock=world.clock.now)
    job_ids = [j.job_id for j in world.store.list_jobs()]
    rng = random.Random(world.options.seed)
    out: dict[str, Any] = {}
    headers = {"Authorization": f"Bearer {world.token}"}
    with (
        BackgroundServer(app) as server,
        httpx.Client(base_url=server.url, headers=headers, trust_env=False, timeout=120) as http,
    ):
        for endpoint in ENDPOINTS:
            samples: list[float] = []
            first = math.nan
            for k in range(WARMUP_REQUESTS + requests):
                path = endpoint.format(job_id=rng.choice(job_ids))
                started = time.perf_counter()
                reply = http.get(path)
                elapsed = (time.perf_counter() - started) * 1000.0
                if reply.status_code != 200:
                    raise RuntimeError(f"GET {path}: {reply.status_code} {reply.text[:200]}")
                if k == 0:
                    first = elapsed
                elif k >= WARMUP_REQUESTS:
                    samples.append(elapsed)
            out[endpoint] = {
                **percentiles(samples, 2),
                "first": round(first, 2),
                "bytes": len(reply.content),
            }
    if profile_dir is not None:
        _profile_endpoints(world, job_ids, profile_dir)
    return out


def _profile_endpoints(world: _World, job_ids: list[str], profile_dir: Path) -> None:
    """cProfile each endpoint's work (the functions its handler calls, with the event logs
    already read once, as the server has), 5 calls each."""
    tallies = EventTallies()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(world.store, tallies))
    store, now = world.store, world.clock.now()
    fleet(store, now, tallies)
    work: dict[str, Callable[[], object]] = {
        "api-jobs": lambda: [j.model_dump(mode="json") for j in store.list_jobs()],
        "api-dashboard": lambda: fleet(store, now, tallies),
        "api-job-dashboard": lambda: job_dashboard(store, job_ids[len(job_ids) // 2], now),
        "api-metrics": lambda: generate_latest(registry),
    }
    for name, call in work.items():
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(5):
            call()
        profiler.disable()
        _write_profile(profiler, profile_dir / f"{name}-{world.options.jobs}jobs")


def _write_profile(profiler: cProfile.Profile, path: Path) -> None:
    """`path`.prof (for pstats / snakeviz) and `path`.txt (the top 40 by cumulative time)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    profiler.dump_stats(path.with_suffix(".prof"))
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
    path.with_suffix(".txt").write_text(text.getvalue())


def measure(options: ScaleOptions) -> dict[str, Any]:
    """Every figure at one size, in a fresh offline world."""
    if options.instances_per_job < 2:
        raise ValueError("--instances-per-job must be at least 2 (a reliable node and a GPU)")
    wall0 = time.monotonic()
    profile = None
    if options.profile_dir is not None:
        profile = options.profile_dir / f"tick-{options.jobs}jobs"
    with offline_world(options) as world:
        progress(f"{options.jobs} jobs x {options.instances_per_job} instances: filling")
        filled = fill(world)
        progress(f"  measuring {options.ticks} ticks")
        ticks = measure_ticks(world, profile)
        progress(f"  measuring the API ({options.requests} requests per endpoint)")
        api = measure_api(world, options.requests, options.profile_dir)
        memory = world.redis.info("memory")
        job_ids = [j.job_id for j in world.store.list_jobs()]
        events = sum(world.redis.xlen(f"{NAMESPACE}:job:{j}:events") for j in job_ids)
        result = {
            "jobs": options.jobs,
            "instances_target": world.target_instances,
            "instances_alive": _alive(world),
            "fill": filled,
            **ticks,
            "api_ms": api,
            "redis_used_memory_bytes": int(memory["used_memory"]),
            "redis_keys": int(world.redis.dbsize()),
            "events_per_job": round(events / max(len(job_ids), 1), 1),
            "redis_bytes_per_event": _bytes_per_entry(world.redis, job_ids),
            "wall_s": round(time.monotonic() - wall0, 1),
        }
    return result


def _bytes_per_entry(client: redis.Redis, job_ids: list[str]) -> float | None:
    """MEMORY USAGE of the first job's event stream over its length (what a long-running
    job's log will cost)."""
    key = f"{NAMESPACE}:job:{job_ids[0]}:events" if job_ids else None
    length = int(client.xlen(key)) if key else 0
    if key is None or length == 0:
        return None
    return round(int(client.memory_usage(key, samples=0) or 0) / length, 1)


#: The figures `scaling` compares (a path into one size's result).
SCALED = {
    "fill_s": ("fill", "s"),
    "tick_s_p50": ("tick_s", "p50"),
    "tick_ec2_s_p50": ("tick_ec2_s", "p50"),
    "tick_other_s_p50": ("tick_other_s", "p50"),
    "redis_commands_per_tick": ("redis_commands_per_tick",),
    "decision_ms_p50": ("decision_ms", "p50"),
    "job_step_ms_p50": ("job_step_ms", "p50"),
    **{f"api_{e}_ms_p50": ("api_ms", e, "p50") for e in ENDPOINTS},
    "redis_used_memory_bytes": ("redis_used_memory_bytes",),
}


def scaling(sizes: list[dict[str, Any]]) -> dict[str, float | None]:
    """Each figure's growth exponent between the smallest and the largest size (see the
    module docstring)."""
    if len(sizes) < 2:
        return {}
    small, large = min(sizes, key=lambda s: s["jobs"]), max(sizes, key=lambda s: s["jobs"])
    ratio = large["jobs"] / small["jobs"]
    out: dict[str, float | None] = {}
    for name, keys in SCALED.items():
        a, b = _get(small, keys), _get(large, keys)
        ok = a is not None and b is not None and a > 0 and b > 0 and ratio > 1
        out[name] = round(math.log(b / a) / math.log(ratio), 2) if ok else None
    return out


def _get(result: dict[str, Any], keys: Sequence[str]) -> float | None:
    value: Any = result
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return float(value) if isinstance(value, int | float) else None


def table(result: dict[str, Any]) -> str:
    """The human-readable summary."""
    rows = [
        ("jobs", lambda s: f"{s['jobs']}"),
        ("instances alive", lambda s: f"{s['instances_alive']}"),
        ("fill: ticks / s", lambda s: f"{s['fill']['ticks']} / {s['fill']['s']:.1f}"),
        ("fill: EC2 calls / s", lambda s: f"{s['fill']['ec2_calls']} / {s['fill']['ec2_s']:.1f}"),
        ("tick s p50/p95/max", lambda s: _trio(s["tick_s"], "{:.2f}")),
        ("  in EC2 calls s p50", lambda s: _one(s["tick_ec2_s"]["p50"], "{:.2f}")),
        ("  the rest s p50", lambda s: _one(s["tick_other_s"]["p50"], "{:.2f}")),
        ("EC2 calls / tick", lambda s: _one(s["ec2_calls_per_tick"], "{:.1f}")),
        ("Redis commands / tick", lambda s: _one(s["redis_commands_per_tick"], "{:.0f}")),
        ("decision ms p50/p95/max", lambda s: _trio(s["decision_ms"], "{:.1f}")),
        ("job step ms p50/p95/max", lambda s: _trio(s["job_step_ms"], "{:.1f}")),
        *[
            (f"GET {e} ms p50/p95", lambda s, e=e: _pair(s["api_ms"][e], "{:.1f}"))
            for e in ENDPOINTS
        ],
        ("Redis used_memory MB", lambda s: f"{s['redis_used_memory_bytes'] / 1e6:.1f}"),
        ("Redis keys", lambda s: f"{s['redis_keys']}"),
        ("events per job", lambda s: f"{s['events_per_job']:.0f}"),
        ("evicted / launched in ticks", lambda s: f"{s['evicted']} / {s['launched']}"),
    ]
    sizes = result["sizes"]
    width = max(len(name) for name, _ in rows) + 2
    cells = [[cell(s) for s in sizes] for _, cell in rows]
    column = max(len(c) for row in cells for c in row) + 2
    lines = [
        name.ljust(width) + "".join(c.rjust(column) for c in row)
        for (name, _), row in zip(rows, cells, strict=True)
    ]
    if result["scaling"]:
        lines.append("")
        lines.append("growth exponent, smallest -> largest size (1: linear, 2: quadratic):")
        for name, value in result["scaling"].items():
            lines.append(f"  {name.ljust(width)}{'-' if value is None else value}")
    target = result["decision_ms_p95_target"]
    worst = max((s["decision_ms"]["p95"] or 0.0) for s in sizes)
    lines.append(f"decision p95 target {target:g} ms: {'met' if worst <= target else 'MISSED'} "
                 f"(worst p95 {worst:.1f} ms)")  # fmt: skip
    return "\n".join(lines)


def _one(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _pair(p: dict[str, Any], fmt: str) -> str:
    return f"{_one(p['p50'], fmt)} / {_one(p['p95'], fmt)}"


def _trio(p: dict[str, Any], fmt: str) -> str:
    return f"{_one(p['p50'], fmt)} / {_one(p['p95'], fmt)} / {_one(p['max'], fmt)}"


def run(
    jobs: Sequence[int],
    *,
    instances_per_job: int = 10,
    ticks: int = 5,
    requests: int = 50,
    seed: int = 1,
    evictions: bool = True,
    start: str = START,
    gpu_types: tuple[str, ...] | None = GPU_TYPES,
    profile_dir: Path | None = None,
) -> dict[str, Any]:
    """The benchmark at each size in `jobs` (the profile at the largest only)."""
    wall0 = time.monotonic()
    sizes = []
    for n in jobs:
        options = ScaleOptions(
            jobs=n, instances_per_job=instances_per_job, ticks=ticks, requests=requests,
            seed=seed, evictions=evictions, start=start, gpu_types=gpu_types,
            profile_dir=profile_dir if n == max(jobs) else None,
        )  # fmt: skip
        sizes.append(measure(options))
    return {
        "instances_per_job": instances_per_job,
        "ticks": ticks,
        "requests": requests,
        "seed": seed,
        "evictions": evictions,
        "start": start,
        "gpu_types": gpu_types,
        "decision_ms_p95_target": DECISION_MS_P95_TARGET,
        "sizes": sizes,
        "scaling": scaling(sizes),
        "profiles": None if profile_dir is None else str(profile_dir),
        "wall_s": round(time.monotonic() - wall0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, nargs="+", default=[10, 30, 100])
    parser.add_argument("--instances-per-job", type=int, default=10)
    parser.add_argument("--ticks", type=int, default=5, help="measured ticks per size")
    parser.add_argument("--requests", type=int, default=50, help="timed GETs per endpoint")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--start", default=START, help="trace time the clock starts at")
    parser.add_argument("--no-evictions", action="store_true", help="replay no evictions")
    parser.add_argument("--gpu-types", nargs="+", default=list(GPU_TYPES),
                        help="the jobs' GPU types, or 'all' (more markets per decision; the "
                        "instances per job are then BidBrain's choice)")  # fmt: skip
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="write cProfile files of the largest size here")  # fmt: skip
    args = parser.parse_args(argv)
    if min(args.jobs) < 1 or args.ticks < 1 or args.requests < 1:
        parser.error("--jobs, --ticks and --requests must be positive")
    if args.instances_per_job < 2:
        parser.error("--instances-per-job must be at least 2 (a reliable node and a GPU)")
    exit_on_signals()  # a SIGTERM unwinds: redis-server stopped, moto reset and stopped
    logging.basicConfig(level=logging.ERROR)  # launch refusals and notices log warnings
    gpu_types = None if args.gpu_types == ["all"] else tuple(args.gpu_types)
    result = run(
        sorted(set(args.jobs)), instances_per_job=args.instances_per_job, ticks=args.ticks,
        requests=args.requests, seed=args.seed, evictions=not args.no_evictions,
        start=args.start, gpu_types=gpu_types, profile_dir=args.profile,
    )  # fmt: skip
    print(json.dumps(result, indent=2))
    print(table(result), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
