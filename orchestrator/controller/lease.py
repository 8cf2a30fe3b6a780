"""One controller per fleet: the processes of a controller id share one store, and only the one
holding the store's lease acts; the others wait as standbys and take over when it lapses.

    lease = FleetLease(store, controller_id="prod", ttl_s=180.0)
    lease.hold()                  # each tick, first: take or renew it, else NotLeaderError
    cloud = FencedCloud(cloud, lease)   # every launch and terminate checks it is still held
    fence_ec2_client(client, lease)     # and every request of them that leaves (retries too)
    store = FencedStore(store, lease).as_store()   # and every write of a tick

The lease lives in the store with a time to live (`ttl_s`, real seconds) and a fencing token
that rises with every new holder: a controller that lost it (a tick longer than the TTL, a
network partition) and comes back finds another token there and stops before its next EC2
mutation or store write, instead of launching, terminating or billing beside the new holder. A
controller of another id refuses the store at start (`bind`): its instances are tagged with the
first id, and it would take them for gone.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Iterable
from typing import Any, cast

from orchestrator.cloud.instances import CloudInstance, LaunchSpec
from orchestrator.cloud.protocol import Cloud
from orchestrator.errors import OrchestratorError, UserError
from orchestrator.store.protocol import Store


class NotLeaderError(OrchestratorError):
    """Another controller process holds the fleet's lease: this one waits (a standby)."""

    def __init__(self, holder: tuple[str, int] | None) -> None:
        self.holder = holder
        who = "no one now" if holder is None else f"{holder[0]} (token {holder[1]})"
        super().__init__(f"standing by: the fleet's lease is held by {who}")


class FleetLease:
    """This process's hold on the fleet's lease (see the module docstring)."""

    def __init__(
        self, store: Store, *, controller_id: str, ttl_s: float, owner: str | None = None
    ) -> None:
        self.store = store
        self.controller_id = controller_id
        self.ttl_s = ttl_s
        self.owner = owner or (
            f"{controller_id}@{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        )
        self.token: int | None = None

    def bind(self) -> None:
        """Bind the store to this controller id, or refuse another controller's store.

        Raises:
            UserError: the store records another controller's fleet.
        """
        bound = self.store.bind_controller_id(self.controller_id)
        if bound != self.controller_id:
            raise UserError(
                f"this store records the fleet of controller {bound!r}, not "
                f"{self.controller_id!r}: its instances are tagged {bound!r}, and this "
                "controller would take them for gone and buy its own",
                field="controller_id",
                fix=f"start with ORCHESTRATOR_CONTROLLER_ID={bound} (a standby of that "
                "controller), or give this controller its own Redis database",
            )

    def hold(self) -> int:
        """Take or renew the lease; its fencing token.

        Raises:
            NotLeaderError: another process holds it.
        """
        token = self.store.acquire_lease(self.owner, self.ttl_s)
        if token is None:
            self.token = None
            raise NotLeaderError(self.store.lease_holder())
        self.token = token
        return token

    def check(self) -> None:
        """Still ours, with the token this process took it with (before an EC2 mutation).

        Raises:
            NotLeaderError: it lapsed or another process holds it now.
        """
        holder = self.store.lease_holder()
        if self.token is None or holder != (self.owner, self.token):
            self.token = None
            raise NotLeaderError(holder)

    def release(self) -> None:
        """Give it up (a clean stop: a standby takes over at its next tick)."""
        self.store.release_lease(self.owner)
        self.token = None


class FencedCloud:
    """A `Cloud` whose launches and terminations first check the lease is still held."""

    def __init__(self, cloud: Cloud, lease: FleetLease) -> None:
        self._cloud = cloud
        self._lease = lease
        self.region = cloud.region
        self.controller_id = cloud.controller_id

    def launch(self, spec: LaunchSpec) -> list[CloudInstance]:
        self._lease.check()
        return self._cloud.launch(spec)

    def describe(
        self, job_id: str | None = None, include_terminated: bool = False
    ) -> list[CloudInstance]:
        return self._cloud.describe(job_id, include_terminated)

    def terminate(self, instance_ids: Iterable[str]) -> None:
        self._lease.check()
        self._cloud.terminate(instance_ids)


#: The EC2 calls that change the fleet.
EC2_MUTATIONS = ("RunInstances", "TerminateInstances")


def fence_ec2_client(client: Any, lease: FleetLease) -> None:
    """Check the lease before every EC2 mutation request leaves `client` (a boto3 EC2 client),
    retries included: botocore's backoff can send a launch again seconds after the
    `FencedCloud` check passed."""

    def check(**_: Any) -> None:
        lease.check()

    for operation in EC2_MUTATIONS:
        client.meta.events.register(f"before-send.ec2.{operation}", check)


#: The store writes a controller makes in its ticks: each first checks the lease is held.
FENCED_WRITES = frozenset({
    "create_job", "transition", "update_progress", "append_ledger", "record_accrued",
    "put_instance", "end_instance", "append_event", "append_prices", "append_training",
    "record_instance_work", "set_training_port", "forget_training_port", "advance_clock",
})  # fmt: skip


class FencedStore:
    """A `Store` whose writes (`FENCED_WRITES`) first check the lease is still held, so that a
    controller that lost it stops at its next write, as at its next EC2 mutation. Reads pass
    through. The check and the write are two calls: a lease that lapses between them lets
    that one write through (its time to live is minutes; a tick's write takes milliseconds).
    """

    def __init__(self, store: Store, lease: FleetLease) -> None:
        self._store = store
        self._lease = lease

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if name not in FENCED_WRITES:
            return attr

        def fenced(*args: Any, **kwargs: Any) -> Any:
            self._lease.check()
            return attr(*args, **kwargs)

        return fenced

    def as_store(self) -> Store:
        """This, typed as the `Store` it stands in for."""
        return cast(Store, self)
