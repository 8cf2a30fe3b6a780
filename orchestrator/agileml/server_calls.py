"""What the elasticity controller asks the nodes' parameter servers to do: the steps of
`Coordinator` that only talk to servers, as functions of what they need (a `call` to a node's
control ops, the partition table, the view). The coordinator decides; these carry it out.

* `configure_all`: every live node gets the roster, backups, epoch and horizon.
* `rebalance`: partitions move to the plan's serving nodes by hand-off, fewest moves first;
  `settle` ends the hand-offs left without an ack once their receivers are fenced off.
* `roll_back`: partitions of a failed owner are lost; every partition is restored from its
  BackupPS to its (new) owner under a new epoch, at its last consistent clock.
* `unfinished_clocks`: a failed worker-only node; which of its clocks survivors must redo.
* `pull_partitions`: every partition's values from its owner (the trained model).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import zmq

from orchestrator.agileml import checkpoints, chunks, wire
from orchestrator.agileml.control import TrainingSpec, View
from orchestrator.agileml.elasticity import RolePlan, assign_partitions
from orchestrator.agileml.errors import AgileMLError, PartitionsLostError
from orchestrator.agileml.partitions import PartitionTable
from orchestrator.agileml.wire import MessageKind

log = logging.getLogger("orchestrator.agileml.coordinator")

#: Where a checkpoint's partitions come from: the BackupPSs' copies, or the owners' own.
CheckpointSource = Literal["backup", "owned"]

#: A control op on a node: (node id, body) -> the node's answer. Raises AgileMLError.
NodeCall = Callable[[str, dict[str, Any]], dict[str, Any]]


def start_nodes(
    call: NodeCall,
    nodes: list[str],
    *,
    table: PartitionTable,
    backups: Mapping[int, str],
    endpoints: Mapping[str, str],
    common: Mapping[str, Any],
) -> None:
    """Configure the job's first nodes for epoch 1: each gets the partitions `table` gives it
    (with their versions), the backups it keeps, and the `common` settings (roster, horizon,
    slack).

    Raises:
        AgileMLError: a node refused or did not answer.
    """
    for node in nodes:
        mine = {
            p: table.get(p).version for p in range(table.num_partitions) if table.owner(p) == node
        }
        backed = [p for p, b in backups.items() if b == endpoints[node]]
        body = {
            "op": "configure", "epoch": 1, "backups": dict(backups), "init_own": mine,
            "init_backup": backed, **common,
        }  # fmt: skip
        call(node, body)


def configure_all(call: NodeCall, nodes: list[str], body: dict[str, Any]) -> bool:
    """Send the `configure` op `body` to every node; False if one refused the roster as too
    late (a worker already passed its first clock). A node that does not answer is left to
    the failure detector (logged)."""
    ok = True
    for node in nodes:
        try:
            call(node, body)
        except AgileMLError as exc:
            if "RosterError" in str(exc):
                ok = False
            else:
                log.warning("configure failed", extra={"node": node, "error": str(exc)})
    return ok


#: How often a hand-off with no ack is sent again to a receiver that still heartbeats.
HANDOFF_ROUNDS = 3


@dataclass(frozen=True)
class Rebalanced:
    """What `rebalance` did: whether any partition moved, and the hand-offs left unsettled
    (old owner -> partition -> receiver node): no ack came, the receiver stopped
    heartbeating or never answered; the old owner keeps the partition frozen until the
    receiver is fenced off and it is told to `resume` it."""

    moved: bool
    unsettled: dict[str, dict[int, str]]


def rebalance(
    call: NodeCall,
    *,
    plan: RolePlan,
    table: PartitionTable,
    endpoints: Mapping[str, str],
    alive: Callable[[str], bool],
) -> Rebalanced:
    """Hand partitions to the plan's serving nodes with as few moves as possible; `table`
    records the new owners and versions. A hand-off without an ack is sent again (the
    receiver takes a partition once) while the receiver is `alive`, up to HANDOFF_ROUNDS
    times; one a receiver refused stays with its owner.

    An old owner that does not answer the `handoff` op is skipped (logged): the failure
    detector takes it out if it is gone, and its partitions are then restored from backups.
    """
    owners = assign_partitions(table.num_partitions, plan.serving, table)
    moves: dict[str, dict[int, str]] = {}
    for p, new in owners.items():
        old = table.owner(p)
        if old != new:
            moves.setdefault(old, {})[p] = new
    unsettled: dict[str, dict[int, str]] = {}
    for old, targets in moves.items():
        left = _hand_off(call, old, targets, owners=owners, table=table, endpoints=endpoints,
                         alive=alive)  # fmt: skip
        if left:
            unsettled[old] = left
    moved = any(table.owner(p) == owners[p] for targets in moves.values() for p in targets)
    return Rebalanced(moved, unsettled)


def _hand_off(
    call: NodeCall,
    old: str,
    targets: dict[int, str],
    *,
    owners: Mapping[int, str],
    table: PartitionTable,
    endpoints: Mapping[str, str],
    alive: Callable[[str], bool],
) -> dict[int, str]:
    """`old`'s moves (partition -> receiver node), in up to HANDOFF_ROUNDS `handoff` ops;
    returns those left unsettled (see `Rebalanced`)."""
    pending, unsettled = dict(targets), dict[int, str]()
    for _ in range(HANDOFF_ROUNDS):
        body = {"op": "handoff", "moves": {p: endpoints[n] for p, n in pending.items()}}
        try:
            out = call(old, body)
        except AgileMLError as exc:
            log.error("handoff op failed", extra={"node": old, "error": str(exc)})
            return unsettled
        for p, version in out["versions"].items():
            table.set(int(p), owners[int(p)], version)
        for p, why in out.get("refused", {}).items():
            log.warning("hand-off refused", extra={"node": old, "partition": p, "error": why})
        unknown = {int(p): pending[int(p)] for p in out.get("unknown", {})}
        pending = {p: n for p, n in unknown.items() if alive(n)}
        unsettled.update({p: n for p, n in unknown.items() if p not in pending})
        if not pending:
            return unsettled
    return {**unsettled, **pending}


def settle(call: NodeCall, unsettled: Mapping[str, Mapping[int, str]]) -> None:
    """Old owners serve their unsettled partitions again (`Rebalanced.unsettled`): call
    this once their receivers are fenced off (failed), so that no request reaches a copy a
    receiver may have taken. An old owner that does not answer is logged and skipped (the
    failure detector takes it out)."""
    for old, parts in unsettled.items():
        try:
            call(old, {"op": "resume", "partitions": sorted(parts)})
        except AgileMLError as exc:
            log.error("resume op failed", extra={"node": old, "error": str(exc)})


def roll_back(
    call: NodeCall,
    *,
    view: View,
    failed: list[str],
    plan: RolePlan,
    table: PartitionTable,
    endpoints: Mapping[str, str],
    epoch: int | None = None,
) -> tuple[int, int, int]:
    """Restore the partitions from their BackupPSs under a new epoch (`epoch`, by default the
    view's next); `table` records the new owners and versions.

    A lost partition (its owner failed) is restored on a node of the plan's serving ones;
    every other one a BackupPS holds is restored in place, on the owner that survived, so
    that every partition restarts from one clock (`rebalance` moves them afterwards if the
    plan says so: a copy restored elsewhere would stay behind on the survivor, whose later
    pushes in it would make it refuse every roster change after). A partition no BackupPS
    holds whose owner survived (a reliable node serving it with no BackupPS, as in stage 1 or
    before its hand-off to a new ActivePS) is left as it is: nothing of it was lost, and the
    clocks the workers redo are duplicates there.

    Returns (epoch, restart clock, end). Normally every partition is restored at one common
    clock, `restart - 1` (`end == restart`): the BackupPSs hold clocks back for that (see
    `advance_backups`), so the model workers redo from is exactly the one they computed it on.
    Should a BackupPS have applied past the common clock (a backup taken over late), each
    partition is restored as far as its backup applied, in [restart - 1, end - 1], and the
    failed workers' shares of clocks [restart, end) are computed by survivors (the pushes
    already in a partition are deduplicated: exactly once, though not bit for bit the run
    without the failure).

    Raises:
        PartitionsLostError: no BackupPS holds a partition a failed node owned (stage 1).
        AgileMLError: a node did not answer, or a restore failed.
    """
    if not view.backups:
        raise PartitionsLostError(f"partitions of {failed} lost: no BackupPS (stage 1)")
    epoch = view.epoch + 1 if epoch is None else epoch
    lost = [p for p in range(table.num_partitions) if table.owner(p) in failed]
    node_at = {e: n for n, e in endpoints.items()}
    backup_nodes = sorted({node_at[b] for b in view.backups.values()} - set(failed))
    progress = _backup_progress(call, backup_nodes)
    source = {
        p: node_at[b]
        for p, b in view.backups.items()
        if p in progress.get(node_at[b], {})  # a BackupPS that failed too holds nothing
    }
    missing = [p for p in lost if p not in source]
    if missing:
        raise PartitionsLostError(f"partitions {missing} of {failed} lost: no BackupPS holds them")
    previous = PartitionTable(table.num_partitions)
    for p in range(table.num_partitions):
        if p not in lost:
            previous.move(p, table.owner(p))
    placed = assign_partitions(table.num_partitions, plan.serving, previous)
    owners = {p: placed[p] if p in lost else table.owner(p) for p in source}
    by_backup: dict[str, dict[int, str]] = {}
    for p, node in source.items():
        by_backup.setdefault(node, {})[p] = endpoints[owners[p]]
    cut = _cut({n: {p: v for p, v in progress[n].items() if p in by_backup[n]} for n in by_backup})
    consistent: dict[int, int] = {}
    for node, targets in sorted(by_backup.items()):
        versions = {p: table.get(p).version for p in targets}
        body = {
            "op": "restore", "epoch": epoch, "owners": targets, "versions": versions,
            "clock": cut,
        }  # fmt: skip
        out = call(node, body)
        for p, (clock, version) in out["restored"].items():
            consistent[int(p)] = clock
            table.set(int(p), owners[int(p)], version)
    return epoch, min(consistent.values()) + 1, max(consistent.values()) + 1


def _backup_progress(call: NodeCall, backups: list[str]) -> dict[str, dict[int, tuple[int, int]]]:
    """Each BackupPS node's partitions: (applied through, complete through)."""
    out: dict[str, dict[int, tuple[int, int]]] = {}
    for node in backups:
        progress = call(node, {"op": "backup_progress"})["backups"]
        out[node] = {int(p): (int(done), int(through)) for p, (done, through) in progress.items()}
    return out


def _common_clock(call: NodeCall, backups: list[str]) -> int | None:
    """The latest clock every backed-up partition can be restored at (None: there is none,
    a backup applied past another's last complete clock)."""
    return _cut(_backup_progress(call, backups))


def _cut(progress: Mapping[str, Mapping[int, tuple[int, int]]]) -> int | None:
    """The latest clock all these backed-up partitions can be restored at (see
    `_common_clock`)."""
    applied = [done for parts in progress.values() for done, _ in parts.values()]
    complete = [through for parts in progress.values() for _, through in parts.values()]
    if not complete:
        return None
    cut = min(complete)
    if max(applied) > cut:
        log.warning("no common clock to roll back to", extra={"applied": max(applied), "cut": cut})
        return None
    return cut


def advance_backups(call: NodeCall, backups: list[str], ceiling: int) -> int:
    """Let the BackupPSs on `backups` apply every clock that all of them hold complete; returns
    the new ceiling (`ceiling` if some node did not answer). Until then they hold clocks back,
    which is what lets `roll_back` restore every partition at one common clock."""
    complete: list[int] = []
    try:
        for node in backups:
            progress = call(node, {"op": "backup_progress"})["backups"]
            complete.extend(through for _, through in progress.values())
    except AgileMLError as exc:
        log.warning("backup progress unknown", extra={"error": str(exc)})
        return ceiling
    if not complete or min(complete) <= ceiling:
        return ceiling
    new = min(complete)
    for node in backups:
        try:
            call(node, {"op": "configure", "backup_ceiling": new})
        except AgileMLError as exc:
            log.warning("backup ceiling not set", extra={"node": node, "error": str(exc)})
    return new


def take_checkpoint(
    call: NodeCall,
    nodes: list[str],
    *,
    root: str,
    clock: int,
    job_id: str,
    num_partitions: int,
    source: CheckpointSource = "backup",
    spare: str | None = None,
) -> checkpoints.Folder:
    """Have `nodes` write every partition they back up (`source="backup"`) or own ("owned")
    at `clock` under `root`, then complete the checkpoint and prune old ones (but `spare`, the
    one the job resumed from); returns its directory.

    Raises:
        AgileMLError: a node could not write its partitions, or some are missing.
    """
    directory = checkpoints.checkpoint_dir(root, clock)
    for node in nodes:
        call(
            node, {"op": "checkpoint", "clock": clock, "dir": directory.location, "source": source}
        )
    checkpoints.complete(directory, job_id=job_id, clock=clock, num_partitions=num_partitions)
    checkpoints.prune(root, spare=spare)
    return directory


def owners_at(call: NodeCall, owners: list[str], clock: int) -> bool:
    """Whether every partition the `owners` hold has reached `clock` exactly.

    Raises:
        AgileMLError: an owner did not answer.
    """
    for node in owners:
        clocks = call(node, {"op": "consistent"})["clocks"].values()
        if any(c != clock for c in clocks):
            return False
    return True


def unfinished_clocks(call: NodeCall, worker: str, table: PartitionTable) -> tuple[int, int]:
    """The clocks [first, end) whose shares of a dead worker survivors must compute: from the
    first it may not have pushed everywhere, to past the last anyone has pushed (the roster may
    change only after that).

    Raises:
        AgileMLError: an owner did not answer.
    """
    frontier, latest = [], []
    for owner in sorted({table.owner(p) for p in range(table.num_partitions)}):
        out = call(owner, {"op": "progress", "worker": worker})
        for mine, last, anyone in out["progress"].values():
            frontier.append(mine)
            latest.append(max(last, anyone))
    first = min(frontier) + 1
    return first, max(first, max(latest) + 1)


def pull_partitions(
    ctx: zmq.Context[Any],
    *,
    spec: TrainingSpec,
    view: View,
    owner_of: Callable[[int], str],
    token: bytes,
    sender: str,
    timeout_s: float,
    final: bool,
) -> list[torch.Tensor]:
    """Every partition's values, pulled from its owner: once every clock of the job is in them
    (`final`), or as they are now.

    Raises:
        AgileMLError: a partition could not be pulled within `timeout_s`.
    """
    out = []
    for p in range(spec.num_partitions):
        owner = owner_of(p)
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(view.endpoints[owner])
            header = {
                "kind": MessageKind.PULL,
                "job_id": spec.job_id,
                "sender": sender,
                "seq": p,
                "partition": p,
                "clock": spec.iterations - 1 if final else -1,
                "epoch": view.epoch,
            }
            sock.send_multipart(wire.encode(header, {}, token))
            got = chunks.await_reply(sock, p, token, timeout_s)
            if got is None:
                raise AgileMLError(f"partition {p}: no answer from {owner}")
            reply, tensors = got
            if reply.kind is not MessageKind.PULL_REPLY:
                raise AgileMLError(f"partition {p}: {owner} answered {reply.detail}")
            out.append(tensors["values"])
        finally:
            sock.close(linger=0)
    return out
