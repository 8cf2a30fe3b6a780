"""The contract for jobs: records, lifecycle moves, progress and the ledger."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from orchestrator.bidbrain.model import JobSpec
from orchestrator.market.billing import EndReason, PerSecondBilling
from orchestrator.market.prices import Market, PriceSeries
from orchestrator.store import (
    ConflictError,
    IllegalTransitionError,
    JobRecord,
    JobState,
    LedgerConflictError,
    LedgerEntry,
    NotFoundError,
    Store,
)
from support.store_contract.data import EDGES, NON_EDGES, NS, SPEC, charge, job, run_together


class JobContract:
    """Jobs, their transitions and their ledger (see `StoreContract`)."""

    # --- jobs

    def test_created_jobs_are_read_back_and_listed_oldest_first(self, store: Store) -> None:
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
        with pytest.raises(ValueError):
            store.list_jobs(states=["paused"])

    def test_creating_an_existing_job_raises_conflict_and_keeps_the_original(
        self, store: Store
    ) -> None:
        store.create_job(job("j1", now_s=1.0))
        with pytest.raises(ConflictError) as info:
            store.create_job(job("j1", now_s=2.0))
        assert (info.value.key, info.value.expected_version, info.value.actual_version) == (
            f"{NS}:job:j1",
            None,
            0,
        )
        assert store.get_job("j1").submitted_at == 1.0

    def test_a_new_job_must_have_spent_nothing(self, store: Store) -> None:
        with pytest.raises(ValueError, match="append_ledger"):
            store.create_job(job().model_copy(update={"spent_usd": 1.0}))
        with pytest.raises(NotFoundError):
            store.get_job("j1")

    def test_records_read_back_are_json_snapshots(self, store: Store) -> None:
        spec = {"name": "x", "tags": ("a", "b"), "lr": float("nan")}
        submitted = JobRecord.submit("j1", spec, 50.0, 1.0)
        store.create_job(submitted)
        submitted.spec["name"] = "changed after create"
        got = store.get_job("j1")
        # a tuple reads back a list, NaN (which JSON lacks) null
        assert got.spec == {"name": "x", "tags": ["a", "b"], "lr": None}
        got.spec["name"] = "changed after read"
        assert store.get_job("j1").spec["name"] == "x"

    @pytest.mark.parametrize("job_id", ["nope", "j1:ledger", "", "a b"])
    def test_unknown_or_impossible_job_ids_raise_not_found(self, store: Store, job_id: str) -> None:
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
        with pytest.raises(NotFoundError):
            store.ledger(job_id)

    # --- transitions

    @pytest.mark.parametrize(("from_state", "to_state"), EDGES, ids=lambda s: str(s))
    def test_allowed_transition_moves_the_job_and_bumps_its_version(
        self, store: Store, from_state: JobState, to_state: JobState
    ) -> None:
        store.create_job(job(state=from_state))
        moved = store.transition(
            "j1", to_state, expected_version=0, now_s=200.0, message=f"{from_state}->{to_state}"
        )
        assert (moved.state, moved.version, moved.updated_at) == (to_state, 1, 200.0)
        assert moved.message == f"{from_state}->{to_state}"
        assert store.get_job("j1") == moved
        assert moved.model_dump(exclude={"state", "version", "updated_at", "message"}) == job(
            state=from_state
        ).model_dump(exclude={"state", "version", "updated_at", "message"})

    @pytest.mark.parametrize(("from_state", "to_state"), NON_EDGES, ids=lambda s: str(s))
    def test_illegal_transition_raises_and_leaves_the_record_unchanged(
        self, store: Store, from_state: JobState, to_state: JobState
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
        self, store: Store, caplog: pytest.LogCaptureFixture
    ) -> None:
        store.create_job(job(state=JobState.SUCCEEDED))
        with (
            caplog.at_level(logging.WARNING, logger="orchestrator.store"),
            pytest.raises(IllegalTransitionError),
        ):
            store.transition("j1", JobState.RUNNING, expected_version=0, now_s=7.0)
        (record,) = caplog.records
        assert record.__dict__["job_id"] == "j1"
        assert (record.__dict__["from_state"], record.__dict__["to_state"]) == (
            "succeeded",
            "running",
        )
        assert record.__dict__["at_s"] == 7.0

    def test_a_job_walks_its_lifecycle_through_versions(self, store: Store) -> None:
        store.create_job(job())
        v = store.transition("j1", "running", expected_version=0, now_s=1.0).version
        v = store.transition("j1", "cancelling", expected_version=v, now_s=2.0).version
        done = store.transition("j1", "cancelled", expected_version=v, now_s=3.0, message="user")
        assert (done.state, done.version, done.message) == (JobState.CANCELLED, 3, "user")
        assert done.state.is_terminal

    def test_stale_expected_version_raises_conflict_and_changes_nothing(self, store: Store) -> None:
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

    def test_a_stale_version_is_a_conflict_even_for_an_illegal_move(self, store: Store) -> None:
        store.create_job(job(state=JobState.SUCCEEDED))
        with pytest.raises(ConflictError):  # the version is checked before the edge
            store.transition("j1", JobState.RUNNING, expected_version=5, now_s=1.0)

    def test_unknown_target_state_is_a_value_error(self, store: Store) -> None:
        store.create_job(job())
        with pytest.raises(ValueError):
            store.transition("j1", "paused", expected_version=0, now_s=1.0)
        with pytest.raises(ValueError):  # checked before the job is looked up
            store.transition("ghost", "paused", expected_version=0, now_s=1.0)

    def test_concurrent_transitions_from_the_same_version_exactly_one_wins(
        self, store: Store
    ) -> None:
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

    def test_progress_updates_do_not_bump_the_version(self, store: Store) -> None:
        store.create_job(job())
        store.transition("j1", JobState.RUNNING, expected_version=0, now_s=1.0)
        updated = store.update_progress("j1", 2.5, now_s=9.0)
        assert (updated.work_done_gpu_hours, updated.updated_at, updated.version) == (2.5, 9.0, 1)
        assert store.get_job("j1") == updated
        ended = store.transition("j1", JobState.SUCCEEDED, expected_version=1, now_s=10.0)
        assert store.update_progress("j1", 3.0, now_s=12.0) == ended  # frozen once ended
        assert store.get_job("j1") == ended
        for bad in (-1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError):
                store.update_progress("j1", bad, now_s=11.0)
        with pytest.raises(ValueError):  # checked before the job is looked up
            store.update_progress("ghost", -1.0, now_s=11.0)

    # --- ledger

    def test_ledger_append_adds_to_spent_usd(self, store: Store) -> None:
        store.create_job(job())
        entries = [charge(start_s=600.0 * k, billed_s=600.0) for k in range(5)]
        for e in entries:
            assert store.append_ledger(e) is True
        assert store.ledger("j1") == entries
        total = sum(e.charged_usd for e in entries)
        assert store.spent_usd("j1") == pytest.approx(total, rel=1e-12)
        assert store.get_job("j1").spent_usd == store.spent_usd("j1")
        assert store.get_job("j1").version == 0  # spend is not a lifecycle write

    def test_concurrent_ledger_appends_from_several_threads_sum_to_spent_usd(
        self, store: Store
    ) -> None:
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
        total = sum(e.charged_usd for e in entries)
        assert store.spent_usd("j1") == pytest.approx(total, rel=1e-12)

    def test_replayed_ledger_entry_is_recorded_once(self, store: Store) -> None:
        store.create_job(job())
        assert store.append_ledger(charge()) is True
        assert store.append_ledger(charge()) is False  # a restarted controller re-sends its bill
        assert len(store.ledger("j1")) == 1
        assert store.spent_usd("j1") == pytest.approx(charge().charged_usd)

    def test_different_charge_for_an_interval_already_billed_is_refused(self, store: Store) -> None:
        store.create_job(job())
        store.append_ledger(charge(billed_s=600.0))
        with pytest.raises(LedgerConflictError) as info:
            store.append_ledger(charge(billed_s=900.0))
        assert (info.value.job_id, info.value.instance_id, info.value.start_s) == ("j1", "i-1", 0.0)
        assert store.ledger("j1") == [charge(billed_s=600.0)]
        assert store.spent_usd("j1") == pytest.approx(charge(billed_s=600.0).charged_usd)

    def test_the_same_interval_of_another_instance_is_another_entry(self, store: Store) -> None:
        store.create_job(job())
        assert store.append_ledger(charge(instance_id="i-1")) is True
        assert store.append_ledger(charge(instance_id="i-2")) is True
        assert len(store.ledger("j1")) == 2

    def test_ledger_of_an_unknown_job_raises_not_found(self, store: Store) -> None:
        with pytest.raises(NotFoundError):
            store.append_ledger(charge(job_id="ghost"))
        with pytest.raises(NotFoundError):
            store.ledger("ghost")
        with pytest.raises(NotFoundError):
            store.spent_usd("ghost")

    def test_ledger_entries_from_a_billing_model_sum_to_the_bill(self, store: Store) -> None:
        store.create_job(job())
        series = PriceSeries(
            Market("p3.2xlarge", "us-east-1a"),
            np.array([0.0, 1800.0]),
            np.array([0.9, 1.2]),
            7200.0,
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
