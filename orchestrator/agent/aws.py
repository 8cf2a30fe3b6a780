"""The instance agent on AWS (`orchestrator worker start`, a systemd service on every worker
that `infra/worker-boot.sh` sets up).

It reads who it is from the instance metadata service (IMDSv2 with instance tags), the job's
AgileML token from Secrets Manager, and runs the `InstanceAgent` until the node's training
ends, the node leaves after an interruption notice, or SIGTERM. The CLI exits non-zero when
the node failed or lost its controller, so that systemd restarts it.
"""

from __future__ import annotations

import dataclasses
import signal
import threading

from orchestrator.agent.identity import InstanceIdentity, read_identity
from orchestrator.agent.instance import NOTICE_POLL_SECONDS, AgentOutcome, InstanceAgent
from orchestrator.cloud.instances import TAG_AGILEML_CONTROLLER
from orchestrator.errors import UserError


def identify(metadata_url: str, agileml_controller: str | None) -> InstanceIdentity:
    """This instance's identity; `agileml_controller` (when given) overrides its tag.

    Raises:
        UserError: no elasticity controller to join (the job does not train), or no job tags.
        MetadataError: the metadata service is unreachable.
    """
    identity = read_identity(metadata_url)
    controller = agileml_controller or identity.agileml_controller
    if not controller:
        raise UserError(
            "no AgileML controller to join",
            field="--agileml-controller",
            fix=f"a training job's instances carry it in the {TAG_AGILEML_CONTROLLER} tag (the "
            "job's spec needs a `training` section); or pass --agileml-controller tcp://HOST:PORT",
        )
    return dataclasses.replace(identity, agileml_controller=controller)


def run_worker(
    identity: InstanceIdentity,
    *,
    token: bytes,
    metadata_url: str,
    notice_poll_s: float = NOTICE_POLL_SECONDS,
) -> AgentOutcome:
    """Join the job and train until it ends, the node leaves, or SIGTERM."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    agent = InstanceAgent(
        identity,
        token=token,
        metadata_url=metadata_url,
        notice_poll_s=notice_poll_s,
        exit_when_training_ends=True,
    )
    return agent.run(stop)
