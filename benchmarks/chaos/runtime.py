"""The AgileML runtime under chaos: jobs of real node processes (the instance agents' training
payload) on the additive probe, through a random stream of kills and notices.

Each job is an elasticity controller in this process and node processes on 127.0.0.1 (one
reliable node, holding the BackupPSs, and transient ones: ActivePSs and workers), training the
additive probe, whose exact final parameters are known (`additive_expected`: the data are
small integers, so float32 sums are exact). Faults, at random moments of a running job:

- `kill_node`: a transient node is SIGKILLed (worker, or ActivePS with its partitions);
- `kill_activeps`: a transient node that owns partitions is SIGKILLed;
- `notice_on_time`: a transient node gets its notice (SIGUSR1) and leaves after its hand-off;
- `notice_twice`: two notices in a row;
- `notice_then_kill`: the notice, then SIGKILL 0-0.5 s later (the hand-off may not finish);
- `kill_reliable`: the reliable node is SIGKILLed (rarely): the job must abort and say why;
  an abort after any other fault is counted as unexpected (a finding).

Each lost transient node is replaced by a new one (as BidBrain buys a replacement). Recovery:
seconds from the fault to the next clock any node completes. A job that makes no progress for
`WATCHDOG_S` is hung (counted, then stopped). At each job's end its parameters are compared
with the exact ones: a mismatch is counted as updates lost or applied twice (the difference's
sum over the mean clock's sum), and as an inexact job.
"""

from __future__ import annotations

import contextlib
import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.chaos.faults import FaultLog
from orchestrator.agileml.control import ModelSpec, TrainingSpec
from orchestrator.agileml.elasticity import NodeTier
from orchestrator.agileml.errors import AgileMLError
from orchestrator.agileml.examples import additive_expected
from orchestrator.agileml.local import LocalJob

WATCHDOG_S = 60.0
RELIABLE = "r0"
#: Fault kinds and their weights.
WEIGHTS = {"kill_node": 4, "kill_activeps": 3, "notice_on_time": 3, "notice_twice": 1,
           "notice_then_kill": 2, "kill_reliable": 1}  # fmt: skip


@dataclass
class RuntimeOptions:
    faults: int = 60
    seed: int = 1
    transient: int = 3  # transient nodes per job
    iterations: int = 300
    faults_per_job: int = 6
    max_wall_s: float = 900.0


@dataclass
class _Outcome:
    jobs: int = 0
    succeeded: int = 0
    aborted_with_reason: int = 0  # after their reliable node was killed, as they must
    unexpected_aborts: int = 0  # any other abort: a finding (its reason in `abort_reasons`)
    abort_reasons: list[str] | None = None
    no_reason: int = 0
    hung: int = 0
    lost_updates: int = 0
    double_applied: int = 0
    inexact_jobs: int = 0
    max_abs_error: float = 0.0
    hung_job: bool = False  # the current job hung: not checked further
    hung_details: list[dict[str, Any]] | None = None  # per hang: the last fault, the events
    last_fault: str = ""
    reliable_killed: bool = False  # in the current job


def run_runtime(options: RuntimeOptions, log: FaultLog) -> dict[str, Any]:
    """Run jobs until `options.faults` are injected (or the wall budget is spent)."""
    rng = random.Random(options.seed)
    out = _Outcome()
    wall0 = time.monotonic()
    while log.total < options.faults and time.monotonic() - wall0 < options.max_wall_s:
        spec = TrainingSpec(
            job_id=f"chaos-{out.jobs}",
            model=ModelSpec(kind="additive", features=2048),
            lr=1.0,
            global_batch=64,  # a power of two: exact in float32
            iterations=options.iterations,
            num_partitions=4,
            min_nodes=2,
            data_seed=rng.randrange(1 << 30),
        )
        out.jobs += 1
        out.hung_job = out.reliable_killed = False
        out.last_fault = "(none yet in this job)"
        _run_job(spec, options, rng, log, out, deadline=wall0 + options.max_wall_s)
    per_job = ("hung_job", "last_fault", "reliable_killed")
    counts = {k: v for k, v in out.__dict__.items() if k not in per_job}
    return {**counts, "wall_s": round(time.monotonic() - wall0, 1)}


def _run_job(
    spec: TrainingSpec,
    options: RuntimeOptions,
    rng: random.Random,
    log: FaultLog,
    out: _Outcome,
    deadline: float,
) -> None:
    with LocalJob(spec) as job:
        job.add_node(RELIABLE, NodeTier.RELIABLE)
        alive = [f"t{i}" for i in range(options.transient)]
        for node in alive:
            job.add_node(node, NodeTier.TRANSIENT)
        fresh = options.transient
        gaps = sorted(rng.sample(range(5, spec.iterations - 5), options.faults_per_job))
        for at in gaps:
            if log.total >= options.faults or time.monotonic() > deadline:
                break
            if not _reach(job, at, out):
                break
            kind = rng.choices(list(WEIGHTS), list(WEIGHTS.values()))[0]
            clock, t0 = job.max_clock(), time.monotonic()
            victim = _fault(job, kind, alive, rng)
            if victim is None:
                continue
            log.fault(kind)
            out.last_fault = f"{kind} {victim} at clock {clock}"
            if kind == "kill_reliable":
                out.reliable_killed = True
                if _ended_by_abort(job, out):
                    log.recovered("kill_reliable (to the abort)", time.monotonic() - t0)
                    return
                break  # it had finished before: its parameters are checked
            alive.remove(victim)
            node = f"t{fresh}"
            fresh += 1
            job.add_node(node, NodeTier.TRANSIENT)  # the replacement BidBrain buys
            alive.append(node)
            if not _reach(job, clock + 1, out):
                break
            log.recovered(kind, time.monotonic() - t0)
        if not out.hung_job:
            _finish(job, spec, out)


def _fault(job: LocalJob, kind: str, alive: list[str], rng: random.Random) -> str | None:
    """Inflict `kind`; the transient node it took (None: nothing to do it to)."""
    if kind == "kill_reliable":
        job.kill(RELIABLE)
        return RELIABLE
    owners = set(job.coordinator.view().owners.values())
    pool = [n for n in alive if n in owners] if kind == "kill_activeps" else alive
    if not pool:
        return None
    victim = rng.choice(pool)
    if kind in ("kill_node", "kill_activeps"):
        job.kill(victim)
    elif kind == "notice_on_time":
        job.evict(victim)
    elif kind == "notice_twice":
        job.evict(victim)
        time.sleep(0.01)
        with contextlib.suppress(ProcessLookupError):
            job.evict(victim)
    else:  # notice_then_kill
        job.evict(victim)
        time.sleep(rng.uniform(0.0, 0.5))
        job.kill(victim)
    return victim


def _reach(job: LocalJob, clock: int, out: _Outcome) -> bool:
    """Wait for `clock` with the watchdog; False when the job ended first (`_finish` counts
    it) or hung (counted here)."""
    last, last_at = job.max_clock(), time.monotonic()
    while job.max_clock() < clock:
        if any(e.kind in ("done", "aborted") for e in job.events()):
            return False
        if job.max_clock() > last:
            last, last_at = job.max_clock(), time.monotonic()
        elif time.monotonic() - last_at > WATCHDOG_S:
            _hang(job, out, f"no clock past {last} (waiting for {clock})")
            return False
        time.sleep(0.02)
    return True


def _hang(job: LocalJob, out: _Outcome, why: str) -> None:
    """Count a hung job, with what it was doing: its last fault and events, and any node
    process that crashed."""
    out.hung += 1
    out.hung_job = True
    events = [(e.kind, list(e.nodes), e.detail) for e in job.events()]
    detail = {"job": job.spec.job_id, "why": why, "last_fault": out.last_fault,
              "max_clock": job.max_clock(), "crashed": job.crashed(5),
              "events": events[-8:]}  # fmt: skip
    out.hung_details = [*(out.hung_details or []), detail]


def _ended_by_abort(job: LocalJob, out: _Outcome) -> bool:
    """After its reliable node is lost the job must abort and say why, in time: True when it
    did (counted); False when it had finished before (`_finish` checks it)."""
    if not job.coordinator.wait_done(WATCHDOG_S):
        _hang(job, out, "no abort after the reliable node was killed")
        return True
    if job.coordinator.error is None:
        return False
    _count_abort(job, out)
    return True


def _count_abort(job: LocalJob, out: _Outcome) -> None:
    error = job.coordinator.error or ""
    if not error.strip():
        out.no_reason += 1
    elif out.reliable_killed:
        out.aborted_with_reason += 1
    else:
        out.unexpected_aborts += 1
        out.abort_reasons = [*(out.abort_reasons or []), f"{out.last_fault}: {error[:200]}"]


def _finish(job: LocalJob, spec: TrainingSpec, out: _Outcome) -> None:
    try:
        params, _ = job.finish(WATCHDOG_S + spec.iterations * 0.5)
    except AgileMLError as exc:
        if "not done" in str(exc):
            _hang(job, out, f"not done at the end: {str(exc)[:300]}")
        else:
            _count_abort(job, out)
        return
    out.succeeded += 1
    got, want = torch.cat(params), additive_expected(spec, spec.iterations)
    if torch.equal(got, want):
        return
    out.inexact_jobs += 1
    out.max_abs_error = max(out.max_abs_error, float((got - want).abs().max()))
    per_clock = float(want.sum()) / spec.iterations
    updates = round(float((got - want).sum()) / per_clock) if per_clock else 0
    if updates > 0:
        out.double_applied += updates
    else:
        out.lost_updates += -updates
