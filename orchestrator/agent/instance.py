"""`InstanceAgent`: the one process that runs on an instance of a job, on AWS and offline alike.

It joins the job's AgileML elasticity controller as a node of the instance's tier (when the job
trains), watches the instance's metadata service for the spot interruption notice and turns it
into the node's eviction notice (hand the partitions off, then leave: two minutes, DESIGN §5),
and, in the offline world, accounts the instance's work on the world's faster clock
(`agent.work`).

    agent = InstanceAgent(identity, token=token, metadata_url=url)
    outcome = agent.run(stop)  # until training ends (AWS) or `stop` is set / the parent dies

Failure semantics: an error that ends the AgileML node is returned in the outcome (the AWS
entry point exits non-zero on it so that systemd restarts the agent; offline it is logged and
the agent goes on accounting work until its instance goes). A node still training when the
agent stops is stopped (the elasticity controller treats it as failed and rolls back).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from orchestrator.agent.identity import InstanceIdentity
from orchestrator.agent.logship import LogShipper
from orchestrator.agent.work import WorkReporter
from orchestrator.cloud.imds import NoticeWatcher
from orchestrator.cloud.notices import InterruptionNotice

if TYPE_CHECKING:
    from orchestrator.agileml.node import AgileMLNode, NodeResult
    from orchestrator.agileml.pipeline.node import PipelineNode

log = logging.getLogger(__name__)

#: Real seconds between two checks of the agent's loop (stop, parent, training).
LOOP_INTERVAL_SECONDS = 0.2
#: Real seconds a stopped AgileML node may take to exit.
NODE_STOP_TIMEOUT_SECONDS = 30.0
#: Real seconds between metadata polls on AWS (the notice comes two minutes ahead).
NOTICE_POLL_SECONDS = 5.0


@dataclass
class AgentOutcome:
    """How an agent's run ended: the AgileML node's result (None: the instance did not train,
    or the agent stopped first), the error that ended the node (if one did), the notices."""

    training: NodeResult | None = None
    error: BaseException | None = None
    notices: list[InterruptionNotice] = field(default_factory=list)

    @property
    def ended(self) -> str:
        """`done`, `left`, `lost_controller` (the node's), `failed` or `stopped`."""
        if self.error is not None:
            return "failed"
        return "stopped" if self.training is None else self.training.ended


class InstanceAgent:
    """The process on one instance (see the module docstring).

    Args:
        identity: who the instance is; `identity.agileml_controller` None: it does not train.
        token: the job's AgileML token (required to train).
        metadata_url: the instance metadata service to watch for notices (None: none).
        notice_poll_s: real seconds between metadata polls.
        notice_clock: the clock notices are judged on (offline: the world's replay clock).
        work: the offline world's work account, reported every loop (None on AWS).
        exit_when_training_ends: return once the node is done or has left (AWS); otherwise
            run until `stop` is set (offline: the fleet stops the agent with its instance).
        parent_pid: return when the parent process is no longer this one (offline: the
            agent never outlives the world that started it).
    """

    def __init__(
        self,
        identity: InstanceIdentity,
        *,
        token: bytes | None,
        metadata_url: str | None,
        notice_poll_s: float = NOTICE_POLL_SECONDS,
        notice_clock: Callable[[], float] = time.time,
        work: WorkReporter | None = None,
        exit_when_training_ends: bool = True,
        parent_pid: int | None = None,
        loop_interval_s: float = LOOP_INTERVAL_SECONDS,
    ) -> None:
        if identity.agileml_controller is not None and token is None:
            raise ValueError("an instance that trains needs the job's token")
        self.identity = identity
        self.metadata_url = metadata_url
        self.notice_poll_s = notice_poll_s
        self.notice_clock = notice_clock
        self.work = work
        self.exit_when_training_ends = exit_when_training_ends
        self.parent_pid = parent_pid
        self.loop_interval_s = loop_interval_s
        self.outcome = AgentOutcome()
        self.node: AgileMLNode | PipelineNode | None = None
        self._token = token

    def on_notice(self, notice: InterruptionNotice) -> None:
        """An interruption: count no work past its time, hand off and leave (a rebalance
        recommendation is only logged)."""
        self.outcome.notices.append(notice)
        log.warning(
            "spot %s notice",
            notice.kind,
            extra={"action": notice.action, "notice_time": notice.notice_time.isoformat()},
        )
        if notice.kind != "interruption":
            return
        if self.work is not None:
            self.work.meter.stop_at(notice.notice_time.timestamp())
        if self.node is not None:
            self.node.leave()

    def run(self, stop: threading.Event) -> AgentOutcome:
        """Train and watch until done (see the class docstring); the outcome says how it
        ended."""
        shipper = LogShipper(self.identity.instance_id, self.identity.job_id, "agent")
        logging.getLogger().addHandler(shipper)
        shipper.start(self._artifact_store)
        watcher: NoticeWatcher | None = None
        trainer: threading.Thread | None = None
        try:
            watcher = self._start_watcher()
            trainer = self._start_training()
        except BaseException:
            shipper.stop()
            logging.getLogger().removeHandler(shipper)
            raise
        log.info(
            "instance agent started",
            extra={"instance_id": self.identity.instance_id, "job_id": self.identity.job_id,
                   "tier": self.identity.tier, "trains": trainer is not None},
        )  # fmt: skip
        try:
            while True:
                if self.work is not None:
                    self.work.report()
                if stop.wait(self.loop_interval_s) or self._parent_gone():
                    break
                training_over = trainer is None or not trainer.is_alive()
                if self.exit_when_training_ends and training_over:
                    break
        finally:
            if watcher is not None:
                watcher.stop()
            if trainer is not None and trainer.is_alive() and self.node is not None:
                self.node.stop()
                trainer.join(timeout=NODE_STOP_TIMEOUT_SECONDS)
            log.info(
                "instance agent stopped",
                extra={"instance_id": self.identity.instance_id, "ended": self.outcome.ended},
            )
            shipper.stop()  # its last write
            logging.getLogger().removeHandler(shipper)
        return self.outcome

    def _artifact_store(self) -> str | None:
        """The job's artifact store, once the node has joined (its spec names it)."""
        return self.node.artifact_store if self.node is not None else None

    def _start_watcher(self) -> NoticeWatcher | None:
        if self.metadata_url is None:
            return None
        watcher = NoticeWatcher(
            self.metadata_url,
            on_notice=self.on_notice,
            poll_interval_s=self.notice_poll_s,
            instance_id=self.identity.instance_id,
            wall_clock=self.notice_clock,
        )
        watcher.start()
        return watcher

    def _start_training(self) -> threading.Thread | None:
        """The AgileML node on a thread, if the instance trains; None otherwise."""
        ident = self.identity
        if ident.agileml_controller is None:
            return None
        # imported here: torch takes seconds to load, and an agent that does not train must
        # start (and see notices) at once
        from orchestrator.agileml.elasticity import NodeTier
        from orchestrator.agileml.node import AgileMLNode
        from orchestrator.agileml.pipeline.node import PipelineNode

        assert self._token is not None
        node: AgileMLNode | PipelineNode
        if ident.parallelism == "pipeline":
            node = PipelineNode(
                ident.instance_id,
                ident.tier,
                job_id=ident.job_id,
                controller=ident.agileml_controller,
                token=self._token,
                host=ident.host,
            )
        else:
            node = AgileMLNode(
                ident.instance_id,
                NodeTier(ident.tier),
                job_id=ident.job_id,
                controller=ident.agileml_controller,
                token=self._token,
                host=ident.host,
            )
        self.node = node

        def train() -> None:
            try:
                self.outcome.training = node.run()
                log.info("training ended", extra={"ended": self.outcome.training.ended})
            except BaseException as exc:  # noqa: BLE001 - handed to the caller in the outcome
                log.exception("training failed")
                self.outcome.error = exc

        thread = threading.Thread(target=train, name="agileml", daemon=True)
        thread.start()
        return thread

    def _parent_gone(self) -> bool:
        if self.parent_pid is None or os.getppid() == self.parent_pid:
            return False
        log.warning("parent process gone; exiting")
        return True
