"""Elasticity decisions: which stage to run, which node plays which role, who owns what.

Everything here except `Membership` is pure: functions of the node set (and the previous
partition table), with no clock and no I/O, so the simulator and the live controller call the
same code. `Membership` records a lifecycle per node; the caller passes the time (`now_s`).

Stages (seed 002, §4.2), by the transient:reliable node ratio:

1. ratio <= `stage2_above` (default 1:1): ParamServs on the reliable nodes only;
2. ratio > `stage2_above`: ActivePSs on half of the transient nodes (longest-running first),
   BackupPSs on the reliable nodes;
3. ratio > `stage3_above` (default 15:1): as 2, with no workers on the reliable nodes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import NoReturn

from orchestrator.agileml.errors import (
    ElasticityError,
    IllegalNodeTransitionError,
    NoReliableNodeError,
    PartitionError,
)
from orchestrator.agileml.partitions import PartitionTable
from orchestrator.agileml.spec import StageThresholds as StageThresholds  # re-exported


class NodeTier(StrEnum):
    """How a node is billed, and so whether it may disappear."""

    RELIABLE = "reliable"  # on-demand: never evicted; holds the BackupPSs
    TRANSIENT = "transient"  # spot: may be evicted with a short warning, or fail


@dataclass(frozen=True)
class Node:
    """A node of the job. `joined_at_s` orders nodes by age (smaller: running longer)."""

    node_id: str
    tier: NodeTier
    joined_at_s: float


class AgileMLStage(IntEnum):
    """The AgileML stage (see the module docstring)."""

    PARAMSERV_ONLY = 1
    ACTIVE_BACKUP = 2
    ACTIVE_BACKUP_NO_RELIABLE_WORKERS = 3


def _count(nodes: Sequence[Node]) -> tuple[int, int]:
    ids = [n.node_id for n in nodes]
    if len(set(ids)) != len(ids):
        raise ElasticityError(f"duplicate node ids in {sorted(ids)}")
    reliable = sum(1 for n in nodes if n.tier is NodeTier.RELIABLE)
    if reliable == 0:
        raise NoReliableNodeError(
            "AgileML needs at least one reliable node (BackupPSs and ParamServs live there). "
            "To fix: add an on-demand node to the job."
        )
    return reliable, len(nodes) - reliable


def choose_stage(nodes: Sequence[Node], thresholds: StageThresholds | None = None) -> AgileMLStage:
    """The stage for this node set, from the transient:reliable ratio.

    Raises:
        ElasticityError: no reliable node, or duplicate node ids.
    """
    th = thresholds or StageThresholds()
    reliable, transient = _count(nodes)
    ratio = transient / reliable
    if ratio > th.stage3_above:
        return AgileMLStage.ACTIVE_BACKUP_NO_RELIABLE_WORKERS
    if ratio > th.stage2_above:
        return AgileMLStage.ACTIVE_BACKUP
    return AgileMLStage.PARAMSERV_ONLY


@dataclass(frozen=True)
class RolePlan:
    """Who runs what. Every tuple is sorted by node id.

    `param_servs` is non-empty only in stage 1, `active_ps` and `backup_ps` only in stages 2-3.
    `serving` is the set of nodes that own partitions (the ParamServs or the ActivePSs).
    """

    stage: AgileMLStage
    param_servs: tuple[str, ...]
    active_ps: tuple[str, ...]
    backup_ps: tuple[str, ...]
    workers: tuple[str, ...]

    @property
    def serving(self) -> tuple[str, ...]:
        return self.param_servs if self.stage is AgileMLStage.PARAMSERV_ONLY else self.active_ps


def plan_roles(nodes: Sequence[Node], thresholds: StageThresholds | None = None) -> RolePlan:
    """The roles of each node for the stage `choose_stage` picks.

    ActivePSs run on ceil(half) of the transient nodes, the longest-running first (smallest
    `joined_at_s`, ties by node id), since a node that has survived long is likelier to stay.

    Raises:
        ElasticityError: no reliable node, or duplicate node ids.
    """
    stage = choose_stage(nodes, thresholds)
    reliable = tuple(sorted(n.node_id for n in nodes if n.tier is NodeTier.RELIABLE))
    transient_nodes = [n for n in nodes if n.tier is NodeTier.TRANSIENT]
    transient = tuple(sorted(n.node_id for n in transient_nodes))
    if stage is AgileMLStage.PARAMSERV_ONLY:
        return RolePlan(stage, reliable, (), (), tuple(sorted(reliable + transient)))
    oldest = sorted(transient_nodes, key=lambda n: (n.joined_at_s, n.node_id))
    active = tuple(sorted(n.node_id for n in oldest[: math.ceil(len(oldest) / 2)]))
    workers = (
        transient
        if stage is AgileMLStage.ACTIVE_BACKUP_NO_RELIABLE_WORKERS
        else tuple(sorted(reliable + transient))
    )
    return RolePlan(stage, (), active, reliable, workers)


def assign_partitions(
    n_partitions: int, servers: Iterable[str], previous: PartitionTable | None = None
) -> dict[int, str]:
    """An owner for each partition: even (counts differ by at most 1) with minimal moves.

    A partition stays with its previous owner when that owner is still serving and not over its
    quota. The servers that already hold the most partitions get the `n % k` larger quotas
    (ties: smaller id), which maximises what stays. Freed partitions go, lowest id first, to the
    servers short of their quota, in id order. Deterministic for equal inputs.

    Raises:
        PartitionError: n_partitions < 1, no servers, or a `previous` table of another size.
    """
    ids = sorted(set(servers))
    if n_partitions < 1:
        raise PartitionError(f"n_partitions must be >= 1, got {n_partitions}")
    if not ids:
        raise PartitionError("cannot assign partitions to no servers")
    if previous is not None and previous.num_partitions != n_partitions:
        raise PartitionError(
            f"previous table has {previous.num_partitions} partitions, want {n_partitions}"
        )
    held: dict[str, list[int]] = {s: [] for s in ids}
    if previous is not None:
        for p in range(n_partitions):
            owner = previous.get(p).owner
            if owner in held:
                held[owner].append(p)
    base, extra = divmod(n_partitions, len(ids))
    by_holding = sorted(ids, key=lambda s: (-len(held[s]), s))
    quota = {s: base + (1 if i < extra else 0) for i, s in enumerate(by_holding)}
    out: dict[int, str] = {}
    for s in ids:
        for p in held[s][: quota[s]]:
            out[p] = s
    pool = iter(p for p in range(n_partitions) if p not in out)
    for s in ids:
        for _ in range(quota[s] - len(held[s][: quota[s]])):
            out[next(pool)] = s
    return dict(sorted(out.items()))


def partition_moves(previous: PartitionTable, new: Mapping[int, str]) -> dict[int, str]:
    """The partitions whose owner changes from `previous` to `new`, with their new owner."""
    return {p: s for p, s in new.items() if previous.get(p).owner != s}


class NodeState(StrEnum):
    """The lifecycle of a node in the job.

    joining -> ready -> active -> (leaving | failed) -> gone. A joining or ready node may also
    leave or fail; a leaving node may fail before its hand-off completes.
    """

    JOINING = "joining"
    READY = "ready"
    ACTIVE = "active"
    LEAVING = "leaving"
    FAILED = "failed"
    GONE = "gone"


ALLOWED: Mapping[NodeState, frozenset[NodeState]] = {
    NodeState.JOINING: frozenset(
        {
            NodeState.READY,  # data assignment loaded; the node signalled ready
            NodeState.LEAVING,  # eviction notice before it ever became ready
            NodeState.FAILED,  # heartbeats lost while loading
        }
    ),
    NodeState.READY: frozenset(
        {
            NodeState.ACTIVE,  # workers switched over to it (scale-up completes)
            NodeState.LEAVING,  # eviction notice while waiting for the switch-over
            NodeState.FAILED,  # heartbeats lost before the switch-over
        }
    ),
    NodeState.ACTIVE: frozenset(
        {
            NodeState.LEAVING,  # eviction notice: hand partitions off / end-of-life push
            NodeState.FAILED,  # heartbeats lost without warning: roll back to BackupPSs
        }
    ),
    NodeState.LEAVING: frozenset(
        {
            NodeState.GONE,  # its partitions and data are with the survivors
            NodeState.FAILED,  # died before its hand-off completed
        }
    ),
    NodeState.FAILED: frozenset(
        {
            NodeState.GONE,  # rollback done; the lost iterations are being redone
        }
    ),
    NodeState.GONE: frozenset(),  # terminal; a returning machine joins under a new node id
}


@dataclass(frozen=True)
class TransitionRecord:
    """One attempted move; `accepted` is False for a refused (illegal) one."""

    node_id: str
    from_state: NodeState | None
    to_state: NodeState
    at_s: float
    accepted: bool


@dataclass
class Membership:
    """The lifecycle state of every node, with a history of accepted and refused moves.

    Not thread-safe. Times are passed in (`now_s`), never read from a clock.
    """

    _states: dict[str, NodeState] = field(default_factory=dict)
    history: list[TransitionRecord] = field(default_factory=list)

    def join(self, node_id: str, now_s: float) -> None:
        """Add a node in `joining`.

        Raises:
            IllegalNodeTransitionError: the node id is already known (even if gone); unchanged.
        """
        current = self._states.get(node_id)
        if current is not None:
            self._refuse(node_id, current, NodeState.JOINING, now_s)
        self._states[node_id] = NodeState.JOINING
        self.history.append(TransitionRecord(node_id, None, NodeState.JOINING, now_s, True))

    def transition(self, node_id: str, to: NodeState, now_s: float) -> None:
        """Move a node to `to` if `ALLOWED` permits it.

        Raises:
            IllegalNodeTransitionError: unknown node or an edge not in `ALLOWED`; the refusal is
                recorded in `history` and the state is unchanged.
        """
        current = self._states.get(node_id)
        if current is None or to not in ALLOWED[current]:
            self._refuse(node_id, current, to, now_s)
        self._states[node_id] = to
        self.history.append(TransitionRecord(node_id, current, to, now_s, True))

    def state(self, node_id: str) -> NodeState | None:
        """The node's state, or None if it never joined."""
        return self._states.get(node_id)

    def in_state(self, *states: NodeState) -> tuple[str, ...]:
        """The ids of the nodes in any of `states`, sorted."""
        return tuple(sorted(n for n, s in self._states.items() if s in states))

    def _refuse(
        self, node_id: str, current: NodeState | None, to: NodeState, now_s: float
    ) -> NoReturn:
        self.history.append(TransitionRecord(node_id, current, to, now_s, False))
        raise IllegalNodeTransitionError(node_id, current, to)
