"""FlexRR settings of a job (`TrainingSpec.straggler`): defaults from the thesis's Table 3.1."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from orchestrator.straggler.patterns import InjectedWork


class StragglerSpec(BaseModel):
    """RapidReassignment settings. `flexrr: false` turns reassignment off (plain BSP/SSP).

    `injected` emulates each row's work by sleeping, under a straggler pattern: for tests and
    benchmarks only (a real job leaves it out).

    Raises:
        pydantic.ValidationError: naming the field, e.g. a follow-up assignment smaller than
            the initial one.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    flexrr: bool = True
    helper_group_size: Annotated[int, Field(ge=1, le=64, strict=True)] = 4
    initial_assignment: Annotated[float, Field(gt=0, le=0.5, strict=True)] = (
        0.025  # of the iteration
    )
    follow_up_assignment: Annotated[float, Field(gt=0, le=0.5, strict=True)] = 0.05
    checks_per_iteration: Annotated[int, Field(ge=1, le=50_000, strict=True)] = 100
    # chunks (one message check each) are made larger when their fixed cost (on a CPU, a
    # dense layer's weights and gradient stream through memory once per chunk) would add more
    # than this to the iteration's compute; measured on the worker's first iteration
    max_chunk_overhead: Annotated[float, Field(gt=0, le=10, strict=True)] = 0.1
    trigger_threshold: Annotated[float, Field(gt=0, le=1, strict=True)] = (
        0.20  # of an iteration behind
    )
    progress_checkpoint: Annotated[float, Field(gt=0, lt=1, strict=True)] = (
        0.75  # when to report progress
    )
    # which of the helpees' input a worker caches ahead: all of it, or the tail that
    # assignments are cut from. "all" loads every helpee's whole share every iteration (3-4x
    # the worker's own data loading, even when nobody straggles); an offer past the tail reads
    # its rows when it is helped
    preload: Literal["all", "tail"] = "tail"
    preload_tail_fraction: Annotated[float, Field(gt=0, le=1, strict=True)] = 0.25
    # a begun assignment not completed within this many of the helpee's iteration times (and
    # at least `help_timeout_min_s`) is taken back: its helper is dead or stuck
    help_timeout_iterations: Annotated[float, Field(gt=0, le=100, strict=True)] = 2.0
    help_timeout_min_s: Annotated[float, Field(gt=0, le=600, strict=True)] = 1.0
    injected: InjectedWork | None = None

    @model_validator(mode="after")
    def _sizes(self) -> StragglerSpec:
        if self.follow_up_assignment < self.initial_assignment:
            raise ValueError(
                f"follow_up_assignment ({self.follow_up_assignment}) must be at least "
                f"initial_assignment ({self.initial_assignment}); the thesis uses twice it"
            )
        return self
