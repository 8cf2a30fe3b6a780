"""The instance agent of the offline world: one process per running instance, started by the
`LocalFleet` (`python -m orchestrator.agent`).

    python -m orchestrator.agent --metadata-url URL --redis-url URL --namespace NS \\
        --work-rate R --clock-start S --clock-speed X [--clock-wall-origin W] \\
        [--ready-after-sim-s 240] [--report-interval-s 0.5] [--notice-poll-s 0.2]

Who it is (instance, job, tier, the job's elasticity controller) comes from the instance's
metadata mock, as on AWS; the job token from `ORCHESTRATOR_AGILEML_TOKEN`. It also accounts the
instance's work on the world's clock (`agent.work`). SIGTERM or SIGINT ends it after at most
one interval (the work since the last report is not reported); it also exits when the fleet
that started it dies, so it never outlives the offline world.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType

from orchestrator.agent.identity import read_identity
from orchestrator.agent.instance import InstanceAgent
from orchestrator.agent.work import WorkMeter, WorkReporter
from orchestrator.cloud.errors import MetadataError
from orchestrator.cloud.local.clock import ReplayClock
from orchestrator.cloud.local.reports import (
    DEFAULT_NOTICE_POLL_SECONDS,
    DEFAULT_READY_AFTER_SIM_SECONDS,
    REPORT_INTERVAL_SECONDS,
)
from orchestrator.errors import UserError
from orchestrator.logfmt import log_to_stderr

log = logging.getLogger("orchestrator.agent")


@dataclass(frozen=True)
class OfflineAgentConfig:
    """The offline agent's command line, validated."""

    metadata_url: str
    redis_url: str
    namespace: str
    work_rate: float
    clock_start_s: float
    clock_speed: float
    clock_wall_origin: float | None = None
    ready_after_sim_s: float = DEFAULT_READY_AFTER_SIM_SECONDS
    report_interval_s: float = REPORT_INTERVAL_SECONDS
    notice_poll_s: float = DEFAULT_NOTICE_POLL_SECONDS


def parse_args(argv: Sequence[str] | None = None) -> OfflineAgentConfig:
    """Parse the command line (exits with code 2 and usage on a bad one, as argparse does)."""
    p = argparse.ArgumentParser(
        prog="python -m orchestrator.agent",
        description="Instance agent of the offline world (trains with AgileML; accounts work).",
    )
    p.add_argument("--metadata-url", required=True, help="the instance's metadata service")
    p.add_argument("--redis-url", required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument("--work-rate", type=float, required=True, help="GPU-hours per hour")
    p.add_argument("--clock-start", type=float, required=True, help="sim epoch s at the origin")
    p.add_argument("--clock-speed", type=float, required=True, help="sim s per real s")
    p.add_argument(
        "--clock-wall-origin",
        type=float,
        default=None,
        help="time.monotonic() at which sim time was --clock-start (default: agent start)",
    )
    p.add_argument("--ready-after-sim-s", type=float, default=DEFAULT_READY_AFTER_SIM_SECONDS)
    p.add_argument("--report-interval-s", type=float, default=REPORT_INTERVAL_SECONDS)
    p.add_argument("--notice-poll-s", type=float, default=DEFAULT_NOTICE_POLL_SECONDS)
    a = p.parse_args(argv)
    if not (math.isfinite(a.work_rate) and a.work_rate >= 0):
        p.error(f"--work-rate must be finite and >= 0, got {a.work_rate}")
    if not (math.isfinite(a.clock_speed) and a.clock_speed > 0):
        p.error(f"--clock-speed must be positive, got {a.clock_speed}")
    if a.report_interval_s <= 0 or a.notice_poll_s <= 0:
        p.error("--report-interval-s and --notice-poll-s must be positive")
    return OfflineAgentConfig(
        metadata_url=a.metadata_url,
        redis_url=a.redis_url,
        namespace=a.namespace,
        work_rate=a.work_rate,
        clock_start_s=a.clock_start,
        clock_speed=a.clock_speed,
        clock_wall_origin=a.clock_wall_origin,
        ready_after_sim_s=a.ready_after_sim_s,
        report_interval_s=a.report_interval_s,
        notice_poll_s=a.notice_poll_s,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run an agent until SIGTERM/SIGINT or its parent dies. Exit code 0, or 2 for a bad
    command line, URL, tag or token."""
    config = parse_args(argv)
    stop = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    parent = os.getppid()
    clock = ReplayClock(
        config.clock_start_s, config.clock_speed, wall_origin=config.clock_wall_origin
    )
    try:
        identity = read_identity(config.metadata_url)
        log_to_stderr(f"agent[{identity.instance_id}]")
        token = None
        if identity.agileml_controller is not None:
            from orchestrator.agileml.token import token_from_env

            token = token_from_env()
        work = WorkReporter(
            config.redis_url,
            namespace=config.namespace,
            job_id=identity.job_id,
            instance_id=identity.instance_id,
            meter=WorkMeter(config.work_rate, clock.now(), config.ready_after_sim_s),
            clock=clock,
        )
    except (UserError, MetadataError, ValueError) as exc:
        log_to_stderr("agent")
        log.error("cannot start: %s", exc)
        return 2
    agent = InstanceAgent(
        identity,
        token=token,
        metadata_url=config.metadata_url,
        notice_poll_s=config.notice_poll_s,
        notice_clock=clock.now,
        work=work,
        exit_when_training_ends=False,
        parent_pid=parent,
        loop_interval_s=config.report_interval_s,
    )
    try:
        agent.run(stop)
    finally:
        work.close()
    log.info("agent exited", extra={"work_gpu_hours": work.meter.work_gpu_hours})
    return 0


if __name__ == "__main__":
    sys.exit(main())
