"""Run a pipeline job on this machine: one `pipeline.stage` process per stage, on loopback.

The launcher binds a rendezvous inbox, starts the stages, tells each one every stage's inbox
once all have said hello, and collects their results and final weights.

Elastic runs (`backup=True`, gpipe or flush): after every step each stage sends its weights
here, the reliable tier's copy. When a stage's process dies (an eviction: `evict=(stage,
step)` injects one with SIGKILL), the launcher stops the others, re-plans the stages for the
nodes now held (`replan(nodes)`, or the same layout on a replacement node), slices the last
step every stage backed up into the new stages, and restarts them there; the minibatches of
the interrupted step are replayed. Flush and GPipe steps are synchronous, so the result is the
same as without the eviction.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

from orchestrator.agileml import wire
from orchestrator.agileml.errors import AgileMLError, WireError
from orchestrator.agileml.pipeline.schedule import Schedule
from orchestrator.agileml.pipeline.stage import ChainModelSpec, StageConfig, build_chain
from orchestrator.agileml.token import TOKEN_ENV
from orchestrator.agileml.wire import MessageKind

Boundaries = list[tuple[int, int]]


@dataclass
class Recovery:
    """One eviction: when the stage was killed, the step the job resumed at, the new layout,
    and when the next minibatch completed after it."""

    stage: int
    killed_at: float
    resumed_step: int
    boundaries: Boundaries
    next_minibatch_at: float | None = None

    @property
    def seconds(self) -> float | None:
        return None if self.next_minibatch_at is None else self.next_minibatch_at - self.killed_at


@dataclass(frozen=True)
class PipelineResult:
    """What a run did: seconds from the first stage's start to the last stage's end (of the
    last attempt), the losses by minibatch, each stage's result (last attempt), the final
    weights (flat, in layer order) and the recoveries."""

    seconds: float
    losses: list[float]
    stages: list[dict[str, Any]]
    weights: torch.Tensor
    recoveries: list[Recovery] = field(default_factory=list)

    def throughput_per_s(self, skip: int = 0) -> float:
        """Minibatches per second through the input stage's backward passes, after the first
        `skip` (start-up: process warm-up and the pipeline filling)."""
        ends = self.stages[0]["backward_ends"]
        if skip >= len(ends) - 1:
            raise AgileMLError(f"skip {skip} leaves nothing to time of {len(ends)} minibatches")
        first = ends[skip - 1] if skip > 0 else self.stages[0]["started"]
        return (len(ends) - skip) / (ends[-1] - first)


def layer_sizes(model: ChainModelSpec, seed: int) -> list[int]:
    """Parameter count of each layer of the chain, in order."""
    return [sum(p.numel() for p in layer.parameters()) for layer in build_chain(model, seed)]


def run_pipeline(
    *,
    model: ChainModelSpec,
    boundaries: Boundaries,
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
    backup: bool = False,
    evict: tuple[int, int] | None = None,
    replan: Callable[[int], Boundaries] | None = None,
    max_recoveries: int = 3,
) -> PipelineResult:
    """Train with one process per stage; stage k runs layers `boundaries[k]` (inclusive).

    `forward_ms`/`backward_ms` emulate each stage's compute per microbatch with sleeps (per
    stage; after a re-plan, spread by layer count). `evict=(stage, step)` kills that stage's
    process once stage 0 backed up `step` (needs `backup`); `replan(nodes)` gives the layout
    for the nodes left (default: the same layout, on a replacement node).

    Raises:
        AgileMLError: bad boundaries, a stage that failed, or a run not done in time.
    """
    sizes = layer_sizes(model, seed)
    _check_boundaries(boundaries, len(sizes))
    if (backup or evict) and schedule not in (Schedule.GPIPE, Schedule.FLUSH):
        raise AgileMLError("elastic runs need a synchronous schedule: gpipe or flush")
    if schedule is Schedule.TWO_BW and microbatches < len(boundaries):
        raise AgileMLError(
            f"2bw keeps two weight versions only when it accumulates at least as many "
            f"microbatches as there are stages: microbatches {microbatches} < "
            f"{len(boundaries)} stages"
        )
    if evict is not None and not backup:
        raise AgileMLError("an injected eviction needs backup=True (nothing to recover from)")
    if evict is not None and not (
        0 <= evict[0] < len(boundaries) and 0 < evict[1] < minibatches // microbatches
    ):
        raise AgileMLError(f"evict={evict}: want (a stage, a step before the last)")
    token = secrets.token_bytes(32)
    ctx: zmq.Context[Any] = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.setsockopt(zmq.LINGER, 0)
    port = inbox.bind_to_random_port("tcp://127.0.0.1")
    out_dir = Path(tempfile.mkdtemp(prefix="pipeline-"))
    deadline = time.monotonic() + timeout_s
    launch = _Launch(
        ctx, inbox, f"tcp://127.0.0.1:{port}", token, out_dir, deadline,
        dict(model=model, schedule=schedule, minibatches=minibatches, microbatches=microbatches,
             microbatch_size=microbatch_size, lr=lr, seed=seed, vertical_sync=vertical_sync,
             backup=backup),
    )  # fmt: skip
    emulated = (forward_ms, backward_ms)
    losses: dict[int, list[float]] = {}  # step -> the last stage's losses of that step
    backups = _Backups()
    recoveries: list[Recovery] = []
    layout = boundaries
    try:
        while True:
            times = _spread(emulated, boundaries, layout)
            launch.start(layout, backups.step, backups.weights, times)
            outcome = launch.run(evict, losses, backups, recoveries)
            if outcome == "done":
                break
            if len(recoveries) > max_recoveries:
                raise AgileMLError(f"{len(recoveries)} stage losses; giving up (logs in {out_dir})")
            evict = None  # injected once
            if replan is not None:
                layout = replan(len(layout) - 1)  # the lost node is not replaced
                _check_boundaries(layout, len(sizes))
            recoveries[-1].resumed_step, recoveries[-1].boundaries = backups.step, layout
        results = launch.results
        weights = torch.cat(
            [torch.from_numpy(np.load(out_dir / f"stage{k}.npy")) for k in range(len(layout))]
        )
        if losses:
            all_losses = [v for s in sorted(losses) for v in losses[s]]
        else:
            all_losses = results[-1]["losses"]
        shutil.rmtree(out_dir, ignore_errors=True)  # kept, with the logs, when a run fails
        return PipelineResult(
            seconds=max(r["ended"] for r in results) - min(r["started"] for r in results),
            losses=all_losses,
            stages=results,
            weights=weights,
            recoveries=recoveries,
        )
    finally:
        launch.kill_all()
        inbox.close()
        ctx.term()


class _Backups:
    """The reliable tier's copy: the weights (flat, in layer order, whatever the layout) of the
    last step that every stage backed up, and the partial newer steps."""

    def __init__(self) -> None:
        self.step = 0
        self.weights: np.ndarray | None = None  # None: the initial weights
        self._partial: dict[int, dict[int, np.ndarray]] = {}

    def add(self, step: int, stage: int, stages: int, weights: np.ndarray) -> None:
        parts = self._partial.setdefault(step, {})
        parts[stage] = weights
        if len(parts) == stages and step > self.step:
            self.step, self.weights = step, np.concatenate([parts[k] for k in range(stages)])
            self._partial = {s: p for s, p in self._partial.items() if s > step}

    def forget_partial(self) -> None:
        self._partial.clear()


def _check_boundaries(boundaries: Boundaries, layers: int) -> None:
    expected = 0
    for first, last in boundaries:
        if first != expected or last < first:
            raise AgileMLError(f"stage boundaries {boundaries} must cover the layers in order")
        expected = last + 1
    if expected != layers:
        raise AgileMLError(f"stage boundaries {boundaries} do not cover all {layers} layers")


def _spread(
    emulated: tuple[list[float] | None, list[float] | None], original: Boundaries, now: Boundaries
) -> tuple[list[float], list[float]]:
    """Per-stage emulated ms for layout `now`, from per-stage ms of `original` spread evenly
    over each original stage's layers."""
    out = []
    for per_stage in emulated:
        per_layer: list[float] = []
        for (first, last), ms in zip(original, per_stage or [0.0] * len(original), strict=True):
            per_layer += [ms / (last - first + 1)] * (last - first + 1)
        out.append([sum(per_layer[a : b + 1]) for a, b in now])
    return out[0], out[1]


class _Launch:
    """Starting, watching and stopping one attempt's stage processes."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        inbox: zmq.Socket[Any],
        rendezvous: str,
        token: bytes,
        out_dir: Path,
        deadline: float,
        common: dict[str, Any],
    ) -> None:
        self.ctx, self.inbox, self.rendezvous, self.token = ctx, inbox, rendezvous, token
        self.out_dir, self.deadline, self.common = out_dir, deadline, common
        self.procs: list[subprocess.Popen[str]] = []
        self.results: list[dict[str, Any]] = []
        self.attempt = 0

    def start(
        self,
        layout: Boundaries,
        first_step: int,
        initial: np.ndarray | None,
        times: tuple[list[float], list[float]],
    ) -> None:
        self.attempt += 1
        self._started_at = time.time()
        self.job_id = f"pipe-{secrets.token_hex(4)}"
        env = {**os.environ, TOKEN_ENV: self.token.hex(), "OMP_NUM_THREADS": "1"}
        offsets = np.cumsum([0] + layer_sizes(self.common["model"], self.common["seed"]))
        self.procs = []
        for k, (first, last) in enumerate(layout):
            weights = None
            if initial is not None:
                weights = str(self.out_dir / f"initial{self.attempt}-{k}.npy")
                np.save(weights, initial[offsets[first] : offsets[last + 1]])
            config = StageConfig(
                job_id=self.job_id,
                stage=k,
                stages=len(layout),
                first_layer=first,
                last_layer=last,
                forward_ms=times[0][k],
                backward_ms=times[1][k],
                rendezvous=self.rendezvous,
                out_dir=str(self.out_dir),
                first_step=first_step,
                initial_weights=weights,
                **self.common,
            )
            path = self.out_dir / f"stage{k}-{self.attempt}.json"
            path.write_text(config.model_dump_json())
            log = (self.out_dir / f"stage{k}-{self.attempt}.log").open("w")
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "orchestrator.agileml.pipeline.stage", str(path)],
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                    env=env,
                )
            )

    def run(
        self,
        evict: tuple[int, int] | None,
        losses: dict[int, list[float]],
        backups: _Backups,
        recoveries: list[Recovery],
    ) -> str:
        """Rendezvous and watch until every stage is done ("done") or one died ("lost")."""
        procs, stages = self.procs, len(self.procs)
        hellos: dict[int, str] = {}
        done: set[int] = set()
        while len(done) < stages:
            dead = [k for k, p in enumerate(procs) if p.poll() not in (None, 0)]
            if dead:
                if not self.common["backup"]:
                    raise AgileMLError(f"stage {dead[0]} failed (logs in {self.out_dir})")
                if not recoveries or recoveries[-1].killed_at < self._started_at:
                    recoveries.append(Recovery(dead[0], time.time(), 0, []))  # not injected
                self.kill_all()
                backups.forget_partial()  # steps not every stage reached are redone
                return "lost"
            remaining = int((self.deadline - time.monotonic()) * 1000)
            if remaining <= 0:
                raise AgileMLError(f"the pipeline did not finish in time (logs in {self.out_dir})")
            if not self.inbox.poll(min(remaining, 100)):
                continue
            try:
                header, tensors = wire.decode(self.inbox.recv_multipart(), self.token)
            except WireError:
                continue  # not ours or malformed: dropped unread
            if header.job_id != self.job_id or header.clock is None:
                continue  # a late message of an earlier attempt
            if header.detail == "hello":
                hellos[header.clock] = wire.parse_json_body(tensors)["inbox"]
                if len(hellos) == stages:
                    self._send_peers(hellos)
            elif header.detail == "backup":
                stage, step = int(header.sender.removeprefix("stage")), header.clock
                backups.add(step, stage, stages, tensors["w"].numpy().copy())
                if stage == stages - 1:
                    losses[step] = tensors["loss"].tolist()
                if evict is not None and stage == 0 and step >= evict[1]:
                    procs[evict[0]].send_signal(signal.SIGKILL)
                    recoveries.append(Recovery(evict[0], time.time(), 0, []))
                    evict = None
            elif header.detail == "first":  # stage 0 completed its first minibatch
                if recoveries and recoveries[-1].next_minibatch_at is None:
                    recoveries[-1].next_minibatch_at = time.time()
            elif header.detail == "done":
                done.add(header.clock)
        self.results = []
        for proc in procs:
            try:
                stdout, _ = proc.communicate(timeout=max(1.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AgileMLError(f"a stage did not exit (logs in {self.out_dir})") from None
            lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
            if proc.returncode != 0 or not lines:
                raise AgileMLError(f"a stage failed (logs in {self.out_dir})")
            self.results.append(json.loads(lines[-1]))
        self.results.sort(key=lambda r: r["stage"])
        return "done"

    def _send_peers(self, hellos: dict[int, str]) -> None:
        self._started_at = time.time()
        peers = {str(k): v for k, v in hellos.items()}
        for k, endpoint in hellos.items():
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(endpoint)
            fields = {"kind": MessageKind.PIPE, "job_id": self.job_id, "sender": "launcher",
                      "seq": k, "clock": 0, "detail": "peers"}  # fmt: skip
            sock.send_multipart(wire.encode(fields, wire.json_body(peers), self.token))
            sock.close()

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()
