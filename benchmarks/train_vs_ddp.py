"""Seconds per steady iteration of a user's job: `orchestrator train`'s runtime against plain
PyTorch DistributedDataParallel (gloo) on the same machine. Prints one JSON object.

* AgileML: `orchestrator.agileml.trainrun.train_locally` with N transient nodes and 1 reliable
  node, no injected faults; its `seconds_per_iteration` (the median gap between consecutive
  iteration ends, not counting the first 5 iterations).
* DDP: N local processes (spawn) on gloo over 127.0.0.1, the job's own initial model (same seed),
  optimizer, scheduler and loss, the same global batches (`roster.global_batch_indices`); rank r
  computes the r-th of N near-equal slices of each global batch. Time per iteration: the median
  gap between consecutive iteration ends on rank 0, skipping the first 5 iterations.

The default job is the example shipped with the package, the demo's small CNN on scikit-learn's
digits with AdamW (orchestrator/jobs/digits_cnn.py); ORCHESTRATOR_TEST_JOB_PAUSE_S, the tests'
knob that slows their jobs' iterations down, is removed from the environment. On a small or shared
machine the figures are noisy: run it more than once.

    python -m benchmarks.train_vs_ddp [JOB.py] [--nodes 4] [--global-batch 256] [--iterations 60]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from benchmarks.ddp_baseline import run_ranks
from orchestrator.agileml.jobcode import dataset_rows, load_job_code, seeded_model
from orchestrator.agileml.roster import global_batch_indices
from orchestrator.agileml.trainrun import TrainPlan, train_locally
from orchestrator.cloud.local.redis_process import free_port
from orchestrator.jobs import DIGITS_CNN

DEFAULT_JOB = DIGITS_CNN
PAUSE_ENV = "ORCHESTRATOR_TEST_JOB_PAUSE_S"
WARMUP = 5  # iterations not timed, as in trainrun's seconds_per_iteration
RELIABLE = 1


@dataclass(frozen=True)
class _DdpPlan:
    """What every DDP rank needs; picklable for the spawn start method."""

    job: str
    workers: int
    global_batch: int
    iterations: int
    seed: int
    init_method: str
    timeout_s: float


def progress(message: str) -> None:
    print(f"[train-vs-ddp {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def agileml_seconds_per_iteration(
    job: Path, *, nodes: int, global_batch: int, iterations: int, seed: int
) -> tuple[float, dict[str, float]]:
    """`train_locally`'s median seconds per steady iteration (every process gone on return),
    and the workers' own timers: mean seconds per iteration pulling, computing, pushing.

    Raises:
        RuntimeError: the run measured no steady iteration (too few iterations).
    """
    plan = TrainPlan(
        code=str(job),
        nodes=nodes,
        reliable=RELIABLE,
        iterations=iterations,
        global_batch=global_batch,
        seed=seed,
    )
    result = train_locally(plan)
    if result.seconds_per_iteration is None:
        raise RuntimeError(f"AgileML measured no steady iteration in {iterations} iterations")
    return result.seconds_per_iteration, result.phase_seconds


def _ddp_train(rank: int, plan: _DdpPlan) -> list[float]:
    """Train this rank's slices of the global batches; returns each iteration's end time."""
    code = load_job_code(plan.job)
    model = DistributedDataParallel(seeded_model(code, plan.seed))
    model.train()
    rows = dataset_rows(code)
    optimizer = code.optimizer(model.parameters())
    scheduler = code.scheduler(optimizer) if code.scheduler is not None else None
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


def _ddp_rank(rank: int, plan: _DdpPlan) -> list[float] | None:
    """One rank's run: rank 0 reports its iteration end times."""
    ends = _ddp_train(rank, plan)
    return ends if rank == 0 else None


def ddp_seconds_per_iteration(
    job: Path, *, workers: int, global_batch: int, iterations: int, seed: int, timeout_s: float
) -> float:
    """Rank 0's median gap between consecutive iteration ends, skipping the first `WARMUP`.

    Raises:
        RuntimeError: a rank failed (its traceback in the message) or the run timed out.
    """
    plan = _DdpPlan(
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
    return statistics.median([ends[c] - ends[c - 1] for c in range(WARMUP, len(ends))])


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    """SIGTERM as SystemExit, so that `finally` and context managers stop every process."""
    del frame
    sys.exit(128 + signum)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    summary = " ".join(__doc__.split("\n\n")[0].split())
    parser = argparse.ArgumentParser(description=summary)
    parser.add_argument(
        "job", nargs="?", type=Path, default=DEFAULT_JOB, help="JOB.py (default: %(default)s)"
    )
    parser.add_argument(
        "--nodes", type=int, default=4, help="transient nodes = DDP ranks (default 4)"
    )
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds, DDP run")
    args = parser.parse_args(argv)
    if not args.job.is_file():
        parser.error(f"job file {args.job} does not exist")
    if args.iterations <= WARMUP + 1:
        parser.error(f"--iterations must be above {WARMUP + 1} (the first {WARMUP} are not timed)")
    if args.nodes < 1 or args.global_batch < args.nodes + RELIABLE:
        parser.error(f"want --nodes >= 1 and --global-batch >= nodes + {RELIABLE}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.pop(PAUSE_ENV, None)  # inherited by the node processes and the DDP ranks
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    common = {"global_batch": args.global_batch, "iterations": args.iterations, "seed": args.seed}
    progress(f"AgileML: {args.nodes} transient + {RELIABLE} reliable nodes, {args.job.name}")
    agileml, phases = agileml_seconds_per_iteration(args.job, nodes=args.nodes, **common)
    progress(f"AgileML: {agileml:.4f} s/it; DDP: {args.nodes} gloo ranks")
    ddp = ddp_seconds_per_iteration(args.job, workers=args.nodes, timeout_s=args.timeout, **common)
    progress(f"DDP: {ddp:.4f} s/it")
    out = {
        "job": str(args.job),
        "nodes": args.nodes,
        "global_batch": args.global_batch,
        "iterations": args.iterations,
        "agileml_s_per_it": round(agileml, 5),
        "agileml_phase_s_per_it": phases,
        "ddp_s_per_it": round(ddp, 5),
        "ratio": round(agileml / ddp, 3),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
