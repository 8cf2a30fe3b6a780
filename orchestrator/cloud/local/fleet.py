"""`LocalFleet`: in the offline world, every running GPU instance of ours is a local process.

Each `step()`:

1. describes this controller's instances in moto;
2. for each GPU instance newly `running`: starts a `MetadataMock` (its instance metadata
   service, serving the instance's tags as AWS does, attached to the `EvictionReplayer` so
   that notices appear at its `/latest/meta-data/spot/instance-action`) and one instance agent
   process (`python -m orchestrator.agent`, the same agent as on AWS, forked from a server
   with torch and the runtime imported: `agileml.forked`) at the instance type's work rate
   (`Catalog.work_rate`). An instance launched with its job's elasticity controller in its
   tags (the controller's `TrainingHost` adds it) also trains, with the fleet's
   `training_token`: spot instances as transient AgileML nodes, on-demand ones (the CPU
   reliable tier included) as reliable nodes (BackupPS / ParamServ). A CPU instance that
   does not train gets no agent;
3. stops (SIGTERM, SIGKILL after `AGENT_STOP_TIMEOUT_SECONDS`) the agents of instances that are
   no longer running, and their metadata mocks;
4. reads each job's `{ns}:job:{job_id}:agent-work` hash (`cloud.local.reports`): each
   instance's simulated work (at its GPU type's rate on the market clock), handed to
   `record_instance_work` (BidBrain learns the job's work rates from it: the offline world's
   CPU processes cannot show one GPU type being faster than another). It is never a job's
   progress: a job's work done is what it trained, counted from its iterations by the
   controller's training host, as on AWS.

A typical instance: launched (pending) -> step: running, agent + mock started -> the agent
reports work after σ -> replayer: notice on the mock, agent stops counting at the eviction
time -> replayer terminates it in moto -> step: agent stopped, its work stays in the hash.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import TracebackType
from typing import Any, Self, cast

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

import orchestrator
from orchestrator.agileml import forked
from orchestrator.agileml.forked import Forked
from orchestrator.agileml.token import AGILEML_TOKEN_ENV
from orchestrator.cloud.ec2 import EC2Cloud
from orchestrator.cloud.errors import CloudError
from orchestrator.cloud.instances import (
    TAG_AGILEML_CONTROLLER,
    TAG_TIER,
    CloudInstance,
    InstanceState,
)
from orchestrator.cloud.local.clock import ReplayClock
from orchestrator.cloud.local.evictions import EvictionReplayer
from orchestrator.cloud.local.metadata_mock import MetadataMock
from orchestrator.cloud.local.reports import (
    DEFAULT_NOTICE_POLL_SECONDS,
    DEFAULT_READY_AFTER_SIM_SECONDS,
    REPORT_INTERVAL_SECONDS,
    AgentHeartbeat,
    agent_heartbeat_key,
    agent_work_key,
)
from orchestrator.errors import OrchestratorError, UserError
from orchestrator.market.catalog import Catalog
from orchestrator.units import SECONDS_PER_HOUR

log = logging.getLogger(__name__)

#: After SIGTERM, an agent exits within one report interval; then it is SIGKILLed.
AGENT_STOP_TIMEOUT_SECONDS = 5.0
AGENT_MODULE = "orchestrator.agent.offline"
REDIS_TIMEOUT_SECONDS = 2.0
LOG_TAIL_CHARS = 2000
MAX_LOG_LINE_CHARS = 500  # of an agent's last log line, in a stall's event

#: What the fleet does with a job's work per instance: (job_id, instance id -> (GPU-hours,
#: the hours it worked for them)).
RecordInstanceWork = Callable[[str, Mapping[str, tuple[float, float]]], object]


class ReportsUnavailableError(OrchestratorError):
    """The agents' reports could not be read: Redis did not answer."""


class LocalNodeState(StrEnum):
    """Lifecycle of one local node (the process standing in for an instance)::

        running --instance gone / close()--> stopped
        running --agent exited by itself--> exited --instance gone / close()--> stopped

    A node without an agent (CPU instance) is `running` until its instance goes. `stopped` is
    terminal; an exited agent is not restarted (its log says why it died).
    """

    RUNNING = "running"
    EXITED = "exited"
    STOPPED = "stopped"


_NODE_TRANSITIONS: dict[LocalNodeState, frozenset[LocalNodeState]] = {
    LocalNodeState.RUNNING: frozenset(
        {
            LocalNodeState.STOPPED,  # its instance is no longer running, or the fleet closes
            LocalNodeState.EXITED,  # the agent process ended on its own (a crash)
        }
    ),
    LocalNodeState.EXITED: frozenset(
        {LocalNodeState.STOPPED}
    ),  # its mock is stopped with the instance
    LocalNodeState.STOPPED: frozenset(),
}


@dataclass
class LocalNode:
    """One running instance of ours and what stands in for it locally."""

    instance: CloudInstance
    work_rate: float
    started_at_s: float
    process: Forked | None = None
    metadata: MetadataMock | None = None
    log_path: Path | None = None
    state: LocalNodeState = LocalNodeState.RUNNING

    @property
    def instance_id(self) -> str:
        return self.instance.instance_id

    def move(self, to: LocalNodeState) -> None:
        if to not in _NODE_TRANSITIONS[self.state]:
            raise RuntimeError(f"node {self.instance_id}: cannot go from {self.state} to {to}")
        self.state = to


@dataclass
class FleetStepReport:
    """What one `LocalFleet.step` did; `agent_work`: the simulated GPU-hours of each job's
    instances (their agents' reports; never the job's progress)."""

    now_s: float
    started: list[str] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    exited: list[str] = field(default_factory=list)
    agent_work: dict[str, float] = field(default_factory=dict)


class LocalFleet:
    """Instance agents for one controller's running GPU instances (see the module docstring).

    Args:
        redis_url: the store's Redis (agents report there).
        namespace: the store's namespace.
        clock: the world's replay clock; agents rebuild it from its start, speed and origin.
        cloud_client: a boto3 EC2 client (of the moto server).
        controller_id: whose instances to stand in for.
        replayer: gets each node's `MetadataMock` (so notices reach the agent), if given.
        catalog: work rates per instance type (default: the bundled catalog).
        log_dir: where agents' logs go (default: a temporary directory deleted by `close`).
        ready_after_sim_s: σ, passed to every agent.
        training_token: the AgileML token of the jobs that train (handed to their agents in
            the environment, never on argv); an instance trains when it carries the
            `orchestrator:agileml-controller` tag its controller launched it with.
        record_instance_work: receives each job's work per instance at every step (the
            store's `record_instance_work`: BidBrain learns the job's rates from it).
        true_work_rates: the rate per GPU model the agents work at, where the world's jobs
            run at other speeds than the catalog says (default: the catalog's).

    Not thread-safe: call `step` and `close` from one thread (the demo loop). Every agent and
    mock is stopped by `close` (or leaving the `with` block), also after a failure; an agent
    whose parent dies without `close` exits by itself within one report interval.

    Raises (on construction):
        ReportsUnavailableError: Redis does not answer.
    """

    def __init__(
        self,
        redis_url: str,
        namespace: str,
        clock: ReplayClock,
        *,
        cloud_client: Any,
        controller_id: str,
        replayer: EvictionReplayer | None = None,
        catalog: Catalog | None = None,
        log_dir: Path | str | None = None,
        ready_after_sim_s: float = DEFAULT_READY_AFTER_SIM_SECONDS,
        report_interval_s: float = REPORT_INTERVAL_SECONDS,
        notice_poll_s: float = DEFAULT_NOTICE_POLL_SECONDS,
        training_token: bytes | None = None,
        record_instance_work: RecordInstanceWork | None = None,
        true_work_rates: Mapping[str, float] | None = None,
    ) -> None:
        self.record_instance_work = record_instance_work
        self.true_work_rates = true_work_rates
        self.redis_url = redis_url
        self.training_token = training_token
        self.namespace = namespace
        self.clock = clock
        self.cloud = EC2Cloud(cloud_client.meta.region_name, controller_id, client=cloud_client)
        self.replayer = replayer
        self.catalog = catalog or Catalog.load()
        self.ready_after_sim_s = ready_after_sim_s
        self.report_interval_s = report_interval_s
        self.notice_poll_s = notice_poll_s
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="orchestrator-fleet-")
            log_dir = self._tmp.name
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # the agents' TMPDIR: an agent SIGKILLed at its stop deadline cannot remove its own
        # temporary folders (a pipeline node's), so the fleet removes them on `close`
        self._agents_tmp = tempfile.TemporaryDirectory(prefix="orchestrator-agents-")
        self.nodes: dict[str, LocalNode] = {}
        self._jobs: set[str] = set()
        self._redis = redis.Redis.from_url(
            redis_url,
            socket_timeout=REDIS_TIMEOUT_SECONDS,
            socket_connect_timeout=REDIS_TIMEOUT_SECONDS,
            retry=Retry(NoBackoff(), 0),
            decode_responses=True,
        )
        try:
            self._redis.ping()
        except redis.exceptions.RedisError as exc:
            self._redis.close()
            self._agents_tmp.cleanup()
            if self._tmp is not None:
                self._tmp.cleanup()
            raise ReportsUnavailableError(f"Redis does not answer: {exc}") from exc
        self._closed = False

    # -- the step -----------------------------------------------------------------------------

    def step(self) -> FleetStepReport:
        """Start, stop and account for agents (see the module docstring).

        Failure semantics: a failed DescribeInstances is logged and no agent is started or
        stopped this step; an agent or mock that fails to start is logged and retried at the
        next step; a failed progress write is logged and rewritten at the next step (the
        agents' hash is cumulative). Never raises for these.
        """
        now = self.clock.now()
        report = FleetStepReport(now)
        try:
            running = {
                i.instance_id: i for i in self.cloud.describe() if i.state is InstanceState.RUNNING
            }
        except CloudError as exc:
            log.warning("fleet: describe failed", extra={"error": str(exc)})
            running = None
        if running is not None:
            for instance_id, instance in running.items():
                if instance_id not in self.nodes:
                    node = self._start_node(instance, now)
                    if node is not None:
                        self.nodes[instance_id] = node
                        if node.process is not None:
                            report.started.append(instance_id)
            gone = [
                n
                for n in self.nodes.values()
                if n.state is not LocalNodeState.STOPPED and n.instance_id not in running
            ]
            self._stop_nodes(gone)
            report.stopped.extend(n.instance_id for n in gone)
        for node in self.nodes.values():
            if node.state is LocalNodeState.RUNNING and node.process is not None:
                code = node.process.poll()
                if code is not None:
                    node.move(LocalNodeState.EXITED)
                    report.exited.append(node.instance_id)
                    log.warning(
                        "instance agent exited by itself",
                        extra={
                            "instance_id": node.instance_id,
                            "exit_code": code,
                            "log_tail": _tail(node.log_path),
                        },
                    )
        report.agent_work = self._record_instance_work()
        return report

    def last_log_line(self, instance_id: str) -> str | None:
        """The last line its agent logged (None: no agent, or nothing logged yet); the
        controller names it when it releases a job's instances for want of progress."""
        node = self.nodes.get(instance_id)
        lines = _tail(node.log_path if node is not None else None).strip().splitlines()
        return lines[-1][-MAX_LOG_LINE_CHARS:] if lines else None

    def _worked(self, job_id: str) -> dict[str, tuple[float, float]]:
        """Each instance's work and the hours it worked for it, from its last heartbeat (one
        write of the agent's: the two agree)."""
        return {
            i: (beat.work_gpu_hours, beat.worked_s / SECONDS_PER_HOUR)
            for i, beat in self.heartbeats_of(job_id).items()
            if 0 < beat.worked_s < math.inf and 0 <= beat.work_gpu_hours < math.inf
        }

    def work_of(self, job_id: str) -> dict[str, float]:
        """The job's agents' cumulative work, per instance (GPU-hours); bad values are logged
        and left out.

        Raises:
            ReportsUnavailableError: Redis did not answer.
        """
        raw = self._hgetall(agent_work_key(self.namespace, job_id))
        out: dict[str, float] = {}
        for instance_id, value in raw.items():
            try:
                out[instance_id] = float(value)
            except ValueError:
                log.warning("bad agent work value", extra={"instance_id": instance_id})
        return out

    def heartbeats_of(self, job_id: str) -> dict[str, AgentHeartbeat]:
        """The job's agents' last heartbeats, per instance; bad values are logged and left out.

        Raises:
            ReportsUnavailableError: Redis did not answer.
        """
        out: dict[str, AgentHeartbeat] = {}
        for instance_id, value in self._hgetall(
            agent_heartbeat_key(self.namespace, job_id)
        ).items():
            try:
                out[instance_id] = AgentHeartbeat.from_json(value)
            except ValueError:
                log.warning("bad agent heartbeat", extra={"instance_id": instance_id})
        return out

    def _hgetall(self, key: str) -> dict[str, str]:
        try:
            return cast(dict[str, str], self._redis.hgetall(key))
        except redis.exceptions.RedisError as exc:
            raise ReportsUnavailableError(f"cannot read {key}: {exc}") from exc

    def _record_instance_work(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for job_id in sorted(self._jobs):
            try:
                totals[job_id] = sum(self.work_of(job_id).values())
                if self.record_instance_work is not None:
                    self.record_instance_work(job_id, self._worked(job_id))
            except OrchestratorError as exc:  # Redis or the store: rewritten at the next step
                log.warning(
                    "fleet: instance work not recorded",
                    extra={"job_id": job_id, "error": str(exc)},
                )
        return totals

    # -- nodes ----------------------------------------------------------------------------------

    def _rates(self) -> dict[str, float] | None:
        if not self.true_work_rates:
            return None
        return {**self.catalog.gpu_work_rates, **self.true_work_rates}

    def _start_node(self, instance: CloudInstance, now: float) -> LocalNode | None:
        try:
            work_rate = self.catalog.work_rate(instance.instance_type, self._rates())
        except UserError as exc:
            log.warning(
                "fleet: no work rate; no agent",
                extra={"instance_id": instance.instance_id, "error": str(exc)},
            )
            work_rate = 0.0
        node = LocalNode(instance, work_rate, now)
        trains = self.training_token is not None and TAG_AGILEML_CONTROLLER in instance.tags
        if instance.job_id is None or (work_rate <= 0 and not trains):
            return node  # not a job's instance, or a CPU node with nothing to train
        self._jobs.add(instance.job_id)
        mock = MetadataMock(instance.instance_id, tags=self._tags_of(instance))
        try:
            mock.start()
            node.metadata = mock
            node.log_path = self.log_dir / f"{instance.instance_id}.log"
            node.process = self._spawn(instance, work_rate, mock.base_url, node.log_path)
        except OSError as exc:
            log.warning(
                "fleet: node start failed; retried next step",
                extra={"instance_id": instance.instance_id, "error": str(exc)},
            )
            mock.stop()
            return None
        if self.replayer is not None:
            self.replayer.attach_metadata(instance.instance_id, mock)
        log.info(
            "instance agent started",
            extra={
                "instance_id": instance.instance_id,
                "instance_type": instance.instance_type,
                "job_id": instance.job_id,
                "work_rate": work_rate,
                "pid": node.process.pid,
                "metadata_url": mock.base_url,
                "log": str(node.log_path),
            },
        )
        return node

    def _tags_of(self, instance: CloudInstance) -> dict[str, str]:
        """The tags the instance's metadata serves: its EC2 tags, as on AWS (the agent reads
        who it is from them), without the training controller when no token was given."""
        tags = {TAG_TIER: "spot" if instance.lifecycle == "spot" else "reliable"}
        tags.update(instance.tags)
        if self.training_token is None:
            tags.pop(TAG_AGILEML_CONTROLLER, None)
        return tags

    def _spawn(
        self, instance: CloudInstance, work_rate: float, metadata_url: str, log_path: Path
    ) -> Forked:
        argv = [
            "--redis-url", self.redis_url,
            "--namespace", self.namespace,
            "--work-rate", repr(work_rate),
            "--clock-start", repr(self.clock.start_s),
            "--clock-speed", repr(self.clock.speed),
            "--clock-wall-origin", repr(self.clock.wall_origin),
            "--metadata-url", metadata_url,
            "--ready-after-sim-s", repr(self.ready_after_sim_s),
            "--report-interval-s", repr(self.report_interval_s),
            "--notice-poll-s", repr(self.notice_poll_s),
        ]  # fmt: skip
        env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=self._agents_tmp.name)
        if self.training_token is not None:
            env[AGILEML_TOKEN_ENV] = self.training_token.hex()
        source_root = str(Path(orchestrator.__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (source_root, env.get("PYTHONPATH")) if p)
        log_path.touch()
        # `python -m orchestrator.agent` runs this module's `main`
        return forked.start(AGENT_MODULE, argv, env=env, stdout=log_path, stderr=log_path)

    def _stop_nodes(self, nodes: Iterable[LocalNode]) -> None:
        """SIGTERM every agent at once, then wait for each (SIGKILL at the deadline); stop
        their mocks and detach them from the replayer. Never raises for a dead process."""
        nodes = list(nodes)
        for node in nodes:
            if node.process is not None and node.process.poll() is None:
                node.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + AGENT_STOP_TIMEOUT_SECONDS
        for node in nodes:
            proc = node.process
            if proc is not None:
                try:
                    proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
                except subprocess.TimeoutExpired:
                    log.warning("instance agent ignored SIGTERM; killed", extra={"pid": proc.pid})
                    proc.kill()
                    proc.wait()
            if self.replayer is not None:
                self.replayer.detach_metadata(node.instance_id)
            if node.metadata is not None:
                node.metadata.stop()
            node.move(LocalNodeState.STOPPED)
            log.info(
                "node stopped",
                extra={
                    "instance_id": node.instance_id,
                    "exit_code": None if proc is None else proc.returncode,
                },
            )

    # -- lifecycle --------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every agent and mock, close the Redis clients, delete the agents' temporary
        folders and the temporary log directory (a `log_dir` given is kept). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._stop_nodes(
                n for n in self.nodes.values() if n.state is not LocalNodeState.STOPPED
            )
        finally:
            self._redis.close()
            self._agents_tmp.cleanup()
            if self._tmp is not None:
                self._tmp.cleanup()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _tail(path: Path | None) -> str:
    if path is None or not path.exists():
        return ""
    return path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
