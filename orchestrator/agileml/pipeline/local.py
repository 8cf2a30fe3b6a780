"""Run a pipeline job on this machine: one `pipeline.stage` process per stage, on loopback.

The launcher binds a rendezvous inbox, starts the stages, tells each one every stage's inbox
once all have said hello, and collects their results and final weights.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

from orchestrator.agileml import wire
from orchestrator.agileml.errors import AgileMLError
from orchestrator.agileml.pipeline.schedule import Schedule
from orchestrator.agileml.pipeline.stage import ChainModelSpec, StageConfig, build_chain
from orchestrator.agileml.token import TOKEN_ENV
from orchestrator.agileml.wire import MessageKind


@dataclass(frozen=True)
class PipelineResult:
    """What a run did: seconds from the first stage's start to the last stage's end, the
    last stage's losses by minibatch, each stage's result, and the final weights (flat)."""

    seconds: float
    losses: list[float]
    stages: list[dict[str, Any]]
    weights: torch.Tensor

    def throughput_per_s(self, skip: int = 0) -> float:
        """Minibatches per second through the input stage's backward passes, after the first
        `skip` (start-up: process warm-up and the pipeline filling)."""
        ends = self.stages[0]["backward_ends"]
        if skip >= len(ends) - 1:
            raise AgileMLError(f"skip {skip} leaves nothing to time of {len(ends)} minibatches")
        first = ends[skip - 1] if skip > 0 else self.stages[0]["started"]
        return (len(ends) - skip) / (ends[-1] - first)


def run_pipeline(
    *,
    model: ChainModelSpec,
    boundaries: list[tuple[int, int]],
    schedule: Schedule,
    minibatches: int,
    microbatches: int = 1,
    microbatch_size: int = 32,
    lr: float = 0.05,
    seed: int = 0,
    vertical_sync: bool = False,
    forward_ms: list[float] | None = None,
    backward_ms: list[float] | None = None,
    timeout_s: float = 300.0,
) -> PipelineResult:
    """Train with one process per stage; stage k runs layers `boundaries[k]` (inclusive).

    `forward_ms`/`backward_ms` emulate each stage's compute per microbatch with sleeps.

    Raises:
        AgileMLError: bad boundaries, or a stage that failed or did not finish in time.
    """
    layers = len(build_chain(model, seed))
    expected = 0
    for first, last in boundaries:
        if first != expected or last < first:
            raise AgileMLError(f"stage boundaries {boundaries} must cover the layers in order")
        expected = last + 1
    if expected != layers:
        raise AgileMLError(f"stage boundaries {boundaries} do not cover all {layers} layers")
    token = secrets.token_bytes(32)
    job_id = f"pipe-{secrets.token_hex(4)}"
    stages = len(boundaries)
    ctx: zmq.Context[Any] = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.setsockopt(zmq.LINGER, 0)
    port = inbox.bind_to_random_port("tcp://127.0.0.1")
    out_dir = Path(tempfile.mkdtemp(prefix="pipeline-"))
    procs: list[subprocess.Popen[str]] = []
    env = {**os.environ, TOKEN_ENV: token.hex(), "OMP_NUM_THREADS": "1"}
    try:
        for k, (first, last) in enumerate(boundaries):
            config = StageConfig(
                job_id=job_id,
                stage=k,
                stages=stages,
                first_layer=first,
                last_layer=last,
                model=model,
                schedule=schedule,
                minibatches=minibatches,
                microbatches=microbatches,
                microbatch_size=microbatch_size,
                lr=lr,
                seed=seed,
                vertical_sync=vertical_sync,
                forward_ms=(forward_ms or [0.0] * stages)[k],
                backward_ms=(backward_ms or [0.0] * stages)[k],
                rendezvous=f"tcp://127.0.0.1:{port}",
                out_dir=str(out_dir),
            )
            path = out_dir / f"stage{k}.json"
            path.write_text(config.model_dump_json())
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "orchestrator.agileml.pipeline.stage", str(path)],
                    stdout=subprocess.PIPE,
                    stderr=(out_dir / f"stage{k}.log").open("w"),
                    text=True,
                    env=env,
                )
            )
        deadline = time.monotonic() + timeout_s
        hellos = _collect(inbox, "hello", stages, deadline, token, procs, out_dir)
        peers = {str(k): wire.parse_json_body(t)["inbox"] for k, t in hellos.items()}
        for k in range(stages):  # one socket per stage: PUSH round-robins across peers
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(peers[str(k)])
            fields = {"kind": MessageKind.PIPE, "job_id": job_id, "sender": "launcher",
                      "seq": k, "clock": 0, "detail": "peers"}  # fmt: skip
            sock.send_multipart(wire.encode(fields, wire.json_body(peers), token))
            sock.close()
        _collect(inbox, "done", stages, deadline, token, procs, out_dir)
        results = []
        for proc in procs:
            stdout, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
            if proc.returncode != 0 or not lines:
                raise AgileMLError(f"a stage failed (logs in {out_dir})")
            results.append(json.loads(lines[-1]))
        weights = torch.cat(
            [torch.from_numpy(np.load(out_dir / f"stage{k}.npy")) for k in range(stages)]
        )
        results.sort(key=lambda r: r["stage"])
        return PipelineResult(
            seconds=max(r["ended"] for r in results) - min(r["started"] for r in results),
            losses=results[-1]["losses"],
            stages=results,
            weights=weights,
        )
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        inbox.close()
        ctx.term()


def _collect(
    inbox: zmq.Socket[Any],
    detail: str,
    stages: int,
    deadline: float,
    token: bytes,
    procs: list[subprocess.Popen[str]],
    out_dir: Path,
) -> dict[int, dict[str, torch.Tensor]]:
    got: dict[int, dict[str, torch.Tensor]] = {}
    while len(got) < stages:
        if any(p.poll() not in (None, 0) for p in procs):
            raise AgileMLError(f"a stage exited early (logs in {out_dir})")
        remaining = int((deadline - time.monotonic()) * 1000)
        if remaining <= 0:
            raise AgileMLError(f"stages did not say {detail!r} in time (logs in {out_dir})")
        if inbox.poll(min(remaining, 200)):
            header, tensors = wire.decode(inbox.recv_multipart(), token)
            if header.detail == detail and header.clock is not None:
                got[header.clock] = tensors
    return got
