"""The control plane under chaos: the controller, Redis and EC2 (moto) of the offline world
running several budgeted jobs through a random stream of faults.

A real redis-server (append-only, fsync always, as on the AWS controller), a moto EC2 server
and the replayed 2020 us-east-1 spot prices; the controller is built as `controller start`
builds it (`build_controller`) and ticked here every `tick_s` simulated seconds. The jobs'
instances do simulated work (each GPU instance adds its catalog work rate once it has been up
σ = the job's add overhead), as the offline fleet's agents report it. Faults:

- `controller_killed`: the controller dies inside one of its EC2 calls (a BaseException no
  handler catches, raised from botocore's send hook at a random call of a tick), and a new
  controller object with empty memory takes over, as a restarted process would;
- `redis_restart`: redis-server is SIGKILLed at a random moment of a tick (from a timer
  thread) and started again on its port;
- `ec2_<code>`: the controller's EC2 calls answer InsufficientInstanceCapacity (RunInstances),
  RequestLimitExceeded, InternalError or Unavailable (1-6 calls in a row: botocore retries
  some of them away, as it does on AWS);
- `notice_on_time`, `notice_twice`, `notice_late`, `notice_never`: a spot instance is evicted
  (terminated in EC2) two minutes after its notice, after two notices, before its notice, or
  with none;
- `clock_jump`: the clock steps forward 5-15 minutes or back 1-3 minutes (the controller
  refuses to tick until its clock is past the furthest tick made: `controller.clock`).

The controller's tick errors are counted by type (`tick_errors`): a store outage mid-tick is
expected there (the next tick repairs), anything else is a finding. At the end, with no more
faults, the world runs until every job has ended, then checks the invariants (see `check`).
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from benchmarks.chaos.faults import EC2_ERRORS, INJECTED, ControllerKilled, Ec2Faults, FaultLog
from orchestrator.api.operations import submit_job
from orchestrator.cloud.errors import CloudError
from orchestrator.cloud.instances import TAG_CONTROLLER
from orchestrator.cloud.local.moto_server import MotoEC2Server
from orchestrator.cloud.local.redis_process import LocalRedis
from orchestrator.cloud.notices import InterruptionNotice
from orchestrator.controller.clock import ClockRewoundError
from orchestrator.controller.core import Controller
from orchestrator.controller.wiring import build_controller
from orchestrator.jobspec import JobSubmission
from orchestrator.market.catalog import Catalog
from orchestrator.market.trace_source import bundled_prices_dir
from orchestrator.settings import ControllerSettings, Settings
from orchestrator.store import JobRecord, RedisStore, StoreError
from orchestrator.units import SECONDS_PER_HOUR

REGION, CONTROLLER_ID, NAMESPACE = "us-east-1", "chaos", "chaos"
START = "2020-02-03T00:00:00Z"
NOTICE_LEAD_S = 120.0  # EC2's two-minute warning
#: Fault kinds and their weights (EC2 errors share theirs).
WEIGHTS = {"controller_killed": 3, "redis_restart": 2, "ec2": 6, "notice_on_time": 2,
           "notice_twice": 1, "notice_late": 1, "notice_never": 2, "clock_jump": 2}  # fmt: skip
SLOW_TICK_S = 60.0  # a tick this long (wall) counts as hung: the watchdog's bound


@dataclass
class WorldOptions:
    faults: int = 300  # stop injecting after this many
    jobs: int = 4  # running side by side; a new wave is submitted when all have ended
    seed: int = 1
    tick_s: float = 120.0
    fault_probability: float = 0.5  # per tick
    max_wall_s: float = 900.0
    max_sim_hours_per_job: float = 96.0  # a job still running after this is hung


@dataclass
class _Soak:
    options: WorldOptions
    rng: random.Random
    redis: LocalRedis
    store: RedisStore
    settings: Settings
    aws: MotoEC2Server
    client: Any  # the clean EC2 client: evictions and checks
    ec2_faults: Ec2Faults
    log: FaultLog
    now: float
    controller: Controller | None = None
    jobs: list[str] = field(default_factory=list)
    work: dict[str, float] = field(default_factory=dict)  # job -> simulated GPU-hours
    due: list[tuple[float, str, str]] = field(default_factory=list)  # (at, what, instance)
    broken_since: tuple[str, float] | None = None  # (fault kind, wall time) until a good tick
    redis_kill_in_s: float | None = None  # kill Redis this long into the next tick
    hung: int = 0
    ticks: int = 0
    catalog: Catalog = field(default_factory=Catalog.load)


def run_world(options: WorldOptions, log: FaultLog | None = None) -> dict[str, Any]:
    """Run the soak (see the module docstring); its counts and the invariants' findings.
    Faults and recovery times go to `log`."""
    rng = random.Random(options.seed)
    log = log if log is not None else FaultLog()
    start = datetime.fromisoformat(START).timestamp()
    settings = Settings(
        controller_id=CONTROLLER_ID,
        region=REGION,
        controller=ControllerSettings(prices=(bundled_prices_dir(REGION),), replay_start=START),
    )
    with _world(settings) as (redis, store, aws):
        faults = Ec2Faults(log, rng)
        soak = _Soak(options, rng, redis, store, settings, aws, aws.client(), faults, log, start)
        wall0 = time.monotonic()
        while log.total < options.faults and time.monotonic() - wall0 < options.max_wall_s:
            if all(_ended(soak, j) for j in soak.jobs):
                _submit_wave(soak)
            if rng.random() < options.fault_probability:
                _inject(soak)
            _step(soak)
        faults.disarm()
        injected_wall_s = time.monotonic() - wall0
        for _ in range(int(options.max_sim_hours_per_job * SECONDS_PER_HOUR / options.tick_s)):
            if all(_ended(soak, j) for j in soak.jobs):
                break
            _step(soak)
        for _ in range(2):  # settle: the last releases and their bills
            _step(soak)
        found = check(soak)
        states = _states(soak)
    return {
        "faults": log.total,
        "by_kind": dict(sorted(log.by_kind.items())),
        "jobs": len(soak.jobs),
        "jobs_by_state": states,
        "ticks": soak.ticks,
        "tick_errors": dict(log.errors),
        "tick_errors_unexpected": sum(n for e, n in log.errors.items() if e.startswith("unex")),
        "hung": soak.hung + found.pop("not_ended"),
        "wall_s": round(time.monotonic() - wall0, 1),
        "injecting_wall_s": round(injected_wall_s, 1),
        **found,
    }


@contextlib.contextmanager
def _world(settings: Settings) -> Iterator[tuple[LocalRedis, RedisStore, MotoEC2Server]]:
    with LocalRedis(persist=True) as redis, MotoEC2Server() as aws:
        store = RedisStore.connect(redis.url, namespace=NAMESPACE)
        try:
            yield redis, store, aws
        finally:
            store.close()


def _submit_wave(soak: _Soak) -> None:
    for _ in range(soak.options.jobs):
        work = soak.rng.uniform(2.0, 8.0)
        # most budgets are ample; some are tight, so that budget exhaustion happens too
        budget = work * soak.rng.choice([1.5, 3.0, 3.0, 5.0])
        job = JobSubmission(name=f"chaos-{len(soak.jobs)}", budget_usd=round(budget, 2),
                            work_gpu_hours=round(work, 2), max_gpus=4.0,
                            instance_types=("p3.2xlarge", "p3.8xlarge"))  # fmt: skip
        with contextlib.suppress(StoreError):  # Redis down at that moment: one job fewer
            soak.jobs.append(submit_job(soak.store, job, now_s=soak.now).job_id)


def _controller(soak: _Soak) -> Controller:
    if soak.controller is None:
        client = soak.aws.client()  # its own: the faults are armed on this one only
        soak.ec2_faults.install(client)
        soak.controller = build_controller(soak.settings, store=soak.store, client=client)
    return soak.controller


def _step(soak: _Soak) -> None:
    """One tick of the controller (with whatever is armed), the evictions due, the work."""
    soak.ticks += 1
    started = time.monotonic()
    kill_redis = _redis_killer(soak)
    try:
        _controller(soak).tick(soak.now)
    except ControllerKilled:
        soak.controller = None  # its memory is gone; the next tick builds a new one
        soak.broken_since = soak.broken_since or ("controller_killed", started)
    except (StoreError, ClockRewoundError) as exc:  # Redis went mid-tick: the next tick
        # repairs; the clock jumped back: no tick until it is past the mark again
        soak.log.errors[f"expected: {type(exc).__name__}"] += 1
    except CloudError as exc:
        injected = INJECTED in str(exc)  # EC2 kept failing past botocore's retries
        soak.log.errors[f"{'expected' if injected else 'unexpected'}: {str(exc)[:100]}"] += 1
    except Exception as exc:  # noqa: BLE001 - a finding: counted, the world goes on
        soak.log.errors[f"unexpected: {type(exc).__name__}: {str(exc)[:100]}"] += 1
    else:
        if soak.broken_since is not None:
            kind, since = soak.broken_since
            soak.log.recovered(kind, time.monotonic() - since)
            soak.broken_since = None
    finally:
        if kill_redis is not None:
            kill_redis.join()
    if time.monotonic() - started > SLOW_TICK_S:
        soak.hung += 1
    _evictions_due(soak)
    _progress(soak)
    soak.now += soak.options.tick_s


def _inject(soak: _Soak) -> None:
    kinds, weights = zip(*WEIGHTS.items(), strict=True)
    kind = soak.rng.choices(kinds, weights)[0]
    rng = soak.rng
    if kind == "controller_killed":
        soak.ec2_faults.arm_kill(rng.randrange(0, 12))
    elif kind == "ec2":
        soak.ec2_faults.arm_error(rng.choice(list(EC2_ERRORS)), rng.randint(1, 6))
    elif kind == "redis_restart":
        soak.redis_kill_in_s = rng.uniform(0.0, 0.05)
    elif kind == "clock_jump":
        soak.now += rng.uniform(300, 900) if rng.random() < 0.5 else -rng.uniform(60, 180)
        soak.log.fault("clock_jump")
    else:
        _evict(soak, kind)


def _redis_killer(soak: _Soak) -> threading.Thread | None:
    """When armed: a thread that SIGKILLs and restarts redis-server `redis_kill_in_s` into
    the tick about to run (started here; the caller joins it after the tick)."""
    delay, soak.redis_kill_in_s = soak.redis_kill_in_s, None
    if delay is None:
        return None

    def restart() -> None:
        time.sleep(delay)
        soak.redis.crash_restart()

    soak.log.fault("redis_restart")
    soak.broken_since = soak.broken_since or ("redis_restart", time.monotonic())
    thread = threading.Thread(target=restart, daemon=True)
    thread.start()
    return thread


def _evict(soak: _Soak, kind: str) -> None:
    spot = [
        r
        for job in soak.jobs
        for r in _safe(lambda job=job: soak.store.list_instances(job, alive_only=True), [])
        if r.lifecycle == "spot"
    ]
    if not spot:
        return
    target = soak.rng.choice(spot).instance_id
    now = soak.now
    if kind in ("notice_on_time", "notice_twice"):
        _notify(soak, target, now + NOTICE_LEAD_S)
        if kind == "notice_twice":
            _notify(soak, target, now + NOTICE_LEAD_S)
        soak.due.append((now + NOTICE_LEAD_S, "terminate", target))
    elif kind == "notice_late":
        _terminate(soak, target)
        soak.due.append((now + soak.options.tick_s, "notice", target))
    else:
        _terminate(soak, target)
    soak.log.fault(kind)


def _notify(soak: _Soak, instance_id: str, at_s: float) -> None:
    notice = InterruptionNotice(instance_id=instance_id, kind="interruption", action="terminate",
                                notice_time=datetime.fromtimestamp(at_s, UTC),
                                received_at_s=soak.now)  # fmt: skip
    if soak.controller is not None:  # a dead controller hears nothing
        soak.controller.notify(notice)


def _terminate(soak: _Soak, instance_id: str) -> None:
    with contextlib.suppress(Exception):  # already gone
        soak.client.terminate_instances(InstanceIds=[instance_id])


def _evictions_due(soak: _Soak) -> None:
    due = [d for d in soak.due if d[0] <= soak.now]
    soak.due = [d for d in soak.due if d[0] > soak.now]
    for _, what, instance_id in due:
        if what == "terminate":
            _terminate(soak, instance_id)
        else:
            _notify(soak, instance_id, soak.now)


def _progress(soak: _Soak) -> None:
    """Each running job's GPU instances add their work rate once up for σ (the fleet's
    agents' report, simulated)."""
    dt = max(soak.options.tick_s, 0.0)
    for job_id in soak.jobs:
        record = _safe(lambda job_id=job_id: soak.store.get_job(job_id), None)
        if record is None or record.state.is_terminal:
            continue
        sigma = float(record.spec.get("app", {}).get("add_overhead_s", 240.0))
        alive = _safe(lambda job_id=job_id: soak.store.list_instances(job_id, alive_only=True), [])
        rate = sum(
            soak.catalog.work_rate(r.instance_type)
            for r in alive
            if soak.now - r.launched_at >= sigma
        )
        soak.work[job_id] = soak.work.get(job_id, 0.0) + rate * dt / SECONDS_PER_HOUR
        with contextlib.suppress(StoreError):
            soak.store.update_progress(job_id, soak.work[job_id], soak.now)


def _ended(soak: _Soak, job_id: str) -> bool:
    record = _safe(lambda: soak.store.get_job(job_id), None)
    return record is not None and record.state.is_terminal


def _states(soak: _Soak) -> dict[str, int]:
    states: dict[str, int] = {}
    for job_id in soak.jobs:
        state = str(soak.store.get_job(job_id).state)
        states[state] = states.get(state, 0) + 1
    return states


def _safe(read: Any, default: Any) -> Any:
    try:
        return read()
    except StoreError:
        return default


def check(soak: _Soak) -> dict[str, Any]:
    """The invariants once every job has ended (or the soak gave up on them):

    - `orphans`: instances of this controller EC2 still runs;
    - `unbilled_or_double_billed`: instances whose ledger entries do not cover their recorded
      life (launch to end, in the controller's clock) exactly once, instances of an ended job
      never ended (so never billed), instances EC2 ran that the store never recorded, and
      ledger entries of no recorded instance;
    - `over_budget_usd`: the sum over jobs of spend beyond the budget;
    - `no_reason`: jobs that ended other than succeeded without a message;
    - `not_ended`: jobs still not ended (hung).
    """
    ec2 = soak.client.describe_instances(
        Filters=[{"Name": f"tag:{TAG_CONTROLLER}", "Values": [CONTROLLER_ID]}]
    )
    ours = [i for r in ec2["Reservations"] for i in r["Instances"]]
    orphans = [i["InstanceId"] for i in ours if i["State"]["Name"] in ("pending", "running")]
    records = {r.instance_id: r for job in soak.jobs for r in soak.store.list_instances(job)}
    bad_billing = [i["InstanceId"] for i in ours if i["InstanceId"] not in records]
    over, no_reason, not_ended = 0.0, [], []
    for job_id in soak.jobs:
        job: JobRecord = soak.store.get_job(job_id)
        if not job.state.is_terminal:
            not_ended.append(job_id)
        elif str(job.state) != "succeeded" and not job.message.strip():
            no_reason.append(job_id)
        over += max(0.0, soak.store.spent_usd(job_id) - job.budget_usd)
        ledger = soak.store.ledger(job_id)
        for entry in ledger:
            if entry.instance_id not in records:
                bad_billing.append(entry.instance_id)
        for rec in soak.store.list_instances(job_id):
            if rec.ended_at is None and job.state.is_terminal:
                bad_billing.append(rec.instance_id)  # never ended, so never billed
                continue
            spans = sorted((e.start_s, e.end_s) for e in ledger if e.instance_id == rec.instance_id)
            if not _covers_once(spans, rec.launched_at, rec.ended_at):
                bad_billing.append(rec.instance_id)
    return {
        "orphans": len(orphans),
        "unbilled_or_double_billed": len(set(bad_billing)),
        "over_budget_usd": round(over, 4),
        "no_reason": len(no_reason),
        "not_ended": len(not_ended),
    }


def _covers_once(spans: list[tuple[float, float]], start: float, end: float | None) -> bool:
    """The spans tile [start, end] with no gap and no overlap (an alive instance: none yet)."""
    if end is None:
        return not spans
    if not spans:
        return end <= start  # a zero-length life bills nothing
    position = start
    for begin, finish in spans:
        if abs(begin - position) > 1e-6 or finish < begin:
            return False
        position = finish
    return abs(position - max(end, start)) <= 1e-6
