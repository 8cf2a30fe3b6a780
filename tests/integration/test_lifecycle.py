"""Nothing is left behind on any exit path: `orchestrator train` removes its temporary folders
when it succeeds, fails or is stopped by SIGTERM, and stops its node or stage processes; one
SIGKILLed (which cannot clean up) leaves no process behind either, since its children exit when
their parent is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.processes import alive as _alive
from support.processes import descendants

from orchestrator.lifecycle import SIGTERM_EXIT_STATUS

JOBS = Path(__file__).parents[1] / "support" / "jobs"


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
    # 2 transient nodes and a reliable one, or 2 pipeline workers (forked: under the fork
    # server, itself a child, as is multiprocessing's resource tracker)
    _wait_for("the node processes", lambda: len(_workers(proc.pid)) >= 2 or proc.poll() is not None)
    time.sleep(4.0)  # into training
    children = descendants(proc.pid)
    assert proc.poll() is None and len(children) >= 2
    return proc, children


WORKER_NAMES = {"stage", "node", "node_process"}


def _workers(pid: int) -> set[int]:
    """The node processes under `pid` (forked ones named `node` or `node_process`), or its
    pipeline's stage processes (named `stage`)."""
    out = set()
    for p in descendants(pid):
        try:
            comm = Path(f"/proc/{p}/comm").read_text().strip()
            cmdline = Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            continue
        if comm in WORKER_NAMES or b"orchestrator.agileml.node" in cmdline:
            out.add(p)
    return out


def _ours(folder: Path) -> list[str]:
    """What the run left in its temp folder (not torch's own compile cache)."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("torchinductor"))


# a linear model on random rows (no scikit-learn to import: quicker); in a node process (the
# launcher has no AgileML token) the loss marks that a node computes, and raises from its
# second call when asked to
MARKED_JOB = """
import os
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

CALLS = 0


def model():
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))


def dataset():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(256, 8, generator=g), torch.randint(0, 4, (256,), generator=g))


def loss(output, target):
    global CALLS
    if "ORCHESTRATOR_AGILEML_TOKEN" in os.environ:
        CALLS += 1
        Path(os.environ["LIFECYCLE_MARKER"]).touch()
        if CALLS > 1 and os.environ.get("LIFECYCLE_FAIL") == "1":
            raise RuntimeError("the job's loss failed")
        time.sleep(float(os.environ.get("LIFECYCLE_PAUSE_S", "0")))
    return nn.functional.cross_entropy(output, target)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)
"""


def _train_marked(
    tmp_path: Path, iterations: int, **env: str
) -> tuple[subprocess.Popen[str], Path, Path]:
    """`orchestrator train` of MARKED_JOB on one transient and one reliable node, with TMPDIR
    a fresh folder; returns the process, that folder and the marker a computing node makes."""
    job, temp, marker = tmp_path / "job.py", tmp_path / "tmp", tmp_path / "computing"
    temp.mkdir(parents=True)
    job.write_text(MARKED_JOB)
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("ORCHESTRATOR_KEEP_LOGS", "ORCHESTRATOR_AGILEML_TOKEN")}  # fmt: skip
    full_env.update(TMPDIR=str(temp), LIFECYCLE_MARKER=str(marker), **env)
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "train", str(job), "--nodes", "1",
         "--iterations", str(iterations), "--global-batch", "16"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=full_env,
    )  # fmt: skip
    return proc, temp, marker


def test_every_exit_of_a_training_run_removes_its_temporary_folders(tmp_path: Path) -> None:
    """A run that succeeds, one whose node fails, one stopped by SIGTERM while its nodes
    compute (the three at once, to be quick)."""
    runs = {
        "success": _train_marked(tmp_path / "success", 5),
        "error": _train_marked(tmp_path / "error", 5, LIFECYCLE_FAIL="1"),
        "sigterm": _train_marked(tmp_path / "sigterm", 3000, LIFECYCLE_PAUSE_S="0.05"),
    }
    stderr: dict[str, str] = {}
    try:
        proc, temp, marker = runs["sigterm"]
        _wait_for("a node to compute", lambda: marker.exists() or proc.poll() is not None)
        assert proc.poll() is None, proc.communicate()[1]
        assert any(p.name.startswith("agileml-") for p in temp.iterdir())  # there, in use
        proc.send_signal(signal.SIGTERM)
        for ending, (proc, _, _) in runs.items():
            stderr[ending] = proc.communicate(timeout=120)[1]
    finally:
        for proc, _, _ in runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert runs["success"][0].returncode == 0, stderr["success"]
    assert runs["error"][0].returncode == 1, stderr["error"]  # `main` once dropped this 1
    assert "error: training failed" in stderr["error"]
    assert runs["sigterm"][0].returncode == SIGTERM_EXIT_STATUS, stderr["sigterm"]
    for ending, (_, temp, marker) in runs.items():
        assert marker.exists(), ending  # a node computed: the run got as far as training
        assert _ours(temp) == [], ending  # no agileml-* (nor any other folder of ours) left


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
    # each notices within a second, then has 5 s to clean up; a busy machine is slower
    _wait_for("the orphans to exit", lambda: not _alive(children), timeout_s=45)
