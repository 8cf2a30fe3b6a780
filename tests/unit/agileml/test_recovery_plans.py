"""What the elasticity controller decides when transient nodes fail, against fake nodes (found
by the chaos soak, where each of these aborted a job whose reliable node was alive):

* a failed worker's shares go to a surrogate only for clocks the worker computes: an evicted
  node killed after it left the roster, or a joiner killed before its first clock, has none
  (a surrogate given one crashed on it; the reliable node did, and the job aborted);
* a roll-back restores a survivor's partitions in place (a copy restored elsewhere stayed
  behind on the survivor, whose later pushes in it made it refuse every roster change after:
  "could not schedule a roster change"), leaves a partition no BackupPS holds alone when its
  owner survived, and still says a partition is lost when its owner failed and no BackupPS
  holds it.
"""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.agileml.control import Adoption, View, member_clocks, without_failed
from orchestrator.agileml.elasticity import AgileMLStage, RolePlan
from orchestrator.agileml.errors import PartitionsLostError
from orchestrator.agileml.partitions import PartitionTable
from orchestrator.agileml.roster import Roster
from orchestrator.agileml.server_calls import roll_back

# -- adoptions ----------------------------------------------------------------------------


def _roster() -> Roster:
    """r0, t0 and t1 from clock 0; t1 out from clock 20 (evicted); t2 joins at clock 30."""
    roster = Roster.starting(["r0", "t0", "t1"])
    roster = roster.with_change(20, ["r0", "t0"])
    return roster.with_change(30, ["r0", "t0", "t2"])


def test_an_evicted_worker_that_fails_after_leaving_the_roster_has_no_shares_to_adopt() -> None:
    roster, adoptions = without_failed(_roster(), {}, {"t1": (24, 26)})
    assert adoptions == {}  # nobody computes t1's share of clock 24: there is none
    assert all("t1" not in roster.members(c) for c in range(20, 40))
    assert roster.members(19) == ("r0", "t0", "t1")  # what it computed stays


def test_a_joiner_that_fails_before_its_first_clock_has_no_shares_to_adopt() -> None:
    roster, adoptions = without_failed(_roster(), {}, {"t2": (25, 27)})
    assert adoptions == {}
    assert all("t2" not in roster.members(c) for c in range(0, 50))  # its join is gone too


def test_a_failed_worker_shares_are_adopted_only_for_the_clocks_it_computes() -> None:
    _, adoptions = without_failed(_roster(), {}, {"t1": (18, 23)})
    assert adoptions == {"t1": Adoption(surrogate="r0", from_clock=18, to_clock=20)}
    _, adoptions = without_failed(_roster(), {}, {"t0": (12, 14)})  # a member throughout
    assert adoptions == {"t0": Adoption(surrogate="r0", from_clock=12, to_clock=14)}
    assert member_clocks(_roster(), "t2", 28, 33) == (30, 33)
    assert member_clocks(_roster(), "t2", 25, 30) == (25, 25)


# -- roll-backs ---------------------------------------------------------------------------

ENDPOINTS = {"r0": "tcp://r0", "t0": "tcp://t0", "t1": "tcp://t1", "t2": "tcp://t2"}


class FakeBackups:
    """The reliable node r0's BackupPS: restores the partitions it holds (partition ->
    (applied through, complete through)) and records where each went."""

    def __init__(self, held: dict[int, tuple[int, int]]) -> None:
        self.held = held
        self.restored: dict[int, str] = {}
        self.epochs: list[int] = []

    def __call__(self, node: str, body: dict[str, Any]) -> dict[str, Any]:
        assert node == "r0", f"{body['op']} asked of {node}"
        if body["op"] == "backup_progress":
            return {"backups": {p: list(v) for p, v in self.held.items()}}
        assert body["op"] == "restore"
        missing = set(body["owners"]) - set(self.held)
        assert not missing, f"a restore of partitions r0 does not back up: {missing}"
        self.epochs.append(body["epoch"])
        self.restored.update(body["owners"])
        return {"restored": {p: [body["clock"], 9] for p in body["owners"]}}


def _table(owners: dict[int, str]) -> PartitionTable:
    table = PartitionTable(len(owners))
    for p, owner in owners.items():
        table.move(p, owner)
    return table


STAGE1 = RolePlan(AgileMLStage.PARAMSERV_ONLY, ("r0",), (), (), ("r0", "t0"))


def test_a_roll_back_restores_a_survivors_partitions_in_place() -> None:
    """Stage 2 dropped to stage 1 (r0 + t0 left): t1's partitions are restored on r0, t0's
    on t0 itself (its hand-off to r0 comes after, by `rebalance`), all at one clock."""
    backups = FakeBackups({p: (5, 7) for p in range(4)})
    table = _table({0: "t0", 1: "t0", 2: "t1", 3: "t1"})
    view = View(epoch=3, backups={p: "tcp://r0" for p in range(4)})
    epoch, restart, end = roll_back(
        backups, view=view, failed=["t1"], plan=STAGE1, table=table, endpoints=ENDPOINTS
    )
    assert (epoch, restart, end) == (4, 8, 8)
    assert backups.restored == {0: "tcp://t0", 1: "tcp://t0", 2: "tcp://r0", 3: "tcp://r0"}
    assert [table.owner(p) for p in range(4)] == ["t0", "t0", "r0", "r0"]


def test_a_partition_no_backup_holds_stays_with_its_surviving_owner() -> None:
    """r0 serves partition 0 with no copy in its BackupPS (it had not handed it to a new
    ActivePS yet): nothing of it is lost, so it is left as it is; the rest is restored."""
    backups = FakeBackups({1: (5, 7), 2: (5, 7), 3: (5, 7)})
    table = _table({0: "r0", 1: "t2", 2: "t2", 3: "t0"})
    view = View(epoch=1, backups={p: "tcp://r0" for p in range(4)})
    plan = RolePlan(AgileMLStage.ACTIVE_BACKUP, (), ("t0", "t1"), ("r0",), ("r0", "t0", "t1"))
    epoch, _, _ = roll_back(
        backups, view=view, failed=["t2"], plan=plan, table=table, endpoints=ENDPOINTS, epoch=5
    )
    assert epoch == 5 and backups.epochs == [5]  # the epoch asked for (a roll-back redone)
    assert set(backups.restored) == {1, 2, 3}
    assert table.owner(0) == "r0" and table.owner(3) == "t0"
    assert {table.owner(1), table.owner(2)} <= {"t0", "t1"}


def test_a_partition_whose_owner_failed_and_no_backup_holds_is_lost() -> None:
    backups = FakeBackups({1: (5, 7)})
    table = _table({0: "t1", 1: "t1"})
    view = View(epoch=1, backups={0: "tcp://r0", 1: "tcp://r0"})
    with pytest.raises(PartitionsLostError, match=r"partitions \[0\] of \['t1'\] lost"):
        roll_back(backups, view=view, failed=["t1"], plan=STAGE1, table=table, endpoints=ENDPOINTS)
    assert backups.restored == {}  # nothing restored when anything is lost
