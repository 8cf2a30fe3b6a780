"""Nothing is left behind on any exit path: `orchestrator train` stopped by SIGTERM removes its
temporary folders and stops its node or stage processes; one SIGKILLed (which cannot clean up)
leaves no process behind either, since its children exit when their parent is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.lifecycle import SIGTERM_EXIT_STATUS

JOBS = Path(__file__).parents[1] / "support" / "jobs"


def _children(pid: int) -> set[int]:
    """The live processes whose parent is `pid` (from /proc)."""
    out = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            out.add(int(entry.name))
    return out


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if state[state.rindex(")") + 2] != "Z":
            alive.add(pid)
    return alive


def _wait_for(what: str, check, timeout_s: float = 120.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _start_training(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[str], set[int]]:
    """`orchestrator train` of a slowed-down job, its temp folders under tmp_path; returns
    the process and its children once they compute."""
    env = {**os.environ, "TMPDIR": str(tmp_path), "ORCHESTRATOR_TEST_JOB_PAUSE_S": "0.02"}
    env.pop("ORCHESTRATOR_KEEP_LOGS", None)
    with (tmp_path.parent / f"{tmp_path.name}-stderr.txt").open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", "train", str(JOBS / "digits_sgd.py"),
             "--nodes", "2", "--iterations", "3000", "--global-batch", "64", *extra],
            stdout=subprocess.DEVNULL, stderr=stderr, text=True, env=env,
        )  # fmt: skip
    # 2 transient nodes and a reliable one, or 2 pipeline workers
    _wait_for(
        "the node processes", lambda: len(_children(proc.pid)) >= 2 or proc.poll() is not None
    )
    time.sleep(4.0)  # into training
    children = _children(proc.pid)
    assert proc.poll() is None and len(children) >= 2
    return proc, children


def _ours(folder: Path) -> list[str]:
    """What the run left in its temp folder (not torch's own compile cache)."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("torchinductor"))


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("--pipeline",)], ids=["data_parallel", "pipeline"])
def test_sigterm_removes_temporary_folders_and_stops_every_child(
    tmp_path: Path, extra: tuple[str, ...]
) -> None:
    proc, children = _start_training(tmp_path, *extra)
    assert _ours(tmp_path) != []  # the run's temporary folders are there
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == SIGTERM_EXIT_STATUS
    _wait_for("the children to exit", lambda: not _alive(children), timeout_s=30)
    assert _ours(tmp_path) == []


@pytest.mark.slow
def test_children_of_a_sigkilled_run_exit_on_their_own(tmp_path: Path) -> None:
    proc, children = _start_training(tmp_path, "--pipeline")
    proc.kill()
    proc.wait(timeout=10)
    _wait_for("the orphans to exit", lambda: not _alive(children), timeout_s=20)
