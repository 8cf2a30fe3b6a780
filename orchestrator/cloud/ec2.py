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

import logging
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import boto3
from botocore.exceptions import BotoCoreError, ClientError

from orchestrator.aws import aws_client
from orchestrator.cloud.errors import CapacityError, CloudError, ThrottledError
from orchestrator.cloud.instances import (
    CAPACITY_CODES,
    LIVE_STATES,
    TAG_ALLOCATION,
    TAG_CONTROLLER,
    TAG_JOB,
    THROTTLE_CODES,
    CloudInstance,
    InstanceState,
    LaunchSpec,
    check_allocation_market,
    instance_from_tags,
)
from orchestrator.market.prices import Market

log = logging.getLogger(__name__)

#: TerminateInstances takes at most 1000 ids per call.
TERMINATE_CHUNK_SIZE = 1000
_NOT_FOUND = "InvalidInstanceID.NotFound"
_INSTANCE_ID = re.compile(r"\bi-[0-9A-Za-z]+\b")


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
        max_price = spec.checked_max_price(self.region)
        existing = self._find_allocation(spec)
        if existing:
            return existing
        tags = spec.tags(self.controller_id, max_price)
        params = self._run_instances_params(spec, max_price, tags)
        try:
            response = self.client.run_instances(**params)
        except (ClientError, BotoCoreError) as exc:
            error = _wrap(exc, "RunInstances", market=spec.market)
            log.warning(
                "launch failed",
                extra={
                    "operation": "RunInstances",
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

    def _run_instances_params(
        self, spec: LaunchSpec, max_price: str | None, tags: dict[str, str]
    ) -> dict[str, Any]:
        """RunInstances' parameters for `spec`: all or nothing (MinCount = MaxCount), the
        allocation's client token, tags on the instances and their volumes, the workers' launch
        template and subnet when configured, the spot options for a spot launch.

        Raises:
            CapacityError: code NoWorkerSubnetInZone (`_subnet_for`).
        """
        tag_list = [{"Key": k, "Value": v} for k, v in tags.items()]
        params: dict[str, Any] = {
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
        else:
            params["ImageId"] = spec.image_id
        if self.subnets:
            params["SubnetId"] = self._subnet_for(spec)
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
        return params

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

    def _find_allocation(self, spec: LaunchSpec) -> list[CloudInstance]:
        """Instances of an earlier launch of this allocation (any state), checked to match."""
        found = list(
            self._describe([{"Name": f"tag:{TAG_ALLOCATION}", "Values": [spec.allocation_id]}])
        )
        check_allocation_market(found, spec)
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
        if not include_terminated:
            filters.append(
                {"Name": "instance-state-name", "Values": [s.value for s in LIVE_STATES]}
            )
        if job_id is not None:
            filters.append({"Name": f"tag:{TAG_JOB}", "Values": [job_id]})
        return sorted(self._describe(filters), key=lambda i: i.instance_id)

    def _describe(self, filters: list[dict[str, Any]]) -> list[CloudInstance]:
        operation = "DescribeInstances"
        # EC2 ANDs the filters in any order. moto (the offline world) tries them in order and
        # stops at the first that fails, and a tag filter costs it a scan of every tag it
        # holds: the caller's (state, then the job or allocation) go before the controller's.
        all_filters = [*filters, {"Name": f"tag:{TAG_CONTROLLER}", "Values": [self.controller_id]}]
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
        return instance_from_tags(
            instance_id=str(raw["InstanceId"]),
            instance_type=str(raw["InstanceType"]),
            zone=str(raw["Placement"]["AvailabilityZone"]),
            state=InstanceState(raw["State"]["Name"]),
            lifecycle="spot" if raw.get("InstanceLifecycle") == "spot" else "on-demand",
            launched_at=launched_at.astimezone(UTC),
            tags=tags,
            controller_id=self.controller_id,
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
