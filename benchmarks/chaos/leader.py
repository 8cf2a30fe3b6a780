"""The soak's controller processes: each is a controller (`build_controller`, as `controller
start` builds it) with its own EC2 client, ticking under the fleet's lease (`FleetLease`) as
the controller service does. One holds the lease and acts; a second one started beside it
(`second_controller`) stands by and takes over when the leader dies (its lease is not given
up: a SIGKILL) and the lease's time to live runs out, as does a restarted process.

Invariants: `acted_without_lease` counts EC2 launches and terminations made by a process that
did not hold the lease at that moment (a botocore hook on each process's client reads the
lease's holder just before the request leaves); `other_id_admitted` counts controllers of
another id that the store did not refuse; each takeover's wall seconds (from the leader's
death to a process holding the lease) are kept, and `slow_takeovers` counts those past the
time to live and `TAKEOVER_SLACK_S`.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.chaos.faults import Ec2Faults
from orchestrator.controller.core import Controller
from orchestrator.controller.lease import FleetLease, NotLeaderError
from orchestrator.controller.outcomes import JobTraining
from orchestrator.controller.wiring import build_controller
from orchestrator.errors import UserError
from orchestrator.settings import Settings
from orchestrator.store import RedisStore, StoreError

#: The lease's time to live in the soak (real seconds): a tick longer than this loses it (the
#: fence stops the rest of that tick) and takes it again at the next. At 2 s, one tick in nine
#: of a full soak on a busy machine lost it that way; inside a long lag such failed decisions
#: stretch a gap past the budget's reserve (production's lease lives 1.5 decision intervals).
LEASE_TTL_S = 5.0
#: A takeover may take the time to live and this much more (the standby's polling).
TAKEOVER_SLACK_S = 1.0
#: Real seconds between a standby's looks at a lapsed lease.
POLL_S = 0.05
MUTATIONS = frozenset({"RunInstances", "TerminateInstances"})


@dataclass
class Process:
    """One controller process: its controller, its hold on the lease, when it first ticked."""

    name: str
    controller: Controller
    lease: FleetLease
    born_s: float | None = None  # the soak's clock at its first tick


@dataclass
class Processes:
    """The live controller processes of the soak and what they did."""

    settings: Settings
    store: RedisStore
    aws: Any  # the moto server
    faults: Ec2Faults
    training: JobTraining
    live: list[Process] = field(default_factory=list)
    acted_without_lease: list[str] = field(default_factory=list)
    other_id_admitted: int = 0
    takeover_s: list[float] = field(default_factory=list)
    leader_died_at: float | None = None  # wall time of the leader's death, until a takeover
    last_leader: Process | None = None  # the process that held the lease at the last tick
    _names: Any = field(default_factory=lambda: itertools.count(1))

    def start(self) -> Process:
        """A new process (a restart, or a second one beside the leader)."""
        name = f"ctl-{next(self._names)}"
        lease = FleetLease(self.store, controller_id=self.settings.controller_id,
                           ttl_s=LEASE_TTL_S, owner=name)  # fmt: skip
        lease.bind()
        client = self.aws.client()
        self.faults.install(client)  # the armed faults hit whichever process calls EC2 next
        controller = build_controller(self.settings, store=self.store, client=client,
                                      training=self.training, lease=lease)  # fmt: skip
        # after the controller's own fence: what gets past it
        client.meta.events.register("before-send.ec2", self._fence_check(lease))
        process = Process(name, controller, lease)
        self.live.append(process)
        return process

    def start_other_id(self) -> None:
        """A controller of another id on the same store: it must be refused."""
        lease = FleetLease(self.store, controller_id=f"{self.settings.controller_id}-other",
                           ttl_s=LEASE_TTL_S)  # fmt: skip
        try:
            lease.bind()
        except UserError:
            return
        self.other_id_admitted += 1

    def died(self, process: Process) -> None:
        """`process` was SIGKILLed: gone without giving its lease up."""
        self.live.remove(process)
        if self.leader_died_at is None:
            self.leader_died_at = time.monotonic()

    def leader(self, max_wait_s: float) -> Process | None:
        """The process that holds the lease now, taking it over when it lapsed (waiting up to
        `max_wait_s`); None when none got it (a finding: counted by the caller)."""
        if not self.live:
            self.start()  # systemd restarts the controller
        deadline = time.monotonic() + max_wait_s
        while True:
            for process in self.live:
                try:
                    process.lease.hold()
                except NotLeaderError:
                    continue
                except StoreError:  # Redis is down: no one acts this tick (and a takeover
                    # is timed from when it is back: a lapsed lease cannot be seen before)
                    if self.leader_died_at is not None:
                        self.leader_died_at = time.monotonic()
                    return None
                self.last_leader = process
                if self.leader_died_at is not None:
                    self.takeover_s.append(time.monotonic() - self.leader_died_at)
                    self.leader_died_at = None
                return process
            if time.monotonic() > deadline:
                return None
            time.sleep(POLL_S)

    @property
    def slow_takeovers(self) -> int:
        return sum(1 for s in self.takeover_s if s > LEASE_TTL_S + TAKEOVER_SLACK_S)

    def _fence_check(self, lease: FleetLease) -> Any:
        def check(request: Any, event_name: str = "", **_: Any) -> None:
            operation = event_name.rsplit(".", 1)[-1]
            if operation not in MUTATIONS:
                return
            try:
                holder = self.store.lease_holder()
            except StoreError:  # Redis is down at that moment: no telling
                return
            if lease.token is None or holder != (lease.owner, lease.token):
                self.acted_without_lease.append(f"{lease.owner} {operation} (held by {holder})")

        return check
