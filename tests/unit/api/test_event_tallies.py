"""The fleet view's and /metrics' incremental reads of the event logs (`views.EventTallies`):
the same facts as folding each job's whole log, reading only what each log gained."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.api.views import EventTallies, fleet, fleet_facts
from orchestrator.store import JobRecord, MemoryStore
from orchestrator.store.events import (
    DecisionEvent,
    EvictionEvent,
    LaunchEvent,
    LaunchFailedEvent,
    NoticeEvent,
)

T0 = 1_580_688_000.0


def submit(store: MemoryStore, job_id: str, at_s: float = T0) -> JobRecord:
    spec = {"name": job_id, "work_gpu_hours": 10.0}
    return store.create_job(JobRecord.submit(job_id, spec, 100.0, at_s))


def launch(job_id: str, instance_id: str, t: float) -> LaunchEvent:
    return LaunchEvent(job_id=job_id, at_s=t, instance_id=instance_id,
                       instance_type="p3.2xlarge", zone="us-east-1a", lifecycle="spot")  # fmt: skip


def evict(job_id: str, instance_id: str, t: float) -> EvictionEvent:
    return EvictionEvent(job_id=job_id, at_s=t, instance_id=instance_id,
                         instance_type="p3.2xlarge", zone="us-east-1a")  # fmt: skip


def decision(job_id: str, t: float, projected: float) -> DecisionEvent:
    return DecisionEvent(job_id=job_id, at_s=t, spent_usd=1.0, work_done_gpu_hours=0.5,
                         expected_cost_per_work=2.0, projected_cost_usd=projected)  # fmt: skip


def summaries(store: MemoryStore, tallies: EventTallies | None) -> list[dict[str, Any]]:
    return fleet(store, T0, tallies)["jobs"]


def test_reading_only_new_events_gives_the_facts_of_the_whole_log() -> None:
    store, tallies = MemoryStore(), EventTallies()
    submit(store, "job-a")
    submit(store, "job-b")
    store.append_event(launch("job-a", "i-1", T0 + 1))
    store.append_event(launch("job-a", "i-2", T0 + 2))
    store.append_event(decision("job-a", T0 + 3, projected=50.0))
    assert summaries(store, tallies) == summaries(store, None)
    # the notice comes in one read, its eviction in the next: still a warned eviction
    store.append_event(NoticeEvent(job_id="job-a", at_s=T0 + 4, instance_id="i-1",
                                   notice="interruption", action="terminate"))  # fmt: skip
    assert summaries(store, tallies) == summaries(store, None)
    store.append_event(evict("job-a", "i-1", T0 + 6))
    store.append_event(evict("job-a", "i-2", T0 + 7))
    store.append_event(LaunchFailedEvent(job_id="job-b", at_s=T0 + 8, market="m@z",
                                         code="InsufficientInstanceCapacity"))  # fmt: skip
    store.append_event(decision("job-a", T0 + 9, projected=60.0))
    incremental, whole = fleet_facts(store, tallies), fleet_facts(store, None)
    assert [f.summary() for f in incremental] == [f.summary() for f in whole]
    a = incremental[0]
    assert (a.evictions_warned, a.evictions_unwarned, a.launches) == (1, 1, 2)
    assert a.projected_cost_usd == 60.0 and a.warned_instances == {"i-1"}
    assert incremental[1].launch_failures == {"InsufficientInstanceCapacity": 1}


def test_each_read_asks_the_store_only_for_the_events_after_the_last_seen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store, tallies = MemoryStore(), EventTallies()
    job = submit(store, "job-a")
    first = store.append_event(launch("job-a", "i-1", T0 + 1))
    asked: list[str] = []
    events = store.events

    def spy(job_id: str, since_id: str = "-", count: int | None = None) -> Any:
        asked.append(since_id)
        return events(job_id, since_id, count)

    monkeypatch.setattr(store, "events", spy)
    kept = tallies.read(store, job)
    assert tallies.read(store, job) is kept  # nothing new: the same tally
    second = store.append_event(launch("job-a", "i-2", T0 + 2))
    newer = tallies.read(store, job)
    assert asked == ["-", first, first]
    assert (kept.launches, newer.launches) == (1, 2)  # a kept tally never changes
    assert newer.last_id == second


def test_a_job_submitted_again_under_the_same_id_starts_over() -> None:
    store, tallies = MemoryStore(), EventTallies()
    job = submit(store, "job-a")
    store.append_event(launch("job-a", "i-1", T0 + 1))
    assert tallies.read(store, job).launches == 1
    fresh = MemoryStore()  # Redis lost its data, say, and the job came again
    again = submit(fresh, "job-a", at_s=T0 + 60)
    fresh.append_event(launch("job-a", "i-9", T0 + 61))
    assert tallies.read(fresh, again).launches == 1


def test_an_ended_jobs_projected_cost_is_what_it_cost() -> None:
    """The last decision's projection (made while it ran) is not shown for an ended job: its
    projected cost is its spend, its projected finish when it ended."""
    store = MemoryStore()
    job = submit(store, "job-a")
    store.append_event(decision("job-a", T0 + 3, projected=50.0))
    [running] = summaries(store, None)
    assert running["projected_cost_usd"] == 50.0
    job = store.transition("job-a", "running", expected_version=job.version, now_s=T0 + 4)
    store.transition("job-a", "succeeded", expected_version=job.version, now_s=T0 + 9)
    for tallies in (None, EventTallies()):
        [ended] = summaries(store, tallies)
        assert ended["projected_cost_usd"] == ended["spent_usd"] == 0.0
        assert ended["projected_finish_at"] == T0 + 9
