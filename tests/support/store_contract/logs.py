"""The contract for what the dashboard reads: a job's event log and its series."""

from __future__ import annotations

import pytest

from orchestrator.store import (
    DecisionEvent,
    Event,
    EvictionEvent,
    JobState,
    LaunchEvent,
    NotFoundError,
    PriceSnapshot,
    StateEvent,
    Store,
    StoreError,
    TrainingReport,
)
from support.store_contract.data import APPENDS, LIMIT, NOTICE, StoreFactory, stream_id


class LogContract:
    """Events, price snapshots and training reports (see `StoreContract`)."""

    # --- events

    def test_events_round_trip_typed_in_order_and_since_returns_only_later_ones(
        self, store: Store
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
        assert isinstance(got[1][1], DecisionEvent) and got[1][1].acquire == (
            "2xp3.2xlarge@us-east-1a",
        )
        assert store.events("j1", since_id=ids[0]) == list(zip(ids[1:], sent[1:], strict=True))
        assert store.events("j1", since_id=ids[-1]) == []
        assert store.events("j1", count=2) == list(zip(ids[:2], sent[:2], strict=True))
        assert store.events("nobody") == []
        with pytest.raises(StoreError):
            store.events("j1", since_id="not-an-id")

    def test_event_ids_are_stream_ids_that_increase_and_page(self, store: Store) -> None:
        ids = [store.append_event(NOTICE) for _ in range(20)]
        pairs = [stream_id(i) for i in ids]
        assert pairs == sorted(pairs) and len(set(pairs)) == len(pairs)

        paged: list[str] = []
        since = "-"
        while page := store.events("j1", since_id=since, count=3):
            assert len(page) <= 3
            paged += [entry_id for entry_id, _ in page]
            since = page[-1][0]
        assert paged == ids

        for ms, _ in pairs:  # "<ms>" alone means "<ms>-0"
            after = [i for i, p in zip(ids, pairs, strict=True) if p > (ms, 0)]
            assert [i for i, _ in store.events("j1", since_id=str(ms))] == after
        assert [i for i, _ in store.events("j1", since_id="0")] == ids

    @pytest.mark.parametrize(
        "since_id",
        ["not-an-id", "", "5-", "-5", "1.5", "5-0-0", "18446744073709551616", "(5", "+"],
    )
    def test_reading_after_something_that_is_not_an_event_id_is_a_store_error(
        self, store: Store, since_id: str
    ) -> None:
        store.append_event(NOTICE)
        with pytest.raises(StoreError):
            store.events("j1", since_id=since_id)

    def test_event_reads_check_their_arguments(self, store: Store) -> None:
        with pytest.raises(ValueError):
            store.events("j1", count=0)
        with pytest.raises(NotFoundError):
            store.events("not a job id")
        assert store.events("j1", since_id="18446744073709551615-18446744073709551614") == []

    def test_event_log_keeps_at_least_the_newest_events_when_trimmed(
        self, new_store: StoreFactory
    ) -> None:
        store = new_store(events_maxlen=LIMIT)
        sent = [NOTICE.model_copy(update={"at_s": float(k)}) for k in range(APPENDS)]
        ids = [store.append_event(e) for e in sent]
        kept = store.events("j1")
        assert LIMIT <= len(kept) < APPENDS
        assert kept == list(zip(ids, sent, strict=True))[-len(kept) :]

    # --- series

    def test_series_read_back_oldest_first_and_latest_training_is_the_newest(
        self, store: Store
    ) -> None:
        assert store.latest_training("job-x") is None and store.latest_prices("job-x") is None
        assert store.training("job-x") == [] and store.prices("job-x") == []
        for i in range(3):
            report = TrainingReport(at_s=float(i), iteration=10 * i, loss=1.0)
            assert stream_id(store.append_training("job-x", report))
            store.append_prices("job-x", PriceSnapshot(at_s=float(i), prices={"m@z": 0.5 + i}))
        latest = store.latest_training("job-x")
        assert latest is not None and latest.iteration == 20
        assert [r.iteration for r in store.training("job-x")] == [0, 10, 20]
        assert [p.prices["m@z"] for p in store.prices("job-x")] == [0.5, 1.5, 2.5]
        assert store.latest_prices("job-x") == store.prices("job-x")[-1]
        assert store.training("job-y") == []
        with pytest.raises(NotFoundError):
            store.append_training("not a job id", TrainingReport(at_s=0.0, iteration=0))

    def test_series_keep_at_least_their_newest_entries_when_trimmed(
        self, new_store: StoreFactory
    ) -> None:
        store = new_store(series_maxlen=LIMIT)
        for k in range(APPENDS):
            store.append_training("j1", TrainingReport(at_s=float(k), iteration=k))
            store.append_prices("j1", PriceSnapshot(at_s=float(k), prices={}))
        iterations = [r.iteration for r in store.training("j1")]
        assert LIMIT <= len(iterations) < APPENDS
        assert iterations == list(range(APPENDS))[-len(iterations) :]
        latest = store.latest_training("j1")
        assert latest is not None and latest.iteration == APPENDS - 1
        times = [p.at_s for p in store.prices("j1")]
        assert LIMIT <= len(times) < APPENDS and times[-1] == APPENDS - 1
        latest_prices = store.latest_prices("j1")
        assert latest_prices is not None and latest_prices.at_s == APPENDS - 1
