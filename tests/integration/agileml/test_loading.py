"""The rows loader (`loading.LoaderRows`) on its own: a share asked for is read by the
DataLoader's processes (started from a fork server, the job's dataset built there from its
spec) and handed over once ready; never a wrong share, never a wait; a loader whose processes
fail is turned off, and the caller reads its rows itself."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from orchestrator.agileml.batches import DatasetRows
from orchestrator.agileml.control import TrainingSpec
from orchestrator.agileml.loading import LoaderRows
from orchestrator.agileml.parts import training_parts

JOB = Path(__file__).parents[2] / "support" / "jobs" / "digits_items.py"


def _ready(loader: LoaderRows, key: str, timeout_s: float = 60.0) -> object:
    rows_of = {"clock-7": torch.arange(3, 15), "clock-8": torch.arange(20, 30)}
    deadline = time.monotonic() + timeout_s
    while (batch := loader.take_prefetched(key)) is None:
        assert loader.failed is None, loader.failed
        assert time.monotonic() < deadline, "the loader never had the share ready"
        loader.prefetch(key, rows_of[key])  # asked again: taking it dropped the ask
        time.sleep(0.05)
    return batch


def test_a_share_read_ahead_is_the_rows_asked_for_and_only_for_its_key() -> None:
    spec = TrainingSpec(job_id="loading", code=str(JOB), global_batch=48)
    rows = training_parts(spec).rows
    assert isinstance(rows, DatasetRows) and not rows.indexed_at_once
    loader = LoaderRows(rows, spec.model_dump_json(), 2)
    try:
        loader.prefetch("clock-7", torch.arange(3, 15))
        batch = _ready(loader, "clock-7")
        x, y = rows.take(torch.arange(3, 15))
        assert torch.equal(batch[0], x) and torch.equal(batch[1], y)  # type: ignore[index]
        loader.prefetch("clock-8", torch.arange(20, 30))
        time.sleep(1.0)
        assert loader.take_prefetched("clock-9") is None  # never asked for
        batch = _ready(loader, "clock-8")
        assert torch.equal(batch[1], rows.take(torch.arange(20, 30))[1])  # type: ignore[index]
        assert loader.take_prefetched("clock-8") is None  # taken: not twice
        assert loader.missed >= 2 and loader.prefetched == 2
    finally:
        loader.close()


def test_a_started_loader_hands_over_each_share_asked_for() -> None:
    """What a node waits for while it loads (`wait_started`): once the processes are up, a
    share asked for is waited for, never read by the caller; a stop ends the wait at once."""
    spec = TrainingSpec(job_id="loading", code=str(JOB), global_batch=48)
    rows = training_parts(spec).rows
    assert isinstance(rows, DatasetRows)
    loader = LoaderRows(rows, spec.model_dump_json(), 2)
    try:
        t0 = time.monotonic()
        assert not loader.wait_started(60, stopping=lambda: True)
        assert time.monotonic() - t0 < 5
        assert loader.wait_started(120), loader.failed
        for clock in range(3):
            loader.prefetch(clock, torch.arange(clock, clock + 12))
        for clock in range(3):
            batch = loader.take_prefetched(clock)
            assert batch is not None
            assert torch.equal(batch[1], rows.take(torch.arange(clock, clock + 12))[1])
        assert loader.prefetched == 3 and loader.missed == 0
    finally:
        loader.close()


def test_a_loader_whose_dataset_fails_is_turned_off(tmp_path: Path) -> None:
    """The job's dataset raises in the loader's processes (here: only there, as a file
    missing on that path would): the loader turns off, and the worker reads the rows itself
    (where the job's own error, if it is one, stops the run)."""
    job = tmp_path / "job.py"
    job.write_text(JOB.read_text().replace(
        "    def __getitem__(self, i: int):  # type: ignore[no-untyped-def]\n",
        "    def __getitem__(self, i: int):  # type: ignore[no-untyped-def]\n"
        f"        if os.getpid() != {os.getpid()}:\n"
        "            raise OSError('no such file')\n",
    ))  # fmt: skip
    spec = TrainingSpec(job_id="loading", code=str(job), global_batch=48)
    rows = training_parts(spec).rows
    assert isinstance(rows, DatasetRows)
    loader = LoaderRows(rows, spec.model_dump_json(), 1)
    try:
        deadline = time.monotonic() + 60
        while loader.failed is None:
            assert time.monotonic() < deadline, "the loader was never turned off"
            loader.prefetch("k", torch.arange(4))
            loader.take_prefetched("k")
            time.sleep(0.05)
        assert "no such file" in loader.failed
        assert not loader.wait_started(60)  # a node waits no longer for it
        loader.prefetch("k2", torch.arange(4))
        assert loader.take_prefetched("k2") is None
        assert torch.equal(rows.take(torch.arange(4))[1], torch.tensor([0, 1, 2, 3]))
    finally:
        loader.close()


def test_the_loader_processes_of_a_sigkilled_node_exit(tmp_path: Path) -> None:
    """A node SIGKILLed (an eviction without notice) leaves no loader process behind, nor
    their fork server: each watches the node and exits once it is gone."""
    items = tmp_path / "items.txt"
    script = (
        "import sys, time, torch\n"
        "from orchestrator.agileml.control import TrainingSpec\n"
        "from orchestrator.agileml.loading import LoaderRows\n"
        "from orchestrator.agileml.parts import training_parts\n"
        "if __name__ == '__main__':\n"
        f"    spec = TrainingSpec(job_id='k', code={str(JOB)!r}, global_batch=48)\n"
        "    loader = LoaderRows(training_parts(spec).rows, spec.model_dump_json(), 2)\n"
        "    loader.prefetch('a', torch.arange(8))\n"
        "    while loader.take_prefetched('a') is None:\n"
        "        loader.prefetch('a', torch.arange(8))\n"
        "        time.sleep(0.05)\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(600)\n"
    )
    env = {**os.environ, "ORCHESTRATOR_TEST_ITEMS_LOG": str(items)}
    node = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        assert node.stdout is not None and node.stdout.readline().strip() == "ready"
        loaders = {line.split()[0] for line in items.read_text().splitlines()} - {str(node.pid)}
        assert len(loaders) == 2, loaders
        server = {line.split()[1] for line in items.read_text().splitlines()} - {str(node.pid)}
        node.kill()
        node.wait(10)
        deadline = time.monotonic() + 15
        while any(Path(f"/proc/{pid}").exists() for pid in loaders | server):
            assert time.monotonic() < deadline, "a loader process outlived its node"
            time.sleep(0.2)
    finally:
        if node.poll() is None:
            node.kill()
