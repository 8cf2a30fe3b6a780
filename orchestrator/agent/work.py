"""The offline world's account of an instance's work (`cloud.local.reports` has the protocol).

`WorkMeter` counts `work_rate` reference-GPU-hours per simulated hour from σ after the instance
started until its eviction; `WorkReporter` writes the count and a heartbeat to Redis every
report interval. On AWS nothing of this runs: the controller counts iterations instead.

Failure semantics: a failed Redis write is logged and the next report writes the (cumulative)
total, so nothing is lost but up to one interval's freshness.
"""

from __future__ import annotations

import logging
import math
import os
import threading

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from orchestrator.cloud.local.clock import SimClock
from orchestrator.cloud.local.reports import (
    AgentHeartbeat,
    agent_heartbeat_key,
    agent_work_key,
)
from orchestrator.units import SECONDS_PER_HOUR

log = logging.getLogger(__name__)

REDIS_TIMEOUT_SECONDS = 2.0


class WorkMeter:
    """Cumulative work of one instance: `work_rate` GPU-hours per hour over
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

    @property
    def worked_s(self) -> float:
        """The seconds counted so far (from ready to the last `advance`, or the stop)."""
        with self._lock:
            return self._counted_until_s - self.ready_at_s

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


class WorkReporter:
    """Writes one instance's heartbeat and cumulative work to Redis (see the module docstring).

    Raises (on construction):
        ValueError: `redis_url` is not a Redis URL.
    """

    def __init__(
        self,
        redis_url: str,
        *,
        namespace: str,
        job_id: str,
        instance_id: str,
        meter: WorkMeter,
        clock: SimClock,
    ) -> None:
        self.meter = meter
        self.clock = clock
        self.instance_id = instance_id
        self._client = redis.Redis.from_url(
            redis_url,
            socket_timeout=REDIS_TIMEOUT_SECONDS,
            socket_connect_timeout=REDIS_TIMEOUT_SECONDS,
            retry=Retry(NoBackoff(), 0),
            decode_responses=True,
        )
        self._work_key = agent_work_key(namespace, job_id)
        self._heartbeat_key = agent_heartbeat_key(namespace, job_id)

    def report(self) -> bool:
        """Write the heartbeat and cumulative work once. False (logged) if Redis failed."""
        now = self.clock.now()
        work = self.meter.advance(now)
        heartbeat = AgentHeartbeat(now, work, os.getpid(), self.meter.worked_s).to_json()
        try:
            pipe = self._client.pipeline(transaction=True)
            pipe.hset(self._work_key, self.instance_id, repr(work))
            pipe.hset(self._heartbeat_key, self.instance_id, heartbeat)
            pipe.execute()
        except redis.exceptions.RedisError as exc:
            log.warning("report failed; retried next interval", extra={"error": str(exc)})
            return False
        return True

    def close(self) -> None:
        self._client.close()
