"""The node agent: the process that runs on (stands in for) one instance of a job.

    python -m orchestrator.node --redis-url URL --namespace NS --job-id J --instance-id I \\
        --work-rate R --clock-start S --clock-speed X [--clock-wall-origin W] \\
        [--metadata-url URL] [--ready-after-sim-s 240] \\
        [--agileml-controller tcp://HOST:PORT --agileml-tier transient|reliable]

With `--agileml-controller` it trains: it runs an AgileML node (`agileml.node.AgileMLNode`,
the job token in `ORCHESTRATOR_AGILEML_TOKEN`) that joins the job's elasticity controller,
and a spot interruption notice becomes that node's eviction notice (it hands off and leaves).

Training runs at the speed of this machine, while the controller's clock may run faster; so
the agent also accounts for the work its instance would do: `R` reference-GPU-hours per
simulated hour, counted from
`--ready-after-sim-s` (σ, the add overhead: boot and data hand-off) after its start. Every
`REPORT_INTERVAL_SECONDS` of real time it writes, in one Redis transaction,

    {ns}:job:{job_id}:agent-work       hash  instance_id -> cumulative GPU-hours (a float)
    {ns}:job:{job_id}:agent-heartbeat  hash  instance_id -> `AgentHeartbeat` JSON

Each agent writes only its own field; `LocalFleet` sums the hash into the job's progress (one
writer), because `Store.update_progress` sets an absolute value.

It watches its instance's metadata service (`NoticeWatcher` on `--metadata-url`): on a spot
interruption notice it logs it and counts no work past the eviction time the notice names.

Failure semantics: a failed Redis write is logged and the next report writes the (cumulative)
total, so nothing is lost but up to one interval's freshness. SIGTERM or SIGINT ends the agent
after at most one interval: the work since the last report is not reported. The agent also
exits when its parent process (the fleet) dies, so it never outlives the offline world.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from orchestrator.agileml.token import AGILEML_TOKEN_ENV, token_from_env
from orchestrator.cloud.imds import InterruptionNotice, NoticeWatcher
from orchestrator.cloud.local.clock import ReplayClock, SimClock
from orchestrator.logfmt import log_to_stderr
from orchestrator.units import SECONDS_PER_HOUR

log = logging.getLogger("orchestrator.node")

#: Real seconds between two reports (heartbeat + work).
REPORT_INTERVAL_SECONDS = 0.5
#: σ: simulated seconds from the agent's start until it does useful work (`AppParams`).
DEFAULT_READY_AFTER_SIM_SECONDS = 240.0
#: Real seconds between metadata polls: at 600x speed, 0.2 s is 2 simulated minutes -- the
#: notice lead -- so a faster clock needs a proportionally shorter poll.
DEFAULT_NOTICE_POLL_SECONDS = 0.2
REDIS_TIMEOUT_SECONDS = 2.0


def agent_work_key(namespace: str, job_id: str) -> str:
    """The hash of the job's agents' cumulative work (field: instance id)."""
    return f"{namespace}:job:{job_id}:agent-work"


def agent_heartbeat_key(namespace: str, job_id: str) -> str:
    """The hash of the job's agents' last heartbeats (field: instance id)."""
    return f"{namespace}:job:{job_id}:agent-heartbeat"


@dataclass(frozen=True, slots=True)
class AgentHeartbeat:
    """An agent's last report: when (sim epoch seconds), its cumulative work, its pid."""

    sim_s: float
    work_gpu_hours: float
    pid: int

    def to_json(self) -> str:
        return json.dumps(
            {"sim_s": self.sim_s, "work_gpu_hours": self.work_gpu_hours, "pid": self.pid}
        )

    @classmethod
    def from_json(cls, text: str) -> AgentHeartbeat:
        """Parse a heartbeat value.

        Raises:
            ValueError: not the JSON object `to_json` writes.
        """
        try:
            data = json.loads(text)
            return cls(float(data["sim_s"]), float(data["work_gpu_hours"]), int(data["pid"]))
        except (TypeError, KeyError, json.JSONDecodeError) as exc:
            raise ValueError(f"not an agent heartbeat: {text[:200]!r}") from exc


class WorkMeter:
    """Cumulative work of one node: `work_rate` GPU-hours per hour over
    [started_s + ready_after_s, stop_at_s], as far as `advance` has been told the time.

    Thread-safe (`stop_at` comes from the notice watcher's thread).
    """

    def __init__(self, work_rate: float, started_s: float, ready_after_s: float) -> None:
        if not (math.isfinite(work_rate) and work_rate >= 0):
            raise ValueError(f"work_rate must be finite and >= 0, got {work_rate}")
        self.work_rate = work_rate
        self.ready_at_s = started_s + max(ready_after_s, 0.0)
        self._counted_until_s = self.ready_at_s
        self._stop_at_s = math.inf
        self._work_gpu_hours = 0.0
        self._lock = threading.Lock()

    @property
    def work_gpu_hours(self) -> float:
        with self._lock:
            return self._work_gpu_hours

    def stop_at(self, sim_s: float) -> None:
        """Count no work past `sim_s` (the earliest of several calls wins)."""
        with self._lock:
            self._stop_at_s = min(self._stop_at_s, sim_s)

    def advance(self, now_s: float) -> float:
        """Add the work done up to `now_s`; return the cumulative total (GPU-hours)."""
        with self._lock:
            until = min(now_s, self._stop_at_s)
            if until > self._counted_until_s:
                hours = (until - self._counted_until_s) / SECONDS_PER_HOUR
                self._work_gpu_hours += self.work_rate * hours
                self._counted_until_s = until
            return self._work_gpu_hours


@dataclass(frozen=True)
class AgentConfig:
    """The agent's command line, validated."""

    redis_url: str
    namespace: str
    job_id: str
    instance_id: str
    work_rate: float
    clock_start_s: float
    clock_speed: float
    clock_wall_origin: float | None
    metadata_url: str | None
    ready_after_sim_s: float = DEFAULT_READY_AFTER_SIM_SECONDS
    agileml_controller: str | None = None  # train in this AgileML job
    agileml_tier: str = "transient"  # or "reliable" (`agileml.elasticity.NodeTier`)
    report_interval_s: float = REPORT_INTERVAL_SECONDS
    notice_poll_s: float = DEFAULT_NOTICE_POLL_SECONDS


class NodeAgent:
    """Reports one node's heartbeat and work until `stop` is set (see the module docstring)."""

    def __init__(self, config: AgentConfig, client: redis.Redis, clock: SimClock) -> None:
        self.config = config
        self.client = client
        self.clock = clock
        self.meter = WorkMeter(config.work_rate, clock.now(), config.ready_after_sim_s)
        self.notices: list[InterruptionNotice] = []
        self.trainer: Any = None  # the AgileMLNode, when training
        self._work_key = agent_work_key(config.namespace, config.job_id)
        self._heartbeat_key = agent_heartbeat_key(config.namespace, config.job_id)

    def on_notice(self, notice: InterruptionNotice) -> None:
        """Stop counting work at an interruption's eviction time (rebalance: log only)."""
        self.notices.append(notice)
        log.warning(
            "spot %s notice",
            notice.kind,
            extra={
                "instance_id": notice.instance_id,
                "action": notice.action,
                "notice_time": notice.notice_time.isoformat(),
            },
        )
        if notice.kind == "interruption":
            self.meter.stop_at(notice.notice_time.timestamp())
            if self.trainer is not None:
                self.trainer.leave()

    def report(self) -> bool:
        """Write the heartbeat and cumulative work once. False (logged) if Redis failed."""
        now = self.clock.now()
        work = self.meter.advance(now)
        heartbeat = AgentHeartbeat(now, work, os.getpid()).to_json()
        try:
            pipe = self.client.pipeline(transaction=True)
            pipe.hset(self._work_key, self.config.instance_id, repr(work))
            pipe.hset(self._heartbeat_key, self.config.instance_id, heartbeat)
            pipe.execute()
        except redis.exceptions.RedisError as exc:
            log.warning("report failed; retried next interval", extra={"error": str(exc)})
            return False
        return True

    def _start_trainer(self) -> threading.Thread | None:
        """Start the AgileML node on a thread, if this agent trains; None otherwise."""
        controller = self.config.agileml_controller
        if controller is None:
            return None
        # imported here: torch takes seconds to load, and an agent that only accounts work
        # must start (and see notices) at once
        from orchestrator.agileml.elasticity import NodeTier
        from orchestrator.agileml.node import AgileMLNode

        token = token_from_env()
        trainer = AgileMLNode(
            self.config.instance_id,
            NodeTier(self.config.agileml_tier),
            job_id=self.config.job_id,
            controller=controller,
            token=token,
        )
        self.trainer = trainer

        def train() -> None:
            try:
                result = trainer.run()
                log.info(
                    "training ended",
                    extra={"ended": result.ended, "iterations": len(result.losses)},
                )
            except Exception:
                log.exception("training failed")

        thread = threading.Thread(target=train, name="agileml", daemon=True)
        thread.start()
        return thread

    def run(self, stop: threading.Event) -> None:
        """Report now and every interval until `stop` is set or the parent process dies."""
        watcher = None
        if self.config.metadata_url:
            watcher = NoticeWatcher(
                self.config.metadata_url,
                on_notice=self.on_notice,
                poll_interval_s=self.config.notice_poll_s,
                wall_clock=self.clock.now,
                instance_id=self.config.instance_id,
            )
            watcher.start()
        trainer_thread = self._start_trainer()
        parent = os.getppid()
        log.info(
            "node agent started",
            extra={
                "instance_id": self.config.instance_id,
                "job_id": self.config.job_id,
                "work_rate": self.config.work_rate,
                "ready_at_s": self.meter.ready_at_s,
            },
        )
        try:
            while True:
                self.report()
                if stop.wait(self.config.report_interval_s):
                    break
                if os.getppid() != parent:
                    log.warning("parent process gone; exiting")
                    break
        finally:
            if watcher is not None:
                watcher.stop()
            if self.trainer is not None and trainer_thread is not None:
                self.trainer.stop()
                trainer_thread.join(timeout=10)
            log.info(
                "node agent stopped",
                extra={
                    "instance_id": self.config.instance_id,
                    "work_gpu_hours": self.meter.work_gpu_hours,
                },
            )


def parse_args(argv: Sequence[str] | None = None) -> AgentConfig:
    """Parse the command line (exits with code 2 and usage on a bad one, as argparse does)."""
    p = argparse.ArgumentParser(
        prog="python -m orchestrator.node",
        description="Node agent of the offline world (trains with AgileML; accounts work).",
    )
    p.add_argument("--redis-url", required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument("--job-id", required=True)
    p.add_argument("--instance-id", required=True)
    p.add_argument("--work-rate", type=float, required=True, help="GPU-hours per hour")
    p.add_argument("--clock-start", type=float, required=True, help="sim epoch s at the origin")
    p.add_argument("--clock-speed", type=float, required=True, help="sim s per real s")
    p.add_argument(
        "--clock-wall-origin",
        type=float,
        default=None,
        help="time.monotonic() at which sim time was --clock-start (default: agent start)",
    )
    p.add_argument("--metadata-url", default=None, help="the instance metadata service")
    p.add_argument("--ready-after-sim-s", type=float, default=DEFAULT_READY_AFTER_SIM_SECONDS)
    p.add_argument("--report-interval-s", type=float, default=REPORT_INTERVAL_SECONDS)
    p.add_argument("--notice-poll-s", type=float, default=DEFAULT_NOTICE_POLL_SECONDS)
    p.add_argument("--agileml-controller", default=None, help="train: the job's controller")
    p.add_argument("--agileml-tier", choices=["transient", "reliable"], default="transient")
    a = p.parse_args(argv)
    if a.agileml_controller and not os.environ.get(AGILEML_TOKEN_ENV):
        p.error(f"--agileml-controller needs the job token (hex) in {AGILEML_TOKEN_ENV}")
    if not (math.isfinite(a.work_rate) and a.work_rate >= 0):
        p.error(f"--work-rate must be finite and >= 0, got {a.work_rate}")
    if not (math.isfinite(a.clock_speed) and a.clock_speed > 0):
        p.error(f"--clock-speed must be positive, got {a.clock_speed}")
    if a.report_interval_s <= 0 or a.notice_poll_s <= 0:
        p.error("--report-interval-s and --notice-poll-s must be positive")
    return AgentConfig(
        redis_url=a.redis_url,
        namespace=a.namespace,
        job_id=a.job_id,
        instance_id=a.instance_id,
        work_rate=a.work_rate,
        clock_start_s=a.clock_start,
        clock_speed=a.clock_speed,
        clock_wall_origin=a.clock_wall_origin,
        metadata_url=a.metadata_url,
        ready_after_sim_s=a.ready_after_sim_s,
        report_interval_s=a.report_interval_s,
        notice_poll_s=a.notice_poll_s,
        agileml_controller=a.agileml_controller,
        agileml_tier=a.agileml_tier,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run an agent until SIGTERM/SIGINT. Exit code 0, or 2 for a bad command line/URL."""
    config = parse_args(argv)
    log_to_stderr(f"node[{config.instance_id}]")
    stop = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        client = redis.Redis.from_url(
            config.redis_url,
            socket_timeout=REDIS_TIMEOUT_SECONDS,
            socket_connect_timeout=REDIS_TIMEOUT_SECONDS,
            retry=Retry(NoBackoff(), 0),
            decode_responses=True,
        )
    except ValueError as exc:
        log.error("bad --redis-url: %s", exc)
        return 2
    clock = ReplayClock(
        config.clock_start_s, config.clock_speed, wall_origin=config.clock_wall_origin
    )
    try:
        NodeAgent(config, client, clock).run(stop)
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
