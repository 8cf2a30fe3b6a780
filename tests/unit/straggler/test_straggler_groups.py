"""Helper and helpee groups (thesis §3.3.1): one helper on the worker's own machine, the others
spread over other machines; helpee groups are the inverse relation."""

from __future__ import annotations

import random

import pytest

from orchestrator.straggler.groups import helpee_groups, helper_groups


def workers(n: int) -> list[str]:
    return [f"w{i:02d}" for i in range(n)]


def round_robin(members: list[str], machines: int) -> dict[str, str]:
    return {w: f"m{i % machines}" for i, w in enumerate(members)}


def blocks(members: list[str], machines: int) -> dict[str, str]:
    return {w: f"m{i * machines // len(members)}" for i, w in enumerate(members)}


LAYOUTS = [
    (n, machines, size, layout)
    for n in (1, 2, 3, 5, 8, 13, 16, 64)
    for machines in (1, 2, 3, 8)
    if machines <= n
    for size in (1, 2, 4, 7)
    for layout in ("round_robin", "blocks")
]


def layout_of(n: int, machines: int, layout: str) -> tuple[list[str], dict[str, str]]:
    members = workers(n)
    place = round_robin if layout == "round_robin" else blocks
    return members, place(members, machines)


@pytest.mark.parametrize(("n", "machines", "size", "layout"), LAYOUTS)
def test_each_worker_gets_min_of_size_and_others_distinct_helpers_never_itself(
    n: int, machines: int, size: int, layout: str
) -> None:
    members, machine_of = layout_of(n, machines, layout)
    groups = helper_groups(members, machine_of, size)
    assert set(groups) == set(members)
    for w, helpers in groups.items():
        assert len(helpers) == min(size, n - 1)
        assert len(set(helpers)) == len(helpers)
        assert w not in helpers
        assert set(helpers) <= set(members)


@pytest.mark.parametrize(("n", "machines", "size", "layout"), LAYOUTS)
def test_one_helper_on_own_machine_when_it_has_another_worker(
    n: int, machines: int, size: int, layout: str
) -> None:
    members, machine_of = layout_of(n, machines, layout)
    groups = helper_groups(members, machine_of, size)
    for w, helpers in groups.items():
        home = machine_of[w]
        neighbours = [x for x in members if x != w and machine_of[x] == home]
        local = [h for h in helpers if machine_of[h] == home]
        if neighbours:
            assert local, f"{w} has no helper on {home}"
            assert helpers[0] in neighbours  # the local helper comes first
        else:
            assert not local
        other_machines = {machine_of[x] for x in members} - {home}
        if neighbours and len(other_machines) >= size - 1:
            # enough machines: exactly one local helper, the others each on another machine
            assert len(local) == 1
            remote = [machine_of[h] for h in helpers if machine_of[h] != home]
            assert len(set(remote)) == len(remote) == min(size, n - 1) - 1


def test_64_workers_round_robin_on_8_machines_get_one_local_and_three_remote_helpers() -> None:
    members = workers(64)
    machine_of = round_robin(members, 8)
    groups = helper_groups(members, machine_of, 4)
    for w, helpers in groups.items():
        machines = [machine_of[h] for h in helpers]
        assert len(helpers) == 4
        assert machines[0] == machine_of[w]
        assert machine_of[w] not in machines[1:]
        assert len(set(machines)) == 4  # four different machines
    assert groups["w00"] == ("w08", "w01", "w02", "w03")
    # helpee groups are balanced too: every worker may help exactly four others
    assert {len(v) for v in helpee_groups(groups).values()} == {4}


def test_helper_groups_are_deterministic_whatever_the_member_order() -> None:
    members = workers(24)
    machine_of = blocks(members, 3)
    expected = helper_groups(members, machine_of, 4)
    rng = random.Random(7)
    for _ in range(20):
        shuffled = members[:]
        rng.shuffle(shuffled)
        mapping = dict(reversed(list(machine_of.items())))  # mapping order does not matter
        assert helper_groups(shuffled, mapping, 4) == expected
        assert helper_groups(tuple(shuffled), mapping, 4) == expected


@pytest.mark.parametrize(("n", "machines", "size", "layout"), LAYOUTS)
def test_helpee_groups_are_the_exact_inverse_of_helper_groups(
    n: int, machines: int, size: int, layout: str
) -> None:
    members, machine_of = layout_of(n, machines, layout)
    helpers = helper_groups(members, machine_of, size)
    helpees = helpee_groups(helpers)
    assert set(helpees) == set(members)
    pairs = {(helpee, helper) for helpee, group in helpers.items() for helper in group}
    inverse = {(helpee, helper) for helper, group in helpees.items() for helpee in group}
    assert pairs == inverse
    for group in helpees.values():
        assert list(group) == sorted(set(group))


def test_helpee_groups_of_a_hand_made_relation() -> None:
    assert helpee_groups({"a": ("b", "c"), "b": ("c",), "c": ()}) == {
        "a": (),
        "b": ("a",),
        "c": ("a", "b"),
    }
    # a helper that is not itself a key still gets its helpees
    assert helpee_groups({"a": ("z",)}) == {"a": (), "z": ("a",)}


def test_single_machine_of_eight_workers_gives_four_distinct_local_helpers_each() -> None:
    members = workers(8)
    groups = helper_groups(members, dict.fromkeys(members, "m0"), 4)
    for w, helpers in groups.items():
        assert len(set(helpers)) == 4 and w not in helpers
    assert groups["w00"] == ("w01", "w02", "w03", "w04")
    assert {len(v) for v in helpee_groups(groups).values()} == {4}


def test_lone_worker_gets_no_helpers() -> None:
    assert helper_groups(["w0"], {"w0": "m0"}, 4) == {"w0": ()}
    assert helper_groups(["w0"], {}, 4) == {"w0": ()}
    assert helpee_groups({"w0": ()}) == {"w0": ()}


def test_no_members_no_groups() -> None:
    assert helper_groups([], {}, 4) == {}


def test_workers_missing_from_machine_of_are_treated_as_alone() -> None:
    members = ["a", "b", "c"]
    machine_of = {"a": "m0", "b": "m0"}  # c's machine is unknown
    groups = helper_groups(members, machine_of, 1)
    assert groups["a"] == ("b",) and groups["b"] == ("a",)  # local helpers: never c
    assert groups["c"] in {("a",), ("b",)}  # c has no machine-mate
    groups2 = helper_groups(members, machine_of, 2)
    assert groups2["a"][0] == "b" and groups2["b"][0] == "a"
    assert sorted(groups2["c"]) == ["a", "b"]


def test_two_machines_of_four_give_one_local_and_three_remote_helpers() -> None:
    members = workers(8)
    machine_of = round_robin(members, 2)
    groups = helper_groups(members, machine_of, 4)
    for w, helpers in groups.items():
        local = [h for h in helpers if machine_of[h] == machine_of[w]]
        assert len(local) == 1, (w, helpers)
