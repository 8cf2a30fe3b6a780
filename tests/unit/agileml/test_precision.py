"""Mixed precision (`TrainingSpec.precision`): what a spec may say, fp16's loss scale and the
servers' skipped steps, and the reference loop a bf16 or fp16 run is compared with."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from orchestrator.agileml.partitions import PartitionLayout
from orchestrator.agileml.precision import LossScale
from orchestrator.agileml.spec import TrainingSpec
from orchestrator.agileml.updates import OptimizerPlan


def test_precision_is_fp32_bf16_or_fp16_and_data_parallel_only() -> None:
    assert TrainingSpec(job_id="j", precision="bf16").precision == "bf16"
    assert TrainingSpec(job_id="j", code="job.py", precision="fp16").precision == "fp16"
    with pytest.raises(ValidationError, match="precision fp16 needs the job's code"):
        TrainingSpec(job_id="j", precision="fp16")  # the built-in SGD skips no step
    with pytest.raises(ValidationError, match="precision"):
        TrainingSpec(job_id="j", precision="fp8")
    with pytest.raises(ValidationError, match="precision bf16 applies to data-parallel jobs"):
        TrainingSpec(job_id="j", code="job.py", parallelism="pipeline", precision="bf16")


def test_wire_precision_is_fp32_or_bf16_for_data_parallel_jobs_and_says_the_bytes() -> None:
    from orchestrator.agileml.trainrun import wire_bytes

    assert TrainingSpec(job_id="j", wire_precision="bf16").wire_precision == "bf16"
    with pytest.raises(ValidationError, match="wire_precision"):
        TrainingSpec(job_id="j", wire_precision="fp16")
    with pytest.raises(ValidationError, match="wire_precision applies to data-parallel jobs"):
        TrainingSpec(job_id="j", code="job.py", parallelism="pipeline", wire_precision="bf16")
    # a worker pulls every value and pushes a gradient of each: 2 x 4 bytes a value, or 2 x 2
    assert wire_bytes(1000, "fp32") == {"precision": "fp32", "bytes_per_worker_iteration": 8000,
                                        "saved_bytes_per_worker_iteration": 0}  # fmt: skip
    assert wire_bytes(1000, "bf16")["bytes_per_worker_iteration"] == 4000
    assert wire_bytes(1000, "bf16")["saved_bytes_per_worker_iteration"] == 4000
    # a partition holding buffers (100 values) is pushed and pulled in fp32: 400 bytes more
    assert wire_bytes(1000, "bf16", 100)["bytes_per_worker_iteration"] == 4400
    assert wire_bytes(1000, "fp32", 100)["bytes_per_worker_iteration"] == 8000


def test_the_loss_scale_unscales_halves_on_overflow_and_grows_after_a_run_of_finite() -> None:
    scale = LossScale(exponent=4, growth_interval=2)
    p, q = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    p.grad, q.grad = torch.tensor([16.0, 32.0, -8.0]), torch.tensor([1.0, 2.0])
    assert scale.unscale([p, q]) and scale.exponent == 4
    assert p.grad.tolist() == [1.0, 2.0, -0.5] and q.grad.tolist() == [1 / 16, 2 / 16]
    p.grad, q.grad = torch.tensor([1.0, float("inf"), 0.0]), torch.tensor([1.0, 2.0])
    assert not scale.unscale([p, q])
    # every parameter's gradient is NaN, the finite one too: every partition skips alike
    assert torch.isnan(p.grad).all() and torch.isnan(q.grad).all()
    assert scale.exponent == 4  # unchanged until the iteration's pushes went through
    scale.update(False)
    assert scale.exponent == 3  # halved
    for _ in range(2):
        p.grad, q.grad = torch.ones(3), torch.ones(2)
        assert scale.unscale([p, q])
        scale.update(True)
    assert scale.exponent == 4 and scale.scale == 16.0  # doubled after 2 finite in a row
    lone = torch.nn.Parameter(torch.zeros(2))  # never given a gradient: NaN too on overflow
    p.grad = torch.tensor([float("nan"), 0.0, 0.0])
    assert not scale.unscale([p, lone]) and torch.isnan(lone.grad).all()


def test_a_server_skips_the_step_of_a_gradient_that_is_not_finite_but_not_the_scheduler() -> None:
    """fp16 (`skip_nonfinite`): the values and the optimizer's state stay, the scheduler and
    the buffers move; without it (fp32), a NaN would go into the weights as in PyTorch."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    layout = PartitionLayout(model, 1)
    plan = OptimizerPlan.from_model(
        model,
        lambda params: torch.optim.SGD(params, lr=0.1),
        lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
        layout.buffer_sizes,
    )
    values = layout.gather(model)[0].clone()
    rule = plan.rules(layout.bounds, skip_nonfinite=True)(0, values)
    before = values.clone()
    grad = torch.full_like(values, float("nan"))
    grad[layout.param_total :] = 1.0  # the buffers' change
    with pytest.warns(UserWarning, match="lr_scheduler.step"):  # before any optimizer.step()
        rule.apply(grad)
    assert torch.equal(values[: layout.param_total], before[: layout.param_total])
    assert torch.equal(values[layout.param_total :], before[layout.param_total :] + 1.0)
    assert rule.skipped == 1
    rule.apply(torch.ones_like(values))  # finite: stepped, at the halved rate
    assert torch.allclose(values[: layout.param_total], before[: layout.param_total] - 0.05)
    plain = plan.rules(layout.bounds)(0, values)
    plain.apply(torch.full_like(values, float("nan")))
    assert torch.isnan(values[: layout.param_total]).all()


def test_the_reference_loop_in_bf16_runs_its_forward_in_bfloat16() -> None:
    """The baseline a bf16 run is compared with computes as the workers do."""
    from pathlib import Path

    from orchestrator.agileml.jobcode import load_job_code
    from orchestrator.agileml.precision import autocast
    from orchestrator.agileml.reference import relative_error, train_reference

    code = load_job_code(Path(__file__).parents[2] / "support" / "jobs" / "digits_adamw.py")
    fp32, _ = train_reference(code, iterations=3, global_batch=32)
    bf16, losses = train_reference(code, iterations=3, global_batch=32, precision="bf16")
    assert 0 < relative_error(bf16, fp32) < 0.05  # bfloat16 rounding, not another job
    assert all(p.dtype == torch.float32 for p in bf16.parameters())  # fp32 master weights
    with autocast("bf16", torch.device("cpu")):
        assert bf16(torch.zeros(2, 1, 8, 8)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="fp32, bf16, fp16"):
        autocast("fp8", torch.device("cpu"))
