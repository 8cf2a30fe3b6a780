"""`orchestrator worker start`: what a worker instance runs on AWS.

`infra/worker-boot.sh` makes it a systemd service on every instance launched from the workers'
launch template. It reads who it is from the instance metadata service (IMDSv2; the launch
template enables instance tags): its instance id, private address, and the job and tier in
the `orchestrator:job-id`, `orchestrator:tier` and `orchestrator:agileml-controller` tags the
controller launched it with. It reads
the AgileML token from Secrets Manager, joins the job's elasticity controller as an AgileML node
and watches the metadata service for the spot interruption notice, on which the node hands its
partitions off and leaves (two minutes, DESIGN §5). It exits non-zero when the node fails or
loses its controller, so that systemd restarts it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orchestrator.cloud.ec2 import TAG_AGILEML_CONTROLLER, TAG_CONTROLLER, TAG_JOB, TAG_TIER
from orchestrator.cloud.imds import (
    INSTANCE_ID_PATH,
    INSTANCE_TAG_PATH,
    LOCAL_IPV4_PATH,
    InterruptionNotice,
    NoticeWatcher,
    read_metadata,
)
from orchestrator.errors import UserError

if TYPE_CHECKING:
    from orchestrator.agileml.node import AgileMLNode, NodeResult

log = logging.getLogger("orchestrator.worker")

#: The EC2 tier tag's values -> AgileML's tiers.
AGILEML_TIER_OF = {"spot": "transient", "reliable": "reliable"}
NOTICE_POLL_SECONDS = 5.0


@dataclass(frozen=True)
class WorkerIdentity:
    """Who this instance is, from its metadata and tags."""

    instance_id: str
    host: str
    job_id: str
    tier: str  # AgileML's: "transient" | "reliable"
    controller_id: str | None
    agileml_controller: str | None = None  # the job's elasticity controller, from its tag


def read_identity(metadata_url: str) -> WorkerIdentity:
    """This instance's id, address, job and tier from the metadata service.

    Raises:
        UserError: the job or tier tag is missing or unknown (not launched by the controller
            from the worker launch template, or instance tags are off in the metadata service).
        MetadataError: the metadata service is unreachable.
    """
    keys = (TAG_JOB, TAG_TIER, TAG_CONTROLLER, TAG_AGILEML_CONTROLLER)
    tag_paths = {key: INSTANCE_TAG_PATH + key for key in keys}
    found = read_metadata(metadata_url, [INSTANCE_ID_PATH, LOCAL_IPV4_PATH, *tag_paths.values()])
    job_id, tier = found[tag_paths[TAG_JOB]], found[tag_paths[TAG_TIER]]
    if not job_id or tier not in AGILEML_TIER_OF:
        raise UserError(
            f"this instance's metadata has no usable {TAG_JOB} / {TAG_TIER} tags "
            f"(got {job_id!r}, {tier!r})",
            fix="workers are launched by the controller (which tags them) from the worker "
            "launch template (which sets InstanceMetadataTags=enabled); see infra/",
        )
    return WorkerIdentity(
        instance_id=found[INSTANCE_ID_PATH] or "",
        host=found[LOCAL_IPV4_PATH] or "127.0.0.1",
        job_id=job_id,
        tier=AGILEML_TIER_OF[tier],
        controller_id=found[tag_paths[TAG_CONTROLLER]],
        agileml_controller=found[tag_paths[TAG_AGILEML_CONTROLLER]],
    )


def worker_token(secret_value: str) -> bytes:
    """The AgileML token from the worker-token secret (hex, as `orchestrator deploy` writes it).

    Raises:
        UserError: the secret does not hold hex.
    """
    try:
        token = bytes.fromhex(secret_value.strip())
    except ValueError:
        token = b""
    if len(token) < 16:
        raise UserError(
            "the worker token secret must hold at least 16 bytes as hex",
            fix="put `python -c 'import secrets; print(secrets.token_hex(32))'` in it",
        )
    return token


class Worker:
    """One AgileML node plus the spot-notice watcher; `run` blocks until training ends or
    `stop` is set."""

    def __init__(
        self,
        identity: WorkerIdentity,
        *,
        agileml_controller: str,
        token: bytes,
        metadata_url: str,
        notice_poll_s: float = NOTICE_POLL_SECONDS,
    ) -> None:
        self.identity = identity
        self.agileml_controller = agileml_controller
        self.metadata_url = metadata_url
        self.notice_poll_s = notice_poll_s
        self.notices: list[InterruptionNotice] = []
        self._token = token
        self.node: AgileMLNode | None = None

    def on_notice(self, notice: InterruptionNotice) -> None:
        """An interruption: hand off and leave (a rebalance recommendation is only logged)."""
        self.notices.append(notice)
        log.warning("spot %s notice", notice.kind, extra={"action": notice.action})
        if notice.kind == "interruption" and self.node is not None:
            self.node.leave()

    def run(self, stop: threading.Event) -> NodeResult | None:
        """Join the job and train until it ends, the node leaves, or `stop` is set (None).

        Raises:
            Exception: whatever ended the AgileML node (e.g. it could not join).
        """
        from orchestrator.agileml.elasticity import NodeTier
        from orchestrator.agileml.node import AgileMLNode  # torch: load only when training

        ident = self.identity
        self.node = AgileMLNode(
            ident.instance_id,
            NodeTier(ident.tier),
            job_id=ident.job_id,
            controller=self.agileml_controller,
            token=self._token,
            host=ident.host,
        )
        outcome: list[NodeResult | BaseException] = []

        def train() -> None:
            try:
                outcome.append(self.node.run())  # type: ignore[union-attr]
            except BaseException as exc:  # noqa: BLE001 - re-raised in `run`'s thread
                outcome.append(exc)

        trainer = threading.Thread(target=train, name="agileml", daemon=True)
        watcher = NoticeWatcher(
            self.metadata_url,
            on_notice=self.on_notice,
            poll_interval_s=self.notice_poll_s,
            instance_id=ident.instance_id,
        )
        log.info(
            "worker joining",
            extra={
                "job_id": ident.job_id,
                "tier": ident.tier,
                "controller": self.agileml_controller,
            },
        )
        watcher.start()
        trainer.start()
        try:
            while trainer.is_alive() and not stop.wait(0.2):
                pass
        finally:
            watcher.stop()
            if trainer.is_alive():
                self.node.stop()
                trainer.join(timeout=30)
        if outcome and isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0] if outcome else None
