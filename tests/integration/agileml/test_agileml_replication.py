"""Replication: per-clock consistency, ActivePS -> BackupPS streaming, roll-back restores,
stale epochs and rosters, and malformed server-to-server messages."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from support.wire_client import HELD_CHECK_MS, WireClient, WireClients

from orchestrator.agileml import wire
from orchestrator.agileml.errors import OwnershipConflictError, PartitionError, RosterError
from orchestrator.agileml.partition_state import (
    PartitionSnapshot,
    PartitionStore,
    PendingChunk,
    PushOutcome,
)
from orchestrator.agileml.rejections import RejectedError, RejectReason
from orchestrator.agileml.roster import Roster, RosterEntry
from orchestrator.agileml.server import ParamServer
from orchestrator.agileml.snapshots import snapshot_from_wire, snapshot_to_wire
from orchestrator.agileml.wire import Header, MessageKind

JOB, TOKEN = "job-r", b"replication-test-token"
WORKERS = ("w0", "w1")
INITIAL = torch.tensor([1.0, 2.0, 3.0, 4.0])


def _delta(worker: str, clock: int) -> torch.Tensor:
    """A distinct small-integer update per (worker, clock): float32 sums of them are exact."""
    base = 1.0 + WORKERS.index(worker) if worker in WORKERS else 7.0
    return torch.tensor([base, -clock, clock % 3, 2.0 * base])


def _roster(*entries: tuple[int, tuple[str, ...]], version: int = 0) -> Roster:
    return Roster(
        entries=tuple(RosterEntry(from_clock=c, workers=w) for c, w in entries), version=version
    )


def _store(roster: Roster | None = None, *, p: int = 0, version: int = 0) -> PartitionStore:
    store = PartitionStore()
    store.add(p, INITIAL, version=version)
    store.set_roster(roster or Roster.starting(WORKERS))
    return store


# -- PartitionStore: consistency and dedup -----------------------------------------------------


def test_consistent_clock_advances_only_when_every_roster_member_pushed() -> None:
    store = _store(_roster((0, WORKERS), (2, ("w0",))))
    for clock in range(4):
        assert store.apply_push(0, "w0", clock, _delta("w0", clock)) is PushOutcome.APPLIED
        assert store.consistent_clock(0) == -1  # w1's clock 0 is missing
    store.apply_push(0, "w1", 0, _delta("w1", 0))
    assert store.consistent_clock(0) == 0  # w1's clock 1 is missing
    assert store.export_partition(0).applied == {("w0", 1), ("w0", 2), ("w0", 3)}
    store.apply_push(0, "w1", 1, _delta("w1", 1))
    assert store.consistent_clock(0) == 3  # clocks 2 and 3 need w0 only
    assert store.export_partition(0).applied == frozenset()  # pairs implied by 3 are pruned
    expected = INITIAL + sum(_delta("w0", c) for c in range(4)) + _delta("w1", 0) + _delta("w1", 1)
    assert torch.equal(store.values(0), expected)


def test_duplicate_pushes_are_acknowledged_and_not_applied_again() -> None:
    store = _store()
    store.apply_push(0, "w0", 0, _delta("w0", 0))
    store.apply_push(0, "w1", 0, _delta("w1", 0))
    store.apply_push(0, "w0", 1, _delta("w0", 1))
    before = store.values(0)
    # implied by the consistent clock (pruned), and still in the applied set
    assert store.apply_push(0, "w1", 0, torch.ones(4)) is PushOutcome.DUPLICATE
    assert store.apply_push(0, "w0", 1, torch.ones(4)) is PushOutcome.DUPLICATE
    assert torch.equal(store.values(0), before)
    assert store.is_applied(0, "w1", 0) and store.is_applied(0, "w0", 1)
    assert not store.is_applied(0, "w1", 1)


@pytest.mark.parametrize(
    ("worker", "clock", "delta", "reason"),
    [
        ("w9", 0, torch.ones(4), RejectReason.UNKNOWN_WORKER),
        ("w1", 3, torch.ones(4), RejectReason.UNKNOWN_WORKER),  # w1 left the roster at 2
        ("w0", -1, torch.ones(4), RejectReason.BAD_CLOCK),
        ("w0", 0, torch.ones(3), RejectReason.BAD_DELTA),
        ("w0", 0, torch.ones(4, dtype=torch.float64), RejectReason.BAD_DELTA),
    ],
)
def test_refused_push_changes_nothing(
    worker: str, clock: int, delta: torch.Tensor, reason: RejectReason
) -> None:
    store = _store(_roster((0, WORKERS), (2, ("w0",))))
    with pytest.raises(RejectedError) as info:
        store.apply_push(0, worker, clock, delta, track_pending=True)
    assert info.value.reason is reason
    snap = store.export_partition(0)
    assert torch.equal(snap.values, INITIAL) and snap.applied == frozenset() and snap.pending == ()


def test_set_roster_refuses_a_change_at_a_clock_with_pushes_and_accepts_a_later_one() -> None:
    base = Roster.starting(WORKERS)
    store = _store(base)
    for w in WORKERS:
        store.apply_push(0, w, 0, _delta(w, 0))
    store.apply_push(0, "w0", 3, _delta("w0", 3))  # w0 ran ahead (SSP)
    before = store.export_partition(0)
    for too_late in (0, 1, 3):
        with pytest.raises(RosterError, match="schedule it after clock 3"):
            store.set_roster(base.with_change(too_late, ["w0", "w1", "w2"]))
        with pytest.raises(RosterError):
            store.check_roster(base.without({"w1"}, too_late))
    assert store.roster == base
    after = store.export_partition(0)
    assert torch.equal(after.values, before.values) and after.applied == before.applied

    later = base.with_change(4, ["w0", "w1", "w2"])
    store.set_roster(later)
    assert store.roster == later and later.changes == ((1, 4),)
    # a push computed on roster 0 is stale from the changed clock on, not before it
    assert store.is_stale(0, 4) and store.is_stale(0, 9)
    assert not store.is_stale(0, 3) and not store.is_stale(1, 4)
    assert store.apply_push(0, "w2", 4, _delta("w2", 4)) is PushOutcome.APPLIED


def test_set_roster_checks_every_partition() -> None:
    store = _store()
    store.add(1, INITIAL)
    store.apply_push(1, "w1", 5, _delta("w1", 5))  # only partition 1 has a late push
    with pytest.raises(RosterError, match="partition 1"):
        store.set_roster(store.roster.with_change(5, ["w0"]))  # type: ignore[union-attr]
    store.set_roster(store.roster.with_change(6, ["w0"]))  # type: ignore[union-attr]
    assert store.roster is not None and store.roster.members(6) == ("w0",)


def test_worker_progress_reports_frontier_latest_and_anyones_latest() -> None:
    store = _store()
    assert store.worker_progress(0, "w0") == (-1, -1, -1)
    for clock in (0, 1, 3):
        store.apply_push(0, "w0", clock, _delta("w0", clock))
    store.apply_push(0, "w1", 0, _delta("w1", 0))
    assert store.consistent_clock(0) == 0
    assert store.worker_progress(0, "w0") == (1, 3, 3)  # 0..1 in, nothing after 3, gap at 2
    assert store.worker_progress(0, "w1") == (0, 0, 3)
    with pytest.raises(PartitionError):
        store.worker_progress(5, "w0")


# -- PartitionStore: streaming (owner side) and chunks (backup side) ---------------------------


def test_take_streamable_returns_only_complete_clocks_coalesced_across_workers() -> None:
    owner = _store()
    owner.apply_push(0, "w0", 0, _delta("w0", 0), track_pending=True)
    owner.apply_push(0, "w0", 1, _delta("w0", 1), track_pending=True)
    assert owner.take_streamable(0) == []  # clock 0 waits for w1
    owner.apply_push(0, "w1", 0, _delta("w1", 0), track_pending=True)
    (chunk,) = owner.take_streamable(0)
    assert (chunk.clock, chunk.workers) == (0, frozenset(WORKERS))
    assert torch.equal(chunk.delta, _delta("w0", 0) + _delta("w1", 0))
    assert owner.take_streamable(0) == []  # taken once
    assert [c.clock for c in owner.export_partition(0).pending] == [1]  # incomplete: kept
    owner.apply_push(0, "w1", 1, _delta("w1", 1), track_pending=True)
    owner.apply_push(0, "w1", 1, torch.ones(4), track_pending=True)  # duplicate: not summed
    (chunk,) = owner.take_streamable(0)
    assert chunk.clock == 1 and torch.equal(chunk.delta, _delta("w0", 1) + _delta("w1", 1))


def test_pushes_without_track_pending_are_not_streamed() -> None:
    owner = _store()
    for w in WORKERS:
        owner.apply_push(0, w, 0, _delta(w, 0))
    assert owner.consistent_clock(0) == 0 and owner.take_streamable(0) == []


def test_streamed_chunks_rebuild_the_owner_state_on_the_backup() -> None:
    owner, backup = _store(), _store()
    for clock in range(5):
        for w in reversed(WORKERS) if clock % 2 else WORKERS:
            owner.apply_push(0, w, clock, _delta(w, clock), track_pending=True)
        for chunk in owner.take_streamable(0):
            assert backup.apply_chunk(0, chunk.clock, chunk.workers, chunk.delta) is (
                PushOutcome.APPLIED
            )
    assert torch.equal(backup.values(0), owner.values(0))
    assert backup.consistent_clock(0) == owner.consistent_clock(0) == 4


def test_apply_chunk_deduplicates_and_refuses_partly_applied_chunks() -> None:
    backup = _store()
    d = _delta("w0", 0)
    assert backup.apply_chunk(0, 0, WORKERS, d) is PushOutcome.APPLIED
    assert backup.consistent_clock(0) == 0
    assert backup.apply_chunk(0, 0, WORKERS, d) is PushOutcome.DUPLICATE
    assert backup.apply_chunk(0, 1, ["w0"], d) is PushOutcome.APPLIED
    assert backup.apply_chunk(0, 1, ["w0"], d) is PushOutcome.DUPLICATE
    before = backup.values(0)
    with pytest.raises(RejectedError) as info:
        backup.apply_chunk(0, 1, WORKERS, d)  # w0's part of clock 1 is already in
    assert info.value.reason is RejectReason.BAD_DELTA
    assert torch.equal(backup.values(0), before) and not backup.is_applied(0, "w1", 1)
    assert backup.apply_chunk(0, 1, ["w1"], d) is PushOutcome.APPLIED
    assert backup.consistent_clock(0) == 1
    assert torch.equal(backup.values(0), INITIAL + 3 * d)


@pytest.mark.parametrize(
    ("p", "clock", "delta", "reason"),
    [
        (3, 0, torch.ones(4), RejectReason.NOT_OWNER),
        (0, -2, torch.ones(4), RejectReason.BAD_CLOCK),
        (0, 0, torch.ones(5), RejectReason.BAD_DELTA),
        (0, 0, torch.ones(4, dtype=torch.float64), RejectReason.BAD_DELTA),
    ],
)
def test_refused_chunk_changes_nothing(
    p: int, clock: int, delta: torch.Tensor, reason: RejectReason
) -> None:
    backup = _store()
    with pytest.raises(RejectedError) as info:
        backup.apply_chunk(p, clock, WORKERS, delta)
    assert info.value.reason is reason
    assert torch.equal(backup.values(0), INITIAL) and backup.consistent_clock(0) == -1


# -- PartitionStore: export / import / restore -------------------------------------------------


def _owner_with_pending() -> PartitionStore:
    """Clock 0 complete but not taken yet, clock 1 pushed by w0 only, clock 2 by w1 only."""
    owner = _store(version=3)
    owner.apply_push(0, "w0", 0, _delta("w0", 0), track_pending=True)
    owner.apply_push(0, "w1", 0, _delta("w1", 0), track_pending=True)
    owner.apply_push(0, "w0", 1, _delta("w0", 1), track_pending=True)
    owner.apply_push(0, "w1", 2, _delta("w1", 2), track_pending=True)
    return owner


def test_export_import_carries_pending_chunks_and_the_applied_set() -> None:
    owner = _owner_with_pending()
    snap = owner.export_partition(0)
    assert (snap.version, snap.consistent, snap.workers) == (3, 0, WORKERS)
    assert snap.applied == {("w0", 1), ("w1", 2)}
    assert [(c.clock, c.workers) for c in snap.pending] == [
        (0, frozenset(WORKERS)),
        (1, frozenset({"w0"})),
        (2, frozenset({"w1"})),
    ]
    receiver = PartitionStore()  # no roster: adopts the snapshot's workers
    assert receiver.import_partition(snap) == 4
    assert receiver.roster == Roster.starting(WORKERS)
    assert torch.equal(receiver.values(0), owner.values(0))
    assert receiver.apply_push(0, "w0", 1, torch.ones(4)) is PushOutcome.DUPLICATE
    assert [c.clock for c in receiver.take_streamable(0)] == [0]
    receiver.apply_push(0, "w1", 1, _delta("w1", 1), track_pending=True)
    (chunk,) = receiver.take_streamable(0)  # w0's half came with the snapshot
    assert chunk.workers == frozenset(WORKERS)
    assert torch.equal(chunk.delta, _delta("w0", 1) + _delta("w1", 1))
    snap.values.add_(100.0)  # the snapshot is a private copy in both directions
    # clock 1 is now complete, so applied: w0's half (carried, summed) and w1's
    assert torch.equal(receiver.values(0), owner.values(0) + _delta("w0", 1) + _delta("w1", 1))


def test_snapshot_with_pending_chunks_round_trips_through_the_wire() -> None:
    snap = _owner_with_pending().export_partition(0)
    workers, tensors = snapshot_to_wire(snap)
    header = {"kind": MessageKind.HANDOFF, "job_id": JOB, "sender": "a", "seq": 1, "partition": 0}
    decoded, got = wire.decode(wire.encode({**header, "workers": workers}, tensors, TOKEN), TOKEN)
    back = snapshot_from_wire(decoded, got)
    assert (back.partition, back.version, back.consistent, back.applied) == (
        0,
        snap.version,
        snap.consistent,
        snap.applied,
    )
    assert set(back.workers) == set(snap.workers)
    assert torch.equal(back.values, snap.values)
    assert [(c.clock, c.workers) for c in back.pending] == [
        (c.clock, c.workers) for c in snap.pending
    ]
    assert all(
        torch.equal(a.delta, b.delta) for a, b in zip(back.pending, snap.pending, strict=True)
    )


def test_restore_import_replaces_the_partition_whatever_its_version() -> None:
    backup = _store()
    backup.apply_chunk(0, 0, WORKERS, _delta("w0", 0))
    restored = backup.export_partition(0)
    assert restored.version == 0
    owner = _owner_with_pending()  # holds version 3, and clocks the backup never saw
    with pytest.raises(OwnershipConflictError):
        owner.import_partition(restored)  # as a hand-off it is stale
    version = owner.import_partition(restored, restore=True)
    assert version > 3  # above what it held, so `moved` replies stay ordered
    snap = owner.export_partition(0)
    assert torch.equal(snap.values, INITIAL + _delta("w0", 0))
    assert (snap.consistent, snap.applied, snap.pending) == (0, frozenset(), ())
    assert owner.apply_push(0, "w0", 1, _delta("w0", 1)) is PushOutcome.APPLIED  # redone

    given = _store(version=2)
    given.drop_partition(0, new_version=5)
    with pytest.raises(OwnershipConflictError):
        given.import_partition(restored)
    assert given.import_partition(restored, restore=True) >= 5


@pytest.mark.parametrize(
    "bad",
    [
        {"values": INITIAL.double()},
        {"values": INITIAL.reshape(2, 2)},
        {"applied": frozenset({("w0", -1)})},
        {"consistent": -2},
        {"pending": (PendingChunk(1, torch.ones(3), frozenset({"w0"})),)},
    ],
    ids=["float64", "2d", "negative-applied", "negative-consistent", "pending-size"],
)
def test_malformed_snapshot_is_refused_and_changes_nothing(bad: dict[str, Any]) -> None:
    good = PartitionSnapshot(0, torch.zeros(4), frozenset(), 9, WORKERS)
    owner = _owner_with_pending()
    before = owner.export_partition(0)
    for restore in (False, True):
        with pytest.raises(PartitionError):
            owner.import_partition(PartitionSnapshot(**{**good.__dict__, **bad}), restore=restore)
    after = owner.export_partition(0)
    assert torch.equal(after.values, before.values)
    assert (after.version, after.applied, after.consistent) == (
        before.version,
        before.applied,
        before.consistent,
    )


# -- ParamServer over sockets ------------------------------------------------------------------


class Client(WireClient):
    """Pushes default to the sender's known delta of the clock (`_delta`)."""

    def push(
        self, clock: int, delta: torch.Tensor | None = None, partition: int = 0, **fields: Any
    ) -> Header:
        d = _delta(self.sender, clock) if delta is None else delta
        return super().push(clock, d, partition, **fields)


class Clients(WireClients):
    def __call__(self, endpoint: str, sender: str) -> Client:
        client = Client(self.context, endpoint, sender, job_id=self.job_id, token=self.token)
        self.made.append(client)
        return client


@pytest.fixture
def clients() -> Iterator[Clients]:
    made = Clients(job_id=JOB, token=TOKEN)
    yield made
    made.close()


@pytest.fixture
def no_thread_leak() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5.0
    while (left := set(threading.enumerate()) - before) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not left, f"threads left running: {sorted(t.name for t in left)}"


@pytest.fixture
def servers(no_thread_leak: None) -> Iterator[dict[str, ParamServer]]:
    """`owner` (an ActivePS of partition 0) streaming to `backup` (its BackupPS), plus a spare
    `new` server with the roster only; all in epoch 1 with workers w0, w1."""
    made = {
        "owner": ParamServer("ps-a", job_id=JOB, token=TOKEN),
        "backup": ParamServer("ps-r", job_id=JOB, token=TOKEN),
        "new": ParamServer("ps-n", job_id=JOB, token=TOKEN),
    }
    try:
        for server in made.values():
            server.start()
            server.register_workers(WORKERS)
            server.set_epoch(1)
        made["owner"].add_partition(0, INITIAL)
        made["backup"].add_backup(0, INITIAL)
        for server in made.values():
            server.set_backups({0: made["backup"].endpoint})
        yield made
    finally:
        for server in made.values():
            server.stop()


def _push_clocks(clients: Clients, endpoint: str, clocks: range, epoch: int = 1) -> None:
    pushers = [clients(endpoint, w) for w in WORKERS]
    for clock in clocks:
        for c in pushers if clock % 2 else reversed(pushers):
            assert c.push(clock, epoch=epoch).detail == "applied"


def test_owner_streams_complete_clocks_so_the_backup_matches_it(
    servers: dict[str, ParamServer], clients: Clients
) -> None:
    owner, backup = servers["owner"], servers["backup"]
    _push_clocks(clients, owner.endpoint, range(5))
    assert owner.flush(5.0)
    assert torch.equal(backup.backup_state(0), owner.state(0))
    assert owner.stats().chunks_streamed == 5 and backup.stats().chunks_backed == 5
    assert backup.backed() == [0] and backup.owned() == []

    clients(owner.endpoint, "w0").push(5, epoch=1)  # clock 5 incomplete: not streamed yet
    assert owner.flush(5.0) and owner.stats().chunks_streamed == 5
    assert torch.equal(backup.backup_state(0), owner.state(0))  # summed, not yet applied
    clients(owner.endpoint, "w1").push(5, epoch=1)
    assert owner.flush(5.0)
    assert torch.equal(backup.backup_state(0), owner.state(0))
    assert backup.stats().chunks_backed == 6


def test_consistent_clocks_report_clock_zero(
    servers: dict[str, ParamServer], clients: Clients
) -> None:
    owner, backup = servers["owner"], servers["backup"]
    _push_clocks(clients, owner.endpoint, range(1))
    assert owner.flush(5.0)
    assert owner.consistent_clocks() == {0: 0}
    assert backup.consistent_clocks(backup=True) == {0: 0}


def test_restore_puts_the_backup_state_on_a_new_owner_under_a_new_epoch(
    servers: dict[str, ParamServer], clients: Clients
) -> None:
    owner, backup, new = servers["owner"], servers["backup"], servers["new"]
    _push_clocks(clients, owner.endpoint, range(2))
    clients(owner.endpoint, "w0").push(2, epoch=1)  # clock 2 never completes: not backed up
    assert owner.flush(5.0)
    owner.stop()  # the ActivePS dies
    backed = backup.backup_state(0)

    restored = backup.restore_owners(2, {0: new.endpoint}, {0: 0})
    assert set(restored) == {0}
    consistent, version = restored[0]
    assert consistent == 1 and version > 0
    assert new.owned() == [0] and new.epoch == 2 and backup.epoch == 2
    assert torch.equal(new.state(0), backed)
    assert new.stats().restores == 1

    w0, w1 = clients(new.endpoint, "w0"), clients(new.endpoint, "w1")
    for header, _ in (
        w0.request(MessageKind.PUSH, {"delta": _delta("w0", 2)}, partition=0, clock=2, epoch=1),
        w0.request(MessageKind.PULL, partition=0, clock=1, epoch=1),
    ):
        assert (header.kind, header.detail) == (MessageKind.ERROR, "stale_epoch:2")
    assert torch.equal(new.state(0), backed)
    header, tensors = w0.request(MessageKind.PULL, partition=0, clock=1, epoch=2)
    assert header.kind is MessageKind.PULL_REPLY and torch.equal(tensors["values"], backed)

    # a late update streamed in the old epoch is refused by the BackupPS
    late = clients(backup.endpoint, "ps-a")
    header, _ = late.request(
        MessageKind.REPLICATE,
        {"delta": _delta("w0", 2)},
        partition=0,
        clock=2,
        workers=list(WORKERS),
        epoch=1,
    )
    assert header.kind is MessageKind.ERROR and header.detail.startswith("stale_epoch")
    assert torch.equal(backup.backup_state(0), backed)

    # clock 2 is redone in epoch 2 (w0's lost push is not a duplicate) and streamed again
    assert w0.push(2, epoch=2).detail == "applied"
    assert w1.push(2, epoch=2).detail == "applied"
    assert new.flush(5.0)
    assert torch.equal(backup.backup_state(0), new.state(0))
    assert torch.equal(new.state(0), backed + _delta("w0", 2) + _delta("w1", 2))


def test_restore_refuses_the_pulls_an_owner_held_in_the_old_epoch(
    servers: dict[str, ParamServer], clients: Clients
) -> None:
    owner, backup = servers["owner"], servers["backup"]
    _push_clocks(clients, owner.endpoint, range(1))
    w0 = clients(owner.endpoint, "w0")
    assert w0.push(1, epoch=1).detail == "applied"
    assert owner.flush(5.0)
    seq = w0.send(MessageKind.PULL, partition=0, clock=1, epoch=1)  # waits for w1's clock 1
    assert w0.silent() and owner.stats().pulls_held == 1

    version = owner.snapshot(0).version
    restored = backup.restore_owners(2, {0: owner.endpoint}, {0: version})
    assert restored[0][0] == 0 and restored[0][1] > version
    header, _ = w0.recv()
    assert (header.kind, header.seq, header.detail) == (MessageKind.ERROR, seq, "stale_epoch:2")
    assert owner.stats().pulls_held == 0 and owner.epoch == 2
    assert torch.equal(owner.state(0), backup.backup_state(0))  # w0's clock 1 rolled back
    assert w0.push(1, epoch=1).detail == "stale_epoch:2"
    assert w0.push(1, epoch=2).detail == "applied"


def test_restore_to_itself_refuses_the_pulls_held_in_the_old_epoch(
    servers: dict[str, ParamServer], clients: Clients
) -> None:
    backup = servers["backup"]
    backup.add_partition(1, INITIAL)  # it also serves partition 1 (as a ParamServ)
    w0 = clients(backup.endpoint, "w0")
    seq = w0.send(MessageKind.PULL, partition=1, clock=0, epoch=1)  # nobody pushed clock 0
    assert w0.silent() and backup.stats().pulls_held == 1
    backup.restore_owners(2, {0: backup.endpoint}, {0: 0})
    assert backup.owned() == [0, 1] and backup.epoch == 2
    header, _ = w0.recv(timeout_ms=HELD_CHECK_MS * 3)
    assert (header.kind, header.seq, header.detail) == (MessageKind.ERROR, seq, "stale_epoch:2")


def test_push_computed_on_an_older_roster_for_a_changed_clock_is_refused(
    servers: dict[str, ParamServer], clients: Clients
) -> None:
    owner = servers["owner"]
    base = Roster.starting(WORKERS)
    _push_clocks(clients, owner.endpoint, range(1))
    for server in servers.values():
        server.set_roster(base.with_change(2, ["w0"]))  # version 1: w1 leaves at clock 2
    w0, w1 = clients(owner.endpoint, "w0"), clients(owner.endpoint, "w1")
    before = owner.state(0)
    refused = w0.push(2, roster_version=0)  # computed on half of clock 2's batch
    assert (refused.kind, refused.detail) == (MessageKind.ERROR, "stale_roster:1")
    assert torch.equal(owner.state(0), before)
    assert w0.push(1, roster_version=0).detail == "applied"  # clock 1 did not change
    assert w1.push(1, roster_version=0).detail == "applied"
    assert w0.push(2, roster_version=1).detail == "applied"
    assert w1.push(2, roster_version=1).detail == "unknown_worker"
    assert owner.snapshot(0).consistent == 2


def test_server_set_roster_refuses_a_late_change_and_keeps_serving(
    servers: dict[str, ParamServer], clients: Clients
) -> None:
    owner = servers["owner"]
    base = Roster.starting(WORKERS)
    _push_clocks(clients, owner.endpoint, range(2))
    w0 = clients(owner.endpoint, "w0")
    w0.push(3)
    with pytest.raises(RosterError):
        owner.set_roster(base.with_change(3, ["w0", "w1", "w2"]))
    w2 = clients(owner.endpoint, "w2")
    assert w2.push(3, torch.ones(4)).detail == "unknown_worker"  # the roster is unchanged
    assert w0.push(2).detail == "applied"
    owner.set_roster(base.with_change(4, ["w0", "w1", "w2"]))
    assert w2.push(4, torch.ones(4), roster_version=1).detail == "applied"


def test_a_store_whose_first_roster_has_changes_refuses_pushes_on_older_rosters() -> None:
    changed = Roster.starting(WORKERS).with_change(4, ["w0", "w1", "w2"])  # version 1
    joiner = _store(changed)  # configured for the first time after the change
    assert joiner.is_stale(0, 4)


def test_handed_off_partition_refuses_pushes_on_older_rosters_at_a_joined_server(
    servers: dict[str, ParamServer], clients: Clients
) -> None:
    owner = servers["owner"]
    changed = Roster.starting(WORKERS).with_change(4, ["w0", "w1", "w2"])
    _push_clocks(clients, owner.endpoint, range(2))
    owner.set_roster(changed)
    with ParamServer("ps-j", job_id=JOB, token=TOKEN) as joiner:
        joiner.set_epoch(1)
        joiner.set_roster(changed)  # what `configure` gives a node that joins now
        joiner.set_backups({0: servers["backup"].endpoint})
        owner.handoff_to(0, joiner.endpoint)
        w0 = clients(joiner.endpoint, "w0")
        before = joiner.state(0)
        refused = w0.push(4, roster_version=0)  # computed on w0's half of clock 4, not a third
        assert (refused.kind, refused.detail) == (MessageKind.ERROR, "stale_roster:1")
        assert torch.equal(joiner.state(0), before)


# -- malformed server-to-server messages --------------------------------------------------------


def _flip_a_buffer_byte(frames: list[bytes]) -> list[bytes]:
    """Tamper with the first tensor buffer after the MAC was computed."""
    first = bytearray(frames[1])
    first[0] ^= 0x01
    return [frames[0], bytes(first), *frames[2:]]


REPLICATE_OK: dict[str, Any] = {"partition": 0, "clock": 0, "workers": list(WORKERS), "epoch": 1}


@pytest.mark.parametrize(
    ("tensors", "fields", "options", "detail"),
    [
        ({}, {}, {}, "bad_delta"),
        ({"delta": torch.ones(4, dtype=torch.float64)}, {}, {}, "bad_delta"),
        ({"delta": torch.ones(4, dtype=torch.int64)}, {}, {}, "bad_delta"),
        ({"delta": torch.ones(5)}, {}, {}, "bad_delta"),
        ({"delta": torch.ones(4)}, {"workers": None}, {}, "bad_delta"),
        ({"delta": torch.ones(4)}, {"clock": None}, {}, "bad_delta"),
        ({"delta": torch.ones(4)}, {"clock": -1}, {}, "bad_clock"),
        ({"delta": torch.ones(4)}, {"partition": 7}, {}, "not_owner"),
        ({"delta": torch.ones(4)}, {"epoch": 0}, {}, "stale_epoch"),
        ({"delta": torch.ones(4)}, {"job_id": "other-job"}, {}, "wrong_job"),
        ({"delta": torch.ones(4)}, {}, {"token": b"not-the-job-token"}, "bad_mac"),
        ({"delta": torch.ones(4)}, {}, {"tamper": _flip_a_buffer_byte}, "bad_mac"),
    ],
    ids=[
        "no-delta",
        "float64",
        "int64",
        "wrong-size",
        "no-workers",
        "no-clock",
        "negative-clock",
        "not-backed-up",
        "old-epoch",
        "wrong-job",
        "wrong-token",
        "bad-mac",
    ],
)
def test_malformed_replicate_is_refused_and_changes_nothing(
    servers: dict[str, ParamServer],
    clients: Clients,
    tensors: dict[str, torch.Tensor],
    fields: dict[str, Any],
    options: dict[str, Any],
    detail: str,
) -> None:
    backup = servers["backup"]
    sender = clients(backup.endpoint, "ps-a")
    header_fields = {k: v for k, v in {**REPLICATE_OK, **fields}.items() if v is not None}
    seq = sender.send(MessageKind.REPLICATE, tensors, **header_fields, **options)
    header, _ = sender.recv()
    assert (header.kind, header.seq, header.detail) == (
        MessageKind.ERROR,
        _seq(seq, detail),
        detail,
    )
    assert torch.equal(backup.backup_state(0), INITIAL)
    assert backup.stats().chunks_backed == 0 and backup.stats().rejected == 1
    # the well-formed chunk is still applied once, and a partly applied one is refused
    ok = sender.request(MessageKind.REPLICATE, {"delta": torch.ones(4)}, **REPLICATE_OK)[0]
    assert (ok.kind, ok.detail) == (MessageKind.REPLICATE_ACK, "applied")
    half = {**REPLICATE_OK, "clock": 1, "workers": ["w0"]}
    assert sender.request(MessageKind.REPLICATE, {"delta": torch.ones(4)}, **half)[0].detail == (
        "applied"
    )
    partial = sender.request(
        MessageKind.REPLICATE, {"delta": torch.ones(4)}, **{**REPLICATE_OK, "clock": 1}
    )[0]
    assert (partial.kind, partial.detail) == (MessageKind.ERROR, "bad_delta")  # w0 already in
    assert torch.equal(backup.backup_state(0), INITIAL + 1)  # clock 1 lacks w1: summed only


def _restore_tensors(**changes: torch.Tensor | None) -> dict[str, torch.Tensor]:
    snap = PartitionSnapshot(0, torch.full((4,), 50.0), frozenset({("w0", 3)}), 0, WORKERS, 2)
    _, tensors = snapshot_to_wire(snap)
    for name, value in changes.items():
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    return tensors


@pytest.mark.parametrize(
    ("tensors", "fields", "options", "detail"),
    [
        (_restore_tensors(pending=None), {}, {}, "bad_snapshot"),
        (_restore_tensors(values=None), {}, {}, "bad_snapshot"),
        ({**_restore_tensors(), "extra": torch.ones(1)}, {}, {}, "bad_snapshot"),
        (_restore_tensors(values=torch.full((4,), 50.0).double()), {}, {}, "bad_snapshot"),
        (_restore_tensors(applied=torch.tensor([[0.0, 3.0]])), {}, {}, "bad_snapshot"),
        (_restore_tensors(applied=torch.tensor([[5, 3]])), {}, {}, "bad_snapshot"),
        (_restore_tensors(applied=torch.tensor([[0, -3]])), {}, {}, "bad_snapshot"),
        (_restore_tensors(version=torch.tensor([0.0])), {}, {}, "bad_snapshot"),
        (_restore_tensors(pending_clocks=torch.tensor([4])), {}, {}, "bad_snapshot"),
        (_restore_tensors(pending=torch.zeros(1, 3)), {}, {}, "bad_snapshot"),
        (_restore_tensors(), {"partition": None}, {}, "bad_snapshot"),
        (_restore_tensors(), {"epoch": None}, {}, "stale_epoch"),
        (_restore_tensors(), {"epoch": 0}, {}, "stale_epoch"),
        (_restore_tensors(), {}, {"token": b"not-the-job-token"}, "bad_mac"),
        (_restore_tensors(), {}, {"tamper": _flip_a_buffer_byte}, "bad_mac"),
    ],
    ids=[
        "no-pending",
        "no-values",
        "extra-tensor",
        "float64-values",
        "float-applied",
        "worker-index-out-of-range",
        "negative-clock",
        "float-version",
        "pending-clocks-mismatch",
        "pending-wrong-size",
        "no-partition",
        "no-epoch",
        "old-epoch",
        "wrong-token",
        "bad-mac",
    ],
)
def test_malformed_restore_is_refused_and_changes_nothing(
    servers: dict[str, ParamServer],
    clients: Clients,
    tensors: dict[str, torch.Tensor],
    fields: dict[str, Any],
    options: dict[str, Any],
    detail: str,
) -> None:
    owner = servers["owner"]
    _push_clocks(clients, owner.endpoint, range(1))
    before = owner.snapshot(0)
    sender = clients(owner.endpoint, "ps-r")
    header_fields = {
        k: v
        for k, v in {"partition": 0, "epoch": 2, "workers": list(WORKERS), **fields}.items()
        if v is not None
    }
    seq = sender.send(MessageKind.RESTORE, tensors, **header_fields, **options)
    header, _ = sender.recv()
    assert (header.kind, header.seq, header.detail) == (
        MessageKind.ERROR,
        _seq(seq, detail),
        detail,
    )
    after = owner.snapshot(0)
    assert torch.equal(after.values, before.values)
    assert (after.version, after.applied, after.consistent) == (
        before.version,
        before.applied,
        before.consistent,
    )
    assert owner.epoch == 1 and owner.stats().restores == 0
    assert clients(owner.endpoint, "w0").push(1, epoch=1).detail == "applied"  # still epoch 1
    # the well-formed restore is taken
    ok = sender.request(
        MessageKind.RESTORE, _restore_tensors(), partition=0, epoch=2, workers=list(WORKERS)
    )[0]
    assert ok.kind is MessageKind.RESTORE_ACK and owner.epoch == 2
    assert torch.equal(owner.state(0), torch.full((4,), 50.0))


@pytest.fixture
def control_server(no_thread_leak: None) -> Iterator[tuple[ParamServer, list[dict[str, Any]]]]:
    calls: list[dict[str, Any]] = []

    def handler(body: dict[str, Any]) -> dict[str, Any]:
        calls.append(body)
        return {"seen": len(calls)}

    server = ParamServer("node-1", job_id=JOB, token=TOKEN, control=handler)
    server.add_partition(0, INITIAL)
    server.register_workers(WORKERS)
    with server:
        yield server, calls


def _body(raw: bytes, dtype: torch.dtype = torch.uint8) -> dict[str, torch.Tensor]:
    return {"body": torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(dtype)}


@pytest.mark.parametrize(
    ("tensors", "options", "detail"),
    [
        (wire.json_body({"op": "status"}), {"token": b"not-the-job-token"}, "bad_mac"),
        (wire.json_body({"op": "status"}), {"tamper": _flip_a_buffer_byte}, "bad_mac"),
        ({}, {}, "schema"),
        (_body(b'{"op":"status"}', torch.float32), {}, "schema"),
        ({"body": torch.zeros(2, 2, dtype=torch.uint8)}, {}, "schema"),
        (_body(b"{not json"), {}, "bad_json"),
        (wire.json_body(["op", "status"]), {}, "unexpected_kind"),
        (wire.json_body({"op": "status"}), {"job_id": "other-job"}, "wrong_job"),
    ],
    ids=[
        "wrong-token",
        "bad-mac",
        "no-body",
        "float-body",
        "2d-body",
        "bad-json",
        "not-an-object",
        "wrong-job",
    ],
)
def test_malformed_control_is_refused_without_calling_the_handler(
    control_server: tuple[ParamServer, list[dict[str, Any]]],
    clients: Clients,
    tensors: dict[str, torch.Tensor],
    options: dict[str, Any],
    detail: str,
) -> None:
    server, calls = control_server
    controller = clients(server.endpoint, "coordinator")
    seq = controller.send(MessageKind.CONTROL, tensors, **options)
    header, _ = controller.recv()
    assert (header.kind, header.seq, header.detail) == (
        MessageKind.ERROR,
        _seq(seq, detail),
        detail,
    )
    assert calls == [] and server.stats().rejected == 1
    header, out = controller.request(MessageKind.CONTROL, wire.json_body({"op": "status"}))
    assert header.kind is MessageKind.CONTROL_REPLY
    assert wire.parse_json_body(out) == {"ok": True, "seen": 1}
    assert calls == [{"op": "status"}]


def test_control_without_a_handler_is_refused(
    servers: dict[str, ParamServer], clients: Clients
) -> None:
    owner = servers["owner"]
    controller = clients(owner.endpoint, "coordinator")
    header, _ = controller.request(MessageKind.CONTROL, wire.json_body({"op": "status"}))
    assert (header.kind, header.detail) == (MessageKind.ERROR, "unexpected_kind")


def _seq(seq: int, detail: str) -> int:
    """The seq an error reply names: 0 when the MAC failed (an unauthenticated header is
    never read), else the request's."""
    return 0 if detail == "bad_mac" else seq
