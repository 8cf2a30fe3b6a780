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
  refuses to tick until its clock is past the furthest tick made: `controller.clock`);
- `agent_killed`: an instance's agent is SIGKILLed and its instance stays up (a third come
  back inside the rejoin grace; `benchmarks.chaos.agents`);
- `second_controller`: a second process of the controller id starts beside the leader and
  stands by (and one of another id is refused; `benchmarks.chaos.leader`); the leader's
  next death is a takeover;
- `controller_rewound`: the leader is SIGKILLed and restarted with `--replay-start` where the
  soak started, hours back: its clock continues from the store's mark (`wiring.replay_clock`);
- `long_lag`: the next decisions come late, the gaps growing 1.5 times a tick from 15 minutes
  to an hour and staying there a while (a controller that lags: the budget must hold).

Every controller process ticks under the fleet's lease, as `controller start` does; a killed
one keeps it until its time to live runs out.

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

from benchmarks.chaos.agents import SimulatedTraining
from benchmarks.chaos.faults import (
    EC2_ERRORS,
    INJECTED,
    ControllerKilled,
    Ec2Faults,
    FaultLog,
    percentile,
)
from benchmarks.chaos.leader import LEASE_TTL_S, Processes
from orchestrator.api.operations import submit_job
from orchestrator.cloud.errors import CloudError
from orchestrator.cloud.instances import TAG_CONTROLLER
from orchestrator.cloud.local.moto_server import MotoEC2Server
from orchestrator.cloud.local.redis_process import LocalRedis
from orchestrator.cloud.notices import InterruptionNotice
from orchestrator.controller.clock import ClockRewoundError
from orchestrator.controller.lease import NotLeaderError
from orchestrator.controller.wiring import controller_clock, patience
from orchestrator.jobspec import JobSubmission
from orchestrator.market.trace_source import bundled_prices_dir
from orchestrator.settings import ControllerSettings, Settings
from orchestrator.store import JobRecord, RedisStore, StoreError
from orchestrator.units import SECONDS_PER_HOUR

REGION, CONTROLLER_ID, NAMESPACE = "us-east-1", "chaos", "chaos"
START = "2020-02-03T00:00:00Z"
NOTICE_LEAD_S = 120.0  # EC2's two-minute warning
#: Fault kinds and their weights (EC2 errors share theirs).
WEIGHTS = {"controller_killed": 3, "redis_restart": 2, "ec2": 6, "notice_on_time": 2,
           "notice_twice": 1, "notice_late": 1, "notice_never": 2, "clock_jump": 2,
           "agent_killed": 3, "second_controller": 1, "controller_rewound": 1,
           "long_lag": 1}  # fmt: skip
MAX_PROCESSES = 3  # controller processes alive at once
#: The kinds injected while the decisions lag: the others fail a tick, and a failed decision
#: in an hour-long gap is a gap of hours, which no reserve of the budget anticipates.
DURING_LAG = frozenset({"agent_killed", "second_controller", "notice_on_time", "notice_twice",
                        "notice_late", "notice_never"})  # fmt: skip
LAG_FIRST_S, LAG_GROWTH, LAG_MAX_S = 900.0, 1.5, 3600.0
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
    start: float
    training: SimulatedTraining
    processes: Processes
    jobs: list[str] = field(default_factory=list)
    due: list[tuple[float, str, str]] = field(default_factory=list)  # (at, what, instance)
    doomed: set[str] = field(default_factory=set)  # instances given a notice
    gaps: list[float] = field(default_factory=list)  # the next decisions' lags (long_lag)
    spend_seen: dict[str, float] = field(default_factory=dict)  # job -> highest live spend
    spend_went_down: list[str] = field(default_factory=list)
    clock_ran_back: int = 0
    no_leader: int = 0
    first_kinds: list[str] | None = None  # kinds not injected yet
    recent: list[str] = field(default_factory=list)  # the last faults, for the findings
    overran: dict[str, str] = field(default_factory=dict)  # job -> the faults before
    budgets: dict[str, float] = field(default_factory=dict)  # job -> its budget (USD)
    broken_since: tuple[str, float] | None = None  # (fault kind, wall time) until a good tick
    redis_kill_in_s: float | None = None  # kill Redis this long into the next tick
    hung: int = 0
    ticks: int = 0


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
        training = SimulatedTraining(store, patience(settings))
        processes = Processes(settings, store, aws, faults, training)
        soak = _Soak(options, rng, redis, store, settings, aws, aws.client(), faults, log, start,
                     start, training, processes)  # fmt: skip
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
        found = {**check(soak), **_found(soak)}
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
            soak.budgets[soak.jobs[-1]] = job.budget_usd


def _step(soak: _Soak) -> None:
    """One tick of the controller that holds the lease (with whatever is armed), then the
    world until the next one: the evictions due, the agents' work, the invariants."""
    soak.ticks += 1
    started = time.monotonic()
    kill_redis = _redis_killer(soak)
    try:
        _tick(soak, started)
    finally:
        if kill_redis is not None:
            kill_redis.join()
    if time.monotonic() - started > SLOW_TICK_S:
        soak.hung += 1
    gap = soak.gaps.pop(0) if soak.gaps else soak.options.tick_s
    soak.now += gap
    _evictions_due(soak)
    _progress(soak, gap)
    _check_spend(soak)


def _tick(soak: _Soak, started: float) -> None:
    try:
        process = soak.processes.leader(max_wait_s=3 * LEASE_TTL_S)
    except StoreError as exc:  # Redis went as it started: the next tick repairs
        soak.log.errors[f"expected: {type(exc).__name__}"] += 1
        return
    if process is None:  # Redis down (expected), or no process could take the lease
        if _safe(soak.store.ping, False) is not False:
            soak.no_leader += 1
        return
    try:
        process.controller.tick(soak.now)
    except ControllerKilled:
        soak.processes.died(process)  # its memory is gone; it keeps the lease till it lapses
        soak.broken_since = soak.broken_since or ("controller_killed", started)
    except (StoreError, ClockRewoundError, NotLeaderError) as exc:  # Redis went mid-tick:
        # the next tick repairs; the clock jumped back: no tick until it is past the mark
        # again; a tick longer than the lease's life: the fence stopped it, the next retakes it
        soak.log.errors[f"expected: {type(exc).__name__}"] += 1
    except CloudError as exc:
        injected = INJECTED in str(exc)  # EC2 kept failing past botocore's retries
        soak.log.errors[f"{'expected' if injected else 'unexpected'}: {str(exc)[:100]}"] += 1
    except Exception as exc:  # noqa: BLE001 - a finding: counted, the world goes on
        soak.log.errors[f"unexpected: {type(exc).__name__}: {str(exc)[:100]}"] += 1
    else:
        if process.born_s is None:
            process.born_s = soak.now
        soak.training.ticked(soak.now, process.born_s, soak.options.tick_s, soak.doomed)
        if soak.broken_since is not None:
            kind, since = soak.broken_since
            soak.log.recovered(kind, time.monotonic() - since)
            soak.broken_since = None


def _inject(soak: _Soak) -> None:
    """One fault: each kind once first (in a random order), then at their weights; while the
    decisions lag, only those that leave the ticks working (see `DURING_LAG`)."""
    rng = soak.rng
    if soak.first_kinds is None:
        soak.first_kinds = rng.sample(list(WEIGHTS), len(WEIGHTS))
    if soak.first_kinds:
        kind = soak.first_kinds[-1]
    else:
        kinds, weights = zip(*WEIGHTS.items(), strict=True)
        kind = rng.choices(kinds, weights)[0]
    if soak.gaps and kind not in DURING_LAG:
        return
    if _apply(soak, kind):
        soak.recent = [*soak.recent[-5:], f"{kind}@{soak.now - soak.start:.0f}s"]
        if soak.first_kinds:
            soak.first_kinds.pop()


def _apply(soak: _Soak, kind: str) -> bool:
    """Inflict (or arm) a fault of `kind`; False when there was nothing to inflict it on."""
    rng, before = soak.rng, soak.log.total
    if kind == "controller_killed":
        soak.ec2_faults.arm_kill(rng.randrange(0, 12))
        return True
    if kind == "ec2":
        soak.ec2_faults.arm_error(rng.choice(list(EC2_ERRORS)), rng.randint(1, 6))
        return True
    if kind == "redis_restart":
        soak.redis_kill_in_s = rng.uniform(0.0, 0.05)
        return True
    if kind == "clock_jump":
        soak.now += rng.uniform(300, 900) if rng.random() < 0.5 else -rng.uniform(60, 180)
        soak.log.fault("clock_jump")
    elif kind == "agent_killed":
        if soak.training.kill(rng, soak.now, soak.options.tick_s) is not None:
            soak.log.fault(kind)
    elif kind == "second_controller":
        if len(soak.processes.live) < MAX_PROCESSES:
            _safe(soak.processes.start, None)
            _safe(soak.processes.start_other_id, None)
            soak.log.fault(kind)
    elif kind == "controller_rewound":
        _rewound_restart(soak)
    elif kind == "long_lag":
        gap, soak.gaps = LAG_FIRST_S, []
        while gap < LAG_MAX_S:
            soak.gaps.append(gap)
            gap *= LAG_GROWTH
        soak.gaps += [LAG_MAX_S] * rng.randint(1, 3)
        soak.log.fault(kind)
    else:
        _evict(soak, kind)
    return soak.log.total > before


def _rewound_restart(soak: _Soak) -> None:
    """The leader is SIGKILLed and started again with the soak's --replay-start, hours back:
    its clock must continue from the store's mark."""
    mark = _safe(soak.store.clock_high_water, None)
    leader = soak.processes.last_leader
    if mark is None or leader is None or leader not in soak.processes.live:
        return
    soak.processes.died(leader)
    soak.processes.start()
    clock, _ = controller_clock(soak.settings, floor_s=mark)  # as `controller start` makes it
    restarted = clock()
    if restarted < mark - 1.0:
        soak.clock_ran_back += 1
    soak.now = max(soak.now, restarted)
    soak.log.fault("controller_rewound")


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
        soak.doomed.add(target)
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
    for process in soak.processes.live:  # a dead controller hears nothing
        process.controller.notify(notice)


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


def _progress(soak: _Soak, dt: float) -> None:
    """The agents of the instances EC2 runs work for `dt` (`SimulatedTraining`); each job's
    trained work is its progress (the agents' report)."""
    ec2 = _safe(lambda: soak.client.describe_instances(
        Filters=[{"Name": f"tag:{TAG_CONTROLLER}", "Values": [CONTROLLER_ID]},
                 {"Name": "instance-state-name", "Values": ["running"]}]), None)  # fmt: skip
    if ec2 is None:
        return
    ids = {i["InstanceId"] for r in ec2["Reservations"] for i in r["Instances"]}
    running = {}
    for job_id in soak.jobs:
        for rec in _safe(lambda job_id=job_id: soak.store.list_instances(job_id), []):
            if rec.instance_id in ids and rec.alive:
                running[rec.instance_id] = (job_id, rec.instance_type, rec.launched_at)
    soak.training.advance(running, soak.now, dt)
    for job_id, work in soak.training.trained_gpu_h.items():
        with contextlib.suppress(StoreError):
            soak.store.update_progress(job_id, work, soak.now)


def _check_spend(soak: _Soak) -> None:
    """A job's live spend (billed + accrued) never goes down."""
    for job_id in soak.jobs:
        spent = _safe(lambda job_id=job_id: soak.store.live_spend_usd(job_id), None)
        if spent is None:
            continue
        seen = soak.spend_seen.get(job_id, 0.0)
        if spent < seen - 1e-6:
            soak.spend_went_down.append(f"{job_id}: ${seen:.4f} -> ${spent:.4f}")
        soak.spend_seen[job_id] = max(seen, spent)
        budget = soak.budgets[job_id]
        if spent > budget and job_id not in soak.overran:
            at = f"{soak.now - soak.start:.0f}s"
            soak.overran[job_id] = f"${spent:.2f} of ${budget:.2f} at {at} after {soak.recent}"


def _found(soak: _Soak) -> dict[str, Any]:
    """The counts of the new faults' invariants (`check` has the ledger's)."""
    takeovers, agents = soak.processes.takeover_s, soak.training
    return {
        "paid_without_agent": len(agents.overdue),
        "agent_killed_released_after_sim_s": {
            "n": len(agents.released_s), "p50": percentile(agents.released_s, 50),
            "max": max(agents.released_s, default=None)},
        "acted_without_lease": len(soak.processes.acted_without_lease),
        "acted_without_lease_details": soak.processes.acted_without_lease[:5],
        "other_id_admitted": soak.processes.other_id_admitted,
        "takeover_s": {"n": len(takeovers), "p50": percentile(takeovers, 50),
                       "max": max(takeovers, default=None), "lease_ttl_s": LEASE_TTL_S},
        "slow_takeovers": soak.processes.slow_takeovers,
        "no_leader": soak.no_leader,
        "clock_ran_back": soak.clock_ran_back,
        "overran_after": list(soak.overran.values())[:5],
        "spend_went_down": len(soak.spend_went_down),
        "spend_went_down_details": soak.spend_went_down[:5],
        "runtime_restarts": sum(agents.restarts.values()),
    }  # fmt: skip


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
    over, no_reason, not_ended, over_jobs = 0.0, [], [], []
    for job_id in soak.jobs:
        job: JobRecord = soak.store.get_job(job_id)
        if not job.state.is_terminal:
            not_ended.append(job_id)
        elif str(job.state) != "succeeded" and not job.message.strip():
            no_reason.append(job_id)
        overrun = soak.store.spent_usd(job_id) - job.budget_usd
        if overrun > 0:
            over += overrun
            over_jobs.append(f"{job_id}: ${overrun:.4f} over ${job.budget_usd:.2f}")
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
        "over_budget_jobs": over_jobs[:5],
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
