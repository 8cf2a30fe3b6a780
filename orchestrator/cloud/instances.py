"""What the orchestrator's instances are, whatever cloud runs them: the tags that say whose
they are, their lifecycle as observed, and the spec of a launch (`Cloud` implementations share
these, so EC2 and the in-memory fake refuse and report the same things).
"""

from __future__ import annotations

import hashlib
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.bidbrain.model import AllocationRequest
from orchestrator.cloud.errors import CloudError
from orchestrator.market.prices import Market, region_of_zone

TAG_CONTROLLER = "orchestrator:controller-id"
TAG_JOB = "orchestrator:job-id"
TAG_ALLOCATION = "orchestrator:allocation-id"
TAG_TIER = "orchestrator:tier"  # "spot" | "reliable"
#: Where a training job's AgileML elasticity controller listens (`tcp://host:port`), set by
#: the controller's `TrainingHost` on AWS and read by `orchestrator worker start`.
TAG_AGILEML_CONTROLLER = "orchestrator:agileml-controller"
#: How a training job trains: `pipeline` (its agents run stage workers, `agileml.pipeline`);
#: absent: data-parallel (AgileML nodes).
TAG_PARALLELISM = "orchestrator:parallelism"
#: The spot max price the instance was launched with; DescribeInstances does not report it.
TAG_MAX_PRICE = "orchestrator:max-price-usd-per-hour"

#: Placeholder AMI for offline runs (moto accepts any id); live runs must pass a real image.
OFFLINE_IMAGE_ID = "ami-orchestrator"
#: AWS refuses spot max prices at or below $0.001/h.
MIN_SPOT_PRICE_USD_PER_HOUR = 0.001
#: EC2 allows ClientToken values of up to 64 ASCII characters.
CLIENT_TOKEN_MAX_CHARS = 64

#: RunInstances codes meaning "EC2 cannot give us these instances now" (see `availability`).
CAPACITY_CODES = frozenset(
    {
        "InsufficientInstanceCapacity",
        "MaxSpotInstanceCountExceeded",
        "SpotMaxPriceTooLow",
        "Unsupported",
        "InstanceLimitExceeded",
        "VcpuLimitExceeded",
    }
)
THROTTLE_CODES = frozenset({"RequestLimitExceeded", "Throttling"})


class InstanceState(StrEnum):
    """EC2's instance lifecycle, as observed (the controller cannot refuse EC2's moves)::

        pending -> running -> stopping -> stopped -> pending      (stop / start)
        pending | running | stopping | stopped -> shutting-down -> terminated

    Our spot instances are one-time with interruption behaviour "terminate": an interruption
    is running -> shutting-down -> terminated. `shutting-down` is already gone for our purposes:
    it cannot come back and is no longer billed.
    """

    PENDING = "pending"
    RUNNING = "running"
    SHUTTING_DOWN = "shutting-down"
    TERMINATED = "terminated"
    STOPPING = "stopping"
    STOPPED = "stopped"

    @property
    def is_gone(self) -> bool:
        return self in (InstanceState.SHUTTING_DOWN, InstanceState.TERMINATED)


LIVE_STATES = tuple(s for s in InstanceState if not s.is_gone)


class CloudInstance(BaseModel, frozen=True):
    """One of our instances as EC2 reports it (live state, not a spec).

    `job_id` and `allocation_id` are None when the instance lacks those tags (never the case
    for instances `EC2Cloud.launch` started).
    """

    instance_id: str
    instance_type: str
    zone: str
    state: InstanceState
    lifecycle: Literal["spot", "on-demand"]
    job_id: str | None
    allocation_id: str | None
    controller_id: str
    launched_at: datetime
    max_price_usd_per_hour: float | None = None
    tags: dict[str, str] = {}  # every tag EC2 reports (ours parsed into the fields above)

    @property
    def market(self) -> Market:
        return Market(self.instance_type, self.zone)


class LaunchSpec(BaseModel):
    """What to launch for one allocation: `count` instances of one market, all or nothing.

    `max_price_usd_per_hour` None means on-demand (the reliable tier); otherwise it is the spot
    bid, which must exceed $0.001 (`EC2Cloud.launch` refuses it otherwise).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    job_id: str = Field(min_length=1)
    allocation_id: str = Field(min_length=1)
    instance_type: str = Field(min_length=1)
    zone: str = Field(min_length=1)
    count: Annotated[int, Field(gt=0)]
    max_price_usd_per_hour: Annotated[float, Field(allow_inf_nan=False)] | None = None
    image_id: str = OFFLINE_IMAGE_ID
    user_data: str = ""
    key_name: str | None = None
    security_group_ids: tuple[str, ...] = ()
    extra_tags: dict[str, str] = Field(
        default_factory=dict, description="more instance tags (the orchestrator's own win)"
    )

    @classmethod
    def from_request(
        cls, request: AllocationRequest, *, job_id: str, allocation_id: str, **options: Any
    ) -> LaunchSpec:
        """The launch of a BidBrain `AllocationRequest` (options: image_id, user_data, ...)."""
        return cls(
            job_id=job_id,
            allocation_id=allocation_id,
            instance_type=request.instance_type,
            zone=request.zone,
            count=request.count,
            max_price_usd_per_hour=request.max_price_usd_per_hour,
            **options,
        )

    @property
    def market(self) -> Market:
        return Market(self.instance_type, self.zone)

    @property
    def is_spot(self) -> bool:
        return self.max_price_usd_per_hour is not None

    @property
    def tier(self) -> Literal["spot", "reliable"]:
        return "spot" if self.is_spot else "reliable"

    def client_token(self, controller_id: str) -> str:
        """RunInstances' idempotency token: the same for every retry of this allocation by this
        controller, different for any other (a hash, so always <= 64 ASCII characters)."""
        digest = hashlib.sha256(f"{controller_id}\n{self.allocation_id}".encode()).hexdigest()
        return f"orchestrator-{digest}"[:CLIENT_TOKEN_MAX_CHARS]

    def checked_max_price(self, region: str) -> str | None:
        """Refuse what EC2 would refuse (a zone of another region, a spot price <= $0.001);
        return the spot max price as RunInstances takes it (None for on-demand).

        Raises:
            CloudError: code InvalidParameterValue (nothing was sent to the cloud).
        """
        operation = "RunInstances"
        if region_of_zone(self.zone) != region:
            raise CloudError(
                f"zone {self.zone} is not in region {region}",
                code="InvalidParameterValue",
                operation=operation,
            )
        if self.max_price_usd_per_hour is None:
            return None
        price = round(self.max_price_usd_per_hour, 6)
        if not price > MIN_SPOT_PRICE_USD_PER_HOUR:
            raise CloudError(
                f"spot max price ${self.max_price_usd_per_hour}/h for {self.market} must exceed "
                f"${MIN_SPOT_PRICE_USD_PER_HOUR}/h",
                code="InvalidParameterValue",
                operation=operation,
            )
        return str(price)

    def tags(self, controller_id: str, max_price: str | None) -> dict[str, str]:
        """The instance tags of this launch: its extra tags, then ours (ours win)."""
        tags = {
            **self.extra_tags,
            TAG_CONTROLLER: controller_id,
            TAG_JOB: self.job_id,
            TAG_ALLOCATION: self.allocation_id,
            TAG_TIER: self.tier,
        }
        if max_price is not None:
            tags[TAG_MAX_PRICE] = max_price
        return tags


def check_allocation_market(found: list[CloudInstance], spec: LaunchSpec) -> None:
    """Refuse a launch whose allocation already has instances in another market.

    Raises:
        CloudError: code IdempotentParameterMismatch.
    """
    wrong = [i for i in found if i.market != spec.market]
    if wrong:
        raise CloudError(
            f"allocation {spec.allocation_id} already has instances in {wrong[0].market} "
            f"({wrong[0].instance_id}), not {spec.market}",
            code="IdempotentParameterMismatch",
            operation="RunInstances",
        )


def instance_from_tags(
    *,
    instance_id: str,
    instance_type: str,
    zone: str,
    state: InstanceState,
    lifecycle: Literal["spot", "on-demand"],
    launched_at: datetime,
    tags: dict[str, str],
    controller_id: str,
) -> CloudInstance:
    """A `CloudInstance` with the fields our tags carry parsed from `tags`."""
    return CloudInstance(
        instance_id=instance_id,
        instance_type=instance_type,
        zone=zone,
        state=state,
        lifecycle=lifecycle,
        job_id=tags.get(TAG_JOB),
        allocation_id=tags.get(TAG_ALLOCATION),
        controller_id=tags.get(TAG_CONTROLLER, controller_id),
        launched_at=launched_at,
        max_price_usd_per_hour=_float_or_none(tags.get(TAG_MAX_PRICE)),
        tags=tags,
    )


def _float_or_none(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return None
