"""`orchestrator.store`: jobs, transitions, the ledger, instances, events and claims on a real
redis-server (started per module on a free port, flushed between tests)."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from itertools import product
from typing import Any

import numpy as np
import pytest
import redis
from support.redis_server import RedisServerError, free_port, start_redis

from orchestrator.bidbrain.model import JobSpec
from orchestrator.errors import UserError
from orchestrator.market.billing import EndReason, PerSecondBilling
from orchestrator.market.prices import Market, PriceSeries
from orchestrator.store import (
    ALLOWED_TRANSITIONS,
    TERMINAL_STATES,
    ConflictError,
    DecisionEvent,
    Event,
    EvictionEvent,
    IllegalTransitionError,
    InstanceRecord,
    JobRecord,
    JobState,
    LaunchEvent,
    LedgerConflictError,
    LedgerEntry,
    NotFoundError,
    NoticeEvent,
    RedisStore,
    StateEvent,
    Store,
    StoreError,
    StoreUnavailableError,
)

NS = "test"
NOTICE = NoticeEvent(job_id="j1", at_s=1.0, instance_id="i-1", notice="rebalance")
SPEC = JobSpec(name="resnet", work_gpu_hours=10.0, max_work_rate=4.0, budget_usd=50.0)


@pytest.fixture
def raw(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture
def store(redis_url: str, raw: redis.Redis) -> Iterator[RedisStore]:
    s = RedisStore.connect(redis_url, namespace=NS)
    yield s
    s.close()


def job(
    job_id: str = "j1", *, now_s: float = 100.0, state: JobState = JobState.QUEUED
) -> JobRecord:
    record = JobRecord.submit(job_id, SPEC.model_dump(mode="json"), 50.0, now_s)
    return record.model_copy(update={"state": state})


def charge(
    job_id: str = "j1", instance_id: str = "i-1", start_s: float = 0.0, billed_s: float = 600.0
) -> LedgerEntry:
    price = 0.9
    return LedgerEntry(
        job_id=job_id,
        instance_id=instance_id,
        instance_type="p3.2xlarge",
        zone="us-east-1a",
        start_s=start_s,
        end_s=start_s + billed_s,
        price_usd_per_hour=price,
        billed_s=billed_s,
        charged_usd=price * billed_s / 3600.0,
        reason=EndReason.PRICE_CHANGE.value,
    )


def instance(instance_id: str, job_id: str = "j1", launched_at: float = 10.0) -> InstanceRecord:
    return InstanceRecord(
        instance_id=instance_id,
        job_id=job_id,
        allocation_id="alloc-1",
        instance_type="p3.2xlarge",
        zone="us-east-1a",
        lifecycle="spot",
        max_price_usd_per_hour=1.2,
        launched_at=launched_at,
        state="running",
    )


def run_together(n: int, fn: Callable[[int], Any]) -> tuple[list[Any], list[BaseException]]:
    """Run fn(0..n-1) on n threads released at the same instant; results and exceptions."""
    barrier = threading.Barrier(n)
    results: list[Any] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        barrier.wait()
        try:
            out = fn(i)
        except BaseException as exc:  # collected; the test asserts on them
            with lock:
                errors.append(exc)
        else:
            with lock:
                results.append(out)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    return results, errors


# --- jobs


def test_created_jobs_are_read_back_and_listed_oldest_first(store: Store) -> None:
    for job_id, now_s in [("b", 2.0), ("a", 3.0), ("c", 1.0)]:
        assert store.create_job(job(job_id, now_s=now_s)) == job(job_id, now_s=now_s)

    got = store.get_job("a")
    assert got == job("a", now_s=3.0)
    assert JobSpec.model_validate(got.spec) == SPEC
    assert got.name == "resnet"
    assert [j.job_id for j in store.list_jobs()] == ["c", "b", "a"]

    store.transition("b", JobState.RUNNING, expected_version=0, now_s=5.0)
    assert [j.job_id for j in store.list_jobs(states=[JobState.RUNNING])] == ["b"]
    assert [j.job_id for j in store.list_jobs(states=["queued"])] == ["c", "a"]
    assert store.list_jobs(states=[]) == []


def test_creating_an_existing_job_raises_conflict_and_keeps_the_original(store: Store) -> None:
    store.create_job(job("j1", now_s=1.0))
    with pytest.raises(ConflictError) as info:
        store.create_job(job("j1", now_s=2.0))
    assert (info.value.key, info.value.expected_version, info.value.actual_version) == (
        f"{NS}:job:j1",
        None,
        0,
    )
    assert store.get_job("j1").submitted_at == 1.0


def test_a_new_job_must_have_spent_nothing(store: Store) -> None:
    with pytest.raises(ValueError, match="append_ledger"):
        store.create_job(job().model_copy(update={"spent_usd": 1.0}))


@pytest.mark.parametrize("job_id", ["nope", "j1:ledger", "", "a b"])
def test_unknown_or_impossible_job_ids_raise_not_found(store: Store, job_id: str) -> None:
    store.create_job(job("j1"))
    with pytest.raises(NotFoundError) as info:
        store.get_job(job_id)
    assert (info.value.kind, info.value.record_id) == ("job", job_id)
    with pytest.raises(NotFoundError):
        store.transition(job_id, JobState.RUNNING, expected_version=0, now_s=1.0)
    with pytest.raises(NotFoundError):
        store.update_progress(job_id, 1.0, now_s=1.0)
    with pytest.raises(NotFoundError):
        store.spent_usd(job_id)


def test_job_records_are_validated() -> None:
    with pytest.raises(ValueError):
        JobRecord.submit("j1", {}, budget_usd=0.0, now_s=0.0)
    with pytest.raises(ValueError):
        JobRecord.submit("bad:id", {}, budget_usd=1.0, now_s=0.0)
    with pytest.raises(ValueError):
        JobRecord.submit("j1", {}, budget_usd=float("inf"), now_s=0.0)


# --- transitions

EDGES = [(a, b) for a, targets in ALLOWED_TRANSITIONS.items() for b in sorted(targets)]
NON_EDGES = [(a, b) for a, b in product(JobState, JobState) if b not in ALLOWED_TRANSITIONS[a]]


def test_transition_table_covers_every_state_and_terminal_states_go_nowhere() -> None:
    assert set(ALLOWED_TRANSITIONS) == set(JobState)
    assert sorted(TERMINAL_STATES) == sorted(
        [JobState.SUCCEEDED, JobState.FAILED, JobState.BUDGET_EXHAUSTED, JobState.CANCELLED]
    )
    assert len(EDGES) == 8
    for state in JobState:
        assert state.value in (JobState.__doc__ or "")


@pytest.mark.parametrize(("from_state", "to_state"), EDGES, ids=lambda s: str(s))
def test_allowed_transition_moves_the_job_and_bumps_its_version(
    store: Store, from_state: JobState, to_state: JobState
) -> None:
    store.create_job(job(state=from_state))
    moved = store.transition(
        "j1", to_state, expected_version=0, now_s=200.0, message=f"{from_state}->{to_state}"
    )
    assert (moved.state, moved.version, moved.updated_at) == (to_state, 1, 200.0)
    assert moved.message == f"{from_state}->{to_state}"
    assert store.get_job("j1") == moved


@pytest.mark.parametrize(("from_state", "to_state"), NON_EDGES, ids=lambda s: str(s))
def test_illegal_transition_raises_and_leaves_the_record_unchanged(
    store: Store, from_state: JobState, to_state: JobState
) -> None:
    store.create_job(job(state=from_state))
    before = store.get_job("j1")
    with pytest.raises(IllegalTransitionError) as info:
        store.transition("j1", to_state, expected_version=0, now_s=200.0)
    assert (info.value.job_id, info.value.from_state, info.value.to_state) == (
        "j1",
        from_state,
        to_state,
    )
    assert store.get_job("j1") == before


def test_illegal_transition_is_logged_with_its_fields(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    store.create_job(job(state=JobState.SUCCEEDED))
    with (
        caplog.at_level(logging.WARNING, logger="orchestrator.store"),
        pytest.raises(IllegalTransitionError),
    ):
        store.transition("j1", JobState.RUNNING, expected_version=0, now_s=7.0)
    (record,) = caplog.records
    assert record.__dict__["job_id"] == "j1"
    assert (record.__dict__["from_state"], record.__dict__["to_state"]) == ("succeeded", "running")
    assert record.__dict__["at_s"] == 7.0


def test_a_job_walks_its_lifecycle_through_versions(store: Store) -> None:
    store.create_job(job())
    v = store.transition("j1", "running", expected_version=0, now_s=1.0).version
    v = store.transition("j1", "cancelling", expected_version=v, now_s=2.0).version
    done = store.transition("j1", "cancelled", expected_version=v, now_s=3.0, message="user")
    assert (done.state, done.version, done.message) == (JobState.CANCELLED, 3, "user")
    assert done.state.is_terminal


def test_stale_expected_version_raises_conflict_and_changes_nothing(store: Store) -> None:
    store.create_job(job())
    store.transition("j1", JobState.RUNNING, expected_version=0, now_s=1.0)
    before = store.get_job("j1")
    with pytest.raises(ConflictError) as info:
        store.transition("j1", JobState.SUCCEEDED, expected_version=0, now_s=2.0)
    assert (info.value.key, info.value.expected_version, info.value.actual_version) == (
        f"{NS}:job:j1",
        0,
        1,
    )
    assert store.get_job("j1") == before


def test_unknown_target_state_is_a_value_error(store: Store) -> None:
    store.create_job(job())
    with pytest.raises(ValueError):
        store.transition("j1", "paused", expected_version=0, now_s=1.0)


def test_concurrent_transitions_from_the_same_version_exactly_one_wins(store: Store) -> None:
    # half the threads start the job, half cancel it: one move wins, whichever it is
    targets = [JobState.RUNNING, JobState.CANCELLED]
    for round_ in range(10):
        job_id = f"race{round_}"
        store.create_job(job(job_id))

        def move(i: int, job_id: str = job_id) -> JobRecord:
            return store.transition(job_id, targets[i % 2], expected_version=0, now_s=float(i))

        wins, errors = run_together(8, move)
        assert len(wins) == 1, errors
        assert len(errors) == 7 and all(isinstance(e, ConflictError) for e in errors)
        assert store.get_job(job_id) == wins[0]
        assert wins[0].version == 1


def test_progress_updates_do_not_bump_the_version(store: Store) -> None:
    store.create_job(job())
    store.transition("j1", JobState.RUNNING, expected_version=0, now_s=1.0)
    updated = store.update_progress("j1", 2.5, now_s=9.0)
    assert (updated.work_done_gpu_hours, updated.updated_at, updated.version) == (2.5, 9.0, 1)
    store.transition("j1", JobState.SUCCEEDED, expected_version=1, now_s=10.0)
    with pytest.raises(ValueError):
        store.update_progress("j1", -1.0, now_s=11.0)


# --- ledger


def test_ledger_append_adds_to_spent_usd(store: Store) -> None:
    store.create_job(job())
    entries = [charge(start_s=600.0 * k, billed_s=600.0) for k in range(5)]
    for e in entries:
        assert store.append_ledger(e) is True
    assert store.ledger("j1") == entries
    assert store.spent_usd("j1") == pytest.approx(sum(e.charged_usd for e in entries), rel=1e-12)
    assert store.get_job("j1").spent_usd == store.spent_usd("j1")
    assert store.get_job("j1").version == 0  # spend is not a lifecycle write


def test_concurrent_ledger_appends_from_several_threads_sum_to_spent_usd(store: Store) -> None:
    store.create_job(job())

    def append_many(thread: int) -> int:
        for k in range(50):
            store.append_ledger(
                charge(instance_id=f"i-{thread}", start_s=float(k), billed_s=1.0 + k + thread)
            )
        return thread

    done, errors = run_together(8, append_many)
    assert not errors and len(done) == 8
    entries = store.ledger("j1")
    assert len(entries) == 400
    assert store.spent_usd("j1") == pytest.approx(sum(e.charged_usd for e in entries), rel=1e-12)


def test_replayed_ledger_entry_is_recorded_once(store: Store) -> None:
    store.create_job(job())
    assert store.append_ledger(charge()) is True
    assert store.append_ledger(charge()) is False  # a restarted controller re-sends its bill
    assert len(store.ledger("j1")) == 1
    assert store.spent_usd("j1") == pytest.approx(charge().charged_usd)


def test_different_charge_for_an_interval_already_billed_is_refused(store: Store) -> None:
    store.create_job(job())
    store.append_ledger(charge(billed_s=600.0))
    with pytest.raises(LedgerConflictError) as info:
        store.append_ledger(charge(billed_s=900.0))
    assert (info.value.instance_id, info.value.start_s) == ("i-1", 0.0)
    assert store.ledger("j1") == [charge(billed_s=600.0)]


def test_spend_is_not_recorded_without_its_entry_when_the_increment_fails(
    store: Store, raw: redis.Redis
) -> None:
    store.create_job(job())
    raw.hset(f"{NS}:job:j1", "spent_usd", "not-a-number")  # a corrupted counter
    with pytest.raises(StoreError, match="refused"):
        store.append_ledger(charge())
    assert raw.llen(f"{NS}:job:j1:ledger") == 0
    assert not raw.exists(f"{NS}:job:j1:ledger-index")


def test_ledger_of_an_unknown_job_raises_not_found(store: Store) -> None:
    with pytest.raises(NotFoundError):
        store.append_ledger(charge(job_id="ghost"))
    with pytest.raises(NotFoundError):
        store.ledger("ghost")


def test_ledger_entries_from_a_billing_model_sum_to_the_bill(store: Store) -> None:
    store.create_job(job())
    series = PriceSeries(
        Market("p3.2xlarge", "us-east-1a"), np.array([0.0, 1800.0]), np.array([0.9, 1.2]), 7200.0
    )
    bill = PerSecondBilling().bill_spot(series, 600.0, 4200.0, EndReason.EVICTED)
    for interval in bill:
        store.append_ledger(
            LedgerEntry.from_interval(
                interval,
                job_id="j1",
                instance_id="i-1",
                instance_type="p3.2xlarge",
                zone="us-east-1a",
            )
        )
    assert [e.reason for e in store.ledger("j1")] == ["price-change", "evicted"]
    assert store.spent_usd("j1") == pytest.approx(sum(i.charged_usd for i in bill))


def test_ledger_entry_charge_must_match_price_and_billed_time() -> None:
    with pytest.raises(ValueError, match="charged_usd"):
        LedgerEntry.model_validate(charge().model_dump() | {"charged_usd": 5.0})


# --- instances


def test_instances_are_listed_per_job_and_ended_ones_drop_from_alive(store: Store) -> None:
    store.put_instance(instance("i-2", launched_at=20.0))
    store.put_instance(instance("i-1", launched_at=10.0))
    store.put_instance(instance("i-9", job_id="j2"))

    assert [r.instance_id for r in store.list_instances("j1")] == ["i-1", "i-2"]
    assert [r.instance_id for r in store.list_instances()] == ["i-1", "i-9", "i-2"]

    ended = store.end_instance("i-1", ended_at=70.0, reason=EndReason.EVICTED.value)
    assert (ended.state, ended.ended_at, ended.end_reason) == ("ended", 70.0, "evicted")
    assert not ended.alive
    assert store.get_instance("i-1") == ended
    assert [r.instance_id for r in store.list_instances("j1", alive_only=True)] == ["i-2"]
    assert [r.instance_id for r in store.list_instances(alive_only=True)] == ["i-9", "i-2"]
    assert [r.instance_id for r in store.list_instances("j1")] == ["i-1", "i-2"]


def test_ending_an_instance_twice_keeps_the_first_end(store: Store) -> None:
    store.put_instance(instance("i-1"))
    first = store.end_instance("i-1", ended_at=70.0, reason="evicted")
    assert store.end_instance("i-1", ended_at=90.0, reason="released") == first


def test_an_ended_instance_cannot_be_put_back_alive(store: Store) -> None:
    store.put_instance(instance("i-1"))
    ended = store.end_instance("i-1", ended_at=70.0, reason="released")
    with pytest.raises(IllegalTransitionError) as info:
        store.put_instance(instance("i-1"))
    assert (info.value.from_state, info.value.to_state) == ("ended", "running")
    assert store.get_instance("i-1") == ended
    assert store.list_instances(alive_only=True) == []


def test_an_instance_cannot_move_to_another_job(store: Store) -> None:
    store.put_instance(instance("i-1", job_id="j1"))
    with pytest.raises(StoreError, match="belongs to job 'j1'"):
        store.put_instance(instance("i-1", job_id="j2"))


def test_instance_errors(store: Store) -> None:
    with pytest.raises(NotFoundError):
        store.get_instance("i-404")
    with pytest.raises(NotFoundError):
        store.end_instance("i-404", ended_at=1.0, reason="released")
    store.put_instance(instance("i-1", launched_at=10.0))
    with pytest.raises(ValueError, match="before launched_at"):
        store.end_instance("i-1", ended_at=5.0, reason="released")
    assert store.get_instance("i-1").alive


# --- events


def test_events_round_trip_typed_in_order_and_since_returns_only_later_ones(
    store: Store,
) -> None:
    sent: list[Event] = [
        LaunchEvent(job_id="j1", at_s=1.0, instance_id="i-1", instance_type="p3.2xlarge",
                    zone="us-east-1a", lifecycle="spot", max_price_usd_per_hour=0.9),
        DecisionEvent(job_id="j1", at_s=2.0, spent_usd=1.5, work_done_gpu_hours=0.25,
                      expected_cost_per_work=None, acquire=("2xp3.2xlarge@us-east-1a",)),
        EvictionEvent(job_id="j1", at_s=3.0, instance_id="i-1", instance_type="p3.2xlarge",
                      zone="us-east-1a"),
    ]  # fmt: skip
    ids = [store.append_event(e) for e in sent]
    store.append_event(StateEvent(job_id="j2", at_s=1.0, state=JobState.QUEUED))

    got = store.events("j1")
    assert got == list(zip(ids, sent, strict=True))
    assert isinstance(got[1][1], DecisionEvent) and got[1][1].acquire == sent[1].acquire
    assert store.events("j1", since_id=ids[0]) == list(zip(ids[1:], sent[1:], strict=True))
    assert store.events("j1", since_id=ids[-1]) == []
    assert store.events("j1", count=2) == list(zip(ids[:2], sent[:2], strict=True))
    assert store.events("nobody") == []
    with pytest.raises(StoreError):
        store.events("j1", since_id="not-an-id")


def test_events_written_before_the_kinds_were_typed_still_read(
    store: Store, raw: redis.Redis
) -> None:
    """A controller upgraded in place keeps showing its old events: the untyped form (a
    `fields` mapping, the API's `to_state`/`reason`) reads as the typed one."""
    key = f"{NS}:job:j1:events"
    legacy = [
        {"job_id": "j1", "kind": "state", "at_s": 1.0,
         "fields": {"from_state": None, "to_state": "queued", "reason": "submitted", "by": "api"}},
        {"job_id": "j1", "kind": "decision", "at_s": 2.0,
         "fields": {"spent_usd": 1.0, "work_done_gpu_hours": 0.5, "expected_cost_per_work": None,
                    "projected_cost_usd": 9.0,
                    "acquire": "1xp3.2xlarge@us-east-1a;2xg4dn.xlarge@us-east-1b",
                    "release": ""}},
        {"job_id": "j1", "kind": "launch", "at_s": 3.0,
         "fields": {"instance_id": "i-1", "instance_type": "p3.2xlarge", "zone": "us-east-1a",
                    "lifecycle": "spot", "max_price": 0.9}},
    ]  # fmt: skip
    for entry in legacy:
        raw.xadd(key, {"event": json.dumps(entry)})
    events = [e for _, e in store.events("j1")]
    assert events[0] == StateEvent(
        job_id="j1", at_s=1.0, state=JobState.QUEUED, message="submitted", by="api"
    )
    assert isinstance(events[1], DecisionEvent)
    assert events[1].acquire == ("1xp3.2xlarge@us-east-1a", "2xg4dn.xlarge@us-east-1b")
    assert events[1].release == ()
    assert isinstance(events[2], LaunchEvent) and events[2].max_price_usd_per_hour == 0.9


def test_a_corrupt_event_is_a_store_error_naming_the_stream(store: Store, raw: redis.Redis) -> None:
    raw.xadd(f"{NS}:job:j1:events", {"event": '{"kind": "nope"}'})
    with pytest.raises(StoreError, match="corrupt event in .*j1:events"):
        store.events("j1")


# --- claims


def test_a_held_claim_cannot_be_taken_and_only_its_owner_releases_it(store: Store) -> None:
    assert store.claim("launch:j1:a1", "ctl-A", ttl_s=30.0) is True
    assert store.claim("launch:j1:a1", "ctl-B", ttl_s=30.0) is False
    assert store.claim("launch:j1:a1", "ctl-A", ttl_s=30.0) is False
    assert store.release_claim("launch:j1:a1", "ctl-B") is False
    assert store.claim_owner("launch:j1:a1") == "ctl-A"
    assert store.release_claim("launch:j1:a1", "ctl-A") is True
    assert store.claim_owner("launch:j1:a1") is None
    assert store.claim("launch:j1:a1", "ctl-B", ttl_s=30.0) is True


def test_a_claim_expires_after_its_ttl(store: Store) -> None:
    assert store.claim("launch:j1:a1", "ctl-A", ttl_s=0.05)
    time.sleep(0.15)
    assert store.claim_owner("launch:j1:a1") is None
    assert store.release_claim("launch:j1:a1", "ctl-A") is False
    assert store.claim("launch:j1:a1", "ctl-B", ttl_s=30.0)


def test_claim_arguments_are_checked(store: Store) -> None:
    for ttl_s in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError):
            store.claim("k", "me", ttl_s=ttl_s)
    with pytest.raises(ValueError):
        store.claim("", "me", ttl_s=1.0)


# --- Redis unavailable


def test_connecting_to_a_closed_port_fails_fast_with_a_clear_message() -> None:
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    start = time.monotonic()
    with pytest.raises(StoreUnavailableError) as info:
        RedisStore.connect(url, timeout_s=0.5)
    assert time.monotonic() - start < 2.0
    text = str(info.value)
    assert f"127.0.0.1:{info.value.url.rsplit(':', 1)[1]}" in text
    assert "hunter2" not in text and ":***@" in info.value.url
    assert "start Redis" in text and "ORCHESTRATOR_REDIS_URL" in text
    assert isinstance(info.value, UserError)  # the CLI prints it without a traceback


def test_a_server_that_never_answers_times_out_instead_of_hanging() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)  # the kernel accepts the connection; nobody ever replies
        port = listener.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(StoreUnavailableError, match="127.0.0.1"):
            RedisStore.connect(f"redis://127.0.0.1:{port}/0", timeout_s=0.3)
        assert time.monotonic() - start < 2.0


def test_a_malformed_url_is_reported_as_unavailable() -> None:
    with pytest.raises(StoreUnavailableError, match="not a Redis URL"):
        RedisStore.connect("http://127.0.0.1:6379")


def test_every_operation_raises_unavailable_once_redis_is_gone() -> None:
    failure = None
    try:
        with start_redis() as url:
            store = RedisStore.connect(url, namespace=NS, timeout_s=0.5)
            store.create_job(job())
    except RedisServerError as exc:
        failure = str(exc)
    if failure is not None:
        pytest.fail(failure, pytrace=False)
    # the server is stopped now
    calls: list[Callable[[], object]] = [
        lambda: store.get_job("j1"),
        lambda: store.list_jobs(),
        lambda: store.transition("j1", "running", expected_version=0, now_s=1.0),
        lambda: store.append_ledger(charge()),
        lambda: store.put_instance(instance("i-1")),
        lambda: store.append_event(NOTICE),
        lambda: store.claim("k", "me", ttl_s=1.0),
    ]
    start = time.monotonic()
    for call in calls:
        with pytest.raises(StoreUnavailableError, match="cannot reach Redis"):
            call()
    assert time.monotonic() - start < 3.0
    store.close()


# --- restart and layout


def test_a_restarted_controller_sees_everything_the_old_one_wrote(
    redis_url: str, store: Store
) -> None:
    store.create_job(job())
    store.transition("j1", JobState.RUNNING, expected_version=0, now_s=1.0)
    store.update_progress("j1", 1.5, now_s=2.0)
    store.append_ledger(charge())
    store.put_instance(instance("i-1"))
    store.put_instance(instance("i-2"))
    store.end_instance("i-2", ended_at=50.0, reason="evicted")
    event_id = store.append_event(NOTICE)
    store.claim("launch:j1:a2", "ctl-old", ttl_s=60.0)
    before = store.get_job("j1")
    store.close()  # the old controller is gone (its memory with it)

    restarted = RedisStore.connect(redis_url, namespace=NS)
    assert restarted.get_job("j1") == before
    assert (before.state, before.version, before.work_done_gpu_hours) == ("running", 1, 1.5)
    assert restarted.spent_usd("j1") == pytest.approx(charge().charged_usd)
    assert restarted.ledger("j1") == [charge()]
    assert [i.instance_id for i in restarted.list_instances("j1", alive_only=True)] == ["i-1"]
    assert [e for e, _ in restarted.events("j1")] == [event_id]
    assert restarted.claim("launch:j1:a2", "ctl-new", ttl_s=60.0) is False  # no double launch
    assert restarted.append_ledger(charge()) is False  # no double charge
    finished = restarted.transition("j1", "succeeded", expected_version=1, now_s=3.0)
    assert finished.version == 2
    restarted.close()


def test_namespaces_do_not_see_each_other(redis_url: str, store: Store) -> None:
    other = RedisStore.connect(redis_url, namespace="other")
    store.create_job(job())
    assert other.list_jobs() == []
    other.create_job(job())  # same id, other namespace: no conflict
    other.close()


def test_every_key_is_namespaced_and_every_value_is_json(store: Store, redis_url: str) -> None:
    raw: Any = redis.Redis.from_url(redis_url, decode_responses=True)
    store.create_job(job())
    store.append_ledger(charge())
    store.put_instance(instance("i-1"))
    store.append_event(NOTICE)
    store.claim("launch:j1:a1", "ctl", ttl_s=60.0)

    keys = raw.keys("*")
    assert keys and all(k.startswith(f"{NS}:") for k in keys)
    for key in keys:
        kind = raw.type(key)
        if kind == "hash":
            values = list(raw.hgetall(key).values())
        elif kind == "list":
            values = raw.lrange(key, 0, -1)
        elif kind == "set":
            continue  # ids
        elif kind == "stream":
            values = [fields["event"] for _, fields in raw.xrange(key)]
        else:
            values = [raw.get(key)]
        for value in values:
            json.loads(value)
    raw.close()


def test_a_client_without_decoded_responses_is_refused(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    with pytest.raises(ValueError, match="decode_responses"):
        RedisStore(client)
    client.close()


def test_latest_training_is_the_newest_report(store: Store) -> None:
    from orchestrator.store import TrainingReport

    assert store.latest_training("job-x") is None
    for i in range(3):
        store.append_training("job-x", TrainingReport(at_s=float(i), iteration=10 * i, loss=1.0))
    latest = store.latest_training("job-x")
    assert latest is not None and latest.iteration == 20
    assert [r.iteration for r in store.training("job-x")] == [0, 10, 20]
