"""fp16 (#34): workers compute under autocast to float16 with a dynamic loss scale; a step
whose gradient overflowed is skipped on every partition (GradScaler's rule), exactly once, and
the run goes on to the weights of a single-process loop that does the same."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

from orchestrator.agileml.jobcode import load_job_code
from orchestrator.agileml.reference import relative_error, train_reference
from orchestrator.agileml.roster import global_batch_indices
from orchestrator.agileml.trainrun import TrainPlan, train_locally, train_spec

JOB = Path(__file__).parents[2] / "support" / "jobs" / "digits_fp16_overflow.py"
OVERFLOW_ROWS = (7, 300, 900)  # the job's rows whose float16 forward overflows
ITERATIONS, BATCH = 45, 48


def test_an_overflowing_step_is_skipped_on_every_partition_and_the_run_goes_on() -> None:
    """3 nodes of 2 devices, 4 partitions: the iterations whose global batch holds an
    overflowing row are the ones skipped, and the weights are the fp16 loop's (to float16's
    rounding of sums over other groupings of rows)."""
    hits = [
        c
        for c in range(ITERATIONS)
        if set(OVERFLOW_ROWS) & set(global_batch_indices(0, c, 1500, BATCH).tolist())
    ]
    assert len(hits) >= 3  # what this test would catch
    plan = TrainPlan(code=str(JOB), nodes=2, reliable=1, iterations=ITERATIONS,
                     global_batch=BATCH, partitions=4, precision="fp16",
                     devices_per_node=2)  # fmt: skip
    spec = train_spec(plan)
    assert spec.precision == "fp16" and not spec.straggler.flexrr
    result = train_locally(plan)
    assert result.skipped_steps == hits, result.skipped_steps
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the scheduler steps before a first skipped step
        expected, losses = train_reference(
            load_job_code(JOB, iterations=ITERATIONS), iterations=ITERATIONS,
            global_batch=BATCH, precision="fp16",
        )  # fmt: skip
    assert [c for c, loss in enumerate(losses) if not math.isfinite(loss)] == hits
    # float16 sums a gradient over each worker's rows, the loop over the whole batch: they
    # round apart (4e-4 measured); a step not skipped somewhere would be a NaN or a 1e5 row
    assert relative_error(result.model, expected) <= 2e-3
    assert result.final_loss is not None and math.isfinite(result.final_loss)
    code = load_job_code(JOB)
    assert code.evaluate is not None
    accuracy = code.evaluate(expected)["held_out_accuracy"]
    assert accuracy > 0.7 and abs(result.evaluation["held_out_accuracy"] - accuracy) <= 0.015
