"""The check to run whenever a machine with GPUs is at hand (#34): `orchestrator train`'s
runtime against plain DDP over NCCL on the same GPUs, on the digits job and a model of about
100M parameters, on one GPU and on all of them. Prints one JSON object.

For each job and each GPU count k (1, and every GPU when there are more):

* AgileML: `train_locally` with 1 reliable and max(1, k - 1) transient nodes, one device each
  (node i on GPU i mod k: with one GPU its two nodes share it); the median gap between
  iteration ends after the first 5.
* DDP: k ranks, rank r on GPU r, NCCL, the job's model, optimizer, scheduler and loss, the same
  global batches (rank r computes the r-th of k slices); the same median.
* a pipeline: `train --pipeline` (flush) on k stage workers, worker w on GPU w;
* The runs' weights against the single-process loop (`reference.train_reference`) on GPU 0:
  the relative distance (`reference.relative_error`).

Without CUDA it prints {"skipped": ...} and exits 0 (CI), unless `--cpu-smoke`: the same flow
on the CPU (gloo, two processes standing in for two GPUs, the digits job only, few
iterations), to check the script itself.

    python -m benchmarks.gpu_check [--iterations 40] [--global-batch 256] [--cpu-smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from benchmarks.ddp_baseline import run_ranks
from benchmarks.train_vs_ddp import DdpPlan
from orchestrator.agileml.batches import to_device
from orchestrator.agileml.errors import AgileMLError
from orchestrator.agileml.jobcode import dataset_rows, load_job_code, seeded_model
from orchestrator.agileml.pipeline.trainrun import train_pipeline_locally
from orchestrator.agileml.reference import relative_error, train_reference
from orchestrator.agileml.roster import global_batch_indices
from orchestrator.agileml.trainrun import TrainPlan, train_locally
from orchestrator.cloud.local.redis_process import free_port
from orchestrator.jobs import DIGITS_CNN
from orchestrator.lifecycle import exit_on_signals

BIG_JOB = Path(__file__).parent / "jobs" / "mlp_100m.py"
WARMUP = 5  # iterations not timed, as in trainrun's seconds_per_iteration
PAUSE_ENV = "ORCHESTRATOR_TEST_JOB_PAUSE_S"


def progress(message: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _steady_median(ends: list[float]) -> float:
    return statistics.median(ends[c] - ends[c - 1] for c in range(WARMUP, len(ends)))


def _ddp_rank(rank: int, plan: DdpPlan) -> tuple[list[float], bytes] | None:
    """Train rank `rank`'s slices; rank 0 returns its iteration end times and the weights (as
    safetensors bytes: a tensor through the result queue would be shared memory, gone with
    the rank's process)."""
    cuda = plan.backend == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    code = load_job_code(plan.job, iterations=plan.iterations)
    model = seeded_model(code, plan.seed).to(device)
    ddp = DistributedDataParallel(model, device_ids=[rank] if cuda else None)
    rows = dataset_rows(code)
    optimizer = code.optimizer(ddp.parameters())
    scheduler = code.make_scheduler(optimizer) if code.make_scheduler is not None else None
    ends: list[float] = []
    dist.barrier()
    for clock in range(plan.iterations):
        batch = global_batch_indices(plan.seed, clock, len(rows), plan.global_batch)
        x, y = to_device(rows.take(batch.tensor_split(plan.workers)[rank]), device)
        optimizer.zero_grad(set_to_none=True)
        code.loss(ddp(x), y).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        if cuda:
            torch.cuda.synchronize(device)
        ends.append(time.perf_counter())
    if rank != 0:
        return None
    weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    return ends, safetensors.torch.save(weights)


def check_one(job: Path, gpus: int, args: argparse.Namespace, loop: torch.nn.Module) -> dict:
    """AgileML and DDP on `gpus` GPUs (processes with --cpu-smoke) for one job."""
    progress(f"{job.name} on {gpus}: AgileML")
    plan = TrainPlan(code=str(job), nodes=max(1, gpus - 1), reliable=1,
                     iterations=args.iterations, global_batch=args.global_batch,
                     devices_per_node=1)  # fmt: skip
    result = train_locally(plan)
    progress(f"{job.name} on {gpus}: DDP")
    ddp_plan = DdpPlan(
        job=str(job), workers=gpus, global_batch=args.global_batch, iterations=args.iterations,
        seed=0, init_method=f"tcp://127.0.0.1:{free_port()}", timeout_s=args.timeout,
        backend="gloo" if args.cpu_smoke else "nccl",
    )  # fmt: skip
    ends, weights = run_ranks(_ddp_rank, ddp_plan, workers=gpus, timeout_s=args.timeout)[0]
    ddp_model = seeded_model(load_job_code(job), 0)
    ddp_model.load_state_dict(safetensors.torch.load(weights))
    progress(f"{job.name} on {gpus}: a pipeline")
    try:
        piped = train_pipeline_locally(plan.model_copy(update={"nodes": gpus, "pipeline": True}))
        pipeline = {
            "pipeline_stages": [e["stages"] for e in piped.events if e["kind"] == "planned"][0],
            "pipeline_s_per_it": piped.seconds_per_iteration,
            "pipeline_distance_to_loop": relative_error(piped.model, loop),
        }
    except AgileMLError as exc:  # the other runs' figures stand
        pipeline = {"pipeline_error": str(exc)}
    agileml_s, ddp_s = result.seconds_per_iteration, _steady_median(ends)
    return {
        "job": job.name,
        "parameters": sum(p.numel() for p in loop.parameters()),
        "gpus": gpus,
        "agileml_s_per_it": agileml_s,
        "agileml_phase_s_per_it": result.phase_seconds,
        "ddp_s_per_it": round(ddp_s, 5),
        "ratio": round(agileml_s / ddp_s, 3) if agileml_s else None,
        "agileml_distance_to_loop": relative_error(result.model, loop),
        "ddp_distance_to_loop": relative_error(ddp_model, loop),
        # `train --pipeline` on as many stage workers (flush: one step per global batch)
        **pipeline,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    summary = " ".join(__doc__.split("\n\n")[0].split())
    parser = argparse.ArgumentParser(description=summary)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds, a DDP run")
    parser.add_argument("--cpu-smoke", action="store_true", help="the flow on the CPU")
    parser.add_argument("--skip-big", action="store_true", help="the digits job only")
    args = parser.parse_args(argv)
    if args.iterations <= WARMUP + 1:
        parser.error(f"--iterations must be above {WARMUP + 1} (the first {WARMUP} are not timed)")
    return args


def main(argv: list[str] | None = None) -> None:
    exit_on_signals()
    args = parse_args(argv)
    os.environ.pop(PAUSE_ENV, None)
    if not torch.cuda.is_available() and not args.cpu_smoke:
        print(json.dumps({"skipped": "no CUDA device on this machine (see --cpu-smoke)"}))
        return
    count = 2 if args.cpu_smoke else torch.cuda.device_count()
    device = torch.device("cpu") if args.cpu_smoke else torch.device("cuda", 0)
    jobs = [DIGITS_CNN] if args.cpu_smoke or args.skip_big else [DIGITS_CNN, BIG_JOB]
    runs: list[dict[str, Any]] = []
    for job in jobs:
        progress(f"{job.name}: the single-process loop on {device}")
        loop, _ = train_reference(
            load_job_code(job, iterations=args.iterations), iterations=args.iterations,
            global_batch=args.global_batch, device=device,
        )  # fmt: skip
        for gpus in sorted({1, count}) if not args.cpu_smoke else [count]:
            runs.append(check_one(job, gpus, args, loop))
    name = "cpu" if args.cpu_smoke else torch.cuda.get_device_name(0)
    print(json.dumps({"device": name, "devices": count, "iterations": args.iterations,
                      "global_batch": args.global_batch, "runs": runs}))  # fmt: skip


if __name__ == "__main__":
    main()
