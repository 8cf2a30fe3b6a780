"""`EC2Cloud`: launch, list and terminate the orchestrator's EC2 instances (a thin boto3 adapter).

Every instance is tagged with the controller, job and allocation that own it and its tier, so
that a restarted controller can find what it owns (`describe`) and `Reconciler` can clean up.

Failure semantics:
    * Transient failures are retried by botocore itself, with the policy of every AWS call of
      the orchestrator (`orchestrator.aws`: "adaptive" mode, client side rate limiting on top
      of exponential backoff, `max_attempts=8`, which botocore counts as retries: up to 9
      attempts per call). This module adds no retry loop of its own.
    * What remains is raised as a `CloudError` carrying the AWS code and the operation:
      `ThrottledError` for RequestLimitExceeded, `CapacityError` for the capacity and limit
      codes of RunInstances (`CAPACITY_CODES`), `CloudError` for anything else (including
      botocore errors raised before a response, e.g. NoCredentialsError, with the exception
      class name as code).
    * Launches are idempotent per (controller, allocation): RunInstances carries a ClientToken
      derived from both, and `launch` first looks for instances already tagged with the
      allocation. Retrying a `launch` with the same spec never launches twice.

Behaviour of moto 5.2 (what the offline tests run against):
    * RunInstances accepts any instance type string, including p2/p3 types, which are missing
      from moto's offering data. With `MOTO_EC2_ENABLE_INSTANCE_TYPE_VALIDATION=true` it rejects
      types not offered anywhere in the region (p2.*, p3.2xlarge: InvalidInstanceType.NotFound)
      but does not check the type against the requested zone. g4dn.xlarge and c5.xlarge are
      offered in us-east-1a/b/c/d/f. A zone outside the region is rejected
      (InvalidParameterValue).
    * ClientToken is stored on the instance but NOT honoured: a repeated call launches again.
      Hence the allocation-tag lookup before RunInstances, which also covers a token AWS has
      forgotten. (On AWS, the token covers the seconds in which a new instance is not yet
      visible to a tag-filtered DescribeInstances.)
    * InstanceMarketOptions with MarketType "spot" gives `InstanceLifecycle == "spot"` (absent
      for on-demand); no spot request id is returned, and MaxPrice is not validated (so the
      $0.001 floor is checked here). Volume TagSpecifications are accepted and applied.
    * TerminateInstances with an unknown id fails the whole call with InvalidInstanceID.NotFound
      naming the id (as AWS does: none of the instances is terminated); terminating an already
      terminated instance succeeds.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

import boto3
from botocore.exceptions import BotoCoreError, ClientError
from pydantic import BaseModel, ConfigDict, Field

from orchestrator.aws import aws_client
from orchestrator.bidbrain.model import AllocationRequest
from orchestrator.cloud.errors import CapacityError, CloudError, ThrottledError
from orchestrator.market.prices import Market, region_of_zone

log = logging.getLogger(__name__)

TAG_CONTROLLER = "orchestrator:controller-id"
TAG_JOB = "orchestrator:job-id"
TAG_ALLOCATION = "orchestrator:allocation-id"
TAG_TIER = "orchestrator:tier"  # "spot" | "reliable"
#: Where a training job's AgileML elasticity controller listens (`tcp://host:port`), set by
#: the controller's `TrainingHost` on AWS and read by `orchestrator worker start`.
TAG_AGILEML_CONTROLLER = "orchestrator:agileml-controller"
#: The spot max price the instance was launched with; DescribeInstances does not report it.
TAG_MAX_PRICE = "orchestrator:max-price-usd-per-hour"

#: Placeholder AMI for offline runs (moto accepts any id); live runs must pass a real image.
OFFLINE_IMAGE_ID = "ami-orchestrator"
#: AWS refuses spot max prices at or below $0.001/h.
MIN_SPOT_PRICE_USD_PER_HOUR = 0.001
#: TerminateInstances takes at most 1000 ids per call.
TERMINATE_CHUNK_SIZE = 1000
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
_NOT_FOUND = "InvalidInstanceID.NotFound"
_INSTANCE_ID = re.compile(r"\bi-[0-9A-Za-z]+\b")


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


class EC2Cloud:
    """The instances of one controller in one region.

    Only instances tagged with this `controller_id` are ever listed; `terminate` acts on the
    ids it is given. A client passed in keeps its own retry config.
    """

    def __init__(
        self,
        region: str,
        controller_id: str,
        *,
        client: Any = None,
        session: boto3.Session | None = None,
        launch_template: str | None = None,
        subnets: Sequence[str] = (),
    ) -> None:
        if not controller_id:
            raise ValueError("controller_id must not be empty")
        if client is None:
            client = aws_client("ec2", region, session=session)
        elif client.meta.region_name != region:
            raise ValueError(
                f"EC2 client is for region {client.meta.region_name!r}, not {region!r}"
            )
        self.region = region
        self.controller_id = controller_id
        self.client = client
        self.launch_template = launch_template
        self.subnets = tuple(subnets)
        self._subnet_of_zone: dict[str, str] | None = None

    # --- launch -------------------------------------------------------------------------------

    def launch(self, spec: LaunchSpec) -> list[CloudInstance]:
        """Launch `spec.count` instances of `spec.market` for one allocation, all or nothing.

        If instances tagged with this controller and `spec.allocation_id` already exist (a
        retry of an earlier launch, in any state), they are returned and nothing is launched.

        Returns:
            The instances, usually still pending.

        Raises:
            CloudError: code InvalidParameterValue, refused before calling EC2: a spot max
                price at or below $0.001, or a zone outside this region; code
                IdempotentParameterMismatch: the allocation already has instances of another
                market. Or any other RunInstances/DescribeInstances error.
            CapacityError: EC2 cannot launch them now (`CAPACITY_CODES`); `market` is the
                spec's market.
            ThrottledError: RequestLimitExceeded after botocore's retries.

        A `ClientError` from RunInstances (every error above) means EC2 launched nothing:
        with MinCount=MaxCount the call is all-or-nothing. A `CloudError` whose code is a
        botocore exception name (a timeout, a lost connection) leaves the outcome unknown:
        retry `launch` with the same spec, which finds or launches the instances exactly once.
        """
        operation = "RunInstances"
        max_price = self._checked_max_price(spec, operation)
        existing = self._find_allocation(spec)
        if existing:
            return existing

        subnet = self._subnet_for(spec) if self.subnets else None
        tags = self._tags(spec, max_price)
        tag_list = [{"Key": k, "Value": v} for k, v in tags.items()]
        params: dict[str, Any] = {
            "ImageId": spec.image_id,
            "InstanceType": spec.instance_type,
            "MinCount": spec.count,
            "MaxCount": spec.count,
            "Placement": {"AvailabilityZone": spec.zone},
            "ClientToken": spec.client_token(self.controller_id),
            "TagSpecifications": [
                {"ResourceType": "instance", "Tags": tag_list},
                {"ResourceType": "volume", "Tags": tag_list},
            ],
        }
        if self.launch_template is not None:
            # the template carries the AMI, instance profile, security group, IMDS options and
            # the boot user data (infra/controller.yaml)
            params["LaunchTemplate"] = {
                "LaunchTemplateName": self.launch_template,
                "Version": "$Latest",
            }
            del params["ImageId"]
        if subnet is not None:
            params["SubnetId"] = subnet
        if spec.user_data:
            params["UserData"] = spec.user_data
        if spec.key_name is not None:
            params["KeyName"] = spec.key_name
        if spec.security_group_ids:
            params["SecurityGroupIds"] = list(spec.security_group_ids)
        if max_price is not None:
            params["InstanceMarketOptions"] = {
                "MarketType": "spot",
                "SpotOptions": {
                    "MaxPrice": max_price,
                    "SpotInstanceType": "one-time",
                    "InstanceInterruptionBehavior": "terminate",
                },
            }

        try:
            response = self.client.run_instances(**params)
        except (ClientError, BotoCoreError) as exc:
            error = _wrap(exc, operation, market=spec.market)
            log.warning(
                "launch failed",
                extra={
                    "operation": operation,
                    "code": error.code,
                    "market": str(spec.market),
                    "allocation_id": spec.allocation_id,
                    "count": spec.count,
                },
            )
            raise error from exc
        instances = [self._to_instance(raw, defaults=tags) for raw in response["Instances"]]
        log.info(
            "launched",
            extra={
                "market": str(spec.market),
                "tier": spec.tier,
                "allocation_id": spec.allocation_id,
                "job_id": spec.job_id,
                "instance_ids": [i.instance_id for i in instances],
            },
        )
        return instances

    def _checked_max_price(self, spec: LaunchSpec, operation: str) -> str | None:
        """Refuse what EC2 would refuse (zone of another region, spot price <= $0.001); return
        the spot max price as RunInstances takes it (None for on-demand)."""
        if region_of_zone(spec.zone) != self.region:
            raise CloudError(
                f"zone {spec.zone} is not in region {self.region}",
                code="InvalidParameterValue",
                operation=operation,
            )
        if spec.max_price_usd_per_hour is None:
            return None
        price = round(spec.max_price_usd_per_hour, 6)
        if not price > MIN_SPOT_PRICE_USD_PER_HOUR:
            raise CloudError(
                f"spot max price ${spec.max_price_usd_per_hour}/h for {spec.market} must exceed "
                f"${MIN_SPOT_PRICE_USD_PER_HOUR}/h",
                code="InvalidParameterValue",
                operation=operation,
            )
        return str(price)

    def _subnet_for(self, spec: LaunchSpec) -> str:
        """The configured subnet in `spec.zone` (zones looked up once, with DescribeSubnets).

        Raises:
            CapacityError: code NoWorkerSubnetInZone: no configured subnet is in that zone, so
                the market cannot be used (BidBrain marks it and buys elsewhere).
        """
        if self._subnet_of_zone is None:
            try:
                found = self.client.describe_subnets(SubnetIds=list(self.subnets))["Subnets"]
            except (ClientError, BotoCoreError) as exc:
                raise _wrap(exc, "DescribeSubnets") from exc
            self._subnet_of_zone = {str(s["AvailabilityZone"]): str(s["SubnetId"]) for s in found}
        subnet = self._subnet_of_zone.get(spec.zone)
        if subnet is None:
            raise CapacityError(
                f"no worker subnet in {spec.zone} (configured: {', '.join(self.subnets)})",
                code="NoWorkerSubnetInZone",
                operation="RunInstances",
                market=spec.market,
            )
        return subnet

    def _tags(self, spec: LaunchSpec, max_price: str | None) -> dict[str, str]:
        tags = {
            **spec.extra_tags,
            TAG_CONTROLLER: self.controller_id,
            TAG_JOB: spec.job_id,
            TAG_ALLOCATION: spec.allocation_id,
            TAG_TIER: spec.tier,
        }
        if max_price is not None:
            tags[TAG_MAX_PRICE] = max_price
        return tags

    def _find_allocation(self, spec: LaunchSpec) -> list[CloudInstance]:
        """Instances of an earlier launch of this allocation (any state), checked to match."""
        found = list(
            self._describe([{"Name": f"tag:{TAG_ALLOCATION}", "Values": [spec.allocation_id]}])
        )
        wrong = [i for i in found if i.market != spec.market]
        if wrong:
            raise CloudError(
                f"allocation {spec.allocation_id} already has instances in {wrong[0].market} "
                f"({wrong[0].instance_id}), not {spec.market}",
                code="IdempotentParameterMismatch",
                operation="RunInstances",
            )
        if found:
            log.info(
                "launch already done",
                extra={
                    "allocation_id": spec.allocation_id,
                    "instance_ids": [i.instance_id for i in found],
                },
            )
        return found

    # --- describe -----------------------------------------------------------------------------

    def describe(
        self, job_id: str | None = None, include_terminated: bool = False
    ) -> list[CloudInstance]:
        """This controller's instances (of one job, if given), sorted by instance id.

        `include_terminated` also returns instances that are shutting down or terminated (EC2
        lists those for about an hour). Instances of other controllers and untagged instances
        are never returned.

        Raises:
            ThrottledError: RequestLimitExceeded after botocore's retries.
            CloudError: any other DescribeInstances failure, on any page; no partial list
                is returned.
        """
        filters: list[dict[str, Any]] = []
        if job_id is not None:
            filters.append({"Name": f"tag:{TAG_JOB}", "Values": [job_id]})
        if not include_terminated:
            filters.append(
                {"Name": "instance-state-name", "Values": [s.value for s in LIVE_STATES]}
            )
        return sorted(self._describe(filters), key=lambda i: i.instance_id)

    def _describe(self, filters: list[dict[str, Any]]) -> list[CloudInstance]:
        operation = "DescribeInstances"
        all_filters = [{"Name": f"tag:{TAG_CONTROLLER}", "Values": [self.controller_id]}, *filters]
        try:
            raw = list(self._pages(all_filters))
        except (ClientError, BotoCoreError) as exc:
            raise _wrap(exc, operation) from exc
        return [self._to_instance(r) for r in raw]

    def _pages(self, filters: list[dict[str, Any]]) -> Iterator[Mapping[str, Any]]:
        paginator = self.client.get_paginator("describe_instances")
        for page in paginator.paginate(Filters=filters):
            for reservation in page.get("Reservations", []):
                yield from reservation.get("Instances", [])

    # --- terminate ----------------------------------------------------------------------------

    def terminate(self, instance_ids: Iterable[str]) -> None:
        """Terminate the given instances, in calls of at most 1000 ids. Idempotent.

        Already terminated instances are fine, and so are ids EC2 does not know (e.g. long
        gone): they are dropped and the others terminated. Ownership is not checked: pass only
        ids this controller owns (`describe`, `Reconciler`).

        Raises:
            ThrottledError: RequestLimitExceeded after botocore's retries.
            CloudError: any other TerminateInstances failure (e.g. InvalidInstanceID.Malformed,
                UnauthorizedOperation). Chunks before the failing one were terminated and the
                failing chunk was not; calling again with the same ids is safe.
        """
        ids = list(dict.fromkeys(instance_ids))
        for start in range(0, len(ids), TERMINATE_CHUNK_SIZE):
            self._terminate_chunk(ids[start : start + TERMINATE_CHUNK_SIZE])

    def _terminate_chunk(self, ids: Sequence[str]) -> None:
        operation = "TerminateInstances"
        remaining = list(ids)
        while remaining:  # each NotFound retry drops at least one id, so this ends
            try:
                self.client.terminate_instances(InstanceIds=remaining)
            except ClientError as exc:
                if _code(exc) != _NOT_FOUND:
                    raise _wrap(exc, operation) from exc
                unknown = self._unknown_ids(remaining, _message(exc))
                if not unknown:
                    raise _wrap(exc, operation) from exc
                log.info("terminate: unknown ids skipped", extra={"instance_ids": sorted(unknown)})
                remaining = [i for i in remaining if i not in unknown]
                continue
            except BotoCoreError as exc:
                raise _wrap(exc, operation) from exc
            log.info("terminated", extra={"instance_ids": remaining})
            return

    def _unknown_ids(self, ids: Sequence[str], message: str) -> set[str]:
        """The ids of `ids` EC2 does not know: those its NotFound message names, else those a
        DescribeInstances filter (which ignores unknown ids) does not return."""
        named = set(_INSTANCE_ID.findall(message)) & set(ids)
        if named:
            return named
        try:
            known = {
                str(r["InstanceId"])
                for r in self._pages([{"Name": "instance-id", "Values": list(ids)}])
            }
        except (ClientError, BotoCoreError) as exc:
            raise _wrap(exc, "DescribeInstances") from exc
        return set(ids) - known

    # --- parsing ------------------------------------------------------------------------------

    def _to_instance(
        self, raw: Mapping[str, Any], defaults: Mapping[str, str] | None = None
    ) -> CloudInstance:
        tags = dict(defaults or {})
        tags.update({str(t["Key"]): str(t["Value"]) for t in raw.get("Tags") or []})
        launched_at = raw["LaunchTime"]
        if isinstance(launched_at, str):
            launched_at = datetime.fromisoformat(launched_at.replace("Z", "+00:00"))
        if launched_at.tzinfo is None:
            launched_at = launched_at.replace(tzinfo=UTC)
        return CloudInstance(
            instance_id=str(raw["InstanceId"]),
            instance_type=str(raw["InstanceType"]),
            zone=str(raw["Placement"]["AvailabilityZone"]),
            state=InstanceState(raw["State"]["Name"]),
            lifecycle="spot" if raw.get("InstanceLifecycle") == "spot" else "on-demand",
            job_id=tags.get(TAG_JOB),
            allocation_id=tags.get(TAG_ALLOCATION),
            controller_id=tags.get(TAG_CONTROLLER, self.controller_id),
            launched_at=launched_at.astimezone(UTC),
            max_price_usd_per_hour=_float_or_none(tags.get(TAG_MAX_PRICE)),
            tags=tags,
        )


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code") or "Unknown")


def _message(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Message") or exc)


def _wrap(
    exc: ClientError | BotoCoreError, operation: str, *, market: Market | None = None
) -> CloudError:
    """The `CloudError` subclass for a botocore failure (`market`: RunInstances only)."""
    if isinstance(exc, BotoCoreError):
        return CloudError(str(exc), code=type(exc).__name__, operation=operation)
    code, message = _code(exc), _message(exc)
    if code in THROTTLE_CODES:
        return ThrottledError(message, code=code, operation=operation)
    if market is not None and code in CAPACITY_CODES:
        return CapacityError(message, code=code, operation=operation, market=market)
    return CloudError(message, code=code, operation=operation)


def _float_or_none(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return None
