"""Every device of a node (#34): a node with K devices runs a worker per device (CPU processes
here), sums their gradients inside the node and pushes once per partition; the weights are a
single-process loop's, through an eviction and a device process's death."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from orchestrator.agileml.devices import DeviceGroup, DeviceLostError, node_devices, slice_of
from orchestrator.agileml.jobcode import load_job_code
from orchestrator.agileml.parts import training_parts
from orchestrator.agileml.reference import relative_error, train_reference
from orchestrator.agileml.spec import TrainingSpec
from orchestrator.agileml.trainrun import TrainPlan, parse_injections, train_locally, train_spec
from orchestrator.agileml.usercode import JobCodeError, ReportedJobCodeError, failure_report

JOBS = Path(__file__).parents[2] / "support" / "jobs"
CPU = torch.device("cpu")


def test_node_devices_are_cpu_processes_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("a machine with CUDA gives its GPUs")
    assert node_devices(None) == [CPU]
    assert node_devices(3) == [CPU] * 3
    assert node_devices(4, cap=2) == [CPU] * 2  # the job's cap wins
    with pytest.raises(ValueError, match="devices must be in 1..16"):
        node_devices(0)
    with pytest.raises(ValueError, match="devices_per_node must be in 1..16"):
        node_devices(2, cap=17)


def test_slices_cover_the_rows_once_in_order() -> None:
    rows = torch.arange(10)
    slices = [slice_of(rows, r, 3) for r in range(3)]
    assert torch.equal(torch.cat(slices), rows)
    assert [len(s) for s in slices] == [4, 3, 3]
    assert [len(slice_of(torch.arange(1), r, 3)) for r in range(3)] == [1, 0, 0]


def _spec(**changes: object) -> TrainingSpec:
    base = TrainingSpec(job_id="devices", global_batch=48, iterations=4, num_partitions=2)
    return base.model_copy(update=changes)


def _grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def _group_and_models(spec: TrainingSpec) -> tuple[Any, DeviceGroup, nn.Module, nn.Module]:
    """The job's parts, a started group of two CPU devices, and two models alike."""
    parts = training_parts(spec)
    group = DeviceGroup("n0", spec.model_dump_json(), parts.layout, [CPU, CPU])
    model, alone = parts.model_factory(), parts.model_factory()
    alone.load_state_dict(model.state_dict())
    group.start()
    return parts, group, model, alone


def _local(parts: Any, model: nn.Module, batch: int) -> Callable[[torch.Tensor], float]:
    """This process's slice through `model`, as the worker computes it."""

    def local(rows: torch.Tensor) -> float:
        x, y = parts.rows.take(rows)
        loss = parts.loss_fn(model(x), y)
        (loss / batch).backward()
        return float(loss.item())

    return local


def test_a_batch_across_two_devices_has_the_whole_batchs_gradient_and_loss() -> None:
    """The built-in MLR on generated data: 48 rows split over this process and a device
    process sum to the gradient and loss of the 48 rows on one process."""
    spec = _spec()
    parts, group, model, alone = _group_and_models(spec)
    local = _local(parts, model, spec.global_batch)
    try:
        rows = torch.randperm(len(parts.rows), generator=torch.Generator().manual_seed(1))[:48]
        loss = group.backward(model, rows, local, version=1)
        x, y = parts.rows.take(rows)
        whole = parts.loss_fn(alone(x), y)
        (whole / spec.global_batch).backward()
        assert loss == pytest.approx(whole.item(), rel=1e-5)
        assert torch.allclose(_grads(model), _grads(alone), atol=1e-6)
        # a second batch on changed parameters: they are sent again (version 2)
        with torch.no_grad():
            for p, q in zip(model.parameters(), alone.parameters(), strict=True):
                p.add_(0.5)
                q.add_(0.5)
        model.zero_grad(set_to_none=True)
        alone.zero_grad(set_to_none=True)
        group.backward(model, rows[:7], local, version=2)
        x, y = parts.rows.take(rows[:7])
        (parts.loss_fn(alone(x), y) / spec.global_batch).backward()
        assert torch.allclose(_grads(model), _grads(alone), atol=1e-6)
    finally:
        group.close()
    assert group.pids() == []


def test_a_device_process_that_is_gone_fails_the_next_batch_with_device_lost() -> None:
    spec = _spec()
    parts = training_parts(spec)
    group = DeviceGroup("n0", spec.model_dump_json(), parts.layout, [CPU, CPU])
    model = parts.model_factory()
    group.start()
    try:
        (pid,) = group.pids()
        os.kill(pid, 9)
        with pytest.raises(DeviceLostError, match=r"a device process is gone \(exit codes 1: -9\)"):
            group.backward(model, torch.arange(8), lambda rows: 0.0, version=1)
        assert group.lost
        with pytest.raises(DeviceLostError, match="closed"):
            group.backward(model, torch.arange(8), lambda rows: 0.0, version=1)
    finally:
        group.close()


@pytest.mark.parametrize("error", [ValueError, RuntimeError], ids=["job-code", "runtime"])
def test_an_error_in_this_process_slice_keeps_the_group_in_step(error: type) -> None:
    """What the node's own slice raises (the job's code; a RuntimeError such as running out
    of memory) goes on as it is, not as a lost device: the others' batch is ended with them,
    so the next batch is right and the group closes at once."""
    spec = _spec()
    parts, group, model, alone = _group_and_models(spec)
    try:

        def failing(rows: torch.Tensor) -> float:
            raise error("out of memory, say")

        with pytest.raises(error, match="out of memory"):
            group.backward(model, torch.arange(20), failing, version=1)
        assert not group.lost

        model.zero_grad(set_to_none=True)
        group.backward(model, torch.arange(20), _local(parts, model, spec.global_batch), version=1)
        x, y = parts.rows.take(torch.arange(20))
        (parts.loss_fn(alone(x), y) / spec.global_batch).backward()
        assert torch.allclose(_grads(model), _grads(alone), atol=1e-6)
    finally:
        started = time.monotonic()
        group.close()
        assert time.monotonic() - started < 5  # the stop was taken: nothing out of step


def test_the_jobs_error_in_a_device_process_comes_back_with_its_report(tmp_path: Path) -> None:
    """A job whose loss fails on rows only the device process computes: the node gets the
    device process's failure report (message and the job's traceback) as a JobCodeError."""
    job = tmp_path / "job.py"
    job.write_text(
        (JOBS / "digits_sgd.py").read_text() + "\n\n_loss = loss\n\ndef loss(output, target):\n"
        "    if len(target) < 20:\n        raise ValueError('too few rows: ' + str(len(target)))\n"
        "    return _loss(output, target)\n"
    )
    spec = _spec(code=str(job))
    parts = training_parts(spec)
    group = DeviceGroup("n0", spec.model_dump_json(), parts.layout, [CPU, CPU])
    model = parts.model_factory()
    group.start()
    try:

        def local(rows: torch.Tensor) -> float:
            x, y = parts.rows.take(rows)
            loss = parts.loss_fn(model(x), y)
            (loss / 48).backward()
            return float(loss.item())

        with pytest.raises(ReportedJobCodeError) as caught:
            group.backward(model, torch.arange(45), local, version=1)  # 23 here, 22 there
            group.backward(model, torch.arange(39), local, version=1)  # 20 here, 19 there
        assert isinstance(caught.value, JobCodeError)
        report = failure_report(caught.value)
        assert "too few rows: 19" in report and "job.py" in report, report
    finally:
        group.close()


def test_a_job_that_fails_to_load_in_a_device_process_fails_the_start(tmp_path: Path) -> None:
    job = tmp_path / "job.py"
    job.write_text((JOBS / "digits_sgd.py").read_text())
    spec = _spec(code=str(job))
    parts = training_parts(spec)
    job.write_text("raise RuntimeError('broken after the node loaded it')\n")
    group = DeviceGroup("n0", spec.model_dump_json(), parts.layout, [CPU, CPU])
    try:
        with pytest.raises(ReportedJobCodeError, match="broken after the node loaded it"):
            group.start()
    finally:
        group.close()


def test_two_devices_per_node_train_the_weights_of_a_single_process_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """3 nodes x 2 devices: the device processes computed rows (the job's loss ran in 6
    processes), the summary counts 6 devices, and the weights are the loop's."""
    rows_log = tmp_path / "rows.txt"
    monkeypatch.setenv("ORCHESTRATOR_TEST_ROWS_LOG", str(rows_log))
    path = JOBS / "digits_sgd.py"
    plan = TrainPlan(code=str(path), nodes=2, reliable=1, iterations=30, global_batch=48,
                     devices_per_node=2)  # fmt: skip
    assert train_spec(plan).devices_per_node == 2
    result = train_locally(plan)
    assert result.devices == {"r0": 2, "t0": 2, "t1": 2}
    pids = {line.split()[0] for line in rows_log.read_text().splitlines()}
    assert len(pids - {str(os.getpid())}) == 6, pids
    expected, _ = train_reference(load_job_code(path), iterations=30, global_batch=48)
    assert relative_error(result.model, expected) <= 1e-5


@pytest.mark.slow
def test_an_eviction_and_a_killed_device_process_keep_the_weights_exact() -> None:
    """The node whose device process is SIGKILLed goes on with its first device and leaves
    (as on a notice): no roll-back, no crash, the loop's weights."""
    path = JOBS / "digits_sgd.py"
    plan = TrainPlan(
        code=str(path), nodes=3, reliable=1, iterations=80, global_batch=48,
        devices_per_node=2, injections=tuple(parse_injections("evict@15,kill-device@40")),
    )  # fmt: skip
    result = train_locally(plan)
    kinds = [e["kind"] for e in result.events]
    assert [k for k in kinds if k.startswith(("injected_", "skipped_"))] == [
        "injected_evict",
        "injected_kill-device",
    ], result.events
    assert "rolled_back" not in kinds and kinds.count("evicted") == 2, result.events
    expected, _ = train_reference(load_job_code(path), iterations=80, global_batch=48)
    assert relative_error(result.model, expected) <= 1e-5


def test_train_cli_says_how_many_devices_trained(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "-m", "orchestrator", "train", str(JOBS / "digits_sgd.py"),
         "--nodes", "1", "--devices-per-node", "2", "--iterations", "10",
         "--global-batch", "32", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "trained on 4 devices in 2 nodes" in run.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["devices"] == 4 and summary["devices_per_node"] == {"r0": 2, "t0": 2}
