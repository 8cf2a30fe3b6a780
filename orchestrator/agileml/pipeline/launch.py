"""The pipeline launcher's processes and the reliable copy they back up to (`local`).

`Backups` keeps the weights and optimizer state of the last consistent cut: the most
minibatches every stage's backups include. `Launch` starts one `pipeline.stage` process per
worker, rendezvouses them, watches them and, when one is lost, either restarts them all from
the cut (`start`, on a new layout if the job re-planned) or replaces only the lost node's
workers (`replace`: its one, or all `devices_per_node` of them): the survivors rewind in place
to the cut (`stage.Rewind`), keeping their processes, models and data, and the replacements
start from the cut.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import zmq
from safetensors.torch import load as load_entries
from safetensors.torch import save_file

from orchestrator.agileml import wire
from orchestrator.agileml.errors import AgileMLError, WireError
from orchestrator.agileml.pipeline.planner import PlannedStage, slots_of
from orchestrator.agileml.pipeline.processes import Spawn, StageProcess, spawn_local
from orchestrator.agileml.pipeline.stage import StageConfig, device_for
from orchestrator.agileml.wire import MessageKind
from orchestrator.lifecycle import KEEP_LOGS_ENV, keep_logs

log = logging.getLogger(__name__)

Layout = tuple[PlannedStage, ...]
#: A worker that exited cleanly without its `done` arriving within this long was lost.
EXIT_GRACE_S = 2.0
#: A worker leaving on notice is replaced once the cut includes its last update, or after this.
LEAVE_WAIT_S = 5.0
#: A worker that said `done` and has not exited this long after is lost (see `Launch._reap`).
EXIT_WAIT_S = 60.0


@dataclass(frozen=True)
class Fault:
    """An injected fault, due once the input stage has backed up `at` minibatches: `kill`
    SIGKILLs the node of the first worker of `stage` (every worker on it), `evict` gives them
    the eviction notice (SIGUSR1), `kill-device` SIGKILLs that one worker (its node is lost
    with it), `join` adds a node (the run re-plans for one more). `stage` None: the middle
    stage of the layout running then (its loss cuts the pipeline in two)."""

    kind: Literal["kill", "evict", "join", "kill-device"]
    at: int
    stage: int | None = None


def _cut_tensors(weights: str | None, optimizer: str | None) -> dict[str, torch.Tensor]:
    """A stage's slice of the cut as `rewind` tensors: `w` its weights, `o` its optimizer
    state (a safetensors blob); from the files `Launch._cut_files` wrote."""
    out: dict[str, torch.Tensor] = {}
    if weights is not None:
        out["w"] = torch.from_numpy(np.load(weights))
    if optimizer is not None:
        out["o"] = torch.frombuffer(bytearray(Path(optimizer).read_bytes()), dtype=torch.uint8)
    return out


def logs_hint(out_dir: Path) -> str:
    """Where a failed run's stage logs are: kept only with ORCHESTRATOR_KEEP_LOGS=1."""
    if keep_logs():
        return f"logs in {out_dir}"
    return f"set {KEEP_LOGS_ENV}=1 to keep the stages' logs"


@dataclass
class Recovery:
    """One loss: when the (first) lost worker's stage was killed, the minibatch the job
    resumed at, the layout it resumed on, how (`stage`: the lost node's workers alone were
    replaced; `restart`: every worker restarted) and when the next minibatch completed after
    it."""

    stage: int
    killed_at: float
    resumed_minibatch: int
    layout: Layout
    next_minibatch_at: float | None = None
    mode: str = "restart"
    notice: bool = False  # the worker had an eviction notice and left after a backup

    @property
    def seconds(self) -> float | None:
        return None if self.next_minibatch_at is None else self.next_minibatch_at - self.killed_at


class Backups:
    """The reliable tier's copy: the weights (flat, in layer order, whatever the layout) and
    the optimizer state (per weight, see `PipelineStage.optimizer_entries`) that include the
    first `done` minibatches, the most that every stage backed up, and the partial newer
    counts (stages whose updates sum different group sizes meet at common multiples)."""

    def __init__(self) -> None:
        self.done = 0
        self.weights: np.ndarray | None = None  # None: the initial weights
        self.optimizer: dict[str, torch.Tensor] = {}
        self._partial: dict[int, dict[int, tuple[np.ndarray, dict[str, torch.Tensor]]]] = {}

    def add(
        self,
        done: int,
        stage: int,
        stages: int,
        weights: np.ndarray | None,
        optimizer: dict[str, torch.Tensor] | None = None,
    ) -> None:
        parts = self._partial.setdefault(done, {})
        parts[stage] = (np.zeros(0, np.float32) if weights is None else weights, optimizer or {})
        if len(parts) == stages and done > self.done:
            self.done = done
            self._keep([parts[k] for k in range(stages)])
            self._partial = {s: p for s, p in self._partial.items() if s > done}

    def _keep(self, parts: list[tuple[np.ndarray, dict[str, torch.Tensor]]]) -> None:
        """The new cut's weights and optimizer state, stage by stage."""
        self.weights = np.concatenate([weights for weights, _ in parts])
        self.optimizer = {key: t for _, entries in parts for key, t in entries.items()}

    def optimizer_of(self, first_layer: int, last_layer: int) -> dict[str, torch.Tensor]:
        """The optimizer entries of layers first_layer..last_layer."""
        return {
            key: t
            for key, t in self.optimizer.items()
            if first_layer <= int(key.split(".", 1)[0]) <= last_layer
        }

    def forget_partial(self) -> None:
        self._partial.clear()

    def begin(self, job_id: str, workers: list[tuple[int, int]], stages: int) -> None:
        """A new attempt starts from the cut (a holder elsewhere drops older messages)."""
        self.forget_partial()

    def cut_of(
        self, first_layer: int, last_layer: int, offsets: np.ndarray
    ) -> tuple[np.ndarray | None, dict[str, torch.Tensor]]:
        """Layers first_layer..last_layer at the cut: their weights (None: the initial ones)
        and optimizer entries; `offsets[i]` is layer i's start in the flat weights."""
        if self.weights is None:
            return None, self.optimizer_of(first_layer, last_layer)
        flat = self.weights[offsets[first_layer] : offsets[last_layer + 1]]
        return flat, self.optimizer_of(first_layer, last_layer)


class Launch:
    """Starting, watching, replacing and stopping the stage processes of a run."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        inbox: zmq.Socket[Any],
        rendezvous: str,
        token: bytes,
        out_dir: Path,
        deadline: float,
        common: dict[str, Any],
        spawn: Spawn | None = None,
        devices_per_node: int = 1,
    ) -> None:
        self.ctx, self.inbox, self.rendezvous, self.token = ctx, inbox, rendezvous, token
        self.devices_per_node = devices_per_node  # a node's workers: slots s // K alike
        self.out_dir, self.deadline, self.common = out_dir, deadline, common
        self.spawn = spawn or spawn_local(token, out_dir)
        self._config = {k: v for k, v in common.items() if k != "sizes"}  # for StageConfig
        self._offsets = np.cumsum([0, *common["sizes"]])  # each layer's start in the weights
        self.procs: list[StageProcess] = []
        self.workers: list[tuple[int, int]] = []  # (stage, replica) of each process
        self.inboxes: dict[int, str] = {}  # worker -> its inbox, from the last rendezvous
        self.results: list[dict[str, Any]] = []
        self.lost: list[int] = []  # the workers `run` found lost
        self.faults: list[Fault] = []  # still to inject, in order
        self.joining = False  # a join is due: `run` returns "join"
        self.attempt = 0
        self.job_id = ""
        self.layout: Layout = ()
        self._slots: list[int] = []  # each worker's slot (`slot_of`)
        self._times: tuple[list[float], list[float]] = ([], [])
        self._started_at = 0.0

    def start(
        self, layout: Layout, backups: Backups, times: tuple[list[float], list[float]]
    ) -> None:
        """Start every worker of `layout` from the reliable copy (the initial model if it is
        empty)."""
        self._new_attempt()
        self.layout, self._times = layout, times
        self.procs = []
        self.workers = [(k, r) for k, st in enumerate(layout) for r in range(st.replicas)]
        self._slots = [slot for stage in slots_of(layout) for slot in stage]  # as `workers`
        backups.begin(self.job_id, self.workers, len(layout))
        for k, st in enumerate(layout):
            files = self._cut_files(k, st, backups)
            for r in range(st.replicas):
                self.procs.append(self._spawn(k, r, backups.done, files))

    def slot_of(self, worker: int) -> int:
        """The worker's slot in the layout's plan (`planner.slots_of`)."""
        return self._slots[worker]

    def node_of(self, worker: int) -> int:
        """The node the worker runs on: `devices_per_node` consecutive slots each."""
        return self.slot_of(worker) // self.devices_per_node

    def nodes(self) -> int:
        """The nodes the running layout is on."""
        return len(self.workers) // self.devices_per_node

    def workers_on(self, node: int) -> set[int]:
        """The workers that run on `node`."""
        return {w for w in range(len(self.workers)) if self.node_of(w) == node}

    def can_replace(self, backups: Backups) -> bool:
        """Whether `replace` can recover: the workers lost are one node's (every one of its
        `devices_per_node`), every other one still running, and a cut past the start to
        rewind to."""
        lost = set(self.lost)
        nodes = {self.node_of(w) for w in lost}
        whole = len(nodes) == 1 and lost == self.workers_on(nodes.pop())
        others = [p for w, p in enumerate(self.procs) if w not in lost]
        alive = all(p.poll() is None for p in others)
        met = len(self.inboxes) == len(self.procs)  # this attempt's rendezvous completed
        return whole and alive and met and backups.done > 0

    def replace(self, backups: Backups) -> None:
        """Start new processes for the lost node's workers at the cut, and have every
        survivor rewind to the cut in place (see the module docstring)."""
        lost = list(dict.fromkeys(self.lost))
        deadline = time.monotonic() + LEAVE_WAIT_S  # one wait for them all
        for w in lost:  # a worker leaving on notice exits after its next backup, unless a
            with contextlib.suppress(subprocess.TimeoutExpired):  # node-mate that left stalls it
                self.procs[w].wait(timeout=max(0.0, deadline - time.monotonic()))
        for w in lost:
            if self.procs[w].poll() is None:
                self.procs[w].kill()
        for w in lost:
            self.procs[w].wait()
        inboxes = self.inboxes  # the survivors', from this attempt's rendezvous
        old_job = self._new_attempt()
        backups.begin(self.job_id, self.workers, len(self.layout))
        files = {k: self._cut_files(k, st, backups) for k, st in enumerate(self.layout)}
        for w, (k, _) in enumerate(self.workers):
            if w in lost:
                continue
            body = wire.json_body({"job_id": self.job_id, "first_minibatch": backups.done})
            self._send(inboxes[w], old_job, "rewind", {**body, **_cut_tensors(*files[k])})
        for w in lost:
            k, r = self.workers[w]
            self.procs[w] = self._spawn(k, r, backups.done, files[k])

    def run(
        self,
        losses: dict[int, float],
        backups: Backups,
        recoveries: list[Recovery],
        on_backup: Callable[[int, dict[int, float]], None] | None = None,
        watch: Callable[[], str | None] | None = None,
    ) -> str:
        """Rendezvous and watch until every worker is done ("done"), one is lost ("lost": its
        index in `lost`; nothing is stopped here), an injected join is due ("join"), or
        `watch()` (asked every poll) returns an outcome of its own."""
        procs, workers = self.procs, len(self.procs)
        hellos: dict[int, str] = {}
        done: set[int] = set()
        exited: dict[int, float] = {}  # worker -> when it was first seen exited cleanly
        leaving: dict[int, tuple[int, float]] = {}  # worker -> (its last backup, when)
        while len(done) < workers:
            codes = [p.poll() for p in procs]
            crashed = [w for w, code in enumerate(codes) if code is not None and code > 0]
            if crashed:  # an error in the stage's code, not a lost node: retrying repeats it
                raise AgileMLError(self._crash_report(crashed[0]))
            now = time.time()
            for w, code in enumerate(codes):  # a leaving worker exits too: see below
                if code == 0 and w not in done and w not in leaving:
                    exited.setdefault(w, now)
            self.lost = [w for w, code in enumerate(codes) if code is not None and code < 0]
            self.lost += [w for w, at in exited.items() if now - at > EXIT_GRACE_S]
            self.lost += [
                w
                for w, (last, at) in leaving.items()
                if (backups.done >= last or now - at > LEAVE_WAIT_S) and w not in self.lost
            ]
            if self.lost:
                return self._lose(backups, recoveries)
            if self.joining:
                self.joining = False
                return "join"
            if watch is not None and (outcome := watch()) is not None:
                return outcome
            remaining = int((self.deadline - time.monotonic()) * 1000)
            if remaining <= 0:
                hint = logs_hint(self.out_dir)
                raise AgileMLError(f"the pipeline did not finish in time ({hint})")
            if not self.inbox.poll(min(remaining, 100)):
                continue
            try:
                header, tensors = wire.decode(self.inbox.recv_multipart(), self.token)
            except WireError:
                continue  # not ours or malformed: dropped unread
            if header.job_id != self.job_id or header.clock is None:
                continue  # a late message of an earlier attempt
            if header.detail == "hello":
                try:
                    hellos[header.clock] = str(wire.parse_json_body(tensors)["inbox"])
                except (WireError, KeyError, TypeError):
                    continue  # a malformed hello: dropped, the stage says hello again
                if len(hellos) == workers:
                    self._send_peers(hellos)
            elif header.detail == "backup":
                self._on_backup(header, tensors, losses, backups, recoveries)
                if on_backup is not None and self._worker_of(header.sender) == 0:
                    on_backup(header.clock, losses)
            elif header.detail == "first":  # stage 0 completed its first minibatch
                if recoveries and recoveries[-1].next_minibatch_at is None:
                    recoveries[-1].next_minibatch_at = time.time()
            elif header.detail == "done":
                done.add(header.clock)
                exited.pop(header.clock, None)
            elif header.detail == "leaving":
                worker = self._worker_of(header.sender)
                if worker is not None:
                    leaving[worker] = (header.clock, time.time())
        reports = self._reap()
        crashed = [w for w, (code, _) in enumerate(reports) if code is not None and code > 0]
        if crashed:  # an error in the stage's code: a retry repeats it
            raise AgileMLError(self._crash_report(crashed[0]))
        lost = [w for w, (code, _) in enumerate(reports) if code is not None and code < 0]
        if lost and backups.done >= self.common["minibatches"]:
            log.warning("a stage's node went after its last update: the reliable copy")
            self.results = []
            return "done"
        if lost:  # its node went after `done`, before its result: redo from the cut
            self.lost = lost
            return self._lose(backups, recoveries)
        self.results = self._collect(reports)
        return "done"

    def _lose(self, backups: Backups, recoveries: list[Recovery]) -> str:
        """Workers `self.lost` are gone: note the recovery (unless injected), forget the
        minibatches not every stage backed up, and say "lost"."""
        if not self.common["backup"]:
            raise AgileMLError(f"a worker was lost ({logs_hint(self.out_dir)})")
        if not recoveries or recoveries[-1].killed_at < self._started_at:
            stage = self.workers[self.lost[0]][0]
            recoveries.append(Recovery(stage, time.time(), 0, ()))  # not injected
        backups.forget_partial()  # minibatches not every stage backed up are redone
        return "lost"

    def _reap(self) -> list[tuple[int | None, list[str]]]:
        """Every worker's exit code and the JSON lines of its output (each one reaped). A
        worker that said `done` but does not exit (or whose exit is not reported) within
        `EXIT_WAIT_S` is killed and counts as lost: its result never comes."""
        reports: list[tuple[int | None, list[str]]] = []
        exit_by = time.monotonic() + EXIT_WAIT_S  # one wait for them all
        for w, proc in enumerate(self.procs):
            left = self.deadline - time.monotonic()
            try:
                wait_s = min(exit_by, self.deadline) - time.monotonic()
                stdout, _ = proc.communicate(timeout=max(1.0, wait_s))
            except subprocess.TimeoutExpired:
                if left <= EXIT_WAIT_S:
                    hint = logs_hint(self.out_dir)
                    raise AgileMLError(f"a stage did not exit ({hint})") from None
                stage, replica = self.workers[w]
                log.warning("a worker did not exit after its last update; taken as lost",
                            extra={"stage": stage, "replica": replica})  # fmt: skip
                proc.kill()
                reports.append((-int(signal.SIGKILL), []))
                continue
            lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
            reports.append((proc.returncode, lines))
        return reports

    def _collect(self, reports: list[tuple[int | None, list[str]]]) -> list[dict[str, Any]]:
        """Every worker's result, sorted by (stage, replica).

        Raises:
            AgileMLError: a worker exited with an error or without its result (which, with
                its code).
        """
        for w, (code, lines) in enumerate(reports):
            if code != 0 or not lines:
                stage, replica = self.workers[w]
                how = f"exited with code {code}" if code != 0 else "exited without its result"
                raise AgileMLError(
                    f"stage {stage} (replica {replica}) {how} ({logs_hint(self.out_dir)})"
                )
        results = [
            {**json.loads(lines[-1]), "node": self.node_of(w)}
            for w, (_, lines) in enumerate(reports)
        ]
        return sorted(results, key=lambda r: (r["stage"], r["replica"]))

    def _on_backup(
        self,
        header: wire.Header,
        tensors: dict[str, torch.Tensor],
        losses: dict[int, float],
        backups: Backups,
        recoveries: list[Recovery],
    ) -> None:
        """File a stage's backup; inject the next fault when it is due."""
        worker, included = self._worker_of(header.sender), header.clock
        if worker is None or included is None:
            return
        stage, replica = self.workers[worker]
        if replica == 0:
            blob = tensors["o"].numpy().tobytes() if "o" in tensors else b""
            optimizer = load_entries(blob) if blob else None
            weights = tensors["w"].numpy().copy() if "w" in tensors else None
            backups.add(included, stage, len(self.layout), weights, optimizer)
        losses.update(zip(tensors["mb"].tolist(), tensors["loss"].tolist(), strict=True))
        if not self.faults or stage != 0 or included < self.faults[0].at:
            return
        fault = self.faults.pop(0)
        if fault.kind == "join":
            self.joining = True
            return
        k = fault.stage if fault.stage is not None else len(self.layout) // 2
        k = min(k, len(self.layout) - 1)  # the layout may have shrunk since
        notice = fault.kind == "evict"
        victim = self.workers.index((k, 0))
        hit = {victim} if fault.kind == "kill-device" else self.workers_on(self.node_of(victim))
        for w in sorted(hit):
            self.procs[w].send_signal(signal.SIGUSR1 if notice else signal.SIGKILL)
        recoveries.append(Recovery(k, time.time(), 0, (), notice=notice))

    def _new_attempt(self) -> str:
        """A new job id (messages of earlier attempts are dropped); returns the old one."""
        old = self.job_id
        self.inboxes = {}  # known again once this attempt's rendezvous completes
        self.attempt += 1
        self._started_at = time.time()
        self.job_id = f"pipe-{secrets.token_hex(4)}"
        return old

    def _cut_files(
        self, k: int, st: PlannedStage, backups: Backups
    ) -> tuple[str | None, str | None]:
        """Stage k's weights and optimizer state at the cut, as files (None: initial)."""
        weights = optimizer = None
        flat, entries = backups.cut_of(st.first_layer, st.last_layer, self._offsets)
        if flat is not None:
            weights = str(self.out_dir / f"initial{self.attempt}-{k}.npy")
            np.save(weights, flat)
        if entries:
            optimizer = str(self.out_dir / f"optimizer{self.attempt}-{k}.safetensors")
            save_file(entries, optimizer)
        return weights, optimizer

    def _spawn(
        self, k: int, r: int, first_minibatch: int, files: tuple[str | None, str | None]
    ) -> StageProcess:
        st = self.layout[k]
        config = StageConfig(
            job_id=self.job_id,
            stage=k,
            stages=len(self.layout),
            replicas=tuple(s.replicas for s in self.layout),
            replica=r,
            first_layer=st.first_layer,
            last_layer=st.last_layer,
            forward_ms=self._times[0][k],
            backward_ms=self._times[1][k],
            rendezvous=self.rendezvous,
            out_dir=str(self.out_dir),
            first_minibatch=first_minibatch,
            initial_weights=files[0],
            initial_optimizer=files[1],
            # on this machine's GPUs if it has any (a node that runs it picks its own)
            device=device_for(self.slot_of(self.workers.index((k, r)))),
            **self._config,
        )
        name = f"stage{k}.{r}-{self.attempt}"
        path = self.out_dir / f"{name}.json"
        path.write_text(config.model_dump_json())
        return self.spawn(name, path)

    def _crash_report(self, worker: int, tail_lines: int = 12) -> str:
        stage, replica = self.workers[worker]
        logs = sorted(self.out_dir.glob(f"stage{stage}.{replica}-*.log"), key=os.path.getmtime)
        lines = logs[-1].read_text(errors="replace").splitlines() if logs else []
        tail = "\n".join(lines[-tail_lines:])
        return f"stage {stage} (replica {replica}) crashed; the end of its log:\n{tail}"

    def _worker_of(self, sender: str | None) -> int | None:
        try:
            worker = int((sender or "").removeprefix("worker"))
        except ValueError:
            return None
        return worker if 0 <= worker < len(self.workers) else None

    def _send(self, endpoint: str, job_id: str, detail: str, tensors: dict[str, Any]) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(endpoint)
        fields = {"kind": MessageKind.PIPE, "job_id": job_id, "sender": "launcher",
                  "seq": 0, "clock": 0, "detail": detail}  # fmt: skip
        sock.send_multipart(wire.encode(fields, tensors, self.token))
        sock.close()

    def _send_peers(self, hellos: dict[int, str]) -> None:
        self._started_at = time.time()
        self.inboxes = dict(hellos)
        peers = {str(k): v for k, v in hellos.items()}
        for endpoint in hellos.values():
            self._send(endpoint, self.job_id, "peers", wire.json_body(peers))

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()
