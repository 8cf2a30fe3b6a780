"""Mixed precision (`TrainingSpec.precision`): what a spec may say, and the reference loop a
bf16 run is compared with."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from orchestrator.agileml.spec import TrainingSpec


def test_precision_is_fp32_or_bf16_and_data_parallel_only() -> None:
    assert TrainingSpec(job_id="j", precision="bf16").precision == "bf16"
    with pytest.raises(ValidationError, match="precision"):
        TrainingSpec(job_id="j", precision="fp16")  # needs a loss scale: not built
    with pytest.raises(ValidationError, match="precision bf16 applies to data-parallel jobs"):
        TrainingSpec(job_id="j", code="job.py", parallelism="pipeline", precision="bf16")


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
    with pytest.raises(ValueError, match="fp32, bf16"):
        autocast("fp16", torch.device("cpu"))
