"""A user's job file is checked before anything is bought: each mistake gets a clear error
naming the function and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.agileml.jobcode import JobCodeError, check_job_code, load_job_code

GOOD = """
import torch
from torch import nn

def model():
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))

def dataset():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g)
    return torch.utils.data.TensorDataset(x, y)

def loss(output, target):
    return nn.functional.cross_entropy(output, target)

def optimizer(params):
    return torch.optim.AdamW(params, lr=0.01)

def scheduler(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=10)
"""


def _job(tmp_path: Path, source: str, name: str = "job.py") -> Path:
    path = tmp_path / name
    path.write_text(source)
    return path


def test_a_good_job_loads_and_passes_the_check(tmp_path: Path) -> None:
    code = load_job_code(_job(tmp_path, GOOD))
    assert code.scheduler is not None and code.collate is None and code.evaluate is None
    check = check_job_code(code, global_batch=32)
    assert (check.rows, check.optimizer) == (64, "AdamW")
    assert load_job_code(tmp_path).path == tmp_path / "job.py"  # a directory: its job.py


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("def optimizer(", "def optimiser(", "defines no `optimizer()` (it defines `optimiser`"),
        ("def model():", "model = 3\ndef unused():", "`model` is a int, not a function"),
        ("def loss(output, target):\n", "def loss(output, target):\n    return output\n", ""),
        ("import torch\n", "import torch\nimport no_such_module_here\n", "importing"),
    ],
)
def test_load_errors_name_the_function(tmp_path: Path, old: str, new: str, message: str) -> None:
    source = GOOD.replace(old, new, 1)
    if not message:  # a loss returning the output is caught by the check
        with pytest.raises(JobCodeError, match="not a scalar tensor"):
            check_job_code(load_job_code(_job(tmp_path, source)), global_batch=8)
        return
    with pytest.raises(JobCodeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_job_code(_job(tmp_path, source))


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("torch.optim.AdamW(params, lr=0.01)", "torch.optim.LBFGS(params)", "LBFGS is not"),
        (
            "torch.optim.lr_scheduler.StepLR(opt, step_size=10)",
            "torch.optim.lr_scheduler.ReduceLROnPlateau(opt)",
            "needs a metric",
        ),
        (
            "return nn.Sequential(",
            "import random\n    torch.manual_seed(random.randrange(10**6))\n"
            "    return nn.Sequential(",
            "different values under the same seed",
        ),
        (
            "return torch.utils.data.TensorDataset(",
            "return [torch.zeros(4)] * 64 or torch.utils.data.TensorDataset(",
            "not an \\(input, target\\) pair",
        ),
        ("torch.randn(64, 4,", "torch.randn(64, 5,", "model\\(\\)\\(inputs\\) raised"),
        (
            "nn.functional.cross_entropy(output, target)",
            "nn.functional.cross_entropy(output, target, reduction='none')",
            "not a scalar",
        ),
        (
            "nn.functional.cross_entropy(output, target)",
            "torch.tensor(float('nan'), requires_grad=True)",
            "is nan",
        ),
        (
            "torch.optim.AdamW(params, lr=0.01)",
            "torch.optim.AdamW([torch.zeros(2, requires_grad=True)])",
            "not one of the model's parameters",
        ),
    ],
)
def test_check_errors_name_the_function_and_the_fix(
    tmp_path: Path, old: str, new: str, message: str
) -> None:
    assert old in GOOD
    code = load_job_code(_job(tmp_path, GOOD.replace(old, new, 1)))
    with pytest.raises(JobCodeError, match=message):
        check_job_code(code, global_batch=8)


def test_a_global_batch_larger_than_the_data_set_is_refused(tmp_path: Path) -> None:
    with pytest.raises(JobCodeError, match="fewer than the global batch"):
        check_job_code(load_job_code(_job(tmp_path, GOOD)), global_batch=65)


def test_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(JobCodeError, match="does not exist"):
        load_job_code(tmp_path / "nope.py")
    with pytest.raises(JobCodeError, match="has no job.py"):
        load_job_code(tmp_path)
    with pytest.raises(JobCodeError, match="not a Python file"):
        load_job_code(_job(tmp_path, GOOD, name="job.txt"))


def test_a_pipeline_job_needs_its_code_and_pipeline_options_need_a_pipeline():
    from pydantic import ValidationError

    from orchestrator.agileml.control import TrainingSpec
    from orchestrator.jobspec import JobSubmission

    with pytest.raises(ValidationError, match="needs the job's code"):
        TrainingSpec(job_id="j", parallelism="pipeline")
    with pytest.raises(ValidationError, match="parallelism `pipeline` only"):
        TrainingSpec(job_id="j", code="job.py", schedule="1f1b")
    with pytest.raises(ValidationError, match="schedule"):
        TrainingSpec(job_id="j", code="job.py", parallelism="pipeline", schedule="zigzag")
    with pytest.raises(ValueError, match="needs the job's code"):
        JobSubmission(name="p", budget_usd=1.0, work_gpu_hours=1.0,
                      training={"parallelism": "pipeline"})  # fmt: skip
    spec = TrainingSpec(job_id="j", code="job.py", parallelism="pipeline", stages=2)
    assert (spec.schedule, spec.stages) == ("flush", 2)
