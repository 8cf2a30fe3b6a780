"""Stage-only recovery replaces a lost node's workers, all of them and only them: with K
workers a node (`devices_per_node`), `Launch.can_replace` holds only when the workers lost are
every worker of one node, the others run, the rendezvous met and a cut exists."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.agileml.pipeline.launch import Backups, Launch


class Proc:
    """A stage process: running (None) or exited with a code."""

    def __init__(self, code: int | None = None) -> None:
        self.code = code

    def poll(self) -> int | None:
        return self.code


def _launch(tmp_path: Path, lost: list[int], k: int = 2, dead: tuple[int, ...] = ()) -> Launch:
    """Four workers in slots 0..3: nodes {0, 1} and {2, 3} with K = 2."""
    launch = Launch(None, None, "tcp://x", b"", tmp_path, 0.0,  # type: ignore[arg-type]
                    {"sizes": [1]}, devices_per_node=k)  # fmt: skip
    launch.workers = [(0, 0), (0, 1), (1, 0), (1, 1)]
    launch._slots = [0, 2, 1, 3]  # stage 0 on both nodes' first device, stage 1 on the second
    launch.procs = [Proc(-9 if w in lost or w in dead else None) for w in range(4)]  # type: ignore[misc]
    launch.inboxes = {w: f"tcp://w{w}" for w in range(4)}
    launch.lost = lost
    return launch


def _backups(done: int) -> Backups:
    backups = Backups()
    backups.done = done
    return backups


@pytest.mark.parametrize(
    ("lost", "k", "replaceable"),
    [
        ([0, 2], 2, True),  # slots 0 and 1: node 0, whole
        ([2, 0], 2, True),  # in any order
        ([0], 2, False),  # half a node: its other worker still runs there
        ([0, 1], 2, False),  # slots 0 and 2: one worker of each node
        ([0, 1, 2, 3], 2, False),  # both nodes
        ([1], 1, True),  # one worker a node: that one
        ([1, 2], 1, False),  # two nodes
    ],
)
def test_only_every_worker_of_one_node_is_replaced(tmp_path, lost, k, replaceable) -> None:
    assert _launch(tmp_path, lost, k).can_replace(_backups(8)) is replaceable


def test_not_without_a_cut_nor_with_another_worker_dead_nor_before_the_rendezvous(
    tmp_path,
) -> None:
    assert not _launch(tmp_path, [0, 2]).can_replace(_backups(0))  # nothing to rewind to
    assert not _launch(tmp_path, [0, 2], dead=(1,)).can_replace(_backups(8))
    unmet = _launch(tmp_path, [0, 2])
    del unmet.inboxes[3]
    assert not unmet.can_replace(_backups(8))
