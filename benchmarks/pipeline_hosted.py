"""A pipeline job through the controller's hosting path: how long a lost stage takes to come back.

The supervisor the controller hosts (`agileml.pipeline.hosted`) and one `PipelineNode` per
instance (as in the instance agents; here on threads of this process, each running its stage
worker as a real process) train the package's digits CNN (`orchestrator/jobs/digits_cnn.py`)
as a 3-stage flush pipeline on 3 nodes: one reliable (it holds the backups, `pipeline.holder`,
and runs a stage) and two spot. At iteration `--fault-at` the spot node of a later stage:

- `notice_replacement`: gets the eviction notice; a new node registers once the supervisor
  knows (as on EC2, where a replacement boots after the notice): stage-only recovery;
- `lost_replacement`: is gone without a word (its stage and heartbeats stop); a new node
  registers at once: stage-only recovery once the loss is detected (missed heartbeats);
- `lost_replan`: is gone without a word and nothing replaces it: the job re-plans for 2 nodes.

Per scenario: seconds from the fault to the next minibatch the input stage completes, how it
recovered, the run's wall time, and the largest difference of the final weights to the run
without a fault (flush: 0 expected). Prints JSON.

With `--devices-per-node K` every node runs K stage workers (its instance's K GPUs; CPU
processes here) and a lost node takes all of them: a replacement takes all their slots.

    python -m benchmarks.pipeline_hosted [--iterations 120] [--fault-at 40] [--devices-per-node 2]
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from orchestrator.agileml.control import TrainingSpec
from orchestrator.agileml.pipeline.hosted import HostedPipeline
from orchestrator.agileml.pipeline.node import PipelineNode
from orchestrator.jobs import DIGITS_CNN
from orchestrator.lifecycle import exit_on_signals

SCENARIOS = ("static", "notice_replacement", "lost_replacement", "lost_replan")


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(scenario: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One run of `scenario` (see the module docstring)."""
    token = secrets.token_bytes(32)
    spec = TrainingSpec(job_id="bench", code=str(DIGITS_CNN), parallelism="pipeline",
                        stages=3, iterations=args.iterations, global_batch=args.global_batch,
                        min_nodes=3, failure_timeout_s=args.failure_timeout_s,
                        devices_per_node=args.devices_per_node)  # fmt: skip
    wait = 0.0 if scenario == "lost_replan" else 30.0
    hosted = HostedPipeline.start(spec, token=token, host="127.0.0.1", port=0,
                                  replace_wait_s=wait)  # fmt: skip
    nodes: dict[str, PipelineNode] = {}
    threads: list[threading.Thread] = []

    def start(name: str, tier: str = "transient") -> None:
        nodes[name] = PipelineNode(name, tier, job_id="bench",
                                   controller=hosted.endpoint, token=token)  # fmt: skip
        threads.append(threading.Thread(target=nodes[name].run, daemon=True))
        threads[-1].start()

    start("r0", "reliable")  # the job's on-demand instance: it holds the backups
    for i in range(2):
        start(f"n{i}")
    started = time.monotonic()
    fault_at: float | None = None
    try:
        while not hosted.done:
            if hosted.error is not None:
                raise RuntimeError(hosted.error)
            if time.monotonic() - started > args.timeout_s:
                raise RuntimeError(f"{scenario}: not done in time: {hosted.events()}")
            due = scenario != "static" and fault_at is None
            if due and hosted.progress().iteration >= args.fault_at:
                fault_at = time.time()
                _fault(scenario, hosted, nodes, start)
            time.sleep(0.02)
        wall = time.monotonic() - started
        hosted.save_weights(out / scenario)
    finally:
        hosted.stop()
        for node in nodes.values():  # each removes its workdir on the way out
            node.stop()
        for thread in threads:
            thread.join(timeout=15)
    result: dict[str, Any] = {"wall_s": round(wall, 2), "events": hosted.events()}
    if hosted.recoveries and fault_at is not None:
        last = hosted.recoveries[-1]
        back = last.next_minibatch_at
        result["recovery_s"] = None if back is None else round(back - fault_at, 3)
        result["mode"] = last.mode
        result["resumed_iteration"] = last.resumed_minibatch // hosted.microbatches
    return result


def _fault(
    scenario: str,
    hosted: HostedPipeline,
    nodes: dict[str, PipelineNode],
    start: Callable[[str], None],
) -> None:
    victim = next(n for st in hosted.stages()[1:] for n in st["nodes"] if n != "r0")  # spot
    if scenario == "notice_replacement":
        nodes[victim].leave()
        deadline = time.monotonic() + 5
        while victim in hosted.pool.nodes() and time.monotonic() < deadline:
            time.sleep(0.02)
        start("n3")
        return
    nodes[victim].stop()
    if scenario == "lost_replacement":
        start("n3")


def main() -> None:
    exit_on_signals()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=120)
    parser.add_argument("--fault-at", type=int, default=40)
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--failure-timeout-s", type=float, default=3.0)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--only", choices=SCENARIOS, action="append")
    parser.add_argument("--devices-per-node", type=int, default=1)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="pipeline-hosted-bench-") as tmp:
        out = Path(tmp)
        for scenario in ["static", *[s for s in (args.only or SCENARIOS) if s != "static"]]:
            progress(f"{scenario} ...")
            results[scenario] = run(scenario, args, out)
            progress(f"{scenario}: {results[scenario].get('recovery_s')} s, "
                     f"{results[scenario]['wall_s']} s in all")  # fmt: skip
        base = load_file(str(out / "static" / "model.safetensors"))
        for scenario in results:
            got = load_file(str(out / scenario / "model.safetensors"))
            diff = max(float((got[k] - v).abs().max()) for k, v in base.items())
            results[scenario]["max_weight_diff_to_static"] = diff
    print(json.dumps({"job": "digits_cnn, 3 stages, flush", "iterations": args.iterations,
                      "devices_per_node": args.devices_per_node,
                      "fault_at": args.fault_at, **results}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
