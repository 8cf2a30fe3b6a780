"""Errors of the cloud package: EC2 calls that failed after botocore's retries.

Every error carries the AWS error `code` (or the botocore exception class name for failures
before a response, e.g. "NoCredentialsError"), AWS's `message`, and the EC2 `operation`.
"""

from __future__ import annotations

from orchestrator.errors import OrchestratorError
from orchestrator.market.prices import Market


class CloudError(OrchestratorError):
    """An EC2 call failed, or was refused locally before it was sent.

    Attributes:
        code: the AWS error code ("InvalidParameterValue", "UnauthorizedOperation", ...), or
            the botocore exception class name when no response came back.
        message: the text AWS or botocore gave (or ours, for a locally refused call).
        operation: the EC2 API operation ("RunInstances", "DescribeInstances", ...).
    """

    def __init__(self, message: str, *, code: str, operation: str) -> None:
        self.message = message
        self.code = code
        self.operation = operation
        super().__init__(self.__str__())

    def __str__(self) -> str:
        return f"{self.operation} failed ({self.code}): {self.message}"


class CapacityError(CloudError):
    """EC2 cannot give us the instances now: no capacity, an account limit, a bid below the
    market, or a type the zone does not offer. Nothing was launched.

    Feed it to `MarketAvailability.mark(error.market, error.code, now_s)` and try elsewhere.

    Attributes:
        market: the (type, zone) the launch asked for, when known.
    """

    def __init__(
        self, message: str, *, code: str, operation: str, market: Market | None = None
    ) -> None:
        self.market = market
        super().__init__(message, code=code, operation=operation)

    def __str__(self) -> str:
        text = super().__str__()
        return text if self.market is None else f"{text} [market {self.market}]"


class ThrottledError(CloudError):
    """EC2 throttled the call (RequestLimitExceeded) and botocore's retries ran out.

    Not a market problem: retry on a later tick, and issue fewer calls.
    """


class MetadataError(CloudError):
    """A metadata request failed or returned something unusable.

    Attributes (besides `CloudError`'s `code`, `message`, `operation`):
        url: the URL requested, when there was a request.
        status: the HTTP status, or None when no response came back (`code` is then the
            exception class name, e.g. "ConnectionRefusedError" or "TimeoutError").
    """

    def __init__(
        self,
        message: str,
        *,
        code: str,
        operation: str,
        url: str | None = None,
        status: int | None = None,
    ) -> None:
        self.url = url
        self.status = status
        super().__init__(message, code=code, operation=operation)


class LifecycleError(OrchestratorError):
    """A lifecycle move that its transition table does not allow (a caller bug).

    Attributes:
        component: the class whose lifecycle it is ("NoticeWatcher", "MetadataMock").
        state: the state it was in.
        requested: the state the caller asked for.
    """

    def __init__(self, component: str, state: str, requested: str) -> None:
        self.component = component
        self.state = state
        self.requested = requested
        super().__init__(f"{component}: cannot go from {state!r} to {requested!r}")
