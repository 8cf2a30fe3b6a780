"""One controller per fleet: of two controller processes on one store, one holds the lease and
acts, the other stands by (and says so) without touching EC2, and takes over when the lease
lapses or is given up; a controller that lost it stops before its next EC2 mutation or store
write; a controller of another id is refused the store."""

from __future__ import annotations

import pytest

from orchestrator.cloud.memory import InMemoryCloud, InMemoryEC2
from orchestrator.controller.lease import FleetLease, NotLeaderError
from orchestrator.controller.service import ControllerService
from orchestrator.controller.wiring import build_controller
from orchestrator.errors import UserError
from orchestrator.jobspec import JobSubmission
from orchestrator.market.prices import to_epoch_seconds
from orchestrator.settings import Settings
from orchestrator.store import JobRecord, MemoryStore

T0 = to_epoch_seconds("2020-02-03T00:00:00Z")  # as conftest's
TTL_S = 180.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def _service(store: MemoryStore, ec2: InMemoryEC2, prices, clock: Clock, name: str):
    lease = FleetLease(store, controller_id="ctl", ttl_s=TTL_S, owner=name)
    lease.bind()
    cloud = InMemoryCloud("us-east-1", "ctl", ec2=ec2)
    controller = build_controller(Settings(), store=store, cloud=cloud, prices=prices,
                                  lease=lease)  # fmt: skip
    return ControllerService(controller, clock=clock, lease=lease), lease


@pytest.fixture
def world(ec2, prices):
    clock = Clock()
    store = MemoryStore(clock=clock)
    sub = JobSubmission(name="t", budget_usd=200.0, work_gpu_hours=40.0, max_gpus=8.0,
                        instance_types=("p3.2xlarge",))  # fmt: skip
    store.create_job(JobRecord.submit("job-1", sub.model_dump(mode="json"), 200.0, T0))
    a, lease_a = _service(store, ec2, prices, clock, "a")
    b, lease_b = _service(store, ec2, prices, clock, "b")
    return clock, store, ec2, (a, lease_a), (b, lease_b)


def test_the_second_process_stands_by_without_touching_ec2(world) -> None:
    clock, store, ec2, (a, _), (b, _) = world
    assert a.tick_once() is not None and a.health().leader
    launched = set(ec2.instances)
    assert launched
    clock.now += 120.0
    assert b.tick_once() is None
    health = b.health()
    assert not health.leader and "held by a" in (health.standby or "")
    assert health.failures == 0 and set(ec2.instances) == launched  # waiting is not failing
    assert a.tick_once() is not None  # the leader goes on


def test_a_standby_takes_over_when_the_lease_lapses_and_the_old_leader_stops(world) -> None:
    clock, store, ec2, (a, lease_a), (b, lease_b) = world
    a.tick_once()
    first = lease_a.token
    clock.now += TTL_S - 1.0
    assert b.tick_once() is None  # a's lease still runs
    clock.now += 2.0  # a stopped ticking (hung, partitioned): its lease lapsed
    assert b.tick_once() is not None and b.health().leader
    assert lease_b.token is not None and first is not None and lease_b.token > first
    # a comes back: it finds the lease taken and stands by, touching nothing
    before = {i: inst.state for i, inst in ec2.instances.items()}
    with pytest.raises(NotLeaderError):
        a.controller.cloud.terminate(list(ec2.instances))  # fenced: its token is stale
    assert {i: inst.state for i, inst in ec2.instances.items()} == before
    assert a.tick_once() is None and not a.health().leader


def test_a_controller_that_lost_the_lease_writes_nothing_to_the_store(world) -> None:
    clock, store, ec2, (a, lease_a), (b, _) = world
    a.tick_once()
    clock.now += TTL_S + 1.0
    assert b.tick_once() is not None  # b holds it now
    job = store.get_job("job-1")
    events = len(store.events("job-1"))
    with pytest.raises(NotLeaderError):
        a.controller.store.update_progress("job-1", 39.0, clock.now)
    with pytest.raises(NotLeaderError):
        a.controller.store.transition(
            "job-1", "cancelled", expected_version=job.version, now_s=clock.now
        )
    assert store.get_job("job-1") == job and len(store.events("job-1")) == events
    assert a.controller.store.get_job("job-1") == job  # reads pass through
    with pytest.raises(NotLeaderError):
        a.controller.tick(clock.now)  # its first write stops it (the clock's mark)
    assert lease_a.token is None


def test_a_stopped_leader_gives_the_lease_up_at_once(world) -> None:
    clock, store, ec2, (a, _), (b, _) = world
    a.tick_once()
    a.stop()
    assert store.lease_holder() is None
    assert b.tick_once() is not None  # no wait for the time to live


def test_a_controller_of_another_id_is_refused_the_store(world) -> None:
    _, store, _, _, _ = world
    with pytest.raises(UserError, match="fleet of controller 'ctl', not 'other'") as info:
        FleetLease(store, controller_id="other", ttl_s=TTL_S).bind()
    assert "ORCHESTRATOR_CONTROLLER_ID=ctl" in (info.value.fix or "")
