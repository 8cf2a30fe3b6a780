"""A job's scheduler is told the run's length when it asks for it (issue #36, item 1):
`scheduler(optimizer, total_iterations)`; `scheduler(optimizer)` works as before."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from orchestrator.agileml.jobcode import load_job_code, with_total_iterations
from orchestrator.agileml.usercode import JobCodeError


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)


def test_a_two_argument_scheduler_is_told_the_runs_iterations() -> None:
    told = []

    def scheduler(opt, total_iterations):  # type: ignore[no-untyped-def]
        told.append(total_iterations)
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=total_iterations)

    made = with_total_iterations(scheduler, 7)(_optimizer())
    for _ in range(7):  # every step of the run, and not one past it
        made.optimizer.step()
        made.step()
    assert told == [7]
    with pytest.raises(ValueError, match="Tried to step"):
        made.step()


def test_a_one_argument_scheduler_is_called_as_it_was() -> None:
    def scheduler(opt):  # type: ignore[no-untyped-def]
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2)

    assert with_total_iterations(scheduler, 7) is scheduler
    assert with_total_iterations(scheduler, None) is scheduler

    def with_default(opt, warmup=5):  # type: ignore[no-untyped-def]
        return torch.optim.lr_scheduler.StepLR(opt, step_size=warmup)

    assert with_total_iterations(with_default, 7) is with_default  # keeps its default

    def named(opt, total_iterations=100):  # type: ignore[no-untyped-def]
        return torch.optim.lr_scheduler.StepLR(opt, step_size=total_iterations)

    assert with_total_iterations(named, 7)(_optimizer()).step_size == 7


def test_a_run_that_did_not_give_its_length_says_so() -> None:
    def scheduler(opt, total):  # type: ignore[no-untyped-def]
        return torch.optim.lr_scheduler.StepLR(opt, step_size=total)

    with pytest.raises(JobCodeError, match="needs the run's iteration count"):
        with_total_iterations(scheduler, None)(_optimizer())


def test_loading_a_job_for_a_run_binds_its_length() -> None:
    job = Path(__file__).parents[2] / "support" / "jobs" / "cancer_onecycle.py"
    code = load_job_code(job, iterations=40)
    assert code.total_iterations == 40 and code.for_run(90).total_iterations == 90
    assert code.make_scheduler is not None
    assert code.make_scheduler(_optimizer()).total_steps == 40
