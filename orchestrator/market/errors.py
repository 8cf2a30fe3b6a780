"""Errors of the market package: bad price data, unknown instance types, missing markets."""

from __future__ import annotations

from orchestrator.errors import OrchestratorError, UserError


class MarketError(OrchestratorError):
    """Base of market errors that are not the user's doing."""


class PriceDataError(UserError):
    """A price file or response is malformed, empty, or holds no usable prices."""

    def __init__(
        self, message: str, *, fix: str = "", field: str | None = None, path: str | None = None
    ) -> None:
        super().__init__(
            message,
            fix=fix
            or "pass files in the exact DescribeSpotPriceHistory response format "
            '({"SpotPriceHistory": [{"AvailabilityZone", "InstanceType", "SpotPrice", '
            '"Timestamp", "ProductDescription"}, ...]}).',
            field=field,
            path=path,
        )


class UnknownInstanceTypeError(UserError):
    """An instance type the catalog does not know."""


class UnknownMarketError(UserError):
    """A (type, zone) or region the data holds no prices or catalog entry for."""
