"""Pipeline-parallel training on local processes (issue #6, first slice): throughput of 1F1B
(PipeDream, weight stashing) vs GPipe-style flush vs PipeDream-Flush vs 2BW vs data
parallelism, for a chain MLP of >= 8 layers on 4 processes. Prints one JSON object; progress
goes to stderr.

* stages: the planner's balanced split of the profiled model into 4 single-worker stages.
* emulated: each stage's compute is the profiler's measured forward/backward time of its layers
  (`pipeline.profiler.profile_sequential`), scaled so a stage takes `--stage-ms` per microbatch,
  and slept (calibrated sleeps), so two cores do not hide the schedules' bubbles. Data
  parallelism gets the same work: each of the 4 ranks sleeps a quarter of the whole model's
  time per minibatch, then all-reduces the real gradients (gloo DDP).
* real: the same runs with no sleeps (the real compute of this small model on 2 shared cores).
* throughput: minibatches per second through the input stage's backward passes after the
  first `--skip` (process warm-up and pipeline fill; a multiple of `--in-flight`, so GPipe and
  Flush are timed over whole steps); data parallelism: the median DDP iteration.
* 1f1b_rr: 1F1B-RR, the first two stages merged into one stage (twice the compute) run by 2
  replicas that take alternate minibatches, so 4 workers still run 3 balanced stages.
* GPipe and Flush step on `--in-flight` microbatches (the same in-flight count as 1F1B's NOAM =
  stages); 2BW accumulates `--in-flight` microbatches per update.

* eviction_flush, eviction_1f1b: every update backed up on the launcher (the reliable tier);
  stage 1's process is SIGKILLed a third of the way and not replaced: the planner re-plans the
  model onto 3 stages, the weights of the last minibatch count every stage backed up are
  sliced into them, and the minibatches after it are replayed. `recovery_s` runs from the kill
  to the input stage's next completed minibatch; the loss (mean of the last 16 minibatches)
  and weights are compared with the same run without the eviction (Flush: equal; 1F1B refills
  the pipeline from the cut, so close).
* replacement_flush: the same kill, but a replacement node takes the lost one's place on the
  same layout: stage-only recovery (the lost stage restarts alone, the others rewind in place
  to the cut) against every stage restarting, and stage-only after the eviction notice
  instead of a kill (the stage leaves right after its next update is backed up);
  `recovery_s` of each (from the kill or the notice), and the weights against the run without
  the eviction (Flush: equal).

    python -m benchmarks.pipeline_elastic [--minibatches 96 --stage-ms 30] [--only-recovery]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from benchmarks.ddp_baseline import ddp_seconds_per_iteration
from orchestrator.agileml.pipeline.local import Layout, chain_layout, describe, run_pipeline
from orchestrator.agileml.pipeline.planner import plan
from orchestrator.agileml.pipeline.profiler import profile_sequential
from orchestrator.agileml.pipeline.schedule import Schedule
from orchestrator.agileml.pipeline.source import ChainModelSpec, build_chain
from orchestrator.lifecycle import exit_on_signals

STAGES = 4
LOOPBACK_BYTES_PER_S = 1e9  # what the planner assumes between stage processes
TARGET_1F1B_OVER_GPIPE = 1.3
# learning rates at which this chain visibly learns in the eviction runs (Flush updates once
# per step of in-flight microbatches, on their mean). Flush's was 1.0 until the global batches
# became per-epoch permutations (issue #16): on that data order 1.0 no longer learns in 384
# minibatches (last-16 loss 2.35 from 2.30) and 0.5 does (0.89)
EVICTION_LR = {Schedule.FLUSH: 0.5, Schedule.ONE_F_ONE_B: 0.25}


def progress(message: str) -> None:
    print(f"[pipeline-bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_eviction(
    args: argparse.Namespace,
    spec: ChainModelSpec,
    profile: Any,
    layout: Layout,
    emulated: tuple[list[float], list[float]],
    schedule: Schedule,
) -> dict[str, Any]:
    """`schedule` with backups: stage 1's process is SIGKILLed a third of the way and not
    replaced, so the job re-plans onto 3 nodes and resumes from the last minibatch count every
    stage backed up; against the same run without the eviction."""
    micro = args.in_flight if schedule is Schedule.FLUSH else 1
    lr = EVICTION_LR[schedule]
    common: dict[str, Any] = dict(
        model=spec,
        layout=layout,
        schedule=schedule,
        minibatches=args.eviction_minibatches,
        microbatches=micro,
        microbatch_size=args.microbatch_size,
        lr=lr,
        forward_ms=emulated[0],
        backward_ms=emulated[1],
        backup=True,
    )
    plain = run_pipeline(**common)
    progress(f"eviction {schedule}: baseline run done")

    def replan(nodes: int) -> Layout:
        return plan(profile, nodes, LOOPBACK_BYTES_PER_S, stages=nodes).stages

    kill_after = args.eviction_minibatches // 3 // micro * micro
    evicted = run_pipeline(**common, evict=(1, kill_after), replan=replan)
    recovery = evicted.recoveries[0]
    progress(
        f"eviction {schedule}: recovered in {recovery.seconds:.2f} s onto "
        f"{describe(recovery.layout)}"
    )
    last = 16

    def tail(losses: list[float]) -> float:
        return sum(losses[-last:]) / last

    return {
        "lr": lr,
        "minibatches": args.eviction_minibatches,
        "evicted_stage": 1,
        "evicted_after_minibatches": kill_after,
        "resumed_at_minibatch": recovery.resumed_minibatch,
        "replanned_stages": describe(recovery.layout),
        "recovery_s": round(recovery.seconds or float("nan"), 3),
        "loss_first_16": round(sum(plain.losses[:last]) / last, 6),
        "loss_without_eviction": round(tail(plain.losses), 6),
        "loss_with_eviction": round(tail(evicted.losses), 6),
        "max_weight_difference": float((plain.weights - evicted.weights).abs().max()),
        "target_recovery_s": 10.0,
    }


def run_replacement(
    args: argparse.Namespace,
    spec: ChainModelSpec,
    layout: Layout,
    emulated: tuple[list[float], list[float]],
) -> dict[str, Any]:
    """Flush with backups; stage 1's process is SIGKILLed a third of the way and a
    replacement takes its place on the same layout: only the lost stage restarts while the
    others rewind in place (`stage`), against every stage restarting (`restart`)."""
    micro = args.in_flight
    common: dict[str, Any] = dict(
        model=spec,
        layout=layout,
        schedule=Schedule.FLUSH,
        minibatches=args.eviction_minibatches,
        microbatches=micro,
        microbatch_size=args.microbatch_size,
        lr=EVICTION_LR[Schedule.FLUSH],
        forward_ms=emulated[0],
        backward_ms=emulated[1],
        backup=True,
    )
    plain = run_pipeline(**common)
    kill_after = args.eviction_minibatches // 3 // micro * micro
    out: dict[str, Any] = {"evicted_stage": 1, "evicted_after_minibatches": kill_after}
    for key, how, notice in (
        ("stage", "stage", False),
        ("restart", "restart", False),
        ("stage_notice", "stage", True),
    ):
        run = run_pipeline(**common, evict=(1, kill_after), recovery=how, notice=notice)
        (recovery,) = run.recoveries
        out[key] = {
            "mode": recovery.mode,
            "resumed_at_minibatch": recovery.resumed_minibatch,
            "recovery_s": round(recovery.seconds or float("nan"), 3),
            "max_weight_difference": float((plain.weights - run.weights).abs().max()),
        }
        progress(f"replacement, {key}: recovered in {recovery.seconds:.2f} s ({recovery.mode})")
    out["stage_over_restart"] = round(out["stage"]["recovery_s"] / out["restart"]["recovery_s"], 3)
    out["target_stage_recovery_s"] = 5.0
    return out


def _merge(per_stage: list[float] | None) -> list[float] | None:
    """Per-stage ms with the first two stages merged into one."""
    return None if per_stage is None else [per_stage[0] + per_stage[1], *per_stage[2:]]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, default=6, help="Linear layers (2*depth-1 modules)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--minibatches", type=int, default=96)
    parser.add_argument(
        "--skip", type=int, default=16, help="minibatches not timed (start-up, pipeline fill)"
    )
    parser.add_argument("--microbatch-size", type=int, default=32)
    parser.add_argument("--in-flight", type=int, default=STAGES)
    parser.add_argument("--stage-ms", type=float, default=30.0, help="emulated F+B per stage")
    parser.add_argument(
        "--eviction-minibatches", type=int, default=384, help="minibatches of each eviction run"
    )
    parser.add_argument(
        "--only-recovery",
        action="store_true",
        help="only the lost-stage recovery runs (stage-only against whole restart)",
    )
    return parser.parse_args()


def throughputs(
    args: argparse.Namespace,
    spec: ChainModelSpec,
    layouts: tuple[Any, Any],
    stage_ms: tuple[list[float], list[float]],
    result: dict[str, Any],
) -> None:
    """Minibatches/s of every schedule (and data parallelism), emulated and real, into
    `result[mode]`. `layouts`: the planned one and the 1F1B-RR one (two stages merged)."""
    layout, merged = layouts
    fwd_ms, bwd_ms = stage_ms
    runs = {
        "gpipe": (Schedule.GPIPE, args.in_flight),
        "flush": (Schedule.FLUSH, args.in_flight),
        "1f1b": (Schedule.ONE_F_ONE_B, 1),
        "2bw": (Schedule.TWO_BW, args.in_flight),
        "1f1b_rr": (Schedule.ONE_F_ONE_B, 1),
    }
    for mode in ("emulated", "real"):
        for name, (schedule, micro) in runs.items():
            rr = name == "1f1b_rr"
            per_stage = (fwd_ms, bwd_ms) if mode == "emulated" else (None, None)
            r = run_pipeline(
                model=spec,
                layout=merged if rr else layout,
                schedule=schedule,
                minibatches=args.minibatches,
                microbatches=micro,
                microbatch_size=args.microbatch_size,
                forward_ms=_merge(per_stage[0]) if rr else per_stage[0],
                backward_ms=_merge(per_stage[1]) if rr else per_stage[1],
            )
            result[mode][name] = round(r.throughput_per_s(skip=args.skip), 2)
            progress(f"{mode} {name}: {result[mode][name]} minibatches/s")
        ddp = ddp_seconds_per_iteration(
            "chain",
            {"features": 64, "hidden": args.hidden, "classes": 10, "depth": args.depth},
            {"n_samples": spec.samples, "n_features": 64, "n_classes": 10},
            workers=STAGES,
            global_batch=args.microbatch_size,
            lr=0.05,
            iterations=args.minibatches,
            emulated_ms=(sum(fwd_ms) + sum(bwd_ms)) / STAGES if mode == "emulated" else 0.0,
        )
        result[mode]["data_parallel"] = round(1 / ddp.seconds_per_iteration, 2)
        progress(f"{mode} data parallel: {result[mode]['data_parallel']} minibatches/s")
        result[mode]["1f1b_over_gpipe"] = round(result[mode]["1f1b"] / result[mode]["gpipe"], 3)


def main() -> None:
    exit_on_signals()  # a SIGTERM unwinds: temporary folders and child processes go
    args = parse_args()
    started = time.monotonic()
    spec = ChainModelSpec(features=64, hidden=args.hidden, classes=10, depth=args.depth)
    model = build_chain(spec, 0)
    layers = len(model)
    profile = profile_sequential(model, torch.randn(args.microbatch_size, spec.features))
    # the planner's balanced split into exactly STAGES stages of one worker each
    planned = plan(profile, STAGES, LOOPBACK_BYTES_PER_S, stages=STAGES)
    layout = planned.stages
    bounds = [(st.first_layer, st.last_layer) for st in layout]
    fwd = [sum(p.forward_ms for p in profile.layers[a : b + 1]) for a, b in bounds]
    bwd = [sum(p.backward_ms for p in profile.layers[a : b + 1]) for a, b in bounds]
    scale = args.stage_ms / max(f + b for f, b in zip(fwd, bwd, strict=True))
    fwd_ms = [f * scale for f in fwd]
    bwd_ms = [b * scale for b in bwd]
    progress(f"{layers} layers on {STAGES} stages {bounds}; emulated x{scale:.0f} of profile")
    # 1F1B-RR: the first two stages merged into one of twice the work, run by 2 replicas
    merged = chain_layout(
        [(bounds[0][0], bounds[1][1]), *bounds[2:]], [2] + [1] * (len(bounds) - 2)
    )
    result: dict[str, Any] = {
        "layers": layers,
        "stages": describe(layout),
        "minibatches": args.minibatches,
        "microbatch_size": args.microbatch_size,
        "in_flight": args.in_flight,
        "emulated_stage_ms": {"forward": fwd_ms, "backward": bwd_ms},
        "emulated": {},
        "real": {},
        "stages_rr": describe(merged),
    }
    if not args.only_recovery:
        throughputs(args, spec, (layout, merged), (fwd_ms, bwd_ms), result)
        result["target_1f1b_over_gpipe"] = TARGET_1F1B_OVER_GPIPE
        for schedule in EVICTION_LR:
            result[f"eviction_{schedule}"] = run_eviction(
                args, spec, profile, layout, (fwd_ms, bwd_ms), schedule
            )
    result["replacement_flush"] = run_replacement(args, spec, layout, (fwd_ms, bwd_ms))
    result["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
