"""Who an instance is, from its instance metadata service: its id, address, job and AgileML
tier, and where the job's elasticity controller listens.

On AWS the controller launches workers from the launch template (which enables instance tags
in the metadata service) with the `orchestrator:*` tags; offline, the local fleet serves the
same tags from each instance's metadata mock. Either way the agent reads them the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from orchestrator.cloud.imds import read_metadata
from orchestrator.cloud.imds_wire import INSTANCE_ID_PATH, INSTANCE_TAG_PATH, LOCAL_IPV4_PATH
from orchestrator.cloud.instances import (
    TAG_AGILEML_CONTROLLER,
    TAG_CONTROLLER,
    TAG_JOB,
    TAG_PARALLELISM,
    TAG_TIER,
)
from orchestrator.errors import UserError

AgileMLTier = Literal["transient", "reliable"]
#: The EC2 tier tag's values -> AgileML's tiers.
AGILEML_TIER_OF: dict[str, AgileMLTier] = {"spot": "transient", "reliable": "reliable"}


@dataclass(frozen=True)
class InstanceIdentity:
    """Who this instance is (from its metadata and tags)."""

    instance_id: str
    job_id: str
    tier: AgileMLTier
    host: str = "127.0.0.1"  # the address the job's other nodes reach this one at
    controller_id: str | None = None
    agileml_controller: str | None = None  # the job's elasticity controller (None: no training)
    parallelism: Literal["data", "pipeline"] = "data"  # pipeline: it runs stage workers


def read_identity(metadata_url: str) -> InstanceIdentity:
    """This instance's identity from the metadata service at `metadata_url`.

    Raises:
        UserError: the job or tier tag is missing or unknown (not launched by the controller
            from the worker launch template, or instance tags are off in the metadata service).
        MetadataError: the metadata service is unreachable.
    """
    keys = (TAG_JOB, TAG_TIER, TAG_CONTROLLER, TAG_AGILEML_CONTROLLER, TAG_PARALLELISM)
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
    return InstanceIdentity(
        instance_id=found[INSTANCE_ID_PATH] or "",
        job_id=job_id,
        tier=AGILEML_TIER_OF[tier],
        host=found[LOCAL_IPV4_PATH] or "127.0.0.1",
        controller_id=found[tag_paths[TAG_CONTROLLER]],
        agileml_controller=found[tag_paths[TAG_AGILEML_CONTROLLER]],
        parallelism="pipeline" if found[tag_paths[TAG_PARALLELISM]] == "pipeline" else "data",
    )
