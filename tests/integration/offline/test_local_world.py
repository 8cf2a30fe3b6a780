"""The offline world: replay clock, moto over HTTP, a local Redis, replayed evictions with their
notices, instance agent processes -- and the unchanged controller running a job through all of it.

Everything started here (servers, processes, threads) is stopped by context managers and
fixtures, also when a test fails.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import redis

from orchestrator.agent.work import WorkMeter
from orchestrator.cloud.ec2 import EC2Cloud
from orchestrator.cloud.imds import NoticeWatcher
from orchestrator.cloud.instances import LaunchSpec
from orchestrator.cloud.local.clock import FakeClock, ReplayClock
from orchestrator.cloud.local.evictions import EvictionReplayer, EvictionState
from orchestrator.cloud.local.fleet import LocalFleet, LocalNodeState
from orchestrator.cloud.local.metadata_mock import MetadataMock
from orchestrator.cloud.local.moto_server import MotoEC2Server
from orchestrator.cloud.local.redis_process import LocalRedis, RedisProcessError
from orchestrator.cloud.notices import InterruptionNotice
from orchestrator.controller.core import TickReport
from orchestrator.controller.wiring import build_controller
from orchestrator.jobspec import JobSubmission
from orchestrator.market.eviction import AvailabilityTrace
from orchestrator.market.prices import to_epoch_seconds
from orchestrator.market.trace_source import TracePriceSource, bundled_prices_dir
from orchestrator.settings import Settings
from orchestrator.store import EventKind, JobRecord, JobState
from orchestrator.store.protocol import Store
from orchestrator.store.redis_store import RedisStore

REGION = "us-east-1"
T0 = to_epoch_seconds("2020-02-03T00:00:00Z")
NS = "localworld"


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def aws() -> Iterator[MotoEC2Server]:
    with MotoEC2Server() as server:
        yield server


@pytest.fixture(scope="module")
def local_redis() -> Iterator[LocalRedis]:
    with LocalRedis() as r:
        yield r


@pytest.fixture
def store(local_redis: LocalRedis) -> Iterator[Store]:
    redis.Redis.from_url(local_redis.url).flushdb()
    s = RedisStore.connect(local_redis.url, namespace=NS)
    yield s
    s.close()


@pytest.fixture(scope="module")
def trace() -> AvailabilityTrace:
    return AvailabilityTrace.bundled()


def submit(store: Store, job_id: str, **fields: Any) -> JobRecord:
    sub = JobSubmission(**{"name": "local", "budget_usd": 20.0, "work_gpu_hours": 1.5, **fields})
    return store.create_job(
        JobRecord.submit(job_id, sub.model_dump(mode="json"), sub.budget_usd, T0)
    )


def launch(cloud: EC2Cloud, job_id: str, instance_type: str, spot: bool = True) -> str:
    spec = LaunchSpec(
        job_id=job_id,
        allocation_id=f"{job_id}-{instance_type}-{'spot' if spot else 'od'}",
        instance_type=instance_type,
        zone="us-east-1a",
        count=1,
        max_price_usd_per_hour=5.0 if spot else None,
    )
    return cloud.launch(spec)[0].instance_id


def state_in_moto(client: Any, instance_id: str) -> str:
    reply = client.describe_instances(InstanceIds=[instance_id])
    return str(reply["Reservations"][0]["Instances"][0]["State"]["Name"])


def wait_for(condition: Callable[[], bool], timeout_s: float, every_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(every_s)
    return condition()


# -- clock ------------------------------------------------------------------------------------


def test_replay_clock_maps_wall_time_to_sim_time_at_its_speed() -> None:
    wall = [100.0]
    clock = ReplayClock(T0, 600.0, wall=lambda: wall[0])
    assert clock.now() == T0
    wall[0] += 0.5
    assert clock.now() == pytest.approx(T0 + 300.0)
    assert clock.to_wall_delay(120.0) == pytest.approx(0.2)
    twin = ReplayClock(T0, 600.0, wall=lambda: wall[0], wall_origin=100.0)  # another process
    assert twin.now() == pytest.approx(clock.now())
    with pytest.raises(ValueError):
        ReplayClock(T0, 0.0)


def test_replay_clock_sleeps_in_real_time_and_never_longer_than_its_bound() -> None:
    clock = ReplayClock(T0, 600.0)
    started = time.monotonic()
    assert clock.sleep_until(clock.now() + 60.0) >= T0 + 60.0  # 0.1 s real
    assert clock.sleep_until(clock.now() + 86400.0, max_wall_s=0.05) < T0 + 86400.0
    assert time.monotonic() - started < 1.0


def test_fake_clock_moves_only_when_told() -> None:
    clock = FakeClock(T0)
    assert clock.advance(30.0) == T0 + 30.0
    assert clock.sleep_until(T0 + 10.0) == T0 + 30.0  # never back
    assert clock.sleep_until(T0 + 90.0) == clock.now() == T0 + 90.0
    with pytest.raises(ValueError):
        clock.advance(-1.0)


# -- servers ----------------------------------------------------------------------------------


def test_moto_server_serves_run_and_describe_instances_over_http_on_loopback(aws) -> None:
    assert aws.endpoint_url.startswith("http://127.0.0.1:")
    ec2 = aws.client()
    assert ec2.meta.endpoint_url == aws.endpoint_url
    run = ec2.run_instances(ImageId="ami-x", MinCount=2, MaxCount=2, InstanceType="p3.2xlarge")
    ids = sorted(i["InstanceId"] for i in run["Instances"])
    described = aws.client().describe_instances(InstanceIds=ids)  # a second client sees them
    assert sorted(i["InstanceId"] for r in described["Reservations"] for i in r["Instances"]) == ids
    ec2.terminate_instances(InstanceIds=ids)


def test_local_redis_starts_answers_ping_and_stops_its_process() -> None:
    with LocalRedis() as r:
        assert r.url.startswith("redis://127.0.0.1:")
        pid = r.pid
        assert pid is not None
        client = redis.Redis.from_url(r.url)
        assert client.ping()
        client.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_missing_redis_server_says_how_to_install_it() -> None:
    with pytest.raises(RedisProcessError) as caught, LocalRedis("no-such-redis-server-binary"):
        pass
    assert "apt-get install redis-server" in str(caught.value)


# -- evictions --------------------------------------------------------------------------------


def test_spot_instances_draw_evictions_from_the_trace_and_on_demand_ones_none(aws, trace) -> None:
    cid = "ctl-draw"
    cloud = EC2Cloud(REGION, cid, client=aws.client())
    spot = [launch(cloud, f"draw-{k}", "p3.2xlarge") for k in range(3)]
    od = launch(cloud, "draw-od", "m5.xlarge", spot=False)
    times: list[list[float | None]] = []
    for _ in range(2):  # the same seed and launches give the same evictions
        replayer = EvictionReplayer(aws.client(), cid, trace, FakeClock(T0), seed=7)
        replayer.step()
        times.append([replayer.eviction_time(i) for i in spot])
        assert replayer.eviction_time(od) == float("inf")
    assert times[0] == times[1]
    assert all(t is not None and T0 < t < float("inf") for t in times[0])  # ~0.6/node-hour
    cloud.terminate([*spot, od])


def test_forced_eviction_gives_the_notice_before_terminating_and_the_node_watcher_sees_it(
    aws, trace
) -> None:
    cid = "ctl-force"
    client = aws.client()
    cloud = EC2Cloud(REGION, cid, client=client)
    victim = launch(cloud, "force-1", "p3.2xlarge")
    clock = FakeClock(T0)
    notices: list[InterruptionNotice] = []
    replayer = EvictionReplayer(
        client, cid, trace, clock, seed=1, notice_s=120.0, on_notice=notices.append
    )
    seen_by_node: list[InterruptionNotice] = []
    with MetadataMock(victim) as mock:
        watcher = NoticeWatcher(mock.base_url, on_notice=seen_by_node.append, instance_id=victim)
        replayer.attach_metadata(victim, mock)
        assert replayer.force_evict(victim, T0 + 600.0)
        replayer.step()
        assert watcher.poll_once() == []
        clock.advance(400.0)  # T0+400: the notice is due at T0+480
        assert replayer.step().notices == []
        clock.advance(80.0)  # T0+480: just in time for a full notice
        step = replayer.step()
        assert [n.instance_id for n in step.notices] == [victim] == [n.instance_id for n in notices]
        assert notices[0].notice_time == datetime.fromtimestamp(T0 + 600.0, UTC)
        assert notices[0].kind == "interruption" and notices[0].action == "terminate"
        assert state_in_moto(client, victim) == "running"
        assert [n.notice_time for n in watcher.poll_once()] == [notices[0].notice_time]
        assert seen_by_node[0].kind == "interruption"
        clock.advance(60.0)
        assert replayer.step().evicted == []
        clock.advance(60.0)  # T0+600
        assert replayer.step().evicted == [victim]
        watcher.stop()
    assert state_in_moto(client, victim) in ("shutting-down", "terminated")
    (record,) = replayer.evictions
    assert record.forced and record.evicted_at_s - record.noticed_at_s >= 120.0
    assert replayer.state(victim) is EvictionState.EVICTED


def test_a_late_step_postpones_the_eviction_to_keep_the_full_notice(aws, trace) -> None:
    cid = "ctl-late"
    client = aws.client()
    victim = launch(EC2Cloud(REGION, cid, client=client), "late-1", "p3.2xlarge")
    clock = FakeClock(T0)
    replayer = EvictionReplayer(client, cid, trace, clock, seed=2, notice_s=120.0)
    replayer.force_evict(victim, T0 + 10.0)  # before the instance was even seen
    clock.advance(50.0)
    step = replayer.step()  # seen, already past both the notice and the eviction time
    assert step.notices[0].notice_time == datetime.fromtimestamp(T0 + 170.0, UTC)
    assert step.evicted == []
    clock.advance(120.0)
    assert replayer.step().evicted == [victim]


# -- instance agents ------------------------------------------------------------------------------


def test_work_counts_only_after_the_warm_up_and_not_past_the_notices_eviction_time() -> None:
    meter = WorkMeter(work_rate=2.0, started_s=T0, ready_after_s=240.0)
    assert meter.advance(T0 + 240.0) == 0.0
    assert meter.advance(T0 + 240.0 + 1800.0) == pytest.approx(1.0)  # 2 GPUs for half an hour
    meter.stop_at(T0 + 240.0 + 3600.0)
    assert meter.advance(T0 + 86400.0) == pytest.approx(2.0)


def test_gpu_instances_get_agents_whose_work_grows_with_sim_time_and_stops_at_termination(
    aws, local_redis, store, tmp_path: Path
) -> None:
    cid, job = "ctl-fleet", "fleet-1"
    submit(store, job)
    client = aws.client()
    cloud = EC2Cloud(REGION, cid, client=client)
    p3 = launch(cloud, job, "p3.2xlarge")
    g4 = launch(cloud, job, "g4dn.xlarge")
    cpu = launch(cloud, job, "m5.xlarge", spot=False)
    clock = ReplayClock(T0, 600.0)
    with LocalFleet(
        local_redis.url,
        NS,
        clock,
        cloud_client=client,
        controller_id=cid,
        log_dir=tmp_path,
        ready_after_sim_s=60.0,
    ) as fleet:
        first = fleet.step()
        assert sorted(first.started) == sorted([p3, g4])  # no agent for the CPU node
        assert fleet.nodes[cpu].process is None

        def work() -> dict[str, float]:
            return fleet.work_of(job)

        assert wait_for(lambda: min(work().get(p3, 0.0), work().get(g4, 0.0)) > 0, 8.0), work()
        h1 = fleet.heartbeats_of(job)
        time.sleep(0.6)  # 360 sim s: at least one more report each
        h2 = fleet.heartbeats_of(job)
        w2 = work()
        for instance_id, rate in ((p3, 1.0), (g4, 0.35)):  # a V100; a T4 does 0.35 of one
            a, b = h1[instance_id], h2[instance_id]
            assert b.sim_s > a.sim_s
            done = (b.work_gpu_hours - a.work_gpu_hours) * 3600.0 / (b.sim_s - a.sim_s)
            assert done == pytest.approx(rate, rel=1e-6)
        simulated = fleet.step().agent_work[job]
        assert simulated >= w2[p3] + w2[g4]
        # the agents' simulated work is never the job's progress: that is what it trained
        assert store.get_job(job).work_done_gpu_hours == 0.0

        cloud.terminate([p3])  # the instance goes: its agent stops, its work stays
        step = fleet.step()
        assert step.stopped == [p3]
        assert fleet.nodes[p3].state is LocalNodeState.STOPPED
        agent = fleet.nodes[p3].process
        assert agent is not None and agent.returncode == 0
        stopped_at = work()[p3]
        time.sleep(0.6)
        assert work()[p3] == stopped_at
        assert work()[g4] > w2[g4]
        processes = [n.process for n in fleet.nodes.values() if n.process is not None]
    assert all(p.poll() is not None for p in processes)  # close() stopped every agent
    cloud.terminate([g4, cpu])


# -- end to end -------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_controller_runs_a_job_to_success_in_the_offline_world_through_an_eviction(
    trace, tmp_path: Path
) -> None:
    cid, job = "ctl-e2e", "e2e-1"
    budget = 20.0
    reports: list[TickReport] = []
    with LocalRedis() as local_redis, MotoEC2Server() as aws:
        store = RedisStore.connect(local_redis.url, namespace=NS)
        submit(
            store,
            job,
            budget_usd=budget,
            work_gpu_hours=1.5,
            max_gpus=2,
            instance_types=("p3.2xlarge",),
        )
        settings = Settings(region=REGION, controller_id=cid)
        controller = build_controller(
            settings, store=store, client=aws.client(), prices=TracePriceSource(
                [bundled_prices_dir(REGION)]))  # fmt: skip
        clock = ReplayClock(T0, 600.0)
        replayer = EvictionReplayer(
            aws.client(), cid, trace, clock, seed=11, on_notice=controller.notify
        )
        forced: str | None = None
        with LocalFleet(
            local_redis.url,
            NS,
            clock,
            cloud_client=aws.client(),
            controller_id=cid,
            replayer=replayer,
            log_dir=tmp_path,
        ) as fleet:
            deadline = time.monotonic() + 60.0
            while time.monotonic() < deadline:
                reports.append(controller.tick(clock.now()))
                if store.get_job(job).state.is_terminal:
                    break
                replayer.step()
                # this controller trains nothing (no training port): the test is the job's
                # work source, from its agents' simulated work, as the scale benchmark is
                work = fleet.step().agent_work.get(job)
                if work is not None:
                    store.update_progress(job, work, clock.now())
                if forced is None and clock.now() > T0 + 900.0:
                    # one not already being reclaimed, whose agent is up to see the notice (on
                    # a busy machine an agent takes seconds to start)
                    for i in controller.cloud.describe():
                        if (
                            i.lifecycle == "spot"
                            and _agent_started(tmp_path / f"{i.instance_id}.log")
                            and replayer.force_evict(i.instance_id, clock.now() + 300.0)
                        ):
                            forced = i.instance_id
                            break
                time.sleep(0.2)
            fleet.step()  # stops the agents of the instances the controller released
            assert all(n.state is LocalNodeState.STOPPED for n in fleet.nodes.values())

        final = store.get_job(job)
        events = [e.kind for _, e in store.events(job)]
        left = controller.cloud.describe()
        store.close()

    assert final.state is JobState.SUCCEEDED, (final.state, final.message)
    assert final.work_done_gpu_hours >= 1.5
    assert 0 < final.spent_usd <= budget
    assert forced is not None
    evicted_by_replayer = {e.instance_id for e in replayer.evictions}
    evicted_seen_by_controller = {i for r in reports for i in r.evicted}
    assert forced in evicted_by_replayer
    assert evicted_by_replayer <= evicted_seen_by_controller
    assert EventKind.NOTICE in events and EventKind.EVICTION in events
    assert "spot interruption notice" in (tmp_path / f"{forced}.log").read_text()
    assert left == []  # nothing of ours left running in moto


def _agent_started(log: Path) -> bool:
    return log.exists() and "instance agent started" in log.read_text(errors="replace")
