"""Seconds per iteration of PyTorch DDP (gloo, local processes): the baseline for AgileML overhead.

W worker processes on 127.0.0.1 train the same example model (`orchestrator.agileml.examples`)
with `DistributedDataParallel` on the gloo backend, strong scaling: the global batch is fixed and
each rank draws `global_batch // W` rows of its shard per iteration. Rank 0 times each iteration
as the wall time between consecutive iteration ends (after `optimizer.step`), with no barriers
inside the loop, which is the rate a user sees. Prints one JSON object.

    python benchmarks/ddp_baseline.py --model mlr --features 5000 --classes 1000 \
        --workers 4 --global-batch 512 --iterations 20
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import time
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from itertools import pairwise
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from orchestrator.agileml.examples import (
    ModelFactory,
    gaussian_mixture,
    initial_model,
    mlp_factory,
    mlr_factory,
    shard,
)
from orchestrator.cloud.local.redis_process import free_port
from orchestrator.lifecycle import exit_on_signals


def chain_factory(**kwargs: Any) -> ModelFactory:
    """The pipeline benchmark's chain MLP (`pipeline.stage.build_chain`) as a factory."""
    from orchestrator.agileml.pipeline.source import ChainModelSpec, build_chain

    spec = ChainModelSpec(**kwargs)
    return lambda: build_chain(spec, 0)


FACTORIES: dict[str, Callable[..., ModelFactory]] = {
    "mlr": mlr_factory,
    "mlp": mlp_factory,
    "chain": chain_factory,
}
KILL_GRACE_SECONDS = 5.0  # after terminate(), before kill()


@dataclass(frozen=True)
class DdpResult:
    """Rank 0's timings (median and each measured iteration) and its loss per iteration.

    `losses` covers every iteration, warmup included; `iteration_seconds` only the measured ones.
    """

    seconds_per_iteration: float
    iteration_seconds: list[float]
    losses: list[float]
    workers: int
    global_batch: int


@dataclass(frozen=True)
class _Plan:
    """What every rank needs to run; picklable for the spawn start method."""

    model: str
    model_kwargs: dict[str, Any]
    data_kwargs: dict[str, Any]
    workers: int
    global_batch: int
    lr: float
    iterations: int
    warmup: int
    seed: int
    init_method: str
    timeout_s: float
    emulated_ms: float = 0.0  # sleep per iteration after the backward (emulated compute)


def make_factory(model: str, model_kwargs: dict[str, Any]) -> ModelFactory:
    """The example model factory named `model` ("mlr" or "mlp") built from `model_kwargs`."""
    if model not in FACTORIES:
        raise ValueError(f"unknown model {model!r}; want one of {sorted(FACTORIES)}")
    return FACTORIES[model](**model_kwargs)


def _minibatch_indices(seed: int, rank: int, iteration: int, n: int, size: int) -> torch.Tensor:
    """`size` row indices into a shard of `n` rows, a function of (seed, rank, iteration).

    The key is the one the AgileML worker "w-{rank}" uses, so both draw the same minibatches.
    """
    key = f"{seed}/w-{rank}/{iteration}".encode()
    gen = torch.Generator().manual_seed(zlib.crc32(key))
    return torch.randint(0, n, (size,), generator=gen)


def _train(rank: int, plan: _Plan) -> tuple[list[float], list[float]]:
    """Train on this rank; returns rank-local (iteration end times, losses)."""
    factory = make_factory(plan.model, plan.model_kwargs)
    model = DistributedDataParallel(initial_model(factory, plan.seed))
    data = gaussian_mixture(**{"seed": plan.seed, **plan.data_kwargs})
    x, y = shard(data, plan.workers, rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=plan.lr)
    local_batch = plan.global_batch // plan.workers
    ends: list[float] = []
    losses: list[float] = []
    dist.barrier()  # start together; no barriers inside the timed loop
    ends.append(time.perf_counter())
    for t in range(plan.warmup + plan.iterations):
        idx = _minibatch_indices(plan.seed, rank, t, len(x), local_batch)
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()  # DDP all-reduces (averages) the gradients here
        if plan.emulated_ms > 0:
            time.sleep(plan.emulated_ms / 1000)
        optimizer.step()
        ends.append(time.perf_counter())
        losses.append(float(loss.item()))
    return ends, losses


def _rank_payload(rank: int, plan: _Plan) -> Any:
    """One rank's run: rank 0 reports its iteration times and losses."""
    ends, losses = _train(rank, plan)
    seconds = [b - a for a, b in pairwise(ends)]
    return {"iteration_seconds": seconds, "losses": losses} if rank == 0 else None


def _rank_entry(rank: int, plan: Any, results: Any, train: Callable[[int, Any], Any]) -> None:
    """Process entry point: join the group (`plan.init_method`, `plan.workers`,
    `plan.timeout_s`; gloo, or `plan.backend` if it names one: nccl puts rank r on GPU r), run
    `train(rank, plan)`, then put ("ok", rank, its result) or ("error", rank, the traceback)
    on `results`."""
    torch.set_num_threads(1)  # as AgileML's nodes (OMP_NUM_THREADS=1)
    backend = getattr(plan, "backend", "gloo")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=plan.init_method,
            rank=rank,
            world_size=plan.workers,
            timeout=timedelta(seconds=plan.timeout_s),
        )
        results.put(("ok", rank, train(rank, plan)))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    train: Callable[[int, Any], Any], plan: Any, *, workers: int, timeout_s: float
) -> dict[int, Any]:
    """Run `train(rank, plan)` in `workers` spawned processes joined in a gloo group (`plan`
    names `init_method`, `workers` and `timeout_s`; `train` must be a module-level function);
    returns rank -> its result. Every process is gone on return.

    Raises:
        RuntimeError: a rank failed (its traceback in the message) or the run timed out.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    deadline = time.monotonic() + timeout_s
    procs = [
        ctx.Process(target=_rank_entry, args=(r, plan, results, train)) for r in range(workers)
    ]
    ok: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for p in procs:
            p.start()
        ok, errors = _collect(procs, results, deadline)
    finally:
        # after a failure the other ranks may be stuck in a collective: stop them right away
        _stop(procs, deadline if len(ok) == workers and not errors else time.monotonic())
    if errors:
        raise RuntimeError("DDP run failed: " + "\n".join(errors))
    if len(ok) < workers:
        missing = sorted(set(range(workers)) - set(ok))
        raise RuntimeError(f"DDP run timed out after {timeout_s} s; no result from {missing}")
    return ok


def _collect(procs: list[Any], results: Any, deadline: float) -> tuple[dict[int, Any], list[str]]:
    """Read one message per rank until the deadline or the first failure; returns (ok, errors)."""
    ok: dict[int, Any] = {}
    errors: list[str] = []
    while len(ok) < len(procs) and not errors:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            status, rank, payload = results.get(timeout=min(remaining, 0.5))
        except queue.Empty:
            for rank, p in enumerate(procs):
                if p.exitcode is not None and p.exitcode != 0 and rank not in ok:
                    errors.append(f"rank {rank} exited with code {p.exitcode} and no result")
            continue
        if status == "ok":
            ok[rank] = payload
        else:
            errors.append(f"rank {rank} failed:\n{payload}")
    return ok, errors


def _stop(procs: list[Any], deadline: float) -> None:
    """Join every process until `deadline`, then terminate and finally kill stragglers."""
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=KILL_GRACE_SECONDS)
        if p.is_alive():
            p.kill()
            p.join()


def ddp_seconds_per_iteration(
    model: str,
    model_kwargs: dict[str, Any],
    data_kwargs: dict[str, Any],
    *,
    workers: int = 4,
    global_batch: int,
    lr: float,
    iterations: int,
    warmup: int = 3,
    seed: int = 0,
    timeout_s: float = 300,
    emulated_ms: float = 0.0,
) -> DdpResult:
    """Run `warmup` + `iterations` DDP iterations on `workers` local gloo processes.

    `model` is "mlr" or "mlp" (`model_kwargs` go to its factory in
    `orchestrator.agileml.examples`); `data_kwargs` go to `gaussian_mixture`. Only the last
    `iterations` iterations are timed. `timeout_s` bounds the whole run, process start included.

    Raises:
        ValueError: bad arguments (unknown model, a global batch not divisible by `workers`).
        RuntimeError: a rank failed (its traceback is in the message) or the run timed out.
    """
    make_factory(model, model_kwargs)  # fail fast on an unknown model or bad kwargs
    if workers < 1 or iterations < 1 or warmup < 0 or timeout_s <= 0:
        raise ValueError("want workers >= 1, iterations >= 1, warmup >= 0 and timeout_s > 0")
    if global_batch < workers or global_batch % workers:
        raise ValueError(f"global batch {global_batch} is not a multiple of {workers} workers")
    plan = _Plan(
        model=model,
        model_kwargs=dict(model_kwargs),
        data_kwargs=dict(data_kwargs),
        workers=workers,
        global_batch=global_batch,
        lr=lr,
        iterations=iterations,
        warmup=warmup,
        seed=seed,
        init_method=f"tcp://127.0.0.1:{free_port()}",
        timeout_s=timeout_s,
        emulated_ms=emulated_ms,
    )
    ok = run_ranks(_rank_payload, plan, workers=workers, timeout_s=timeout_s)
    measured = ok[0]["iteration_seconds"][warmup:]
    return DdpResult(
        seconds_per_iteration=statistics.median(measured),
        iteration_seconds=measured,
        losses=ok[0]["losses"],
        workers=workers,
        global_batch=global_batch,
    )


def main() -> None:
    exit_on_signals()  # a SIGTERM unwinds: the ranks are stopped
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(FACTORIES), default="mlr")
    parser.add_argument("--features", type=int, default=5000)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--hidden", type=int, default=256, help="MLP hidden width")
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    model_kwargs: dict[str, Any] = {"n_features": args.features, "n_classes": args.classes}
    if args.model == "mlp":
        model_kwargs["hidden"] = args.hidden
    data_kwargs = {
        "n_samples": args.samples,
        "n_features": args.features,
        "n_classes": args.classes,
    }
    params = sum(p.numel() for p in make_factory(args.model, model_kwargs)().parameters())
    start = time.perf_counter()
    result = ddp_seconds_per_iteration(
        args.model,
        model_kwargs,
        data_kwargs,
        workers=args.workers,
        global_batch=args.global_batch,
        lr=args.lr,
        iterations=args.iterations,
        warmup=args.warmup,
        seed=args.seed,
        timeout_s=args.timeout,
    )
    out = {
        "model": args.model,
        "params": params,
        "workers": result.workers,
        "global_batch": result.global_batch,
        "iterations": args.iterations,
        "warmup": args.warmup,
        "seconds_per_iteration": result.seconds_per_iteration,
        "min_iteration_seconds": min(result.iteration_seconds),
        "max_iteration_seconds": max(result.iteration_seconds),
        "first_loss": result.losses[0],
        "last_loss": result.losses[-1],
        "wall_seconds": time.perf_counter() - start,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
