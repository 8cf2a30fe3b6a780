"""The elasticity controller's side of roll-backs and checkpoints, against fake nodes: the
BackupPSs' ceiling follows the clock all of them hold complete, a roll-back finds the common
clock (or says there is none), and a stage-1 checkpoint holds the horizon until every partition
is there, then writes, or gives up after its limit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from orchestrator.agileml import checkpoints
from orchestrator.agileml.checkpointing import HOLD_LIMIT_S, Checkpointer
from orchestrator.agileml.control import TrainingSpec
from orchestrator.agileml.errors import AgileMLError
from orchestrator.agileml.server_calls import _common_clock, advance_backups


class FakeNodes:
    """Answers the control ops the controller sends, from a table per node."""

    def __init__(self, progress: dict[str, dict[int, tuple[int, int]]]) -> None:
        self.progress = progress  # node -> partition -> (applied through, complete through)
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.down: set[str] = set()
        self.consistent: dict[str, dict[int, int]] = {}

    def __call__(self, node: str, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append((node, body))
        if node in self.down:
            raise AgileMLError(f"{node} did not answer")
        op = body["op"]
        if op == "backup_progress":
            return {"backups": {p: list(v) for p, v in self.progress[node].items()}}
        if op == "consistent":
            return {"clocks": self.consistent[node]}
        if op == "checkpoint":
            for p in self.consistent.get(node, {}):
                checkpoints.write_part(
                    body["dir"], p, clock=body["clock"], values=torch.zeros(2), rule_state=b""
                )
            return {}
        return {}


def test_the_backup_ceiling_is_the_clock_every_backup_holds_complete() -> None:
    nodes = FakeNodes({"r0": {0: (3, 9), 1: (3, 7)}, "r1": {2: (3, 8)}})
    assert advance_backups(nodes, ["r0", "r1"], 3) == 7
    sent = [(n, b["backup_ceiling"]) for n, b in nodes.calls if b["op"] == "configure"]
    assert sent == [("r0", 7), ("r1", 7)]
    nodes.calls.clear()
    assert advance_backups(nodes, ["r0", "r1"], 7) == 7  # nothing new: nothing sent
    assert all(b["op"] == "backup_progress" for _, b in nodes.calls)
    nodes.down.add("r1")
    assert advance_backups(nodes, ["r0", "r1"], 5) == 5  # unknown progress: kept


def test_a_roll_back_finds_the_common_clock_or_that_there_is_none() -> None:
    assert _common_clock(FakeNodes({"r0": {0: (3, 9), 1: (2, 6)}}), ["r0"]) == 6
    # a copy taken over late already applied past another's last complete clock
    assert _common_clock(FakeNodes({"r0": {0: (8, 9), 1: (2, 6)}}), ["r0"]) is None
    assert _common_clock(FakeNodes({"r0": {}}), ["r0"]) is None


def _spec(tmp_path: Path, **kw: Any) -> TrainingSpec:
    return TrainingSpec(
        job_id="j", iterations=1000, num_partitions=2, checkpoint_dir=str(tmp_path), **kw
    )


def test_a_stage_1_checkpoint_holds_the_horizon_until_every_partition_is_there(
    tmp_path: Path,
) -> None:
    taken: list[int] = []
    ckpt = Checkpointer(
        _spec(tmp_path, checkpoint_every=10),
        start_clock=0,
        now_s=0.0,
        record=lambda clock, _: taken.append(clock),
    )
    nodes = FakeNodes({})
    nodes.consistent = {"r0": {0: 11, 1: 12}}
    assert not ckpt.hold_horizon(nodes, horizon=5, owners=["r0"], now_s=1.0)  # not due yet
    assert ckpt.hold_horizon(nodes, horizon=12, owners=["r0"], now_s=1.0)  # due: held
    assert ckpt.hold_horizon(nodes, horizon=20, owners=["r0"], now_s=2.0)  # still at 12
    assert taken == []
    nodes.consistent = {"r0": {0: 12, 1: 12}}
    assert not ckpt.hold_horizon(nodes, horizon=20, owners=["r0"], now_s=3.0)  # written
    assert taken == [12]
    manifest = checkpoints.read_manifest(checkpoints.checkpoint_dir(tmp_path, 12))
    assert (manifest.clock, manifest.num_partitions) == (12, 2)


def test_a_hold_that_is_not_reached_is_dropped_after_its_limit(tmp_path: Path) -> None:
    taken: list[int] = []
    ckpt = Checkpointer(
        _spec(tmp_path, checkpoint_every=10), start_clock=0, now_s=0.0,
        record=lambda clock, _: taken.append(clock),
    )  # fmt: skip
    nodes = FakeNodes({})
    nodes.consistent = {"r0": {0: 11, 1: 11}}  # a worker died: clock 12 never completes
    assert ckpt.hold_horizon(nodes, horizon=12, owners=["r0"], now_s=1.0)
    assert ckpt.hold_horizon(nodes, horizon=12, owners=["r0"], now_s=HOLD_LIMIT_S)
    assert not ckpt.hold_horizon(nodes, horizon=12, owners=["r0"], now_s=HOLD_LIMIT_S + 2)
    assert taken == [] and checkpoints.latest(tmp_path) is None
    ckpt.drop_hold()


def test_no_checkpoint_without_a_schedule_or_a_folder(tmp_path: Path) -> None:
    nodes = FakeNodes({})
    off = Checkpointer(
        TrainingSpec(job_id="j", num_partitions=2), start_clock=0, now_s=0.0,
        record=lambda *_: None,
    )  # fmt: skip
    assert not off.hold_horizon(nodes, horizon=50, owners=["r0"], now_s=1e9)
    never = Checkpointer(
        _spec(tmp_path), start_clock=0, now_s=0.0,
        record=lambda *_: None,
    )  # fmt: skip
    assert not never.hold_horizon(nodes, horizon=50, owners=["r0"], now_s=1e9)
    assert nodes.calls == []


def test_a_stage_1_roll_back_says_the_partitions_are_lost_so_the_job_aborts() -> None:
    """No BackupPS holds the partitions: `roll_back` raises PartitionsLostError, which the
    controller turns into an abort (not a logged failure and a job waiting forever)."""
    from orchestrator.agileml.control import View
    from orchestrator.agileml.elasticity import AgileMLStage, RolePlan
    from orchestrator.agileml.errors import PartitionsLostError
    from orchestrator.agileml.partitions import PartitionTable
    from orchestrator.agileml.server_calls import roll_back

    nodes = FakeNodes({})
    plan = RolePlan(AgileMLStage.PARAMSERV_ONLY, ("r0",), (), (), ("r0",))
    with pytest.raises(PartitionsLostError, match="no BackupPS"):
        roll_back(nodes, view=View(epoch=1), failed=["r1"], plan=plan,
                  table=PartitionTable(2), endpoints={})  # fmt: skip
    assert nodes.calls == []  # nothing asked of any node
