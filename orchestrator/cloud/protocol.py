"""`Cloud`: what the controller, the reconciler, the offline world's fleet and the deployment's
teardown need from a cloud: launch an allocation, list this controller's instances, terminate.

`EC2Cloud` (boto3; moto offline) is the real one; `InMemoryCloud` is a fake for fast unit tests,
held to the same behaviour by the contract tests (tests/support/cloud_contract.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from orchestrator.cloud.instances import CloudInstance, LaunchSpec


@runtime_checkable
class Cloud(Protocol):
    """The instances of one controller (`controller_id`) in one region (`region`)."""

    region: str
    controller_id: str

    def launch(self, spec: LaunchSpec) -> list[CloudInstance]:
        """Launch `spec.count` instances of `spec.market` for one allocation, all or nothing.

        Idempotent per allocation: if instances tagged with this controller and
        `spec.allocation_id` already exist (in any state), they are returned and nothing is
        launched. The instances carry `spec.tags(...)`: the spec's extra tags, then this
        controller's, the job's, the allocation's and the tier (ours win).

        Returns:
            The instances, usually still pending.

        Raises:
            CloudError: code InvalidParameterValue, refused before calling the cloud: a spot
                max price at or below $0.001, or a zone outside this region; code
                IdempotentParameterMismatch: the allocation already has instances of another
                market; any other refusal.
            CapacityError: the cloud cannot launch them now (`CAPACITY_CODES`, or
                NoWorkerSubnetInZone); `market` is the spec's market. Nothing was launched.
            ThrottledError: the cloud throttled the call (after the client's retries).
        """
        ...

    def describe(
        self, job_id: str | None = None, include_terminated: bool = False
    ) -> list[CloudInstance]:
        """This controller's instances (of one job, if given), sorted by instance id.

        `include_terminated` also returns instances that are shutting down or terminated.
        Instances of other controllers and untagged instances are never returned.

        Raises:
            ThrottledError, CloudError: the listing failed; no partial list is returned.
        """
        ...

    def terminate(self, instance_ids: Iterable[str]) -> None:
        """Terminate the given instances. Idempotent: already terminated instances and ids the
        cloud does not know are fine. Ownership is not checked: pass only this controller's.

        Raises:
            ThrottledError, CloudError: the call failed; calling again with the same ids is
                safe.
        """
        ...
