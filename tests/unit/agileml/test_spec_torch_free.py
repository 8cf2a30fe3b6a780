"""A job spec's `training` section is validated without the runtime: the API (and `submit`)
type a submission with `agileml.spec`, which imports neither torch nor the runtime."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
from orchestrator.jobspec import JobSubmission
JobSubmission.model_validate({"name": "x", "budget_usd": 10, "work_gpu_hours": 1,
    "training": {"code": "sha256:" + "0" * 64, "iterations": 10, "parallelism": "pipeline"}})
try:
    JobSubmission.model_validate({"name": "x", "budget_usd": 10, "work_gpu_hours": 1,
                                  "training": {"iterations": 0}})
except ValueError as exc:
    assert "iterations" in str(exc), exc
else:
    raise AssertionError("iterations 0 was accepted")
heavy = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "zmq")))
print(heavy)
"""


def test_validating_a_training_section_imports_neither_torch_nor_zmq() -> None:
    run = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_the_runtime_sees_the_same_spec_class() -> None:
    from orchestrator.agileml import control, elasticity, spec

    assert control.TrainingSpec is spec.TrainingSpec
    assert elasticity.StageThresholds is spec.StageThresholds
