"""Gradient accumulation's pieces: how a share splits into micro-batches, where the option is
refused, and the reference loop it is held to."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from orchestrator.agileml.batches import micro_batches
from orchestrator.agileml.spec import MAX_ACCUMULATE, TrainingSpec


@given(st.integers(0, 5000), st.integers(1, MAX_ACCUMULATE))
def test_micro_batches_cover_the_rows_in_order_in_near_equal_spans(rows: int, parts: int) -> None:
    spans = micro_batches(rows, parts)
    assert len(spans) == max(1, min(parts, rows))
    assert spans[0][0] == 0 and spans[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    sizes = [end - start for start, end in spans]
    assert max(sizes) - min(sizes) <= 1
    assert rows == 0 or min(sizes) >= 1


def test_accumulate_is_bounded_and_data_parallel_only() -> None:
    assert TrainingSpec(job_id="j", accumulate=8).accumulate == 8
    for bad in (0, MAX_ACCUMULATE + 1, 2.0, True):
        with pytest.raises(ValidationError, match="accumulate"):
            TrainingSpec(job_id="j", accumulate=bad)
    with pytest.raises(ValidationError, match="accumulate applies to data-parallel jobs"):
        TrainingSpec(job_id="j", code="job.py", parallelism="pipeline", accumulate=2)


def test_the_reference_loop_accumulating_equals_it_whole_for_per_row_losses() -> None:
    """Micro-batches' mean losses weighted by their rows sum to the batch's mean loss: without
    per-batch statistics the loop's weights do not depend on `accumulate` (beyond rounding)."""
    from pathlib import Path

    from orchestrator.agileml.jobcode import load_job_code
    from orchestrator.agileml.reference import relative_error, train_reference

    code = load_job_code(Path(__file__).parents[2] / "support" / "jobs" / "digits_adamw.py")
    whole, losses = train_reference(code, iterations=6, global_batch=50)
    split, split_losses = train_reference(code, iterations=6, global_batch=50, accumulate=7)
    assert relative_error(split, whole) <= 1e-5
    assert split_losses == pytest.approx(losses, rel=1e-5)
