"""Reconcile what EC2 runs for this controller with what the store believes it owns.

`plan_reconciliation` is pure: given the instances EC2 reports and the store's view, it decides.
`Reconciler` observes (describe), decides (plan), then acts (terminate orphans). Example after a
controller crash::

    EC2:   i-1 (job a, running)  i-2 (job a, pending)  i-3 (job b, running)
    store: i-1 -> a, i-9 -> a    active jobs: {a}
    plan:  adopt i-2 (launched for active job a just before the crash: keep and record it)
           terminate i-3 (job b has finished: an orphan)
           gone i-9 (the store thinks it alive; EC2 has terminated or forgotten it)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

from orchestrator.cloud.instances import CloudInstance
from orchestrator.cloud.protocol import Cloud

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReconcilePlan:
    """What to do so that EC2 and the store agree.

    Attributes:
        terminate: ids of live instances tagged by this controller that no active job owns
            (their job finished, or the store never knew them and their job is not active).
        adopt: live instances tagged with an active job that the store does not know: keep
            them and record them in the store.
        gone: ids the store holds as alive that EC2 reports shutting down, terminated, or not
            at all: record them as lost.
    """

    terminate: tuple[str, ...] = ()
    adopt: tuple[CloudInstance, ...] = ()
    gone: tuple[str, ...] = ()

    @property
    def is_noop(self) -> bool:
        return not (self.terminate or self.adopt or self.gone)


def plan_reconciliation(
    cloud: Sequence[CloudInstance],
    owned: Mapping[str, str],
    active_jobs: Set[str],
    *,
    controller_id: str | None = None,
) -> ReconcilePlan:
    """Decide, for each instance, whether to keep, adopt or terminate it.

    Args:
        cloud: this controller's instances as EC2 reports them (`EC2Cloud.describe`).
        owned: instance id -> job id, as the store believes.
        active_jobs: ids of the jobs that are still running.
        controller_id: if given, instances tagged with another controller are ignored (a
            guard; `EC2Cloud.describe` already returns only this controller's).

    An owned instance whose store job is active is kept, whatever its tags say; an owned one
    whose store job is not active is terminated. Instances already shutting down or terminated
    are never terminated or adopted. An empty `active_jobs` terminates every live instance: pass
    it only when the store has really been read.
    """
    live = {
        i.instance_id: i
        for i in cloud
        if not i.state.is_gone and (controller_id is None or i.controller_id == controller_id)
    }
    terminate: list[str] = []
    adopt: list[CloudInstance] = []
    for instance_id, instance in sorted(live.items()):
        if instance_id in owned:
            if owned[instance_id] not in active_jobs:
                terminate.append(instance_id)
        elif instance.job_id is not None and instance.job_id in active_jobs:
            adopt.append(instance)
        else:
            terminate.append(instance_id)
    gone = sorted(i for i in owned if i not in live)
    return ReconcilePlan(terminate=tuple(terminate), adopt=tuple(adopt), gone=tuple(gone))


class Reconciler:
    """One reconcile pass over one controller's instances: describe, plan, terminate orphans.

    Recording adopted and gone instances is the caller's job (the store integration).
    """

    def __init__(self, cloud: Cloud) -> None:
        self.cloud = cloud

    def reconcile(self, owned: Mapping[str, str], active_jobs: Set[str]) -> ReconcilePlan:
        """Run one pass and return its plan, orphans already terminated.

        Raises:
            CloudError: describe failed (nothing was terminated), or terminate failed (some
                orphans may be terminated). Each pass starts from a fresh describe, so running
                the next pass is safe.
        """
        instances = self.cloud.describe()
        plan = plan_reconciliation(
            instances, owned, active_jobs, controller_id=self.cloud.controller_id
        )
        if not plan.is_noop:
            log.info(
                "reconcile plan",
                extra={
                    "controller_id": self.cloud.controller_id,
                    "terminate": list(plan.terminate),
                    "adopt": [i.instance_id for i in plan.adopt],
                    "gone": list(plan.gone),
                },
            )
        if plan.terminate:
            self.cloud.terminate(plan.terminate)
        return plan
