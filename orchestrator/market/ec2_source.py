"""`EC2PriceSource`: live spot price history from EC2's DescribeSpotPriceHistory.

Failure semantics:
    * Transient failures are retried by botocore itself with the policy of every AWS call of
      the orchestrator (`orchestrator.aws`: "adaptive" mode, up to 9 attempts per API call,
      i.e. per page): throttling (RequestLimitExceeded, Throttling, ...), 5xx responses, and
      connection/read timeouts, with exponential backoff, jitter and client-side rate limiting.
      This module adds no retry loop of its own; a client passed in keeps whatever retry config
      it was built with.
    * Any error that remains after those retries -- a `botocore.exceptions.ClientError` (e.g.
      UnauthorizedOperation, AuthFailure, InvalidParameterValue) or a `BotoCoreError` (no
      credentials, endpoint unreachable) -- is raised as `PriceFetchError` with the AWS error
      code and the region. A failure on any page fails the whole call: no partial history is
      returned.
    * A well-formed response with no usable Linux/UNIX prices, or an empty/inverted time range,
      raises `PriceDataError` (a `UserError`): the request, not AWS, is at fault.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import boto3
from botocore.exceptions import BotoCoreError, ClientError

from orchestrator.aws import aws_client
from orchestrator.market.errors import MarketError, PriceDataError
from orchestrator.market.prices import (
    LINUX_PRODUCT,
    PriceHistory,
    PriceSource,
    region_of_zone,
    series_from_records,
    to_datetime,
    to_epoch_seconds,
)

OPERATION = "DescribeSpotPriceHistory"


class PriceFetchError(MarketError):
    """DescribeSpotPriceHistory failed after botocore's retries.

    Attributes:
        code: the AWS error code (e.g. "UnauthorizedOperation"), or the botocore exception
            class name for errors raised before a response (e.g. "NoCredentialsError").
        region: the region queried.
        message: the error text AWS or botocore gave.
    """

    def __init__(self, message: str, *, code: str, region: str) -> None:
        self.message = message
        self.code = code
        self.region = region
        super().__init__(f"{OPERATION} failed in {region} ({code}): {message}")


class EC2PriceSource(PriceSource):
    """Spot prices of one region, fetched live with DescribeSpotPriceHistory (Linux/UNIX only).

    Each market's series starts with the record in effect at `start` (which may predate it) and
    ends at `end`, exactly like `TracePriceSource.history` over the same window.
    """

    def __init__(
        self, region: str, *, client: Any = None, session: boto3.Session | None = None
    ) -> None:
        if client is None:
            client = aws_client("ec2", region, session=session)
        elif client.meta.region_name != region:
            raise ValueError(
                f"EC2 client is for region {client.meta.region_name!r}, not {region!r}"
            )
        self.region = region
        self.client = client

    @property
    def source_name(self) -> str:
        return f"{OPERATION}({self.region})"

    def history(
        self,
        start: datetime | float,
        end: datetime | float,
        *,
        instance_types: Sequence[str] | None = None,
        zones: Sequence[str] | None = None,
    ) -> PriceHistory:
        """Price series of every matching market of the region over [start, end].

        Raises:
            PriceDataError: the range is empty, no zone given is in this region, or EC2 holds
                no Linux/UNIX prices for the request.
            PriceFetchError: the API call failed after botocore's retries.
        """
        start_s, end_s = to_epoch_seconds(start), to_epoch_seconds(end)
        if end_s <= start_s:
            raise PriceDataError(
                f"time range is empty: end {end} is not after start {start}", field="end"
            )
        types = list(instance_types) if instance_types is not None else None
        if types is not None and not types:
            raise PriceDataError(
                "no instance types given",
                field="instance_types",
                fix="pass at least one instance type, or None for all types",
            )
        region_zones = None
        if zones is not None:
            region_zones = [z for z in zones if region_of_zone(z) == self.region]
            if not region_zones:
                raise PriceDataError(
                    f"none of the zones {list(zones)} is in region {self.region}",
                    field="zones",
                    fix=f"pass availability zones of {self.region} (e.g. {self.region}a)",
                )

        params: dict[str, Any] = {
            "StartTime": to_datetime(start_s),
            "EndTime": to_datetime(end_s),
            "ProductDescriptions": [LINUX_PRODUCT],
        }
        if types is not None:
            params["InstanceTypes"] = types
        if region_zones is not None:
            # The AvailabilityZone parameter takes a single zone; the filter takes a list.
            params["Filters"] = [{"Name": "availability-zone", "Values": region_zones}]

        records = self._fetch(params)
        records = [r for r in records if self._wanted(r, types, region_zones)]
        series = series_from_records(records, source=self.source_name, end_s=end_s)
        selected = [s for s in (s.window(start_s, end_s) for s in series) if s is not None]
        if not selected:
            raise PriceDataError(
                f"{self.source_name} returned no {LINUX_PRODUCT} spot prices for "
                f"types={types if types is not None else 'any'} "
                f"zones={region_zones if region_zones is not None else 'any'} "
                f"between {to_datetime(start_s).isoformat()} and {to_datetime(end_s).isoformat()}",
                fix=f"check that the instance types are offered as spot in {self.region} "
                "(and in the zones given), and that the range is within the last 90 days",
            )
        return PriceHistory(selected)

    def _fetch(self, params: dict[str, Any]) -> list[Mapping[str, Any]]:
        records: list[Mapping[str, Any]] = []
        try:
            paginator = self.client.get_paginator("describe_spot_price_history")
            for page in paginator.paginate(**params):
                records.extend(page.get("SpotPriceHistory", []))
        except ClientError as exc:
            error = exc.response.get("Error", {})
            raise PriceFetchError(
                str(error.get("Message") or exc),
                code=str(error.get("Code") or "Unknown"),
                region=self.region,
            ) from exc
        except BotoCoreError as exc:
            raise PriceFetchError(str(exc), code=type(exc).__name__, region=self.region) from exc
        return records

    def _wanted(
        self, record: Mapping[str, Any], types: list[str] | None, zones: list[str] | None
    ) -> bool:
        """Drop records of other regions, types or zones (the filters should already have).
        Records missing a field are kept, for `series_from_records` to report."""
        if not isinstance(record, Mapping):
            return True
        zone, itype = record.get("AvailabilityZone"), record.get("InstanceType")
        if zone is not None and (
            region_of_zone(str(zone)) != self.region or (zones is not None and zone not in zones)
        ):
            return False
        return itype is None or types is None or itype in types
