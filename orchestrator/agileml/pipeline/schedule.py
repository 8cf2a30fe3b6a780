"""Pipeline schedules: the static order of forward (F), backward (B) and update (U) operations
each stage runs (PipeDream 1F1B, PipeDream-Flush, 2BW; GPipe for comparison).

    gpipe   per step of M microbatches: every F, then every B, then U (a flush per step)
    flush   PipeDream-Flush: per step, 1F1B over the M microbatches, then U (synchronous SGD
            on M microbatches, like GPipe, with at most S in flight per stage)
    1f1b    PipeDream: 1F1B without flushes, U after every B; the input stage keeps S
            minibatches in flight (NOAM); weight stashing keeps each minibatch's F and B on one
            weight version
    2bw     PipeDream-2BW: 1F1B without flushes, U after every M-th B (gradient accumulation),
            so at most two weight versions are live

A stage's 1F1B order: `S - s - 1` forwards of warm-up, then alternately F and B, then the
remaining Bs. Every schedule is a pure function of (schedule, stages, stage, minibatches, M).
"""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple


class Schedule(StrEnum):
    GPIPE = "gpipe"
    FLUSH = "flush"
    ONE_F_ONE_B = "1f1b"
    TWO_BW = "2bw"


class Op(NamedTuple):
    """`kind` F or B on `minibatch`, or U (apply the accumulated gradient; minibatch -1)."""

    kind: str
    minibatch: int


def one_f_one_b(stages: int, stage: int, minibatches: list[int]) -> list[Op]:
    """The 1F1B order of `minibatches` at `stage` (warm-up, steady 1F1B, cool-down)."""
    warmup = min(stages - stage - 1, len(minibatches))
    ops = [Op("F", m) for m in minibatches[:warmup]]
    for j in range(len(minibatches) - warmup):
        ops += [Op("F", minibatches[warmup + j]), Op("B", minibatches[j])]
    ops += [Op("B", m) for m in minibatches[len(minibatches) - warmup :]]
    return ops


def stage_ops(
    schedule: Schedule, *, stages: int, stage: int, minibatches: int, microbatches: int
) -> list[Op]:
    """Every operation `stage` runs, in order.

    `microbatches` (M) is the step size of gpipe/flush and the accumulation of 2bw; for gpipe
    and flush `minibatches` must be a multiple of it.

    Raises:
        ValueError: a stage outside [0, stages), or minibatches not a multiple of M.
    """
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is not in [0, {stages})")
    if microbatches < 1 or minibatches < 1:
        raise ValueError("minibatches and microbatches must be at least 1")
    order = list(range(minibatches))
    if schedule is not Schedule.ONE_F_ONE_B and minibatches % microbatches:
        raise ValueError(
            f"{schedule} updates on whole groups of microbatches: minibatches ({minibatches}) "
            f"must be a multiple of microbatches ({microbatches})"
        )
    if schedule in (Schedule.GPIPE, Schedule.FLUSH):
        if minibatches % microbatches:
            raise ValueError(
                f"{schedule} runs whole steps: minibatches ({minibatches}) must be a multiple "
                f"of microbatches ({microbatches})"
            )
        ops: list[Op] = []
        for first in range(0, minibatches, microbatches):
            step = order[first : first + microbatches]
            if schedule is Schedule.GPIPE:
                ops += [Op("F", m) for m in step] + [Op("B", m) for m in step]
            else:
                ops += one_f_one_b(stages, stage, step)
            ops.append(Op("U", -1))
        return ops
    every = 1 if schedule is Schedule.ONE_F_ONE_B else microbatches
    ops = []
    backwards = 0
    for op in one_f_one_b(stages, stage, order):
        ops.append(op)
        if op.kind == "B":
            backwards += 1
            if backwards % every == 0:
                ops.append(Op("U", -1))
    return ops
