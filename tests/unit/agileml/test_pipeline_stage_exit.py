"""A stage worker's exit: its result reaches the supervisor however large it is, and a worker
that said `done` but never exits is taken as lost, not waited on forever."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator.agileml.pipeline import launch as launch_module
from orchestrator.agileml.pipeline.launch import Launch
from orchestrator.agileml.pipeline.processes import LocalStage


def test_a_stage_whose_result_outgrows_a_pipe_exits_unread(tmp_path: Path) -> None:
    """Nobody reads a stage's output before it exits (the node polls for the exit first): a
    result larger than a pipe's buffer (64 KiB) must not block the process."""
    out = tmp_path / "stage.out"
    with out.open("w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-c", "print('{' + 'x' * 300_000 + '}', flush=True)"], stdout=f
        )
    stage = LocalStage(proc, out)
    deadline = time.monotonic() + 60
    while stage.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stage.returncode == 0, "the stage blocked writing its result"
    text, _ = stage.communicate(timeout=5)
    assert len(text.strip()) == 300_002
    assert not out.exists()


class _Hung:
    """A worker that said `done` and never exits (its exit report lost)."""

    def __init__(self) -> None:
        self.returncode: int | None = None
        self.killed = False

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        self.killed = True

    def wait(self, timeout: float | None = None) -> int:
        raise subprocess.TimeoutExpired("stage", timeout or 0)

    def send_signal(self, sig: int) -> None:
        pass

    def communicate(self, input: str | None = None, timeout: float | None = None) -> Any:
        time.sleep(min(timeout or 0, 0.05))
        raise subprocess.TimeoutExpired("stage", timeout or 0)


def test_a_worker_that_never_exits_after_done_is_lost_not_waited_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(launch_module, "EXIT_WAIT_S", 0.05)
    launch = Launch.__new__(Launch)  # only what `_reap` reads
    hung = _Hung()
    launch.procs = [hung]
    launch.workers = [(1, 0)]
    launch.out_dir = tmp_path
    launch.deadline = time.monotonic() + 1e9  # a hosted pipeline runs with no deadline
    reports = launch._reap()
    assert hung.killed
    assert reports[0][0] is not None and reports[0][0] < 0  # lost: redone from the cut
