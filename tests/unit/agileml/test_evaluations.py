"""Evaluation during a local run (`agileml.evaluations`): which checkpoints are evaluated."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from orchestrator.agileml import checkpoints
from orchestrator.agileml.evaluations import EvaluationWatch
from orchestrator.agileml.parts import training_parts
from orchestrator.agileml.spec import TrainingSpec

JOB = Path(__file__).parents[3] / "orchestrator" / "jobs" / "digits_cnn.py"


@pytest.fixture
def parts():  # type: ignore[no-untyped-def]
    return training_parts(TrainingSpec(job_id="eval", code=str(JOB), num_partitions=2))


def _checkpoint(root: Path, parts, clock: int) -> None:  # type: ignore[no-untyped-def]
    values = parts.layout.gather(parts.initial_model)
    folder = checkpoints.checkpoint_dir(root, clock)
    for p, v in enumerate(values):
        checkpoints.write_part(folder, p, clock=clock, values=v, rule_state=b"")
    checkpoints.complete(folder, job_id="eval", clock=clock, num_partitions=len(values))


def test_only_this_runs_checkpoints_about_every_n_iterations_are_evaluated(
    tmp_path: Path, parts
) -> None:  # type: ignore[no-untyped-def]
    _checkpoint(tmp_path, parts, 499)  # an earlier run's, left in the same folder
    time.sleep(0.01)
    watch = EvaluationWatch(tmp_path, 30, parts.code, parts, since_unix=time.time(),
                            iterations=100)  # fmt: skip
    for clock in (9, 19, 29, 39, 59, 69):  # --checkpoint-every 10 beside --eval-every 30
        _checkpoint(tmp_path, parts, clock)
    watch.poll()
    assert [r["iteration"] for r in watch.results] == [30, 60]
    assert all(0 <= r["held_out_accuracy"] <= 1 for r in watch.results)
    watch.poll()  # nothing new
    assert len(watch.results) == 2
    watch.add_final(60, {"held_out_accuracy": 0.5})  # the end, at a checkpointed iteration
    assert [r["iteration"] for r in watch.results] == [30, 60]
    assert watch.results[-1]["held_out_accuracy"] == 0.5
