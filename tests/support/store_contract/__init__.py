"""The `Store` contract as tests: what every implementation must do, whatever keeps the data.

`StoreContract` gathers the tests (`jobs`: jobs, transitions and the ledger; `fleet`: instances,
training ports and claims; `logs`: events and series; `data`: the sample records they use). A
subclass named `Test...` runs them on one implementation by providing the `new_store` fixture
(a factory taking `events_maxlen` and `series_maxlen`):

* `tests/unit/store/test_store_contract.py`: `MemoryStore`;
* `tests/integration/store/test_store.py`: `RedisStore` on a real redis-server.

So a unit test may use `MemoryStore()` where the controller uses Redis, and trust that it behaves
the same. A behaviour only one implementation has (a restart, an unreachable server, exact
trimming) is tested next to that subclass, not here.
"""

from __future__ import annotations

import pytest

from orchestrator.store import Store
from support.store_contract.data import (
    APPENDS,
    EDGES,
    LIMIT,
    NON_EDGES,
    NOTICE,
    NS,
    SPEC,
    StoreFactory,
    charge,
    instance,
    job,
    run_together,
    stream_id,
)
from support.store_contract.fleet import FleetContract
from support.store_contract.jobs import JobContract
from support.store_contract.logs import LogContract

__all__ = [
    "APPENDS",
    "EDGES",
    "LIMIT",
    "NON_EDGES",
    "NOTICE",
    "NS",
    "SPEC",
    "StoreContract",
    "StoreFactory",
    "charge",
    "instance",
    "job",
    "run_together",
    "stream_id",
]


class StoreContract(JobContract, FleetContract, LogContract):
    """The contract's tests. Subclasses provide `new_store`."""

    @pytest.fixture
    def new_store(self) -> StoreFactory:
        raise NotImplementedError("a Test... subclass provides the store under test")

    @pytest.fixture
    def store(self, new_store: StoreFactory) -> Store:
        return new_store()

    def test_it_is_a_store_and_answers(self, store: Store) -> None:
        assert isinstance(store, Store)
        store.ping()
