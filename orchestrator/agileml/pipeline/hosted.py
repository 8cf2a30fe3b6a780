"""`HostedPipeline`: a pipeline job (`parallelism: pipeline`) run on the instances a controller
holds for it, with the interface `hosting.HostedTraining` has for data-parallel jobs.

The supervisor listens where the job's launch tag says (`remote.NodePool`): every instance's
agent registers there as a node. Once `min_nodes` have, the first of them profiles the job's
layers (on its data, which the controller never fetches) and PipeDream's planner lays them out
on those nodes (stages, replicas); each node runs `devices_per_node` stage workers (one per
GPU of its instance, 1 unless the job says otherwise; the planner's two levels then: a node's
devices, then the nodes).
From then on the supervisor works as the local launcher does (`launch.Launch`:
rendezvous, backups of every stage's weights and optimizer state at each consistent cut,
faults; the backups go to a `holder.BackupHolder` on the first reliable (on-demand) node when
the job has one, which runs a stage worker too, as every AgileML node is a worker; else they
stay here), with these policies for a footprint that changes under it:
- a node lost (evicted, with or without notice) is replaced by a node that registers within
  `REPLACE_WAIT_S`: only the lost node's workers restart there (the same slots and devices),
  from the cut, while the others rewind in place (stage-only recovery). With no node to take
  its place the job re-plans for the nodes left and every stage restarts from the cut (so
  does a node of several workers that lost one: it cannot be replaced alone);
- a node that registers while the pipeline runs is used by re-planning for every node held
  (every stage restarts from the cut) once it has been there `failure_timeout_s` + 1 s (it may
  be the replacement of a node whose loss is not known yet).
Microbatches per iteration are fixed at the first plan, so every layout runs the same
optimizer steps (flush/gpipe: the same as one process).

Failure semantics: a stage that crashes (an error in the job's code) ends the training with
that stage's log tail as `error`; the controller's job goes on until it ends (no retries of a
deterministic failure). A restarted controller's supervisor resumes from the holder's cut (the
nodes are told to register again; the holder keeps its cut); without a reliable instance it
starts again from the initial model (pipeline jobs write no checkpoints yet).
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import math
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

from orchestrator.agileml import checkpoints
from orchestrator.agileml.control import TrainingSpec, TrainingStatus
from orchestrator.agileml.errors import AgileMLError
from orchestrator.agileml.jobcode import JobCode, code_path, load_job_code, seeded_model
from orchestrator.agileml.parts import training_parts
from orchestrator.agileml.pipeline.holder import RemoteBackups
from orchestrator.agileml.pipeline.launch import Backups, Launch, Layout, Recovery
from orchestrator.agileml.pipeline.local import chain_sizes, check_layout, describe
from orchestrator.agileml.pipeline.planner import slots_of
from orchestrator.agileml.pipeline.processes import StageProcess
from orchestrator.agileml.pipeline.profiler import ModelProfile
from orchestrator.agileml.pipeline.remote import NodePool
from orchestrator.agileml.pipeline.schedule import Schedule
from orchestrator.agileml.pipeline.source import ChainModelSpec, job_layers, load_layers
from orchestrator.agileml.pipeline.trainrun import (
    INSTANCE_BYTES_PER_S,
    microbatches_for,
    plan_on_nodes,
)

log = logging.getLogger(__name__)

#: Seconds a lost stage waits for a node to take its place before the job re-plans.
REPLACE_WAIT_S = 15.0
#: Seconds a node may take to profile the job's layers (it loads the job and its data first).
PROFILE_TIMEOUT_S = 300.0
#: Seconds a node that said hello counts as the job's (its instance is not released) while it
#: fetches the job's code and data, which sends no heartbeat, before it registers.
FETCH_GRACE_S = 600.0
#: Schedules of a few updates are enough to find a deadlock (the orders repeat per update).
CHECK_UPDATES = 4


class HostedPipeline:
    """One pipeline job's supervisor, hosted (see the module docstring)."""

    def __init__(
        self,
        spec: TrainingSpec,
        *,
        token: bytes,
        host: str,
        port: int,
        replace_wait_s: float = REPLACE_WAIT_S,
    ) -> None:
        if spec.code is None:
            raise AgileMLError("a pipeline job needs its code (training.code)")
        self.spec = spec
        self._token = token
        self.code = code_path(spec, with_data=False)  # the data stays on the nodes
        self.out_dir = Path(tempfile.mkdtemp(prefix="pipeline-hosted-"))
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        rendezvous_port = self.inbox.bind_to_random_port(f"tcp://{host}")
        welcome = {"rendezvous_port": rendezvous_port, "code": spec.code,
                   "code_store": spec.code_store, "data": spec.data}  # fmt: skip
        try:
            self.pool = NodePool(
                job_id=spec.job_id, token=token, host=host, port=port, out_dir=self.out_dir,
                welcome=welcome, failure_timeout_s=max(spec.failure_timeout_s, 3.0),
            )  # fmt: skip
        except BaseException:  # the port is taken: nothing of this attempt stays
            self.inbox.close()
            self.ctx.term()
            shutil.rmtree(self.out_dir, ignore_errors=True)
            raise
        self.endpoint = f"tcp://{host}:{self.pool.port}"
        self._lock = threading.Lock()
        self._halt = threading.Event()
        self._events: list[str] = []
        self._error: str | None = None
        self._done = False
        self._iteration = 0
        self._loss: float | None = None
        self._final: np.ndarray | None = None
        self.backups: Backups = Backups()  # RemoteBackups when a reliable node holds them
        self.holder: str | None = None  # that node
        self.recoveries: list[Recovery] = []
        self.layout: Layout = ()
        self.placement: list[str] = []  # node of each worker (stages in order, replicas within)
        self.devices_per_node = spec.devices_per_node or 1  # stage workers a node runs
        self._device_index: list[int] = []  # each worker's device on its node (as placement)
        self.microbatches = 0
        self.replace_wait_s = replace_wait_s
        self.join_settle_s = self.pool.failure_timeout_s + 1.0  # see `_watch`
        self._recovery_told = True
        self._thread = threading.Thread(target=self._supervise, name="pipeline", daemon=True)

    @classmethod
    def start(
        cls, spec: TrainingSpec, *, token: bytes, host: str, port: int, **options: Any
    ) -> HostedPipeline:
        """Bind `host:port` for the job's nodes and start supervising (`options`: those of
        the constructor).

        Raises:
            zmq.ZMQError: the port is taken (a host tries the next one).
        """
        hosted = cls(spec, token=token, host=host, port=port, **options)
        try:
            hosted.pool.start()
        except BaseException:
            hosted.stop()
            raise
        hosted._thread.start()
        return hosted

    # --- what a host reads --------------------------------------------------------------

    @property
    def error(self) -> str | None:
        """Why the job failed: the supervisor's error, or its node server's crash."""
        return self._error or self.pool.crashed

    @property
    def done(self) -> bool:
        return self._done

    def progress(self) -> TrainingStatus:
        with self._lock:
            return TrainingStatus(self._iteration, self._loss, 0, 0)

    def events(self) -> list[str]:
        with self._lock:
            return [*self._events]

    def members(self) -> frozenset[str]:
        """The nodes (instances) registered now and heartbeating, leaving ones included, and
        those fetching the job's code and data before they register (for `FETCH_GRACE_S`)."""
        return frozenset(self.pool.nodes(include_leaving=True)) | self.pool.fetching(FETCH_GRACE_S)

    def node_work(self) -> dict[str, tuple[int, float]]:
        """Nothing: a stage's speed says nothing of its instance's for the whole model."""
        return {}

    def node_devices(self) -> dict[str, int]:
        """The stage workers (a device each) of every node in the running layout."""
        with self._lock:
            return dict(collections.Counter(self.placement))

    def watch_evaluations(self, checkpoints: object) -> None:
        """Nothing: a pipeline is evaluated at its end (`eval_every` is data-parallel)."""
        del checkpoints

    def evaluating(self) -> bool:
        """Never: a pipeline is evaluated by whoever fetches its weights."""
        return False

    def evaluations(self) -> list[dict[str, Any]]:
        """None during the run (see `watch_evaluations`)."""
        return []

    def stages(self) -> list[dict[str, Any]]:
        """The layout running now: per stage its layers and the nodes of its replicas."""
        with self._lock:
            out, w = [], 0
            for k, st in enumerate(self.layout):
                nodes = self.placement[w : w + st.replicas]
                out.append({"stage": k, "first_layer": st.first_layer,
                            "last_layer": st.last_layer, "nodes": nodes})  # fmt: skip
                w += st.replicas
            return out

    def model_loss(self, timeout_s: float = 1.0) -> float | None:
        """The mean loss of the last iteration's microbatches (the stages' own)."""
        with self._lock:
            return self._loss

    def initial_loss(self) -> float:
        """The model's loss on the training set before any update (the offline demo's; it
        reads the job's data here, as `HostedTraining.initial_loss` does)."""
        parts = training_parts(self.spec)
        return parts.loss_of(parts.initial_model)

    def evaluate(self, timeout_s: float = 1.0) -> dict[str, float] | None:
        job = self._job
        if job.evaluate is None:
            return None
        model = self._model(self._weights())
        model.eval()
        with torch.no_grad():
            return {k: float(v) for k, v in job.evaluate(model).items()}

    def save_weights(self, folder: checkpoints.Location, timeout_s: float = 10.0) -> int:
        """Write the model of the last cut (every iteration once `done`) into `folder`."""
        weights = self._weights()
        with self._lock:
            iterations = self._iteration
        checkpoints.save_weights(self._model(weights), folder)
        return iterations

    def save_checkpoint_weights(self, checkpoint: Any, folder: Any) -> int:
        raise AgileMLError("pipeline jobs do not write checkpoints yet")

    def stop(self) -> None:
        """Stop the supervisor; every node is told to stop its workers."""
        self._halt.set()
        try:
            if self._thread.is_alive():
                self._thread.join(timeout=30.0)
            self.pool.stop()
            self.inbox.close()
            self.ctx.term()
        finally:  # also when one of these raises (or a signal interrupts them)
            shutil.rmtree(self.out_dir, ignore_errors=True)

    # --- supervision ----------------------------------------------------------------------

    def _weights(self) -> np.ndarray | None:
        with self._lock:
            final = self._final
        return final if final is not None else self.backups.weights  # the holder's: a request

    @functools.cached_property
    def _job(self) -> JobCode:
        """The job's functions, imported once (on first use, not at hosting)."""
        return load_job_code(self.code)

    def _model(self, weights: np.ndarray | None) -> torch.nn.Module:
        job = self._job
        model = seeded_model(job, self.spec.seed)
        if weights is not None:
            load_layers(job_layers(job, model), torch.from_numpy(weights.copy()))
        return model

    def _event(self, line: str) -> None:
        log.info("pipeline: %s", line, extra={"job_id": self.spec.job_id})
        with self._lock:
            self._events.append(line)

    def _supervise(self) -> None:
        try:
            self._run()
        except Exception as exc:  # noqa: BLE001 - reported as the job's training error
            if self._halt.is_set():
                return  # stopped: the job ended and its instances went first
            if not isinstance(exc, AgileMLError):
                log.exception("pipeline supervisor failed")
            self._error = str(exc) if isinstance(exc, AgileMLError) else repr(exc)
            self._event(f"failed {self._error}")

    def _wait_nodes(self, count: int, timeout_s: float = math.inf) -> list[str] | None:
        deadline = time.monotonic() + timeout_s
        while not self._halt.is_set() and time.monotonic() < deadline:
            if self.pool.crashed:
                return None  # `error` says why
            busy = self.pool.busy()
            nodes = [n for n in self.pool.nodes() if n not in busy]
            if len(nodes) >= count:
                return nodes
            time.sleep(0.1)
        return None

    def _run(self) -> None:
        spec = self.spec
        nodes = self._wait_nodes(spec.min_nodes)
        if nodes is None:
            return
        profile = self._profile(nodes)
        if profile is None:
            return
        sizes = chain_sizes(ChainModelSpec(), spec.seed, self.code)
        backup_to, resumed_m, resumed = self._place_backups(nodes, sizes)
        layout = self._plan(profile, len(nodes))
        m = self.microbatches = resumed_m or microbatches_for(spec.global_batch, len(layout))
        if isinstance(self.backups, RemoteBackups):
            self.backups.microbatches = m
        minibatches = spec.iterations * m
        if resumed >= minibatches:  # the controller went after the last update: all backed up
            self._finish(None)
            return
        common = dict(model=ChainModelSpec(), code=self.code, sizes=sizes,
                      schedule=Schedule(spec.schedule), minibatches=minibatches, microbatches=m,
                      microbatch_size=spec.global_batch // m, lr=spec.lr, seed=spec.seed,
                      vertical_sync=False, backup=True, backup_to=backup_to)  # fmt: skip
        launch = Launch(self.ctx, self.inbox, "tcp://supervisor", self._token, self.out_dir,
                        time.monotonic() + 1e9, common, spawn=self._spawn,
                        devices_per_node=self.devices_per_node)  # fmt: skip
        self._check(launch, layout, minibatches - resumed)
        losses: dict[int, float] = {}
        self._start(launch, layout, nodes)
        self._event(f"planned {describe(layout)} on {' '.join(self.placement)}")
        while not self._halt.is_set():
            outcome = launch.run(losses, self.backups, self.recoveries, self._on_backup,
                                 watch=self._watch)  # fmt: skip
            if outcome == "halted":
                return
            if outcome == "done":
                self._finish(launch)
                return
            if self.backups.done >= minibatches:  # lost after every stage's last update
                self._finish(launch)
                return
            if outcome == "join":
                held = self.pool.nodes()
                free = [n for n in held if n not in self.placement]
                placed = [n for n in dict.fromkeys(self.placement) if n in held]
                self._restart(launch, profile, placed + free, "joined")
                continue
            self._recover(launch, profile, minibatches)

    def _place_backups(self, nodes: list[str], sizes: list[int]) -> tuple[str | None, int, int]:
        """The reliable copy on the first reliable node: its holder's endpoint (the stages
        back up there; None: no reliable node, kept here) and, when the holder already has a
        cut (this supervisor restarted), the microbatches per iteration it counts in and the
        minibatches in it (else 0, 0)."""
        tiers = self.pool.tiers()
        reliable = [n for n in nodes if tiers.get(n) == "reliable"]
        if reliable:
            answer = self.pool.request(reliable[0], "hold", {}, timeout_s=30.0)
            if answer is not None:
                state = answer[0]
                self.holder = reliable[0]
                self.backups = RemoteBackups(self.pool, reliable[0], sizes)
                self._event(f"backups on {reliable[0]} (reliable)")
                done, m = int(state.get("done", 0)), int(state.get("microbatches", 0))
                if done > 0 and m > 0:
                    with self._lock:
                        self._iteration = done // m
                    self._event(f"resumed from iteration {done // m}: the cut on {reliable[0]}")
                    return str(state["endpoint"]), m, done
                return str(state["endpoint"]), 0, 0
        self._event("backups on the supervisor (no reliable instance to hold them)")
        return None, 0, 0

    def _profile(self, nodes: list[str]) -> ModelProfile | None:
        """The job's layers timed on its first node that answers (on its data; None: halted).

        Raises:
            AgileMLError: the job's code failed there (its error).
        """
        spec = self.spec
        while not self._halt.is_set():
            node = nodes[0]
            workers = len(nodes) * self.devices_per_node
            body = {"seed": spec.seed, "global_batch": spec.global_batch, "workers": workers}
            self.pool.command(node, "profile", body)
            deadline = time.monotonic() + PROFILE_TIMEOUT_S
            while node not in self.pool.profiles and node in self.pool.nodes():
                if self._halt.is_set() or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            answer = self.pool.profiles.pop(node, None)
            if answer is None and node in self.pool.nodes() and not self._halt.is_set():
                raise AgileMLError(
                    f"profiling the job's layers on {node} took over {PROFILE_TIMEOUT_S:g} s"
                )
            if answer is not None and "error" in answer:
                raise AgileMLError(
                    f"profiling the job's layers on {node} failed: {answer['error']}"
                )
            if answer is not None:
                self._event(f"profiled {len(answer['profile']['layers'])} layers on {node}")
                return ModelProfile.model_validate(answer["profile"])
            nodes = self._wait_nodes(spec.min_nodes) or []  # that node went: ask another
        return None

    def _recover(self, launch: Launch, profile: ModelProfile, minibatches: int) -> None:
        """A worker was lost: replace its node's workers alone on a node that takes its place,
        else re-plan; nothing when every minibatch got backed up meanwhile (the run loop
        finishes)."""
        if self._halt.is_set():
            return
        self._recovery_told = False
        (lost,) = launch.lost[:1]
        recovery = self.recoveries[-1]
        gone = self.placement[lost]
        self._event(f"lost stage {recovery.stage} on {gone} (minibatch {self.backups.done})")
        # a spare can take the place of one node lost: of its one worker, or of its K if gone
        # (a node of K still here is re-planned on at once: it cannot be replaced alone)
        one_node = len({self.placement[w] for w in launch.lost}) == 1
        waits = one_node and (self.devices_per_node == 1 or gone not in self.pool.nodes())
        spare = self._wait_nodes(1, self.replace_wait_s) if waits else None
        # a survivor whose worker has exited (lost after `done`) is free, but no spare
        spare = [n for n in spare or () if n not in self.placement] or None
        held = self.pool.nodes()  # after the wait: a node may have gone meanwhile
        # a node of several workers: those of its workers still running survive with it
        survivors = [n for i, n in enumerate(self.placement) if i != lost and n in held]
        if self._halt.is_set() or self.backups.done >= minibatches:
            return  # a stage relaunched at the end would have nothing to run
        if one_node and self.devices_per_node > 1 and gone not in held:  # every worker of it
            launch.lost = [w for w, n in enumerate(self.placement) if n == gone]
        if spare and launch.can_replace(self.backups):
            with self._lock:
                for w in launch.lost:  # the same slots: the same devices on the new node
                    self.placement[w] = spare[0]
            launch.replace(self.backups)
            recovery.mode, recovery.resumed_minibatch = "stage", self.backups.done
            recovery.layout = self.layout
            stages = sorted({launch.workers[w][0] for w in launch.lost})
            named = f"stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))}"
            self._event(f"replaced {named} on {spare[0]} from iteration "
                        f"{self.backups.done // self.microbatches}")  # fmt: skip
            return
        nodes = list(dict.fromkeys(survivors + (spare or [])))
        if not nodes:
            self._event("no node left: waiting for one")
            nodes = self._wait_nodes(1) or []
            if not nodes:
                return
        self._restart(launch, profile, nodes, "re-planned")
        recovery.resumed_minibatch, recovery.layout = self.backups.done, self.layout

    def _restart(self, launch: Launch, profile: ModelProfile, nodes: list[str], why: str) -> None:
        if self._halt.is_set():
            return
        launch.kill_all()
        self.backups.forget_partial()
        layout = self._plan(profile, len(nodes))
        self._check(launch, layout, launch.common["minibatches"] - self.backups.done)
        self._start(launch, layout, nodes)
        self._event(f"{why}: {describe(layout)} on {' '.join(self.placement)} from iteration "
                    f"{self.backups.done // self.microbatches}")  # fmt: skip

    def _check(self, launch: Launch, layout: Layout, left: int) -> None:
        """Refuse a layout that cannot run the `left` minibatches (AgileMLError); a few
        updates show a deadlock (the orders repeat per update)."""
        common, m = launch.common, self.microbatches
        workers = sum(st.replicas for st in layout)
        check_layout(layout, len(common["sizes"]), common["schedule"],
                     min(left, CHECK_UPDATES * m * workers), m)  # fmt: skip

    def _plan(self, profile: ModelProfile, nodes: int) -> Layout:
        """The layout on `nodes` nodes of `devices_per_node` stage workers each."""
        k, stages = self.devices_per_node, self.spec.stages
        return plan_on_nodes(profile, nodes, k, INSTANCE_BYTES_PER_S, stages)

    def _start(self, launch: Launch, layout: Layout, nodes: list[str]) -> None:
        """Start the layout's workers: the one in slot s on node s // K, on its device s % K."""
        k = self.devices_per_node
        slots = [slot for stage in slots_of(layout) for slot in stage]  # as Launch's workers
        with self._lock:
            self.layout = layout
            self.placement = [nodes[slot // k] for slot in slots]
            self._device_index = [slot % k for slot in slots]
        zeros = [0.0] * len(layout)
        launch.start(layout, self.backups, (zeros, zeros))

    def _spawn(self, name: str, config_path: Path) -> StageProcess:
        config = json.loads(config_path.read_text())
        worker = sum(st.replicas for st in self.layout[: config["stage"]]) + config["replica"]
        files = {
            Path(config[key]).name: Path(config[key]).read_bytes()
            for key in ("initial_weights", "initial_optimizer")
            if config.get(key)
        }
        return self.pool.spawn(self.placement[worker], name, config, files,
                               device_index=self._device_index[worker])  # fmt: skip

    def _watch(self) -> str | None:
        if self._halt.is_set():
            return "halted"
        held = self.pool.nodes()
        if any(n not in held for n in self.placement):
            return None  # a node of the layout is leaving: a new one is its replacement
        free = [n for n in held if n not in self.placement]
        # a node that came just now may be the replacement of one lost but not yet known lost
        # (its heartbeats stop `failure_timeout_s` before the pool says so): wait that long
        settle = self.join_settle_s
        return "join" if any(self.pool.registered_for(n) >= settle for n in free) else None

    def _on_backup(self, done: int, losses: dict[int, float]) -> None:
        last = self.recoveries[-1] if self.recoveries else None
        if last is not None and last.seconds is not None and not self._recovery_told:
            self._recovery_told = True
            self._event(f"running again {last.seconds:.2f} s after stage {last.stage} was lost")
        m = self.microbatches
        recent = [losses[k] for k in sorted(losses)[-m:]] if losses else []
        with self._lock:
            self._iteration = done // m
            if recent:
                self._loss = sum(recent) / len(recent)

    def _finish(self, launch: Launch | None) -> None:
        """Done: the final weights from the stages' results, else from the reliable copy."""
        if launch is not None and launch.results:
            files = [self.out_dir / f"stage{k}.npy" for k in range(len(self.layout))]
            final = np.concatenate([np.load(f) for f in files])
        else:
            weights = self.backups.weights  # the holder's: one request
            assert weights is not None
            final = weights
        with self._lock:
            self._final = final
            self._iteration = self.spec.iterations
            self._done = True
        self._event(f"done: {self.spec.iterations} iterations")
