"""`RedisStore` on a real redis-server (started per module on a free port, flushed between
tests): the `Store` contract (`support/store_contract/`, which `MemoryStore` passes too), and
what only Redis does: atomic scripts against a corrupted key, controllers on separate
connections, legacy and corrupt stream entries, an unreachable server, a restart, the key
layout."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from support.redis_server import RedisServerError, free_port, start_redis
from support.store_contract import (
    NOTICE,
    NS,
    StoreContract,
    StoreFactory,
    charge,
    instance,
    job,
    run_together,
)

from orchestrator.errors import UserError
from orchestrator.store import (
    ConflictError,
    DecisionEvent,
    JobRecord,
    JobState,
    LaunchEvent,
    RedisStore,
    StateEvent,
    StoreError,
    StoreUnavailableError,
    TrainingReport,
)


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


class TestRedisStore(StoreContract):
    @pytest.fixture
    def new_store(self, redis_url: str, raw: redis.Redis) -> Iterator[StoreFactory]:
        made: list[RedisStore] = []

        def make(**limits: int) -> RedisStore:
            client = redis.Redis.from_url(redis_url, decode_responses=True)
            made.append(RedisStore(client, NS, url=redis_url, **limits))
            return made[-1]

        yield make
        for s in made:
            s.close()


# --- atomicity that only Redis can break: a corrupted key, separate connections


def test_spend_is_not_recorded_without_its_entry_when_the_increment_fails(
    store: RedisStore, raw: redis.Redis
) -> None:
    store.create_job(job())
    raw.hset(f"{NS}:job:j1", "spent_usd", "not-a-number")  # a corrupted counter
    with pytest.raises(StoreError, match="refused"):
        store.append_ledger(charge())
    assert raw.llen(f"{NS}:job:j1:ledger") == 0
    assert not raw.exists(f"{NS}:job:j1:ledger-index")


def test_controllers_on_separate_connections_race_and_exactly_one_write_wins(
    redis_url: str, store: RedisStore
) -> None:
    """Eight controllers, each with its own client: the scripts are atomic across connections,
    not only across the threads of one client."""
    stores = [RedisStore.connect(redis_url, namespace=NS) for _ in range(8)]
    store.create_job(job())

    def move(i: int) -> JobRecord:
        return stores[i].transition("j1", JobState.RUNNING, expected_version=0, now_s=float(i))

    wins, errors = run_together(8, move)
    assert len(wins) == 1 and all(isinstance(e, ConflictError) for e in errors), errors

    appended, errors = run_together(8, lambda i: stores[i].append_ledger(charge()))
    assert not errors and sorted(appended) == [False] * 7 + [True]
    assert store.spent_usd("j1") == pytest.approx(charge().charged_usd)

    claimed, errors = run_together(8, lambda i: stores[i].claim("launch:j1:a1", f"c{i}", 30.0))
    assert not errors and sorted(claimed) == [False] * 7 + [True]
    for s in stores:
        s.close()


# --- stream entries written outside this version of the store


def test_events_written_before_the_kinds_were_typed_still_read(
    store: RedisStore, raw: redis.Redis
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


def test_a_corrupt_event_is_a_store_error_naming_the_stream(
    store: RedisStore, raw: redis.Redis
) -> None:
    raw.xadd(f"{NS}:job:j1:events", {"event": '{"kind": "nope"}'})
    with pytest.raises(StoreError, match="corrupt event in .*j1:events"):
        store.events("j1")


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
        lambda: store.ping(),
        lambda: store.create_job(job("j2")),
        lambda: store.get_job("j1"),
        lambda: store.list_jobs(),
        lambda: store.transition("j1", "running", expected_version=0, now_s=1.0),
        lambda: store.update_progress("j1", 1.0, now_s=1.0),
        lambda: store.append_ledger(charge()),
        lambda: store.ledger("j1"),
        lambda: store.spent_usd("j1"),
        lambda: store.put_instance(instance("i-1")),
        lambda: store.end_instance("i-1", ended_at=20.0, reason="released"),
        lambda: store.list_instances(),
        lambda: store.append_event(NOTICE),
        lambda: store.events("j1"),
        lambda: store.append_training("j1", TrainingReport(at_s=0.0, iteration=0)),
        lambda: store.latest_training("j1"),
        lambda: store.prices("j1"),
        lambda: store.latest_prices("j1"),
        lambda: store.set_training_port("j1", 29500),
        lambda: store.training_ports(),
        lambda: store.claim("k", "me", ttl_s=1.0),
        lambda: store.release_claim("k", "me"),
        lambda: store.claim_owner("k"),
    ]
    start = time.monotonic()
    for call in calls:
        with pytest.raises(StoreUnavailableError, match="cannot reach Redis"):
            call()
    assert time.monotonic() - start < 3.0
    store.close()


# --- restart and layout


def test_a_restarted_controller_sees_everything_the_old_one_wrote(
    redis_url: str, store: RedisStore
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


def test_namespaces_do_not_see_each_other(redis_url: str, store: RedisStore) -> None:
    other = RedisStore.connect(redis_url, namespace="other")
    store.create_job(job())
    assert other.list_jobs() == []
    other.create_job(job())  # same id, other namespace: no conflict
    other.close()


def test_every_key_is_namespaced_and_every_value_is_json(store: RedisStore, redis_url: str) -> None:
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
