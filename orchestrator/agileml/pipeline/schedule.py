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

A replicated stage (1F1B-RR) runs each minibatch on one replica, round-robin; its replicas sum
their gradients at every U, so they hold the same weights.

A stage's 1F1B order: forwards of warm-up (`S - s - 1` with one worker per stage; the workers
after it in general), then alternately F and B, then the remaining Bs. Every schedule is a pure
function of (schedule, stages, stage, minibatches, M, replicas, replica).
"""

from __future__ import annotations

from collections.abc import Sequence
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


def one_f_one_b(warmup: int, minibatches: list[int]) -> list[Op]:
    """The 1F1B order of `minibatches` after `warmup` forwards (warm-up, steady 1F1B,
    cool-down)."""
    warmup = min(warmup, len(minibatches))
    ops = [Op("F", m) for m in minibatches[:warmup]]
    for j in range(len(minibatches) - warmup):
        ops += [Op("F", minibatches[warmup + j]), Op("B", minibatches[j])]
    ops += [Op("B", m) for m in minibatches[len(minibatches) - warmup :]]
    return ops


def stage_ops(
    schedule: Schedule,
    *,
    stages: int,
    stage: int,
    minibatches: int,
    microbatches: int,
    replicas: Sequence[int] | None = None,
    replica: int = 0,
    first_minibatch: int = 0,
) -> list[Op]:
    """Every operation one replica of `stage` runs, in order, on minibatches
    `first_minibatch` .. `minibatches - 1` (a resumed run starts past 0).

    `microbatches` (M) is the step size of gpipe/flush and the accumulation of 2bw.
    `replicas[k]` workers run stage k (default 1 each); minibatch m goes to replica
    `m % replicas[k]` (round-robin), and replica r runs the stage's order filtered to its own
    minibatches. Stage k's warm-up counts the workers from k to the output stage, so the input
    stage admits one minibatch per worker and a replica never waits on a forward that needs its
    own backward first; for one worker per stage that is PipeDream's `S - k - 1`.

    Raises:
        ValueError: a stage or replica out of range, or minibatches that do not split into
            whole steps (gpipe/flush: a multiple of M) or equal shares of updates per replica
            (1f1b: of replicas[stage]; 2bw: of M * replicas[stage]), counted from
            `first_minibatch`.
    """
    counts = list(replicas) if replicas is not None else [1] * stages
    if len(counts) != stages or min(counts) < 1:
        raise ValueError(f"replicas {counts} must give at least 1 for each of {stages} stages")
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is not in [0, {stages})")
    if not 0 <= replica < counts[stage]:
        raise ValueError(f"replica {replica} is not in [0, {counts[stage]})")
    count = minibatches - first_minibatch
    if microbatches < 1 or count < 1 or first_minibatch < 0:
        raise ValueError("minibatches (after first_minibatch) and microbatches must be at least 1")
    share = counts[stage]
    group = update_group(schedule, microbatches, share)
    if count % group:
        raise ValueError(
            f"{schedule} updates on whole groups of {group} minibatches (microbatches "
            f"{microbatches}, {share} replicas of stage {stage}): minibatches ({count}) "
            f"must be a multiple of {group}"
        )
    warmup = sum(counts[stage:]) - 1

    def own(ops: list[Op]) -> list[Op]:
        return [op for op in ops if op.minibatch % share == replica]

    order = list(range(first_minibatch, minibatches))
    ops: list[Op] = []
    if schedule in (Schedule.GPIPE, Schedule.FLUSH):
        for first in range(0, count, microbatches):
            step = order[first : first + microbatches]
            if schedule is Schedule.GPIPE:
                ops += own([Op("F", m) for m in step] + [Op("B", m) for m in step])
            else:
                ops += own(one_f_one_b(warmup, step))
            ops.append(Op("U", -1))
        return ops
    every = 1 if schedule is Schedule.ONE_F_ONE_B else microbatches
    backwards = 0
    for op in own(one_f_one_b(warmup, order)):
        ops.append(op)
        if op.kind == "B":
            backwards += 1
            if backwards % every == 0:
                ops.append(Op("U", -1))
    return ops


def update_group(schedule: Schedule, microbatches: int, replicas: int) -> int:
    """Minibatches each update of a stage run by `replicas` workers sums: a step of M (gpipe,
    flush), one per replica (1f1b), M per replica (2bw)."""
    return {Schedule.ONE_F_ONE_B: replicas, Schedule.TWO_BW: replicas * microbatches}.get(
        schedule, microbatches
    )


def stuck_worker(
    schedule: Schedule, *, replicas: Sequence[int], minibatches: int, microbatches: int
) -> tuple[int, int, Op] | None:
    """Play every replica's order against the others with unbounded buffers: a forward waits
    for the upstream forward of its minibatch, a backward for its own forward and the
    downstream backward, an
    update for every replica of its stage to reach the same update. Returns the first
    (stage, replica, op) left waiting, or None when every operation can complete."""
    stages = len(replicas)
    orders = {
        (k, r): stage_ops(schedule, stages=stages, stage=k, minibatches=minibatches,
                          microbatches=microbatches, replicas=replicas, replica=r)
        for k in range(stages)
        for r in range(replicas[k])
    }  # fmt: skip
    at = dict.fromkeys(orders, 0)  # index of the next operation
    done: set[tuple[str, int, int]] = set()  # (kind, stage, minibatch)
    reached = dict.fromkeys(orders, 0)  # updates reached (gradients sent), by worker
    at_update: set[tuple[tuple[int, int], int]] = set()  # (worker, position) of reached Us

    def ready(k: int, r: int, op: Op) -> bool:
        if op.kind == "F":
            return k == 0 or ("F", k - 1, op.minibatch) in done
        if op.kind == "B":
            own_forward = ("F", k, op.minibatch) in done
            return own_forward and (k == stages - 1 or ("B", k + 1, op.minibatch) in done)
        return all(reached[(k, q)] >= reached[(k, r)] for q in range(replicas[k]))

    progressed = True
    while progressed:
        progressed = False
        for worker, ops in orders.items():
            while at[worker] < len(ops):
                op = ops[at[worker]]
                if op.kind == "U" and (worker, at[worker]) not in at_update:
                    at_update.add((worker, at[worker]))
                    reached[worker] += 1
                    progressed = True
                if not ready(*worker, op):
                    break
                if op.kind != "U":
                    done.add((op.kind, worker[0], op.minibatch))
                at[worker] += 1
                progressed = True
    for worker, ops in orders.items():
        if at[worker] < len(ops):
            return worker[0], worker[1], ops[at[worker]]
    return None
