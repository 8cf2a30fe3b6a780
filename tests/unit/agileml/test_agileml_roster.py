"""Rosters: worker sets by clock, scheduled changes, and each worker's share of the global batch."""

from __future__ import annotations

import itertools

import pytest
import torch
from pydantic import ValidationError

from orchestrator.agileml.errors import RosterError
from orchestrator.agileml.roster import (
    Roster,
    RosterEntry,
    global_batch_indices,
    worker_share,
)


def _roster(*entries: tuple[int, tuple[str, ...]], version: int = 0) -> Roster:
    return Roster(
        entries=tuple(RosterEntry(from_clock=c, workers=w) for c, w in entries), version=version
    )


def _schedule(roster: Roster) -> list[tuple[int, tuple[str, ...]]]:
    return [(e.from_clock, e.workers) for e in roster.entries]


# -- construction and validation ---------------------------------------------------------------


def test_starting_sorts_and_deduplicates_the_workers() -> None:
    roster = Roster.starting(["w2", "w0", "w1", "w0"])
    assert _schedule(roster) == [(0, ("w0", "w1", "w2"))]
    assert roster.version == 0


@pytest.mark.parametrize(
    "workers",
    [("w1", "w0"), ("w0", "w0"), ("w0", "w2", "w1"), ("",)],
    ids=["unsorted", "duplicate", "partly-unsorted", "empty-id"],
)
def test_entry_workers_must_be_sorted_unique_and_named(workers: tuple[str, ...]) -> None:
    with pytest.raises(ValidationError):
        RosterEntry(from_clock=0, workers=workers)


def test_entry_clock_must_not_be_negative() -> None:
    with pytest.raises(ValidationError):
        RosterEntry(from_clock=-1, workers=("w0",))


@pytest.mark.parametrize(
    "clocks",
    [(), (1,), (3, 5), (0, 4, 4), (0, 5, 2)],
    ids=["empty", "starts-at-1", "starts-at-3", "repeated", "decreasing"],
)
def test_roster_needs_a_first_entry_at_0_and_increasing_clocks(clocks: tuple[int, ...]) -> None:
    with pytest.raises(ValidationError):
        _roster(*((c, ("w0",)) for c in clocks))


def test_roster_version_must_not_be_negative() -> None:
    with pytest.raises(ValidationError):
        _roster((0, ("w0",)), version=-1)


def test_roster_is_frozen_and_round_trips_through_json() -> None:
    roster = _roster((0, ("a", "b")), (4, ("a",)), (9, ("a", "c")), version=3)
    with pytest.raises(ValidationError):
        roster.version = 4  # type: ignore[misc]
    assert Roster.model_validate(roster.model_dump(mode="json")) == roster
    with pytest.raises(ValidationError):
        Roster.model_validate({**roster.model_dump(mode="json"), "extra": 1})


# -- members ------------------------------------------------------------------------------------


def test_members_follow_the_entry_in_force_at_each_clock() -> None:
    roster = _roster((0, ("a", "b")), (4, ("a",)), (9, ("a", "c")))
    expected = {0: ("a", "b"), 3: ("a", "b"), 4: ("a",), 8: ("a",), 9: ("a", "c"), 1000: ("a", "c")}
    for clock, members in expected.items():
        assert roster.members(clock) == members, clock


def test_members_can_be_empty_from_some_clock_on() -> None:
    roster = Roster.starting(["a"]).without({"a"}, 3)
    assert roster.members(2) == ("a",)
    assert roster.members(3) == roster.members(50) == ()


# -- with_change --------------------------------------------------------------------------------


def test_with_change_replaces_the_schedule_from_its_clock_and_bumps_the_version() -> None:
    roster = _roster((0, ("a", "b")), (4, ("a",)), (9, ("a", "c")), version=2)
    changed = roster.with_change(6, ["d", "a", "d"])
    assert _schedule(changed) == [(0, ("a", "b")), (4, ("a",)), (6, ("a", "d"))]
    assert changed.version == 3
    assert roster.members(9) == ("a", "c")  # the original is unchanged (frozen)


def test_with_change_at_an_existing_entry_clock_replaces_that_entry() -> None:
    roster = _roster((0, ("a", "b")), (4, ("a",)))
    assert _schedule(roster.with_change(4, ["b"])) == [(0, ("a", "b")), (4, ("b",))]
    assert _schedule(roster.with_change(0, ["c"])) == [(0, ("c",))]


def test_with_change_refuses_a_negative_clock() -> None:
    with pytest.raises(RosterError):
        Roster.starting(["a"]).with_change(-1, ["a"])


# -- without ------------------------------------------------------------------------------------


def test_without_keeps_later_entries_minus_the_removed_workers() -> None:
    roster = _roster((0, ("a", "b")), (4, ("a", "b", "c")), (9, ("b", "c", "d")), version=5)
    out = roster.without({"b"}, 2)
    assert _schedule(out) == [
        (0, ("a", "b")),
        (2, ("a",)),
        (4, ("a", "c")),
        (9, ("c", "d")),
    ]
    assert out.version == 6
    for clock in range(12):
        expected = tuple(w for w in roster.members(clock) if clock < 2 or w != "b")
        assert out.members(clock) == expected, clock


def test_without_merges_entries_that_become_identical() -> None:
    roster = _roster((0, ("a", "b")), (4, ("a", "b", "c")), (7, ("a", "b")))
    out = roster.without({"c"}, 0)
    assert _schedule(out) == [(0, ("a", "b"))]
    # removal at an existing entry's clock: that entry is rewritten, not duplicated
    assert _schedule(roster.without({"a"}, 4)) == [(0, ("a", "b")), (4, ("b", "c")), (7, ("b",))]


def test_without_a_non_member_changes_only_the_version() -> None:
    roster = _roster((0, ("a", "b")), (4, ("a",)))
    out = roster.without({"zz"}, 2)
    assert _schedule(out) == _schedule(roster)
    assert out.version == roster.version + 1
    assert roster.first_difference(out) is None


def test_without_refuses_a_negative_clock() -> None:
    with pytest.raises(RosterError):
        Roster.starting(["a"]).without({"a"}, -3)


# -- first_difference and first_clock_of --------------------------------------------------------


def test_first_difference_is_the_first_clock_whose_members_differ() -> None:
    base = _roster((0, ("a", "b")), (4, ("a",)))
    assert base.first_difference(base) is None
    assert base.first_difference(base.with_change(6, ["a"])) is None  # same members throughout
    assert base.first_difference(base.with_change(6, ["a", "c"])) == 6
    assert base.first_difference(base.without({"b"}, 2)) == 2
    assert base.first_difference(Roster.starting(["a", "c"])) == 0
    # symmetric, and found at a clock that only the other roster has an entry for
    other = _roster((0, ("a", "b")), (4, ("a",)), (10, ("a", "b")))
    assert base.first_difference(other) == other.first_difference(base) == 10


def test_first_clock_of_finds_the_next_clock_a_worker_computes() -> None:
    roster = _roster((0, ("a",)), (5, ("a", "b")), (8, ("a",)), (12, ("b",)))
    assert roster.first_clock_of("a", 0) == 0
    assert roster.first_clock_of("a", 7) == 7
    assert roster.first_clock_of("a", 12) is None
    assert roster.first_clock_of("b", 0) == 5
    assert roster.first_clock_of("b", 6) == 6
    assert roster.first_clock_of("b", 9) == 12
    assert roster.first_clock_of("b", 40) == 40
    assert roster.first_clock_of("zz", 0) is None


# -- worker_share and global_batch_indices ------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 2, 7, 16, 33, 256])
def test_worker_shares_partition_the_global_batch_for_any_member_count(batch: int) -> None:
    for n in sorted({1, 2, 3, 5, min(batch, 8), batch}):
        if n > batch:
            continue
        members = tuple(f"w{i:03d}" for i in range(n))
        shares = [worker_share(members, w, batch) for w in members]
        covered = list(itertools.chain.from_iterable(range(s.start, s.stop) for s in shares))
        assert covered == list(range(batch)), (batch, n)  # disjoint, in order, exact cover
        sizes = [s.stop - s.start for s in shares]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1, (batch, n, sizes)
        assert sizes == sorted(sizes, reverse=True)  # the first `batch % n` take one more row


def test_worker_share_refuses_non_members_and_too_many_members() -> None:
    with pytest.raises(RosterError):
        worker_share(("a", "b"), "c", 8)
    with pytest.raises(RosterError):
        worker_share(("a", "b", "c"), "a", 2)


def test_global_batch_indices_are_a_deterministic_function_of_seed_and_clock() -> None:
    state = torch.random.get_rng_state()
    first = global_batch_indices(3, 7, 100, 16)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is untouched
    assert torch.equal(first, global_batch_indices(3, 7, 100, 16))
    assert first.dtype == torch.int64 and first.shape == (16,)
    assert int(first.min()) >= 0 and int(first.max()) < 100
    others = [global_batch_indices(3, c, 100, 16) for c in range(8)]
    assert sum(torch.equal(first, o) for o in others) == 1  # only clock 7 itself
    assert not torch.equal(first, global_batch_indices(4, 7, 100, 16))


def test_shares_of_different_member_sets_cover_the_same_rows() -> None:
    """Strong scaling: whoever computes a clock, its rows are the same global batch."""
    rows = global_batch_indices(0, 11, 50, 16)
    for members in [("a",), ("a", "b"), ("a", "b", "c"), tuple(f"w{i}" for i in range(16))]:
        got = torch.cat([rows[worker_share(members, w, 16)] for w in members])
        assert torch.equal(got, rows), members


def test_last_clock_of_finds_the_last_clock_a_worker_computes_up_to_a_bound() -> None:
    roster = Roster.starting(["a", "b"]).with_change(5, ["a"]).with_change(9, ["a", "b"])
    assert [roster.last_clock_of("b", upto) for upto in (-1, 0, 3, 7, 12)] == [-1, 0, 3, 4, 12]
    assert roster.last_clock_of("a", 7) == 7
    assert roster.last_clock_of("c", 12) == -1
