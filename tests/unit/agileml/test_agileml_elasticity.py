"""Elasticity decisions: stage choice, role plans, partition assignment, node lifecycle."""

from __future__ import annotations

import itertools

import pytest
from pydantic import ValidationError

from orchestrator.agileml.elasticity import (
    ALLOWED,
    AgileMLStage,
    Membership,
    Node,
    NodeState,
    NodeTier,
    StageThresholds,
    assign_partitions,
    choose_stage,
    partition_moves,
    plan_roles,
)
from orchestrator.agileml.errors import ElasticityError, IllegalNodeTransitionError, PartitionError
from orchestrator.agileml.partitions import PartitionTable


def _nodes(reliable: int, transient: int) -> list[Node]:
    out = [Node(f"r{i}", NodeTier.RELIABLE, 0.0) for i in range(reliable)]
    out += [Node(f"t{i:02d}", NodeTier.TRANSIENT, float(i)) for i in range(transient)]
    return out


@pytest.mark.parametrize(
    ("reliable", "transient", "stage"),
    [
        (1, 0, AgileMLStage.PARAMSERV_ONLY),
        (1, 1, AgileMLStage.PARAMSERV_ONLY),  # 1:1 is not above the stage-2 threshold
        (2, 2, AgileMLStage.PARAMSERV_ONLY),
        (1, 2, AgileMLStage.ACTIVE_BACKUP),  # 2:1
        (1, 15, AgileMLStage.ACTIVE_BACKUP),  # 15:1 is not above the stage-3 threshold
        (2, 30, AgileMLStage.ACTIVE_BACKUP),
        (1, 16, AgileMLStage.ACTIVE_BACKUP_NO_RELIABLE_WORKERS),  # 16:1
    ],
)
def test_stage_is_chosen_by_the_transient_to_reliable_ratio(
    reliable: int, transient: int, stage: AgileMLStage
) -> None:
    assert choose_stage(_nodes(reliable, transient)) is stage


def test_custom_thresholds_move_the_stage_boundaries() -> None:
    th = StageThresholds(stage2_above=3.0, stage3_above=5.0)
    assert choose_stage(_nodes(1, 3), th) is AgileMLStage.PARAMSERV_ONLY
    assert choose_stage(_nodes(1, 4), th) is AgileMLStage.ACTIVE_BACKUP
    assert choose_stage(_nodes(1, 6), th) is AgileMLStage.ACTIVE_BACKUP_NO_RELIABLE_WORKERS


@pytest.mark.parametrize(("s2", "s3"), [(0.0, 5.0), (5.0, 5.0), (6.0, 5.0), (-1.0, 2.0)])
def test_thresholds_must_be_positive_and_ordered(s2: float, s3: float) -> None:
    with pytest.raises(ValidationError):
        StageThresholds(stage2_above=s2, stage3_above=s3)


def test_no_reliable_node_is_an_error_that_says_what_to_do() -> None:
    with pytest.raises(ElasticityError, match="at least one reliable node.*To fix"):
        choose_stage(_nodes(0, 4))
    with pytest.raises(ElasticityError):
        plan_roles([])


def test_duplicate_node_ids_are_refused() -> None:
    with pytest.raises(ElasticityError, match="duplicate"):
        choose_stage([Node("a", NodeTier.RELIABLE, 0), Node("a", NodeTier.TRANSIENT, 1)])


def test_stage1_plan_puts_paramservs_on_reliable_nodes_and_workers_everywhere() -> None:
    plan = plan_roles(_nodes(2, 1))
    assert plan.stage is AgileMLStage.PARAMSERV_ONLY
    assert plan.param_servs == ("r0", "r1") == plan.serving
    assert (plan.active_ps, plan.backup_ps) == ((), ())
    assert plan.workers == ("r0", "r1", "t00")


def test_stage2_activeps_run_on_the_longest_running_half_of_transient_nodes() -> None:
    nodes = [
        Node("r0", NodeTier.RELIABLE, 0.0),
        Node("young", NodeTier.TRANSIENT, 50.0),
        Node("old", NodeTier.TRANSIENT, 10.0),
        Node("mid-b", NodeTier.TRANSIENT, 20.0),
        Node("mid-a", NodeTier.TRANSIENT, 20.0),  # same age as mid-b: the id breaks the tie
        Node("newest", NodeTier.TRANSIENT, 60.0),
    ]
    plan = plan_roles(nodes)
    assert plan.stage is AgileMLStage.ACTIVE_BACKUP
    assert plan.active_ps == ("mid-a", "mid-b", "old") == plan.serving  # ceil(5 / 2) = 3
    assert plan.backup_ps == ("r0",)
    assert plan.param_servs == ()
    assert plan.workers == ("mid-a", "mid-b", "newest", "old", "r0", "young")


def test_stage3_plan_has_no_workers_on_reliable_nodes() -> None:
    plan = plan_roles(_nodes(1, 17))
    assert plan.stage is AgileMLStage.ACTIVE_BACKUP_NO_RELIABLE_WORKERS
    assert plan.active_ps == tuple(f"t{i:02d}" for i in range(9))  # the 9 oldest of 17
    assert plan.backup_ps == ("r0",)
    assert plan.workers == tuple(f"t{i:02d}" for i in range(17))


def _table(assignment: dict[int, str]) -> PartitionTable:
    table = PartitionTable(len(assignment))
    for p, owner in assignment.items():
        table.move(p, owner)
    return table


def _counts(assignment: dict[int, str]) -> list[int]:
    owners = list(assignment.values())
    return [owners.count(s) for s in set(owners)]


@pytest.mark.parametrize(("n", "k"), [(1, 1), (7, 3), (8, 4), (10, 4), (3, 5)])
def test_fresh_assignment_is_even_and_deterministic(n: int, k: int) -> None:
    servers = [f"s{i}" for i in range(k)]
    first = assign_partitions(n, servers)
    assert sorted(first) == list(range(n))
    assert max(_counts(first)) - min(_counts(first)) <= 1
    assert first == assign_partitions(n, list(reversed(servers)))


def test_server_leaving_moves_only_its_partitions() -> None:
    before = assign_partitions(10, ["a", "b", "c", "d"])
    table = _table(before)
    after = assign_partitions(10, ["a", "b", "d"], table)
    moved = partition_moves(table, after)
    assert set(moved) == {p for p, s in before.items() if s == "c"}
    assert max(_counts(after)) - min(_counts(after)) <= 1
    assert "c" not in after.values()


def test_server_joining_takes_only_its_fair_share() -> None:
    before = assign_partitions(12, ["a", "b", "c"])  # 4 each
    table = _table(before)
    after = assign_partitions(12, ["a", "b", "c", "d"], table)  # 3 each
    moved = partition_moves(table, after)
    assert set(moved.values()) == {"d"} and len(moved) == 3
    assert _counts(after) == [3, 3, 3, 3]


def test_uneven_previous_keeps_the_most_partitions_in_place() -> None:
    table = _table({0: "a", 1: "a", 2: "a", 3: "a", 4: "b"})
    after = assign_partitions(5, ["a", "b"], table)
    assert len(partition_moves(table, after)) == 1  # a keeps 3 (the larger quota), b gets 1
    assert after == {0: "a", 1: "a", 2: "a", 3: "b", 4: "b"}


def test_assignment_refuses_impossible_requests() -> None:
    with pytest.raises(PartitionError):
        assign_partitions(4, [])
    with pytest.raises(PartitionError):
        assign_partitions(0, ["a"])
    with pytest.raises(PartitionError):
        assign_partitions(4, ["a"], PartitionTable(3))


LEGAL_EDGES = [(src, dst) for src, dsts in ALLOWED.items() for dst in sorted(dsts)]
ILLEGAL_EDGES = [
    (src, dst)
    for src, dst in itertools.product(NodeState, NodeState)
    if dst not in ALLOWED[src] and dst is not NodeState.JOINING
]
PATH_TO = {
    NodeState.JOINING: [],
    NodeState.READY: [NodeState.READY],
    NodeState.ACTIVE: [NodeState.READY, NodeState.ACTIVE],
    NodeState.LEAVING: [NodeState.LEAVING],
    NodeState.FAILED: [NodeState.FAILED],
    NodeState.GONE: [NodeState.FAILED, NodeState.GONE],
}


def _member_in(state: NodeState) -> Membership:
    m = Membership()
    m.join("n1", now_s=0.0)
    for i, step in enumerate(PATH_TO[state]):
        m.transition("n1", step, now_s=float(i + 1))
    assert m.state("n1") is state
    return m


@pytest.mark.parametrize(("src", "dst"), LEGAL_EDGES)
def test_every_allowed_membership_edge_is_accepted(src: NodeState, dst: NodeState) -> None:
    m = _member_in(src)
    m.transition("n1", dst, now_s=100.0)
    assert m.state("n1") is dst
    assert m.history[-1].accepted and m.history[-1].at_s == 100.0


@pytest.mark.parametrize(("src", "dst"), ILLEGAL_EDGES)
def test_illegal_membership_edge_is_refused_and_recorded(src: NodeState, dst: NodeState) -> None:
    m = _member_in(src)
    with pytest.raises(IllegalNodeTransitionError) as info:
        m.transition("n1", dst, now_s=100.0)
    assert (info.value.node_id, info.value.from_state, info.value.to_state) == ("n1", src, dst)
    assert m.state("n1") is src
    assert not m.history[-1].accepted


def test_scale_up_then_eviction_lifecycle() -> None:
    m = Membership()
    m.join("spot-1", now_s=0.0)
    m.join("spot-2", now_s=0.0)
    for to in (NodeState.READY, NodeState.ACTIVE, NodeState.LEAVING, NodeState.GONE):
        m.transition("spot-1", to, now_s=1.0)
    assert m.in_state(NodeState.GONE) == ("spot-1",)
    assert m.in_state(NodeState.JOINING) == ("spot-2",)
    with pytest.raises(IllegalNodeTransitionError):
        m.join("spot-1", now_s=2.0)  # a node id is never reused
    with pytest.raises(IllegalNodeTransitionError) as info:
        m.transition("ghost", NodeState.READY, now_s=2.0)
    assert info.value.from_state is None
