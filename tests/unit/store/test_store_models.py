"""The store's records and the job lifecycle table, without a store."""

from __future__ import annotations

import pytest
from support.store_contract import EDGES, charge

from orchestrator.store import (
    ALLOWED_TRANSITIONS,
    TERMINAL_STATES,
    JobRecord,
    JobState,
    LedgerEntry,
    TrainingReport,
)


def test_job_records_are_validated() -> None:
    with pytest.raises(ValueError):
        JobRecord.submit("j1", {}, budget_usd=0.0, now_s=0.0)
    with pytest.raises(ValueError):
        JobRecord.submit("bad:id", {}, budget_usd=1.0, now_s=0.0)
    with pytest.raises(ValueError):
        JobRecord.submit("j1", {}, budget_usd=float("inf"), now_s=0.0)


def test_transition_table_covers_every_state_and_terminal_states_go_nowhere() -> None:
    assert set(ALLOWED_TRANSITIONS) == set(JobState)
    assert sorted(TERMINAL_STATES) == sorted(
        [JobState.SUCCEEDED, JobState.FAILED, JobState.BUDGET_EXHAUSTED, JobState.CANCELLED]
    )
    assert len(EDGES) == 8
    for state in JobState:
        assert state.value in (JobState.__doc__ or "")


def test_ledger_entry_charge_must_match_price_and_billed_time() -> None:
    with pytest.raises(ValueError, match="charged_usd"):
        LedgerEntry.model_validate(charge().model_dump() | {"charged_usd": 5.0})


@pytest.mark.parametrize(
    "fields",
    [
        {"iteration": 10**400},  # once stored, /metrics answered 500 until the next report
        {"iteration": 2**63},
        {"iteration": 1, "reassigned": 2**63},
        {"iteration": 1, "stage_transitions": 10**30},
        {"iteration": 1, "loss": float("nan")},
    ],
)
def test_a_training_report_holds_only_numbers_a_reader_can_take(fields: dict) -> None:
    with pytest.raises(ValueError):
        TrainingReport(at_s=0.0, **fields)
    TrainingReport(at_s=0.0, iteration=2**63 - 1)  # the largest int64 is fine


def test_an_evaluation_keeps_the_metrics_a_report_can_carry() -> None:
    """What a job's evaluate() returned, as a training report can store it: finite numbers
    with names that fit, at most MAX_METRICS of them; anything else left out, never raised."""
    from pydantic import ValidationError

    from orchestrator.store.models import MAX_METRICS, Evaluation

    result = {"iteration": 40, "acc": 0.9, "loss": float("nan"), "x" * 65: 1.0, "note": "text",
              "inf": float("inf"), "\ud800": 1.0, "tab\t": 1.0,
              **{f"m{i:02d}": float(i) for i in range(40)}}  # fmt: skip
    e = Evaluation.of(result)
    assert e.iteration == 40 and e.metrics["acc"] == 0.9
    assert len(e.metrics) == MAX_METRICS
    assert not {"loss", "x" * 65, "note", "inf", "\ud800", "tab\t"} & set(e.metrics)
    assert TrainingReport(at_s=1.0, iteration=41, evaluation=e).evaluation == e
    with pytest.raises(ValidationError):
        Evaluation(iteration=1, metrics={"bad": float("nan")})
