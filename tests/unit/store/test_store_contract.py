"""`MemoryStore` keeps the `Store` contract (`support/store_contract/`, which Redis passes too),
and what only it does: exact trimming and time from the injected clock."""

from __future__ import annotations

import functools

import pytest
from support.store_contract import LIMIT, NOTICE, NS, StoreContract, StoreFactory, job

from orchestrator.cloud.local.clock import FakeClock
from orchestrator.store import MemoryStore, Store, TrainingReport


class TestMemoryStore(StoreContract):
    @pytest.fixture
    def new_store(self) -> StoreFactory:
        return functools.partial(MemoryStore, NS)


def test_memory_trims_to_exactly_the_limit() -> None:
    store = MemoryStore(events_maxlen=LIMIT, series_maxlen=LIMIT)
    ids = [store.append_event(NOTICE) for _ in range(LIMIT + 5)]
    for k in range(LIMIT + 5):
        store.append_training("j1", TrainingReport(at_s=float(k), iteration=k))
    assert [i for i, _ in store.events("j1")] == ids[-LIMIT:]
    assert [r.iteration for r in store.training("j1")] == list(range(5, LIMIT + 5))


def test_memory_event_ids_take_their_milliseconds_from_the_clock() -> None:
    clock = FakeClock(5.0)
    store = MemoryStore(clock=clock.now)
    assert [store.append_event(NOTICE) for _ in range(2)] == ["5000-0", "5000-1"]
    clock.advance(0.002)
    assert store.append_event(NOTICE) == "5002-0"
    assert store.append_training("j1", TrainingReport(at_s=0.0, iteration=0)) == "5002-0"


def test_memory_event_ids_still_increase_when_the_clock_goes_back() -> None:
    times = iter([5.0, 4.0, 4.0])
    store = MemoryStore(clock=lambda: next(times))
    assert [store.append_event(NOTICE) for _ in range(3)] == ["5000-0", "5000-1", "5000-2"]


def test_memory_claims_expire_on_the_injected_clock() -> None:
    clock = FakeClock(100.0)
    store = MemoryStore(clock=clock.now)
    assert store.claim("launch:j1:a1", "ctl-A", ttl_s=30.0)
    clock.advance(29.999)
    assert store.claim_owner("launch:j1:a1") == "ctl-A"
    assert not store.claim("launch:j1:a1", "ctl-B", ttl_s=30.0)
    clock.advance(0.002)
    assert store.claim_owner("launch:j1:a1") is None
    assert store.claim("launch:j1:a1", "ctl-B", ttl_s=30.0)


def test_memory_stores_share_nothing_and_close_keeps_the_data() -> None:
    first, second = MemoryStore(), MemoryStore()
    first.create_job(job())
    assert second.list_jobs() == []
    first.close()
    assert first.get_job("j1") == job()


def test_a_memory_store_is_a_store() -> None:
    store: Store = MemoryStore()  # mypy checks the protocol here; isinstance at run time
    assert isinstance(store, Store)
    with pytest.raises(ValueError, match="namespace"):
        MemoryStore("bad:namespace")
