"""What the chaos soak injects and how it keeps count: the `FaultLog` (faults per kind,
recovery times, errors seen) and `Ec2Faults`, a botocore hook that makes the controller's own
EC2 client see EC2's errors (or dies with the controller) at the calls it is armed for.

The errors are real EC2 error documents handed to botocore before the request leaves
(`before-send`), so botocore parses them and retries what it retries (throttling and 5xx,
`orchestrator.aws.retry_config()`) exactly as it does for AWS's own.
"""

from __future__ import annotations

import random
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from botocore.awsrequest import AWSResponse

#: EC2 error code -> (HTTP status, the calls it is injected into; None: any).
EC2_ERRORS: dict[str, tuple[int, frozenset[str] | None]] = {
    "InsufficientInstanceCapacity": (500, frozenset({"RunInstances"})),
    "RequestLimitExceeded": (503, None),
    "InternalError": (500, None),
    "Unavailable": (503, None),
}


#: In every injected error's message.
INJECTED = "chaos soak: injected"


class ControllerKilled(BaseException):  # noqa: N818 - a kill, not an error to handle
    """The controller dies here: raised from inside one of its EC2 calls, a BaseException so
    that no `except Exception` in the controller survives it (as a SIGKILL would not be)."""


@dataclass
class FaultLog:
    """Faults injected per kind, recovery seconds per kind, unexpected errors by type."""

    by_kind: Counter[str] = field(default_factory=Counter)
    recovery_s: dict[str, list[float]] = field(default_factory=dict)
    errors: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def fault(self, kind: str, count: int = 1) -> None:
        self.by_kind[kind] += count

    def recovered(self, kind: str, seconds: float) -> None:
        self.recovery_s.setdefault(kind, []).append(seconds)

    def merge(self, other: FaultLog) -> None:
        self.by_kind.update(other.by_kind)
        self.errors.update(other.errors)
        for kind, values in other.recovery_s.items():
            self.recovery_s.setdefault(kind, []).extend(values)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation; None for no values."""
    if not values:
        return None
    if len(values) == 1:
        return round(values[0], 3)
    return round(statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1], 3)


class _Body:
    """The raw body botocore reads an injected response from."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    def stream(self, **_: Any) -> Any:
        yield self._data

    def read(self, *_: Any, **__: Any) -> bytes:
        data, self._data = self._data, b""
        return data


def _error_response(url: str, code: str, status: int) -> AWSResponse:
    body = (
        '<?xml version="1.0" encoding="UTF-8"?><Response><Errors><Error>'
        f"<Code>{code}</Code><Message>{INJECTED} {code}</Message>"
        "</Error></Errors><RequestID>chaos</RequestID></Response>"
    ).encode()
    return AWSResponse(url, status, {}, _Body(body))


class Ec2Faults:
    """Armed faults for one EC2 client (`install`): the next calls that match answer with an
    EC2 error, or kill the controller (`ControllerKilled`). Each injection is logged."""

    def __init__(self, log: FaultLog, rng: random.Random) -> None:
        self.log, self.rng = log, rng
        self._errors: list[str] = []  # one code per call to fail, in order
        self._kill_after: int | None = None  # EC2 calls left before the kill

    def install(self, client: Any) -> None:
        client.meta.events.register("before-send.ec2", self._before_send)

    def arm_error(self, code: str, calls: int) -> None:
        self._errors.extend([code] * calls)

    def arm_kill(self, after_calls: int) -> None:
        self._kill_after = after_calls

    def disarm(self) -> None:
        self._errors.clear()
        self._kill_after = None

    @property
    def armed_kill(self) -> bool:
        return self._kill_after is not None

    def _before_send(self, request: Any, event_name: str = "", **_: Any) -> AWSResponse | None:
        operation = event_name.rsplit(".", 1)[-1]
        if self._kill_after is not None:
            if self._kill_after <= 0:
                self._kill_after = None
                self.log.fault("controller_killed")
                raise ControllerKilled(f"in {operation}")
            self._kill_after -= 1
        if self._errors:
            code = self._errors[0]
            status, only = EC2_ERRORS[code]
            if only is None or operation in only:
                self._errors.pop(0)
                self.log.fault(f"ec2_{code}")
                return _error_response(request.url, code, status)
        return None
