"""Run an AgileML job on this machine: the elasticity controller in this process, each node a
separate process on loopback (`python -m orchestrator.agileml.node`, forked from a server
with the imports done: `forked`); its output, JSON at the end, goes to a file.

Used by the benchmark and the offline demo; `evict` sends a node its eviction notice (SIGUSR1),
`kill` takes it away without warning (SIGKILL).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from orchestrator.agileml import forked
from orchestrator.agileml.control import TrainingSpec
from orchestrator.agileml.coordinator import Coordinator, CoordinatorEvent
from orchestrator.agileml.elasticity import NodeState, NodeTier
from orchestrator.agileml.errors import AgileMLError
from orchestrator.agileml.token import AGILEML_TOKEN_ENV
from orchestrator.lifecycle import remove_run_dir

STOP_GRACE_SECONDS = 10.0
#: The longest a held node waits for the nodes added before it to join (`add_node`).
JOINED_WAIT_S = 60.0


@dataclass(frozen=True)
class NodeOutcome:
    """A node process's result (empty lists for a killed node)."""

    node_id: str
    ended: str  # done | left | stopped | killed | crashed
    losses: list[tuple[int, float]]
    ends: list[tuple[int, float]]  # (clock, wall-clock time the iteration ended)
    timings: dict[str, float]  # seconds spent pulling, computing, pushing (all iterations)
    straggler: dict[str, float]  # FlexRR counters (`reassign.ReassignStats`)
    skipped_clocks: list[int] = field(default_factory=list)  # fp16: its gradient overflowed


def mean_phase_seconds(outcomes: dict[str, NodeOutcome]) -> dict[str, float]:
    """The workers' own timers: mean seconds per iteration in each phase (wait: for the first
    pulled partition, which under BSP includes the wait for the slowest peer; pull: the rest;
    compute; push), over the nodes that computed."""
    per_node: dict[str, list[float]] = {}
    for outcome in outcomes.values():
        if outcome.ends:
            for phase, seconds in outcome.timings.items():
                per_node.setdefault(phase, []).append(seconds / len(outcome.ends))
    return {k: round(statistics.mean(v), 5) for k, v in per_node.items()}


class LocalJob:
    """One job: a controller and node processes. Use as a context manager (always cleans up).

    Raises:
        AgileMLError: from `wait_clock`/`finish` when the job does not progress in time.
    """

    def __init__(self, spec: TrainingSpec, *, log_dir: Path | None = None) -> None:
        self.spec = spec
        self._token = secrets.token_bytes(32)
        self.coordinator = Coordinator(spec, token=self._token)
        self._procs: dict[str, forked.Forked] = {}
        self._killed: set[str] = set()
        self._held: set[str] = set()  # started, not released yet
        self._unjoined: set[str] = set()  # stopped at the end while still joining
        # a log folder made here is removed on every exit (a crashed node's error carries the
        # end of its log), kept after an error with ORCHESTRATOR_KEEP_LOGS=1 (`remove_run_dir`)
        self._own_log_dir = log_dir is None
        self._log_dir = log_dir or Path(tempfile.mkdtemp(prefix="agileml-"))

    def __enter__(self) -> LocalJob:
        try:
            self.coordinator.start()
        except BaseException:  # `with` runs no __exit__ when __enter__ raised; no node ran
            if self._own_log_dir:
                remove_run_dir(self._log_dir, failed=False)
            raise
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        try:
            self.close()
        finally:  # also when a second signal interrupts close()
            if self._own_log_dir:
                remove_run_dir(self._log_dir, failed=exc_type is not None)

    def add_node(self, node_id: str, tier: NodeTier, *, held: bool = False) -> None:
        """Start a node process; it joins, loads its data and says ready on its own.

        `held`: the process starts, joins and loads (the job's code, data and model, warmed
        up) but says ready only on `release`, so that a join happens when it is asked for, not
        a load later. It starts once the nodes added before it have joined, so that it is
        younger than they are (the oldest transient nodes are the ActivePSs).
        """
        if held:
            self._wait_joined(list(self._procs))
        env = {**os.environ, AGILEML_TOKEN_ENV: self._token.hex()}
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("OPENBLAS_NUM_THREADS", "1")
        # a node started while others compute imports the runtime at low priority; the nodes
        # a job starts with, and a held joiner (it starts with the job and must be ready when
        # released), at normal priority: nice 19 would starve them on a busy machine
        computing = not held and self.max_clock() >= 0
        entry = "orchestrator.agileml.node_process" if computing else "orchestrator.agileml.node"
        cmd = [
            "--node-id", node_id, "--job-id", self.spec.job_id, "--tier", tier.value,
            "--controller", self.coordinator.endpoint,
        ]  # fmt: skip
        k = self.spec.devices_per_node
        if k is not None:  # each node on its own GPUs, where the machine has them
            cmd += ["--devices", str(k), "--first-device", str(len(self._procs) * k)]
        if held:
            self._held.add(node_id)
            cmd.append("--hold")
        stdout, stderr = self._out_path(node_id), self._log_dir / f"{node_id}.log"
        stdout.write_bytes(b"")
        stderr.write_bytes(b"")
        self._procs[node_id] = forked.start(
            entry, cmd, env=env, stdout=stdout, stderr=stderr, stdin=held
        )

    def _wait_joined(self, nodes: list[str]) -> None:
        """Until the controller has heard each of `nodes` join (or its process ended), at most
        `JOINED_WAIT_S`: a forked node joins within milliseconds of its start."""
        deadline = time.monotonic() + JOINED_WAIT_S
        for node_id in nodes:
            while self.coordinator.node_state(node_id) is None:
                if self._procs[node_id].poll() is not None:
                    break  # ended: `crashed` reports it
                if time.monotonic() > deadline:
                    return  # a slow one leaves the order to chance
                time.sleep(0.01)

    def _out_path(self, node_id: str) -> Path:
        """Where the node's standard output (its result, JSON) goes."""
        return self._log_dir / f"{node_id}.out"

    def starting_nodes(self) -> list[str]:
        """The nodes started to join now (not held back for a later join)."""
        return [n for n in self._procs if n not in self._held]

    def release(self, node_id: str) -> None:
        """Let a held node join."""
        self._held.discard(node_id)
        stdin = self._procs[node_id].stdin
        if stdin is not None:
            with contextlib.suppress(BrokenPipeError):  # it died held: `crashed` says so
                stdin.write(b"join\n")

    def evict(self, node_id: str) -> None:
        """The eviction notice: the node finishes its clocks, hands off, and leaves."""
        self._procs[node_id].send_signal(signal.SIGUSR1)

    def kill(self, node_id: str) -> float:
        """Take the node away without warning; returns the wall-clock time of the kill."""
        self._procs[node_id].kill()
        self._killed.add(node_id)
        return time.time()

    def kill_device(self, node_id: str) -> int:
        """SIGKILL one device process of the node (`devices`); returns its process id.

        Raises:
            AgileMLError: the node has no device process (one device, or not loaded yet).
        """
        node = self._procs[node_id].pid
        for pid in _children(node):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue  # gone meanwhile
            if b"orchestrator.agileml.device_process" in cmdline:
                os.kill(pid, signal.SIGKILL)
                return pid
        raise AgileMLError(f"node {node_id} has no device process to kill")

    def crashed(self, tail_lines: int = 20) -> dict[str, str]:
        """Nodes whose process ended with an error (not killed here): node -> its log's end."""
        out = {}
        for node_id, proc in self._procs.items():
            code = proc.poll()
            if code is None or code == 0 or node_id in self._killed:
                continue
            path = self._log_dir / f"{node_id}.log"
            lines = path.read_text(errors="replace").splitlines() if path.exists() else []
            out[node_id] = "\n".join(lines[-tail_lines:]) or f"(exit code {code}, no log)"
        return out

    def max_clock(self) -> int:
        """The highest clock any node reported finishing."""
        done = [c for losses in self.coordinator.node_losses().values() for c, _ in losses]
        return max(done, default=-1)

    def wait_clock(self, clock: int, timeout_s: float) -> None:
        """Wait until some node has finished `clock`.

        Raises:
            AgileMLError: not within `timeout_s`, or the job ended before it.
        """
        deadline = time.monotonic() + timeout_s
        while self.max_clock() < clock:
            ended = any(e.kind in ("done", "aborted") for e in self.events())
            if ended and self.max_clock() < clock:
                raise AgileMLError(f"the job ended before clock {clock}: {self.events()}")
            if time.monotonic() > deadline:
                raise AgileMLError(f"clock {clock} not reached in {timeout_s}s: {self.events()}")
            time.sleep(0.02)

    def events(self) -> list[CoordinatorEvent]:
        return self.coordinator.events()

    def finish(self, timeout_s: float) -> tuple[list[torch.Tensor], dict[str, NodeOutcome]]:
        """Wait for the job to be done; returns the final partitions and each node's outcome."""
        if not self.coordinator.wait_done(timeout_s):
            raise AgileMLError(f"job not done in {timeout_s}s: {self.events()}")
        if self.coordinator.error is not None:
            raise AgileMLError(f"the job was aborted: {self.coordinator.error}")
        params = self.coordinator.fetch_parameters()
        self.coordinator.stop()
        self._stop_unjoined()
        return params, self._collect()

    def _stop_unjoined(self) -> None:
        """Stop the nodes that were still joining (or held) when the job ended: they wait to
        hear that they are ready, not that the job is over, and would be waited on for
        `STOP_GRACE_SECONDS` each (a joiner released near the end kept `train` 10 s longer)."""
        computing = (NodeState.ACTIVE, NodeState.LEAVING, NodeState.GONE)
        for node_id, proc in self._procs.items():
            if proc.poll() is None and self.coordinator.node_state(node_id) not in computing:
                self._unjoined.add(node_id)
                proc.terminate()

    def close(self) -> None:
        """Stop the controller and every node process that is still running."""
        self.coordinator.stop()
        for proc in self._procs.values():
            _close_stdin(proc)
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs.values():
            try:
                proc.wait(STOP_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _collect(self) -> dict[str, NodeOutcome]:
        out = {}
        for node_id, proc in self._procs.items():
            _close_stdin(proc)  # as `communicate` did
            try:
                proc.wait(timeout=STOP_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            stdout = self._out_path(node_id).read_text(errors="replace")
            lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
            if node_id in self._killed or node_id in self._held or not lines:
                ended = "killed" if node_id in self._killed else "crashed"
                ended = "still joining at the end" if node_id in self._unjoined else ended
                ended = "never released" if node_id in self._held else ended
                out[node_id] = NodeOutcome(node_id, ended, [], [], {}, {})
                continue
            data = json.loads(lines[-1])
            out[node_id] = NodeOutcome(
                node_id,
                data["ended"],
                [(int(c), float(v)) for c, v in data["losses"]],
                [(int(c), float(t)) for c, t in data["ends"]],
                {k: float(v) for k, v in data.get("timings", {}).items()},
                {k: float(v) for k, v in data.get("straggler", {}).items()},
                [int(c) for c in data.get("skipped_clocks", [])],
            )
        return out

    @property
    def log_dir(self) -> Path:
        return self._log_dir


def _close_stdin(proc: forked.Forked) -> None:
    """End a node's stdin: one still held reads EOF and exits (released by nobody)."""
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()


def _children(pid: int) -> list[int]:
    """The process ids of `pid`'s children (Linux's /proc: listed by the thread that started
    each)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out
