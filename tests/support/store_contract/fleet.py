"""The contract for what the controller keeps about its fleet: instances, hosted training
ports and launch claims."""

from __future__ import annotations

import math
import time

import pytest

from orchestrator.market.billing import EndReason
from orchestrator.store import (
    IllegalTransitionError,
    InstanceRecord,
    InstanceWork,
    LedgerConflictError,
    NotFoundError,
    Store,
    StoreError,
)
from support.store_contract.data import charge, instance, job, run_together


class FleetContract:
    """Instances, training ports and claims (see `StoreContract`)."""

    # --- instances

    def test_instances_are_listed_per_job_and_ended_ones_drop_from_alive(
        self, store: Store
    ) -> None:
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
        assert store.list_instances("nobody") == []
        with pytest.raises(NotFoundError):
            store.list_instances("not a job id")

    def test_putting_an_instance_again_overwrites_it(self, store: Store) -> None:
        store.put_instance(instance("i-1"))
        pending = instance("i-1").model_copy(update={"state": "pending"})
        assert store.put_instance(pending) == pending
        assert store.get_instance("i-1") == pending
        assert len(store.list_instances(alive_only=True)) == 1

    def test_putting_an_ended_record_ends_the_instance(self, store: Store) -> None:
        store.put_instance(instance("i-1"))
        ended = instance("i-1").model_copy(
            update={"state": "ended", "ended_at": 50.0, "end_reason": "released"}
        )
        store.put_instance(ended)
        assert store.get_instance("i-1") == ended
        assert store.list_instances(alive_only=True) == []
        assert store.end_instance("i-1", ended_at=90.0, reason="evicted") == ended

    def test_ending_an_instance_twice_keeps_the_first_end(self, store: Store) -> None:
        store.put_instance(instance("i-1", launched_at=10.0))
        first = store.end_instance("i-1", ended_at=70.0, reason="evicted")
        assert store.end_instance("i-1", ended_at=90.0, reason="released") == first
        assert store.end_instance("i-1", ended_at=1.0, reason="released") == first  # not checked

    def test_an_instance_is_ended_and_billed_in_one_step(self, store: Store) -> None:
        """The bill lands with the end or not at all: a later end (a restarted controller's,
        with a later time) finds the first end and its bill standing, never half of it."""
        store.create_job(job())
        store.put_instance(instance("i-1", launched_at=0.0))
        bill = [charge(start_s=0.0, billed_s=600.0), charge(start_s=600.0, billed_s=300.0)]
        ended = store.end_instance("i-1", ended_at=900.0, reason="evicted", bill=bill)
        assert ended.ended_at == 900.0 and store.ledger("j1") == bill
        assert store.spent_usd("j1") == pytest.approx(sum(c.charged_usd for c in bill))
        longer = [bill[0], charge(start_s=600.0, billed_s=500.0)]
        assert store.end_instance("i-1", ended_at=1100.0, reason="evicted", bill=longer) == ended
        assert store.ledger("j1") == bill

    def test_live_spend_is_the_ledger_plus_what_alive_instances_ran_up(self, store: Store) -> None:
        """Spend is live: billed plus each alive instance's accrued cost as last recorded. An
        instance that ends is counted in its bill instead, never in both; a new record
        replaces the last one."""
        store.create_job(job())
        store.put_instance(instance("i-1", launched_at=0.0))
        store.put_instance(instance("i-2", launched_at=0.0))
        assert store.live_spend_usd("j1") == 0.0  # nothing recorded yet
        store.record_accrued("j1", {"i-1": 0.15, "i-2": 0.25}, at_s=600.0)
        assert store.live_spend_usd("j1") == pytest.approx(0.40)
        bill = [charge(start_s=0.0, billed_s=600.0)]  # 0.15 at 0.9 $/h
        store.end_instance("i-1", ended_at=600.0, reason="evicted", bill=bill)
        assert store.live_spend_usd("j1") == pytest.approx(bill[0].charged_usd + 0.25)
        store.record_accrued("j1", {"i-2": 0.5}, at_s=1200.0)
        assert store.live_spend_usd("j1") == pytest.approx(bill[0].charged_usd + 0.5)
        store.record_accrued("j1", {}, at_s=1300.0)
        assert store.live_spend_usd("j1") == pytest.approx(bill[0].charged_usd)
        assert store.spent_usd("j1") == pytest.approx(bill[0].charged_usd)  # the ledger alone
        with pytest.raises(NotFoundError):
            store.live_spend_usd("j9")

    def test_a_bill_that_conflicts_changes_nothing(self, store: Store) -> None:
        store.create_job(job())
        store.put_instance(instance("i-1", launched_at=0.0))
        store.append_ledger(charge(start_s=600.0, billed_s=300.0))  # an older controller's half
        bill = [charge(start_s=0.0, billed_s=600.0), charge(start_s=600.0, billed_s=500.0)]
        with pytest.raises(LedgerConflictError):
            store.end_instance("i-1", ended_at=1100.0, reason="evicted", bill=bill)
        assert store.get_instance("i-1").alive
        assert len(store.ledger("j1")) == 1
        with pytest.raises(ValueError, match="holds a charge of instance i-2"):
            store.end_instance("i-1", 1100.0, "evicted", [charge(instance_id="i-2")])
        assert store.get_instance("i-1").alive

    def test_concurrent_ends_of_an_instance_leave_one_end(self, store: Store) -> None:
        store.put_instance(instance("i-1"))

        def end(i: int) -> InstanceRecord:
            return store.end_instance("i-1", ended_at=100.0 + i, reason=f"r{i}")

        ends, errors = run_together(8, end)
        assert not errors and len(ends) == 8
        stored = store.get_instance("i-1")
        assert stored.ended_at is not None and stored.end_reason == f"r{stored.ended_at - 100:.0f}"
        assert all(e == stored for e in ends)  # every caller sees the one end that stands

    def test_an_ended_instance_cannot_be_put_back_alive(self, store: Store) -> None:
        store.put_instance(instance("i-1"))
        ended = store.end_instance("i-1", ended_at=70.0, reason="released")
        with pytest.raises(IllegalTransitionError) as info:
            store.put_instance(instance("i-1"))
        assert (info.value.from_state, info.value.to_state) == ("ended", "running")
        assert store.get_instance("i-1") == ended
        assert store.list_instances(alive_only=True) == []

    def test_an_instance_cannot_move_to_another_job(self, store: Store) -> None:
        store.put_instance(instance("i-1", job_id="j1"))
        with pytest.raises(StoreError, match="belongs to job 'j1'"):
            store.put_instance(instance("i-1", job_id="j2"))
        assert store.get_instance("i-1").job_id == "j1"
        assert store.list_instances("j2") == []

    def test_instance_errors(self, store: Store) -> None:
        with pytest.raises(NotFoundError) as info:
            store.get_instance("i-404")
        assert (info.value.kind, info.value.record_id) == ("instance", "i-404")
        with pytest.raises(NotFoundError):
            store.get_instance("i:404")
        with pytest.raises(NotFoundError):
            store.end_instance("i-404", ended_at=1.0, reason="released")
        store.put_instance(instance("i-1", launched_at=10.0))
        with pytest.raises(ValueError, match="before launched_at"):
            store.end_instance("i-1", ended_at=5.0, reason="released")
        assert store.get_instance("i-1").alive

    # --- hosted training ports

    def test_training_ports_are_remembered_overwritten_and_forgotten(self, store: Store) -> None:
        assert store.training_ports() == {}
        store.set_training_port("j1", 29500)
        store.set_training_port("j2", 29501)
        store.set_training_port("j1", 29502)
        assert store.training_ports() == {"j1": 29502, "j2": 29501}
        store.forget_training_port("j2")
        store.forget_training_port("never-hosted")
        assert store.training_ports() == {"j1": 29502}
        with pytest.raises(NotFoundError):
            store.set_training_port("not a job id", 1)

    # --- instance work

    def test_instance_work_is_recorded_per_job_and_overwritten_per_instance(
        self, store: Store
    ) -> None:
        assert store.instance_work("j1") == {}
        store.record_instance_work(
            "j1",
            {
                "i-1": InstanceWork(work_gpu_hours=0.5, hours=1.0),
                "i-2": InstanceWork(work_gpu_hours=1.25, hours=2.0),
            },
        )
        store.record_instance_work("j1", {"i-1": InstanceWork(work_gpu_hours=0.75, hours=1.5)})
        store.record_instance_work("j2", {"i-3": InstanceWork(work_gpu_hours=2.0, hours=2.0)})
        store.record_instance_work("j2", {})
        assert store.instance_work("j1") == {
            "i-1": InstanceWork(work_gpu_hours=0.75, hours=1.5),
            "i-2": InstanceWork(work_gpu_hours=1.25, hours=2.0),
        }  # fmt: skip
        assert store.instance_work("j2") == {"i-3": InstanceWork(work_gpu_hours=2.0, hours=2.0)}
        with pytest.raises(NotFoundError):
            store.record_instance_work("not a job id", {})
        with pytest.raises(NotFoundError):
            store.instance_work("not a job id")

    @pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
    def test_instance_work_must_be_finite_and_not_negative(self, bad: float) -> None:
        with pytest.raises(ValueError):
            InstanceWork(work_gpu_hours=bad, hours=1.0)
        with pytest.raises(ValueError):
            InstanceWork(work_gpu_hours=1.0, hours=bad)

    # --- the clock's high-water mark

    def test_the_clock_mark_only_rises(self, store: Store) -> None:
        assert store.clock_high_water() is None
        assert store.advance_clock(1_580_688_000.25) == 1_580_688_000.25
        assert store.advance_clock(1_580_688_100.5) == 1_580_688_100.5
        assert store.advance_clock(1_580_688_000.0) == 1_580_688_100.5  # a clock behind it
        assert store.clock_high_water() == 1_580_688_100.5
        for bad in (float("nan"), float("inf"), True):
            with pytest.raises(ValueError):
                store.advance_clock(bad)
        assert store.clock_high_water() == 1_580_688_100.5

    def test_concurrent_clocks_leave_the_highest_mark(self, store: Store) -> None:
        marks, errors = run_together(8, lambda i: store.advance_clock(1000.0 + i))
        assert not errors and all(m >= 1000.0 for m in marks)
        assert store.clock_high_water() == 1007.0

    # --- the fleet's controller

    def test_the_controller_id_is_bound_once(self, store: Store) -> None:
        assert store.bind_controller_id("ctl-a") == "ctl-a"
        assert store.bind_controller_id("ctl-b") == "ctl-a"  # another controller's fleet
        assert store.bind_controller_id("ctl-a") == "ctl-a"

    def test_one_owner_holds_the_lease_and_a_new_holder_gets_a_higher_token(
        self, store: Store
    ) -> None:
        assert store.lease_holder() is None
        first = store.acquire_lease("a", ttl_s=30.0)
        assert first is not None and store.lease_holder() == ("a", first)
        assert store.acquire_lease("b", ttl_s=30.0) is None  # a standby waits
        assert store.acquire_lease("a", ttl_s=30.0) == first  # renewed: the same token
        assert store.release_lease("b") is False and store.release_lease("a") is True
        second = store.acquire_lease("b", ttl_s=30.0)
        assert second is not None and second > first and store.lease_holder() == ("b", second)

    def test_a_lease_not_renewed_lapses(self, store: Store) -> None:
        first = store.acquire_lease("a", ttl_s=0.05)
        time.sleep(0.15)
        assert store.lease_holder() is None
        second = store.acquire_lease("b", ttl_s=30.0)
        assert first is not None and second is not None and second > first
        assert store.acquire_lease("a", ttl_s=30.0) is None

    def test_of_concurrent_lease_takers_exactly_one_holds_it(self, store: Store) -> None:
        tokens, errors = run_together(8, lambda i: store.acquire_lease(f"ctl-{i}", 30.0))
        assert not errors and sum(1 for t in tokens if t is not None) == 1
        for bad in (0.0, -1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError):
                store.acquire_lease("a", ttl_s=bad)

    # --- claims

    def test_a_held_claim_cannot_be_taken_and_only_its_owner_releases_it(
        self, store: Store
    ) -> None:
        assert store.claim("launch:j1:a1", "ctl-A", ttl_s=30.0) is True
        assert store.claim("launch:j1:a1", "ctl-B", ttl_s=30.0) is False
        assert store.claim("launch:j1:a1", "ctl-A", ttl_s=30.0) is False
        assert store.release_claim("launch:j1:a1", "ctl-B") is False
        assert store.claim_owner("launch:j1:a1") == "ctl-A"
        assert store.release_claim("launch:j1:a1", "ctl-A") is True
        assert store.claim_owner("launch:j1:a1") is None
        assert store.release_claim("launch:j1:a1", "ctl-A") is False
        assert store.claim("launch:j1:a1", "ctl-B", ttl_s=30.0) is True
        assert store.claim_owner("launch:j1:a2") is None

    def test_a_claim_expires_after_its_ttl(self, store: Store) -> None:
        assert store.claim("launch:j1:a1", "ctl-A", ttl_s=0.05)
        time.sleep(0.15)
        assert store.claim_owner("launch:j1:a1") is None
        assert store.release_claim("launch:j1:a1", "ctl-A") is False
        assert store.claim("launch:j1:a1", "ctl-B", ttl_s=30.0)

    def test_of_concurrent_claims_exactly_one_wins(self, store: Store) -> None:
        won, errors = run_together(8, lambda i: store.claim("launch:j1:a1", f"ctl-{i}", 30.0))
        assert not errors and sorted(won) == [False] * 7 + [True]
        assert store.claim_owner("launch:j1:a1") is not None

    def test_claim_arguments_are_checked(self, store: Store) -> None:
        for ttl_s in (0.0, -1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError):
                store.claim("k", "me", ttl_s=ttl_s)
        with pytest.raises(ValueError):
            store.claim("", "me", ttl_s=1.0)
        with pytest.raises(ValueError):
            store.claim("k", "", ttl_s=1.0)
        assert store.claim_owner("k") is None
