"""Seconds per steady iteration of a user's job: `orchestrator train`'s runtime against plain
PyTorch DistributedDataParallel (gloo) on the same machine. Prints one JSON object.

* AgileML: `orchestrator.agileml.trainrun.train_locally` on N processes, as DDP: N-1 transient
  nodes and 1 reliable node (every one of them computes a share), no injected faults; the median
  and the mean gap between consecutive iteration ends, not counting the first 5 iterations.
* DDP: N local processes (spawn) on gloo over 127.0.0.1, the job's own initial model (same seed),
  optimizer, scheduler and loss, the same global batches (`roster.global_batch_indices`); rank r
  computes the r-th of N near-equal slices of each global batch. Time per iteration: the median
  and the mean gap between consecutive iteration ends on rank 0, skipping the first 5.

`ratio` compares the medians (robust to the machine's noise), `mean_ratio` the means (what a
user's wall clock sees: it counts every stall). On a shared machine one pair of runs can be
off by a third either way: `--repeats` runs AgileML and DDP alternately that many times and
reports every pair and the median of each figure.

The default job is the example shipped with the package, the demo's small CNN on scikit-learn's
digits with AdamW (orchestrator/jobs/digits_cnn.py); ORCHESTRATOR_TEST_JOB_PAUSE_S, the tests'
knob that slows their jobs' iterations down, is removed from the environment. On a small or shared
machine the figures are noisy (see `--repeats`).

    python -m benchmarks.train_vs_ddp [JOB.py] [--nodes 4] [--global-batch 256]
        [--iterations 200] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from benchmarks.ddp_baseline import run_ranks
from orchestrator.agileml.jobcode import dataset_rows, load_job_code, seeded_model
from orchestrator.agileml.roster import global_batch_indices
from orchestrator.agileml.trainrun import TrainPlan, train_locally
from orchestrator.cloud.local.redis_process import free_port
from orchestrator.jobs import DIGITS_CNN
from orchestrator.lifecycle import exit_on_signals

DEFAULT_JOB = DIGITS_CNN
PAUSE_ENV = "ORCHESTRATOR_TEST_JOB_PAUSE_S"
WARMUP = 5  # iterations not timed, as in trainrun's seconds_per_iteration
RELIABLE = 1


@dataclass(frozen=True)
class DdpPlan:
    """What every DDP rank needs; picklable for the spawn start method."""

    job: str
    workers: int
    global_batch: int
    iterations: int
    seed: int
    init_method: str
    timeout_s: float
    backend: str = "gloo"  # nccl: rank r on GPU r (`benchmarks.gpu_check`)


def progress(message: str) -> None:
    print(f"[train-vs-ddp {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def agileml_seconds_per_iteration(
    job: Path,
    *,
    nodes: int,
    global_batch: int,
    iterations: int,
    seed: int,
    overlap: bool = False,
    partitions: int | None = None,
    wire_precision: str = "fp32",
) -> tuple[tuple[float, float], dict[str, float]]:
    """`train_locally`'s (median, mean) seconds per steady iteration on `nodes` processes
    (every process gone on return), and the workers' own timers: mean seconds per iteration
    pulling, computing, pushing. `overlap`, `partitions` and `wire_precision` as
    `TrainPlan`'s.

    Raises:
        RuntimeError: the run measured no steady iteration (too few iterations).
    """
    plan = TrainPlan(
        code=str(job),
        nodes=nodes - RELIABLE,
        reliable=RELIABLE,
        iterations=iterations,
        global_batch=global_batch,
        seed=seed,
        overlap=overlap,
        partitions=partitions,
        wire_precision=wire_precision,  # type: ignore[arg-type]
    )
    result = train_locally(plan)
    median, mean = result.seconds_per_iteration, result.mean_seconds_per_iteration
    if median is None or mean is None:
        raise RuntimeError(f"AgileML measured no steady iteration in {iterations} iterations")
    return (median, mean), result.phase_seconds


def _ddp_train(rank: int, plan: DdpPlan) -> list[float]:
    """Train this rank's slices of the global batches; returns each iteration's end time."""
    code = load_job_code(plan.job, iterations=plan.iterations)
    model = DistributedDataParallel(seeded_model(code, plan.seed))
    model.train()
    rows = dataset_rows(code)
    optimizer = code.optimizer(model.parameters())
    scheduler = code.make_scheduler(optimizer) if code.make_scheduler is not None else None
    ends: list[float] = []
    dist.barrier()  # start together; no barriers inside the timed loop
    for clock in range(plan.iterations):
        batch = global_batch_indices(plan.seed, clock, len(rows), plan.global_batch)
        x, y = rows.take(batch.tensor_split(plan.workers)[rank])
        optimizer.zero_grad(set_to_none=True)
        code.loss(model(x), y).backward()  # DDP averages the gradients over the ranks here
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        ends.append(time.perf_counter())
    return ends


def _ddp_rank(rank: int, plan: DdpPlan) -> list[float] | None:
    """One rank's run: rank 0 reports its iteration end times."""
    ends = _ddp_train(rank, plan)
    return ends if rank == 0 else None


def ddp_seconds_per_iteration(
    job: Path, *, workers: int, global_batch: int, iterations: int, seed: int, timeout_s: float
) -> tuple[float, float]:
    """Rank 0's (median, mean) gap between consecutive iteration ends, skipping the first
    `WARMUP`.

    Raises:
        RuntimeError: a rank failed (its traceback in the message) or the run timed out.
    """
    plan = DdpPlan(
        job=str(job),
        workers=workers,
        global_batch=global_batch,
        iterations=iterations,
        seed=seed,
        init_method=f"tcp://127.0.0.1:{free_port()}",
        timeout_s=timeout_s,
    )
    ok = run_ranks(_ddp_rank, plan, workers=workers, timeout_s=timeout_s)
    ends: list[float] = ok[0]
    gaps = [ends[c] - ends[c - 1] for c in range(WARMUP, len(ends))]
    return statistics.median(gaps), statistics.fmean(gaps)


def _pair(
    agileml: tuple[float, float], ddp: tuple[float, float], phases: dict[str, float]
) -> dict[str, Any]:
    """The figures of one AgileML run and the DDP run after it."""
    return {
        "agileml_s_per_it": round(agileml[0], 5),
        "agileml_mean_s_per_it": round(agileml[1], 5),
        "agileml_phase_s_per_it": phases,
        "ddp_s_per_it": round(ddp[0], 5),
        "ddp_mean_s_per_it": round(ddp[1], 5),
        "ratio": round(agileml[0] / ddp[0], 3),
        "mean_ratio": round(agileml[1] / ddp[1], 3),
    }


def _median(values: Iterable[float]) -> float:
    return round(statistics.median(values), 5)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    summary = " ".join(__doc__.split("\n\n")[0].split())
    parser = argparse.ArgumentParser(description=summary)
    parser.add_argument(
        "job", nargs="?", type=Path, default=DEFAULT_JOB, help="JOB.py (default: %(default)s)"
    )
    parser.add_argument(
        "--nodes", type=int, default=4, help="processes: DDP ranks, AgileML nodes (default 4)"
    )
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3, help="alternating pairs of runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds, DDP run")
    parser.add_argument(
        "--partitions", type=int, default=None, help="AgileML partitions (default: by size)"
    )
    parser.add_argument(
        "--compare-overlap",
        action="store_true",
        help="run AgileML with overlap on, and again with it off, in every repeat "
        "(`agileml.streams`)",
    )
    parser.add_argument(
        "--wire-precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="what AgileML's pushes and pulls carry (`TrainingSpec.wire_precision`)",
    )
    args = parser.parse_args(argv)
    if not args.job.is_file():
        parser.error(f"job file {args.job} does not exist")
    if args.iterations <= WARMUP + 1:
        parser.error(f"--iterations must be above {WARMUP + 1} (the first {WARMUP} are not timed)")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.nodes <= RELIABLE or args.global_batch < args.nodes:
        parser.error(f"want --nodes > {RELIABLE} and --global-batch >= --nodes")
    return args


def main(argv: list[str] | None = None) -> None:
    exit_on_signals()  # a SIGTERM unwinds: temporary folders and child processes go
    args = parse_args(argv)
    os.environ.pop(PAUSE_ENV, None)  # inherited by the node processes and the DDP ranks
    common = {"global_batch": args.global_batch, "iterations": args.iterations, "seed": args.seed}
    transient = args.nodes - RELIABLE
    runs = []
    for k in range(1, args.repeats + 1):
        progress(f"[{k}/{args.repeats}] AgileML: {transient} transient + {RELIABLE} reliable nodes")
        agileml, phases = agileml_seconds_per_iteration(
            args.job,
            nodes=args.nodes,
            partitions=args.partitions,
            overlap=args.compare_overlap,
            wire_precision=args.wire_precision,
            **common,
        )
        progress(f"[{k}/{args.repeats}] AgileML: {agileml[0]:.4f} s/it; DDP: {args.nodes} ranks")
        ddp = ddp_seconds_per_iteration(
            args.job, workers=args.nodes, timeout_s=args.timeout, **common
        )
        progress(f"[{k}/{args.repeats}] DDP: {ddp[0]:.4f} s/it")
        run = _pair(agileml, ddp, phases)
        if args.compare_overlap:
            progress(f"[{k}/{args.repeats}] AgileML with overlap off")
            off, off_phases = agileml_seconds_per_iteration(
                args.job, nodes=args.nodes, partitions=args.partitions, overlap=False, **common
            )
            progress(f"[{k}/{args.repeats}] AgileML, overlap off: {off[0]:.4f} s/it")
            run |= {
                "no_overlap_s_per_it": round(off[0], 5),
                "no_overlap_mean_s_per_it": round(off[1], 5),
                "no_overlap_phase_s_per_it": off_phases,
                "no_overlap_ratio": round(off[0] / ddp[0], 3),
                "overlap_speedup": round(off[0] / agileml[0], 3),
            }
        runs.append(run)
    out = {
        "job": str(args.job),
        "nodes": args.nodes,
        "global_batch": args.global_batch,
        "iterations": args.iterations,
        "wire_precision": args.wire_precision,
        **{k: _median(r[k] for r in runs) for k in runs[0] if not k.endswith("phase_s_per_it")},
        "agileml_phase_s_per_it": {
            phase: _median(r["agileml_phase_s_per_it"][phase] for r in runs)
            for phase in runs[0]["agileml_phase_s_per_it"]
        },
        "runs": runs,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
