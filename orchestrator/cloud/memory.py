"""`InMemoryCloud`: a `Cloud` in memory, for fast unit tests of the controller and its friends.

It behaves as `EC2Cloud` does on moto (the contract tests in tests/support/cloud_contract.py
hold both to the same checks): launches are all or nothing, tagged, idempotent per allocation
and refused for the same reasons; an instance is `pending` when launched and `running` from the
first listing on (as moto reports it); terminated instances stay listed with
`include_terminated`. Several controllers may share one account (`InMemoryEC2`), each seeing
only its own instances.

Test hooks on the account: `refuse_launches` (a capacity code, or any other, per market),
`throttle` (the next calls fail with RequestLimitExceeded), `reclaim` (the cloud takes a spot
instance back, as an interruption does). Not modelled: AMIs, launch templates and security
groups (accepted and ignored), subnets other than "a zone has a worker subnet or not",
per-account limits, prices and billing.
"""

from __future__ import annotations

import itertools
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from orchestrator.cloud.errors import CapacityError, CloudError, ThrottledError
from orchestrator.cloud.instances import (
    CAPACITY_CODES,
    TAG_ALLOCATION,
    TAG_CONTROLLER,
    CloudInstance,
    InstanceState,
    LaunchSpec,
    check_allocation_market,
    instance_from_tags,
)
from orchestrator.market.prices import Market

_INSTANCE_ID = re.compile(r"^i-[0-9a-f]{8,17}$")


@dataclass
class _Instance:
    instance_id: str
    spec: LaunchSpec
    tags: dict[str, str]
    launched_at: datetime
    state: InstanceState = InstanceState.PENDING


@dataclass
class InMemoryEC2:
    """One account's instances, shared by the `InMemoryCloud`s of its controllers, with the
    test hooks (see the module docstring). Thread-safe."""

    clock: Callable[[], float] = time.time
    instances: dict[str, _Instance] = field(default_factory=dict)
    _refusals: dict[Market | None, str] = field(default_factory=dict)
    _throttled_calls: int = 0
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def refuse_launches(self, code: str, market: Market | None = None) -> None:
        """Refuse every later launch in `market` (None: in every market) with `code`."""
        self._refusals[market] = code

    def allow_launches(self, market: Market | None = None) -> None:
        """Undo `refuse_launches` for `market` (None: the refusal of every market)."""
        self._refusals.pop(market, None)

    def throttle(self, calls: int = 1) -> None:
        """Fail the next `calls` calls (of any kind) with RequestLimitExceeded."""
        self._throttled_calls += calls

    def reclaim(self, instance_id: str) -> None:
        """The cloud takes the instance back (a spot interruption): it is terminated."""
        with self._lock:
            self.instances[instance_id].state = InstanceState.TERMINATED

    def _check_throttle(self, operation: str) -> None:
        if self._throttled_calls > 0:
            self._throttled_calls -= 1
            raise ThrottledError(
                "Request limit exceeded.", code="RequestLimitExceeded", operation=operation
            )

    def _new_id(self) -> str:
        return f"i-{next(self._ids):017x}"


class InMemoryCloud:
    """The instances of one controller in one region of an `InMemoryEC2` account.

    Args:
        region: the region; launches in a zone of another region are refused.
        controller_id: whose instances these are (the tag every launch carries).
        ec2: the account (default: a new one of its own).
        worker_zones: the zones with a worker subnet (None: every zone), as `EC2Cloud` with
            configured subnets: a launch elsewhere is a CapacityError NoWorkerSubnetInZone.
    """

    def __init__(
        self,
        region: str = "us-east-1",
        controller_id: str = "local",
        *,
        ec2: InMemoryEC2 | None = None,
        worker_zones: Iterable[str] | None = None,
    ) -> None:
        if not controller_id:
            raise ValueError("controller_id must not be empty")
        self.region = region
        self.controller_id = controller_id
        self.ec2 = ec2 if ec2 is not None else InMemoryEC2()
        self.worker_zones = None if worker_zones is None else frozenset(worker_zones)

    def launch(self, spec: LaunchSpec) -> list[CloudInstance]:
        """See `Cloud.launch`."""
        max_price = spec.checked_max_price(self.region)
        with self.ec2._lock:
            self.ec2._check_throttle("RunInstances")
            existing = self._find(lambda i: i.tags.get(TAG_ALLOCATION) == spec.allocation_id)
            if existing:
                found = [self._view(i) for i in existing]
                check_allocation_market(found, spec)
                return found
            self._check_capacity(spec)
            tags = spec.tags(self.controller_id, max_price)
            now = datetime.fromtimestamp(self.ec2.clock(), UTC)
            made = [_Instance(self.ec2._new_id(), spec, dict(tags), now) for _ in range(spec.count)]
            for inst in made:
                self.ec2.instances[inst.instance_id] = inst
            return [self._view(i) for i in made]

    def describe(
        self, job_id: str | None = None, include_terminated: bool = False
    ) -> list[CloudInstance]:
        """See `Cloud.describe`. Pending instances are running from their first listing on."""
        with self.ec2._lock:
            self.ec2._check_throttle("DescribeInstances")
            out = []
            for inst in self._find(lambda i: True):
                if inst.state is InstanceState.PENDING:
                    inst.state = InstanceState.RUNNING
                if job_id is not None and inst.spec.job_id != job_id:
                    continue
                if inst.state.is_gone and not include_terminated:
                    continue
                out.append(self._view(inst))
            return sorted(out, key=lambda i: i.instance_id)

    def terminate(self, instance_ids: Iterable[str]) -> None:
        """See `Cloud.terminate`. A malformed id is refused as EC2 refuses it."""
        ids = list(dict.fromkeys(instance_ids))
        with self.ec2._lock:
            self.ec2._check_throttle("TerminateInstances")
            bad = [i for i in ids if not _INSTANCE_ID.match(i)]
            if bad:
                raise CloudError(
                    f"Invalid id: {bad[0]!r}",
                    code="InvalidInstanceID.Malformed",
                    operation="TerminateInstances",
                )
            for instance_id in ids:
                inst = self.ec2.instances.get(instance_id)
                if inst is not None:
                    inst.state = InstanceState.TERMINATED

    def _find(self, keep: Callable[[_Instance], bool]) -> list[_Instance]:
        return [
            i
            for i in self.ec2.instances.values()
            if i.tags.get(TAG_CONTROLLER) == self.controller_id and keep(i)
        ]

    def _check_capacity(self, spec: LaunchSpec) -> None:
        code = self.ec2._refusals.get(spec.market, self.ec2._refusals.get(None))
        if code is None and self.worker_zones is not None and spec.zone not in self.worker_zones:
            code = "NoWorkerSubnetInZone"
        if code is None:
            return
        message = f"injected {code} for {spec.market}"
        if code in CAPACITY_CODES or code == "NoWorkerSubnetInZone":
            raise CapacityError(message, code=code, operation="RunInstances", market=spec.market)
        raise CloudError(message, code=code, operation="RunInstances")

    def _view(self, inst: _Instance) -> CloudInstance:
        return instance_from_tags(
            instance_id=inst.instance_id,
            instance_type=inst.spec.instance_type,
            zone=inst.spec.zone,
            state=inst.state,
            lifecycle="spot" if inst.spec.is_spot else "on-demand",
            launched_at=inst.launched_at,
            tags=inst.tags,
            controller_id=self.controller_id,
        )
