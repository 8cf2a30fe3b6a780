"""An AgileML node: one parameter server (whatever role the controller gives it) and one worker.

Lifecycle: start the server, `join` the job's elasticity controller (which answers with the
training spec), build the data and model (the "load"), say `ready`, then train by the view that
every heartbeat reply carries, until the view says `done`/`shutdown` or the roster no longer has
this worker (after an eviction: then, once the server has handed off its partitions, `left`).

Run one per machine: `python -m orchestrator.agileml.node --node-id ... --tier transient
--controller tcp://...`, with the job token hex in `ORCHESTRATOR_AGILEML_TOKEN`
(`token.AGILEML_TOKEN_ENV`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import torch

from orchestrator.agileml import checkpoints
from orchestrator.agileml.batches import DatasetRows, RowSource, share_read_seconds
from orchestrator.agileml.control import (
    ControlClient,
    ControlError,
    Heartbeat,
    JobFailed,
    Join,
    Leaving,
    Left,
    Ready,
    Reply,
    TrainingSpec,
    View,
    dump,
)
from orchestrator.agileml.devices import DeviceGroup, DeviceLostError, node_devices
from orchestrator.agileml.elasticity import NodeTier
from orchestrator.agileml.errors import AgileMLError, HandoffError, PartitionError, WorkerError
from orchestrator.agileml.jobcode import uses_batch_statistics
from orchestrator.agileml.loading import LoaderRows
from orchestrator.agileml.lowprio import at_low_priority
from orchestrator.agileml.partitions import PartitionLayout, PartitionTable
from orchestrator.agileml.parts import training_parts
from orchestrator.agileml.peers import PeerLink
from orchestrator.agileml.reassign import Reassigner
from orchestrator.agileml.rejections import FINAL_REJECTIONS
from orchestrator.agileml.roster import Roster
from orchestrator.agileml.server import HANDOFF_TIMEOUT_SECONDS, ParamServer
from orchestrator.agileml.token import token_from_env
from orchestrator.agileml.usercode import JobCodeError, failure_report
from orchestrator.agileml.worker import StaleViewError, Worker, WorkerSpec
from orchestrator.errors import UserError
from orchestrator.lifecycle import exit_with_parent
from orchestrator.logfmt import log_to_stderr

log = logging.getLogger(__name__)
T = TypeVar("T")

JOIN_TIMEOUT_SECONDS = 10.0
LOST_CONTROLLER_HEARTBEATS = 50
LEFT_ATTEMPTS = 3  # heartbeats without an answer before the node gives up
#: The longest a loading node waits for its rows loader's processes to start (`loading`).
LOADER_START_S = 120.0
#: A share of rows read item by item is read ahead (`loading`) if it takes at least this long
#: to read: the loader's processes and hand-over cost more than a quicker read saves (a
#: 140-row table indexed in Python: 0.104 s per iteration with the loader, 0.014 without).
LOADER_MIN_SHARE_S = 0.02
#: How often a held node's wait for its release looks at whether it was stopped.
RELEASE_POLL_S = 0.2


@dataclass
class NodeResult:
    """What a node did: its losses by clock, when each iteration ended (wall clock, so that
    processes can be compared), and how it ended."""

    node_id: str
    losses: list[tuple[int, float]] = field(default_factory=list)
    ends: list[tuple[int, float]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per iteration phase
    straggler: dict[str, float] = field(default_factory=dict)  # FlexRR counters (ReassignStats)
    ended: str = ""  # done | left | lost_controller
    devices: int = 1  # the devices it trained on at the end (`devices`)
    devices_lost: int = 0  # device processes that were gone (it went on with its first)
    skipped_clocks: list[int] = field(default_factory=list)  # fp16: its gradient overflowed


class AgileMLNode:
    """One node of an AgileML job (see the module docstring). `run()` blocks; `leave()` and
    `stop()` may be called from other threads (e.g. a spot-notice watcher)."""

    def __init__(
        self,
        node_id: str,
        tier: NodeTier,
        *,
        job_id: str,
        controller: str,
        token: bytes,
        host: str = "127.0.0.1",
        phase_hook: Callable[[str, int], None] | None = None,
        low_priority_load: bool = False,
        devices: int | None = None,
        first_device: int = 0,
    ) -> None:
        self.node_id = node_id
        # a held node (`train --inject join@N`) loads and warms up, then waits for `hold()`
        # before it says ready, so that it joins when asked, not a load later; False: never
        # released (the job ended first, or the node was stopped)
        self.hold: Callable[[], bool] | None = None
        # the devices this node has (`node_devices`: every GPU, or this many CPU processes)
        self._devices_requested = devices
        self._first_device = first_device
        self._devices: DeviceGroup | None = None
        self._loader: LoaderRows | None = None  # the rows read ahead (`loading`)
        self._scale_hint: int | None = None  # fp16: where the running workers' scale is
        # load and warm up at nice 19 (`_load`): for a node beside running ones on one machine
        self._low_priority_load = low_priority_load
        self._phase_hook = phase_hook  # fault injection in tests (see Worker)
        self.tier = tier
        self.job_id = job_id
        self._controller = controller
        self._token = token
        self._host = host
        self._view = View()
        self._spec: TrainingSpec | None = None
        self._layout: PartitionLayout | None = None
        self._initial: list[Any] = []
        # a resumed job's checkpoint, read when this node is first given partitions (a node
        # that joins later gets them by hand-off, and the checkpoint may be pruned by then)
        self._checkpoint: checkpoints.Checkpoint | None = None
        self._server: ParamServer | None = None
        self._leaving = threading.Event()
        self._stop = threading.Event()
        self._clock = 0
        self._last_loss: float | None = None
        self._lost = False
        self._job_error: str | None = None  # the job's code failed here (`_failure`)
        self._failure_cause: Literal["job_code", "refused"] = "job_code"  # `JobFailed.cause`
        self._worker: Worker | None = None
        self._reassigner: Reassigner | None = None
        self._link: PeerLink | None = None
        self._refresh = threading.Event()  # the trainer wants a heartbeat (and view) now

    @property
    def stopping(self) -> bool:
        """`stop` was called (SIGTERM)."""
        return self._stop.is_set()

    def leave(self) -> None:
        """An eviction notice: finish the current clock, hand partitions off, then exit."""
        self._leaving.set()

    def stop(self) -> None:
        """Exit at once (the controller will treat this node as failed)."""
        self._stop.set()

    @property
    def artifact_store(self) -> str | None:
        """The job's artifact store, once joined (the spec's `code_store`, set by the
        controller; None for a job run without one)."""
        spec = self._spec
        return spec.code_store if spec is not None else None

    @property
    def view(self) -> View:
        return self._view

    def run(self) -> NodeResult:
        """Join, train and leave (see the module docstring).

        Raises:
            ControlError: the controller did not accept the join.
        """
        server = ParamServer(
            self.node_id,
            job_id=self.job_id,
            token=self._token,
            host=self._host,
            control=self._on_control,
        )
        self._server = server
        client = ControlClient(job_id=self.job_id, sender=self.node_id, token=self._token)
        # the FlexRR inbox is bound before the join so that peers learn it from the view
        self._link = PeerLink(self.node_id, job_id=self.job_id, token=self._token, host=self._host)
        result = NodeResult(self.node_id)
        try:
            spec = self._join(client, server)
            log.info("joined", extra={"node": self.node_id, "tier": str(self.tier),
                                      "job": self.job_id})  # fmt: skip
            # heartbeats from the join on: the controller tells a node that died while
            # loading from a slow one by them
            beat = threading.Thread(
                target=self._heartbeats, args=(spec,), name=f"hb-{self.node_id}", daemon=True
            )
            beat.start()
            try:
                spec_worker = self._load(spec)
            except JobCodeError as exc:  # deterministic: the job fails with it, not the node
                self._report_failure(client, failure_report(exc))
                raise
            if self.hold is not None:
                log.info("loaded; held until released", extra={"node": self.node_id})
                if not self.hold():
                    result.ended = "never released"
                    return result
                if self._scale_hint is not None:  # fp16: the scale the others reached since
                    spec_worker.start_loss_scale_at(self._scale_hint)
            self._ready(client)
            log.info("loaded and ready", extra={"node": self.node_id})
            result.ended = self._train(spec, spec_worker, result)
            computed = [c for c, _ in result.losses]  # the iterations it computed
            log.info("ended", extra={"node": self.node_id, "how": result.ended,
                                     "computed": len(computed),
                                     "last": max(computed, default=None)})  # fmt: skip
            self._stop.set()
            beat.join(5)
            if result.ended == "left":
                for _ in range(LEFT_ATTEMPTS):  # else the controller takes it for a failure
                    if self._send(client, Left()) is not None:
                        break
            return result
        finally:
            self._stop.set()
            if self._devices is not None:
                self._devices.close()
            if self._loader is not None:
                log.info("rows loader", extra={"node": self.node_id,
                                               "shares_read_ahead": self._loader.prefetched,
                                               "shares_read_here": self._loader.missed,
                                               "failed": self._loader.failed})  # fmt: skip
                self._loader.close()
            client.close()
            server.stop()
            if self._reassigner is not None:
                self._reassigner.close()
            elif self._link is not None:
                self._link.close()

    # -- phases -----------------------------------------------------------------------------

    def _join(self, client: ControlClient, server: ParamServer) -> TrainingSpec:
        server.start()
        peer = self._link.endpoints if self._link is not None else None
        reply = self._send(
            client, Join(tier=self.tier, endpoint=server.endpoint, peer_inboxes=peer)
        )
        if reply is None or not reply.ok or reply.spec is None:
            why = (reply.error or "refused") if reply is not None else "no answer to join"
            raise ControlError(self._controller, why)
        self._spec = reply.spec
        if reply.view is not None:
            self._view = reply.view
        return reply.spec

    def _ready(self, client: ControlClient) -> None:
        """Say `ready` until the controller answers (a busy controller may miss one call; a
        repeated `ready` is ignored).

        Raises:
            ControlError: no answer within JOIN_TIMEOUT_SECONDS.
        """
        deadline = time.monotonic() + JOIN_TIMEOUT_SECONDS
        while self._send(client, Ready()) is None:
            if time.monotonic() > deadline or self._stop.is_set():
                raise ControlError(self._controller, "no answer to `ready`")

    def _load(self, spec: TrainingSpec) -> Worker:
        """Build the job's data, model and worker, warmed up. Beside running workers (one
        machine) a joiner's load slows their clocks, so with `low_priority_load` the runtime's
        own code runs at the lowest priority (`lowprio`): a built-in model's data and
        parameters, and every job's warm-up. A user's job code builds on this thread (it may
        start threads or set thread state)."""
        if spec.code is None:
            parts = self._low_priority(lambda: training_parts(spec))
        else:
            parts = training_parts(spec)
        if self._server is not None:
            self._server.set_update_rules(parts.rules)
            self._server.set_clipping(spec.clip_grad_norm is not None)
        self._initial = parts.layout.gather(parts.initial_model)
        self._layout = parts.layout
        slots = node_devices(
            self._devices_requested, spec.devices_per_node, first=self._first_device
        )
        if len(slots) > 1:  # a job code error in a device process is a JobCodeError too
            group = DeviceGroup(self.node_id, spec.model_dump_json(), parts.layout, slots)
            self._devices = group
            try:
                group.start(stopping=self._stop.is_set)
            except DeviceLostError as exc:  # a device that cannot start: train on the first
                log.warning("a device process did not start; training on the first device",
                            extra={"node": self.node_id, "error": str(exc)})  # fmt: skip
                group.close()
                self._devices = None
        self._worker = Worker(
            WorkerSpec(
                self.node_id,
                spec.job_id,
                spec.global_batch,
                spec.slack,
                seed=spec.seed,
                overlap=spec.overlap,
                accumulate=spec.accumulate,
                precision=spec.precision,
                wire_precision=spec.wire_precision,
                clip_grad_norm=spec.clip_grad_norm,
                iterations=spec.iterations,
            ),
            token=self._token,
            layout=self._layout,
            table=PartitionTable(spec.num_partitions),
            endpoints={},
            model_factory=parts.model_factory,
            data=self._rows_source(spec, parts.rows),
            loss_fn=parts.loss_fn,
            device=slots[0],
            roster=Roster.starting([self.node_id]),
            epoch=0,
            abort=self._should_abort,
            phase_hook=self._phase_hook,
            local_endpoints=self._local_endpoints(),
            devices=self._devices,
        )
        if self._scale_hint is not None:  # fp16: a joiner starts at the others' scale
            self._worker.start_loss_scale_at(self._scale_hint)
        straggler = spec.straggler
        # fp16: a helper's gradients would be scaled by its own loss scale (`precision`);
        # BatchNorm: a chunk's batch statistics are not the share's (and a chunk of one row
        # fails in train mode: a user's job through the controller failed on it)
        flexrr = (
            straggler.flexrr
            and spec.precision != "fp16"
            and not uses_batch_statistics(parts.initial_model)
        )
        if flexrr or straggler.injected is not None:
            self._reassigner = Reassigner(
                straggler,
                worker_id=self.node_id,
                link=self._link if flexrr else None,
                leaving=self._leaving.is_set,
            )
            self._worker.reassigner = self._reassigner
        self._warm_up(self._worker, self._reassigner)
        if self._loader is not None and not self._loader.wait_started(
            LOADER_START_S, stopping=self._stop.is_set
        ):
            log.warning("the rows loader is not up; the worker reads its rows itself until it is",
                        extra={"node": self.node_id, "failed": self._loader.failed})  # fmt: skip
        if not flexrr and self._link is not None:
            self._link.close()
            self._link = None
        return self._worker

    def _rows_source(self, spec: TrainingSpec, rows: RowSource) -> RowSource:
        """The job's rows, read ahead by a DataLoader (`loading`) when they are read item by
        item, a share of them takes at least `LOADER_MIN_SHARE_S` to read, and this worker
        takes them all (not its device processes, which take their own)."""
        if (
            spec.loader_workers > 0
            and isinstance(rows, DatasetRows)
            and not rows.indexed_at_once
            and self._devices is None
        ):
            share_s = share_read_seconds(rows, math.ceil(spec.global_batch / self._workers(spec)))
            if share_s < LOADER_MIN_SHARE_S:
                log.info("rows read here: a share is too quick to read for a loader to pay",
                         extra={"node": self.node_id,
                                "share_read_ms": round(share_s * 1000, 3)})  # fmt: skip
                return rows
            self._loader = LoaderRows(rows, spec.model_dump_json(), spec.loader_workers)
            log.info("rows read ahead", extra={
                "node": self.node_id, "loader_workers": spec.loader_workers,
                "share_read_ms": round(share_s * 1000, 3)})  # fmt: skip
            return self._loader
        return rows

    def _workers(self, spec: TrainingSpec) -> int:
        """The workers this node expects to share a global batch with, itself included, as it
        loads: the roster's (a node joining a running job), else the nodes the job starts
        with (`min_nodes`, which a job spec may leave at 1: the share is then overrated)."""
        roster = self._view.roster
        if roster is None:
            return spec.min_nodes
        latest = roster.entries[-1].workers  # the membership last scheduled
        return len(set(latest) | {self.node_id})

    def _low_priority(self, work: Callable[[], T]) -> T:
        """`work()` at nice 19 if this node loads at low priority, on a CPU-only machine (CUDA
        and autograd's device threads started there would stay at nice 19), else here."""
        if self._low_priority_load and not torch.cuda.is_available():
            return at_low_priority(work)
        return work()

    def _warm_up(self, worker: Worker, reassigner: Reassigner | None) -> None:
        """FlexRR's chunk calibration (which warms up too), or else one forward/backward,
        before `ready`: not in a clock the running workers wait on. If it fails (on the
        low-priority thread, say), the first clock does it, and any real fault of the model
        surfaces there."""
        try:
            if reassigner is not None:
                self._low_priority(lambda: reassigner.calibrate(worker))
            else:
                self._low_priority(worker.warm_up)
        except Exception:  # noqa: BLE001 - not needed to train; the first clock retries
            log.warning("warm-up failed; the first clock will do it", exc_info=True)

    def _should_abort(self) -> bool:
        """Stop waiting: stopped, rolled back, or given a dead worker's shares (which the
        pull it waits on may need)."""
        worker, view = self._worker, self._view
        if self._stop.is_set():
            return True
        if worker is None:
            return False
        return view.epoch != worker.epoch or self._adoptions(view) != worker.adoptions

    def _adoptions(self, view: View) -> dict[str, tuple[int, int]]:
        return {
            w: (a.from_clock, a.to_clock)
            for w, a in view.adoptions.items()
            if a.surrogate == self.node_id
        }

    def _train(self, spec: TrainingSpec, worker: Worker, result: NodeResult) -> str:
        was_member = False
        clip = spec.clip_grad_norm is not None
        settled: tuple[int | None, int] = (None, -1)  # (epoch, clock) settled at
        try:
            while not self._stop.is_set():
                view = self._view
                if self._lost:
                    return "lost_controller"
                if self._server is not None and self._server.crashed:
                    raise AgileMLError(self._server.crashed)  # its partitions are unreachable
                # clipping: the last clock waits for its coefficient, which the workers send
                # once past it; `done` (every worker past it) may come before they have
                unsettled = (
                    clip
                    and worker.clock >= spec.iterations
                    and settled
                    != (
                        worker.epoch,
                        worker.clock,
                    )
                )
                done = view.done and not unsettled
                if view.shutdown or (done and not self._owns_partitions()):
                    return "done"
                if view.epoch == 0 or view.roster is None or done:
                    time.sleep(spec.heartbeat_s / 4)
                    continue
                self._sync(worker, view)
                clock = worker.clock
                first = view.roster.first_clock_of(self.node_id, clock)
                if clip and clock >= spec.iterations and settled != (worker.epoch, clock):
                    if self._settle(worker, spec):  # clipping: the last clock's coefficient
                        settled = (worker.epoch, clock)  # again after a roll-back
                    continue
                if clock >= spec.iterations or first is None:
                    evicted = was_member and first is None and self._leaving.is_set()
                    if evicted and not self._owns_partitions():
                        return "left"  # out of the roster, partitions handed off
                    time.sleep(spec.heartbeat_s / 4)
                    continue
                if first > clock:
                    worker.clock = first  # a joining worker starts at its scheduled clock
                was_member = True
                try:
                    loss = worker.step()
                except StaleViewError as exc:
                    self._await_view(worker, exc.roster_version, spec)
                    continue
                except DeviceLostError as exc:
                    self._device_lost(worker, exc, result)
                    continue
                except JobCodeError as exc:  # no retry can fix it: the job fails with it
                    self._job_error = failure_report(exc)  # with the job's traceback
                    log.error("the job's code failed:\n%s", self._job_error)
                    return self._await_abort(spec)
                except WorkerError as exc:
                    if self._failure() is not None:  # this node's server applied it and failed
                        return self._await_abort(spec)
                    if exc.reason.partition(":")[0] in FINAL_REJECTIONS:  # no retry can help
                        self._failure_cause = "refused"  # before the error: see `_failure`
                        self._job_error = str(exc)
                        log.error("a parameter server refused this worker's request: %s", exc)
                        return self._await_abort(spec)
                    log.warning("iteration failed; retrying", extra={"error": str(exc)})
                    time.sleep(spec.heartbeat_s)
                    continue
                self._clock, self._last_loss = worker.clock, loss
                result.losses.append((worker.clock - 1, loss))
                result.ends.append((worker.clock - 1, time.time()))
            return "stopped"
        finally:
            result.timings = dict(worker.timings)
            if self._reassigner is not None:
                result.straggler = self._reassigner.summary()
            worker.close()
            result.devices = worker.device_count
            result.skipped_clocks = sorted(worker.skipped_clocks)

    def _settle(self, worker: Worker, spec: TrainingSpec) -> bool:
        """`worker.settle()`; False if it is to be tried again (see `_train`'s retries)."""
        try:
            worker.settle()
        except StaleViewError as exc:
            self._await_view(worker, exc.roster_version, spec)
            return False
        except WorkerError as exc:
            log.warning("settling the last clock failed; retrying", extra={"error": str(exc)})
            time.sleep(spec.heartbeat_s)
            return False
        return True

    def _device_lost(self, worker: Worker, exc: DeviceLostError, result: NodeResult) -> None:
        """A device process is gone: the node goes on with its first device alone (the
        iteration is redone there), and a transient node leaves, as on an eviction notice, so
        that its instance is released and replaced."""
        group = worker.devices
        result.devices_lost += group.size - 1 if group is not None else 0
        worker.devices = None
        log.warning(
            "a device process is gone; going on with the first device"
            + ("" if self.tier is NodeTier.RELIABLE else " and leaving"),
            extra={"node": self.node_id, "error": str(exc)},
        )
        if self.tier is not NodeTier.RELIABLE:
            self.leave()

    def _failure(self) -> str | None:
        """The report of the job's code failing here (in the worker, or in this node's
        parameter server applying an update), None while it has not."""
        server = self._server
        return self._job_error or (server.job_error if server is not None else None)

    def _await_abort(self, spec: TrainingSpec) -> str:
        """After the job's code failed here: the heartbeat thread reports it, and the
        controller aborts the job; wait for its shutdown (or its loss) and say so."""
        self._refresh.set()  # the next heartbeat now
        while not self._stop.is_set() and not self._lost and not self._view.shutdown:
            time.sleep(spec.heartbeat_s / 4)
        return "job_failed"

    def _report_failure(self, client: ControlClient, error: str) -> None:
        """Tell the controller that the job's code failed (a few tries: it may be busy)."""
        for _ in range(LEFT_ATTEMPTS):
            if self._send(client, JobFailed(error=error, cause=self._failure_cause)) is not None:
                return

    def _await_view(self, worker: Worker, roster_version: int | None, spec: TrainingSpec) -> None:
        """Ask for the view now, and wait (a little) until it is newer than the worker's."""
        self._refresh.set()
        deadline = time.monotonic() + spec.failure_timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            view = self._view
            if view.epoch != worker.epoch:
                return
            current = view.roster.version if view.roster is not None else -1
            if roster_version is not None and current >= roster_version:
                return
            if roster_version is None and self._refresh.is_set() is False:
                return  # refreshed once; a stale epoch shows in the next one
            time.sleep(0.002)

    def _sync(self, worker: Worker, view: View) -> None:
        """Bring the worker to the view: a new epoch restarts its clock and its table."""
        if view.epoch != worker.epoch:
            worker.epoch = view.epoch
            worker.clock = view.restart_clock
            worker.table = PartitionTable(len(self._initial))
        worker.roster = view.roster
        worker.endpoints = dict(view.endpoints)
        if self._reassigner is not None:
            self._reassigner.update_view(epoch=view.epoch, roster=view.roster, peers=view.peers)
        worker.adoptions = self._adoptions(view)
        for p, owner in view.owners.items():
            if worker.table.get(p).owner is None:
                worker.table.move(p, owner)
            worker.table.set(p, owner, view.versions.get(p, 0))
        self._clock = worker.clock

    def _local_endpoints(self) -> dict[str, str]:
        """This node's server, reached by its worker in-process (`ServerLoop.inproc_endpoint`)."""
        server = self._server
        if server is None or not server.inproc_endpoint:
            return {}
        return {server.endpoint: server.inproc_endpoint}

    def _owns_partitions(self) -> bool:
        server = self._server
        return server is not None and bool(server.owned())

    # -- heartbeats -------------------------------------------------------------------------

    def _heartbeats(self, spec: TrainingSpec) -> None:
        client = ControlClient(job_id=spec.job_id, sender=self.node_id, token=self._token)
        misses = 0
        told_leaving = False
        try:
            while not self._stop.is_set():
                if self._leaving.is_set() and not told_leaving:
                    told_leaving = self._send(client, Leaving()) is not None
                failure = self._failure()
                if failure is not None:  # the job's code failed here: the job must abort
                    self._report_failure(client, failure)
                self._refresh.clear()
                helped = (
                    0 if self._reassigner is None else self._reassigner.stats.rows_helped_by_others
                )
                rows, busy = (0, 0.0) if self._worker is None else self._worker.work_done()
                beat = Heartbeat(
                    clock=self._clock,
                    loss=self._last_loss,
                    reassigned_rows=helped,
                    rows_computed=rows,
                    compute_s=busy,
                    devices=1 if self._worker is None else self._worker.device_count,
                    loss_scale_exponent=None
                    if self._worker is None
                    else self._worker.loss_scale_exponent,
                )
                reply = self._send(client, beat)
                misses = 0 if reply is not None else misses + 1
                if misses >= LOST_CONTROLLER_HEARTBEATS:
                    self._lost = True
                    return
                self._refresh.wait(spec.heartbeat_s)
        finally:
            client.close()

    def _send(self, client: ControlClient, message: Any) -> Reply | None:
        spec = self._spec
        timeout = spec.failure_timeout_s / 2 if spec is not None else JOIN_TIMEOUT_SECONDS
        try:
            out = client.call(self._controller, dump(message), timeout)
        except ControlError as exc:
            log.warning("controller call failed", extra={"op": message.op, "error": exc.reason})
            return None
        reply = Reply.model_validate(out)
        if reply.view is not None:
            self._view = reply.view
        if reply.loss_scale_exponent is not None:
            self._scale_hint = reply.loss_scale_exponent
        return reply

    # -- control ops from the controller (run on the server's control threads) -------------

    def _on_control(self, body: dict[str, Any]) -> dict[str, Any]:
        server, layout = self._server, self._layout
        if server is None or layout is None:
            raise AgileMLError("node not loaded yet")
        op = body.get("op")
        if op == "configure":
            if "epoch" in body:
                server.set_epoch(int(body["epoch"]))
            if "horizon" in body:
                server.set_horizon(int(body["horizon"]), int(body["slack"]))
            if "backups" in body:
                server.set_backups({int(p): e for p, e in body["backups"].items()})
            if "init_own" in body:  # the start: what the node holds is exactly this
                server.keep_only(
                    {int(p) for p in body["init_own"]},
                    {int(p) for p in body.get("init_backup", [])},
                )
            for p, version in body.get("init_own", {}).items():
                server.add_partition(int(p), version=int(version), **self._start_of(int(p)))
            for p in body.get("init_backup", []):
                server.add_backup(int(p), **self._start_of(int(p)))
            if "roster" in body:
                server.set_roster(Roster.model_validate(body["roster"]))
            if "backup_ceiling" in body:
                server.set_backup_ceiling(int(body["backup_ceiling"]))
            return {}
        if op == "handoff":
            return hand_off(server, {int(p): str(e) for p, e in body["moves"].items()})
        if op == "resume":
            for p in body["partitions"]:
                server.resume_partition(int(p))
            return {}
        if op == "restore":
            owners = {int(p): e for p, e in body["owners"].items()}
            versions = {int(p): int(v) for p, v in body["versions"].items()}
            clock = body.get("clock")
            restored = server.restore_owners(
                int(body["epoch"]), owners, versions, clock=None if clock is None else int(clock)
            )
            return {"restored": {p: list(cv) for p, cv in restored.items()}}
        if op == "status":
            unsettled = server.unsettled()
            return {"owned": server.owned(), "backed": server.backed(), "unsettled": unsettled}
        if op == "checkpoint":
            clock, owned = int(body["clock"]), body.get("source") == "owned"
            states = server.partition_states(clock, backup=not owned)
            for p, (values, state) in states.items():
                checkpoints.write_part(body["dir"], p, clock=clock, values=values, rule_state=state)
            return {"written": sorted(states)}
        if op == "consistent":
            return {"clocks": server.consistent_clocks()}
        if op == "backup_progress":
            return {"backups": {p: list(ac) for p, ac in server.backup_progress().items()}}
        if op == "progress":
            return {"progress": server.worker_progress(str(body["worker"]))}
        raise AgileMLError(f"unknown control op {op!r}")

    def _start_of(self, p: int) -> dict[str, Any]:
        """Partition p as the job starts: the initial model's values, or, resuming, the
        checkpoint's values, optimizer state and clock."""
        spec = self._spec
        if spec is None or spec.resume_from is None:
            return {"values": self._initial[p]}
        if self._checkpoint is None:
            self._checkpoint = checkpoints.read(spec.resume_from, spec.num_partitions)
        ckpt = self._checkpoint
        return {"values": ckpt.values[p], "rule_state": ckpt.rule_states[p], "clock": ckpt.clock}


def hand_off(
    server: ParamServer, moves: dict[int, str], *, timeout_s: float = HANDOFF_TIMEOUT_SECONDS
) -> dict[str, Any]:
    """The `handoff` control op: each move tried (one failing does not stop the others).

    Returns `versions` (partition -> version at its new owner), `refused` (partition ->
    reason; still served here) and `unknown` (partition -> reason: no ack came, the
    partition stays frozen; see `ParamServer.handoff_to`).
    """
    versions: dict[int, int] = {}
    refused: dict[int, str] = {}
    unknown: dict[int, str] = {}
    for p, endpoint in sorted(moves.items()):
        try:
            versions[p] = server.handoff_to(p, endpoint, timeout_s=timeout_s).version
        except HandoffError as exc:
            (unknown if exc.outcome_unknown else refused)[p] = str(exc)
        except PartitionError as exc:
            refused[p] = str(exc)
    return {"versions": versions, "refused": refused, "unknown": unknown}


def _released_on_stdin(node: AgileMLNode) -> bool:
    """A held node's release: a line on stdin (True); EOF, or the node stopped (SIGTERM), is
    False. Polled, so that a stop ends the wait (a blocking read outlived SIGTERM)."""
    while not node.stopping:
        ready, _, _ = select.select([sys.stdin], [], [], RELEASE_POLL_S)
        if ready:
            return bool(sys.stdin.readline())
    return False


def main(argv: list[str] | None = None, *, low_priority_load: bool = False) -> int:
    """Run one node until its job is done or it leaves; prints its result as JSON.
    `low_priority_load`: see `AgileMLNode` (`node_process` sets it; a held node, `--hold`,
    loads at normal priority with the job's start and says ready when a line comes on stdin)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--node-id", required=True)
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--tier", choices=[t.value for t in NodeTier], required=True)
    parser.add_argument("--controller", required=True, help="tcp://host:port of the controller")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve partitions on")
    parser.add_argument(
        "--hold", action="store_true", help="load, then say ready once a line is on stdin"
    )
    parser.add_argument(
        "--devices", type=int, help="devices to train on (default: every GPU, else 1 CPU)"
    )
    parser.add_argument(
        "--first-device", type=int, default=0, help="the first GPU's index (nodes sharing GPUs)"
    )
    args = parser.parse_args(argv)
    try:
        token = token_from_env()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # the runtime's milestones (joined, ready, hand-offs, how it ended) and what went wrong;
    # other libraries' at WARNING
    log_to_stderr(f"agileml[{args.node_id}]", "WARNING")
    level = os.environ.get("ORCHESTRATOR_LOG_LEVEL", "INFO")
    logging.getLogger("orchestrator").setLevel(level)
    log.setLevel(level)  # this module's own: `__main__` under `python -m`
    node = AgileMLNode(
        args.node_id,
        NodeTier(args.tier),
        job_id=args.job_id,
        controller=args.controller,
        token=token,
        host=args.host,
        low_priority_load=low_priority_load and not args.hold,
        devices=args.devices,
        first_device=args.first_device,
    )
    if args.hold:
        node.hold = lambda: _released_on_stdin(node)
    exit_with_parent()  # a SIGKILLed launcher leaves no node behind
    signal.signal(signal.SIGUSR1, lambda *_: node.leave())  # the eviction notice
    signal.signal(signal.SIGTERM, lambda *_: node.stop())
    result = node.run()
    print(json.dumps(dataclasses.asdict(result)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
