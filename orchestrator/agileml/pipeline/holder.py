"""The reliable copy of a hosted pipeline job on one of its reliable (on-demand) instances.

A pipeline job's stages back their weights and optimizer state up after every update. With a
reliable instance in the job, those backups go to a `BackupHolder` there (in its node, as a
BackupPS is in AgileML), not to the supervisor: the holder keeps the last consistent cut
(`launch.Backups`) and forwards each backup to the supervisor without its weights (the count
and the losses, which is all the supervisor decides on). It outlives a supervisor: a restarted
controller's supervisor finds the holder's cut and resumes the job from there. When the
supervisor (re)starts stages it asks the holder, through the node pool, for the cut
(`RemoteBackups`): `begin` (a new attempt: older messages are dropped from then on; the cut's
count) and `cut` (a stage's layers' weights and optimizer state). A reliable instance is
on-demand: it is not evicted; if it is lost anyway, the supervisor's requests fail and the
training ends with that error.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import zmq
from safetensors.torch import load as load_entries
from safetensors.torch import save as save_entries

from orchestrator.agileml import wire
from orchestrator.agileml.drops import DropLog
from orchestrator.agileml.errors import AgileMLError, WireError
from orchestrator.agileml.pipeline.launch import Backups
from orchestrator.agileml.wire import MessageKind

if TYPE_CHECKING:
    from orchestrator.agileml.pipeline.remote import NodePool

log = logging.getLogger(__name__)

#: Seconds the supervisor waits for the holder's answer (a cut may be the whole model).
REQUEST_TIMEOUT_S = 60.0


class BackupHolder:
    """The holder, on a reliable node (see the module docstring): `start()` binds its inbox
    on `host` (its `endpoint`) and runs its thread; backups of attempts other than the current
    one are dropped."""

    def __init__(self, token: bytes, job_id: str, host: str, rendezvous: str) -> None:
        self._token, self.job_id, self.rendezvous = token, job_id, rendezvous
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://{host}:{self.inbox.bind_to_random_port(f'tcp://{host}')}"
        self.forward = self.ctx.socket(zmq.PUSH)
        self.forward.setsockopt(zmq.LINGER, 1000)
        self.forward.connect(rendezvous)
        self.backups = Backups()
        self.attempt = ""  # the job id of the current attempt
        self.workers: list[tuple[int, int]] = []
        self.stages = 0
        self.offsets = np.zeros(1, dtype=np.int64)  # each layer's start in the flat weights
        self.microbatches = 0  # the job's microbatches per iteration (what `done` counts)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._seq = 0
        self._thread = threading.Thread(target=self._serve, name="backup-holder", daemon=True)
        self._drops = DropLog(log, "backup holder dropped a message", job_id=job_id)
        self.crashed: str | None = None  # why its thread ended, if it failed

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.inbox.close()
        self.forward.close()
        self.ctx.term()

    def begin(self, body: dict[str, Any]) -> dict[str, Any]:
        """A new attempt (`job_id`, `workers` [[stage, replica], ...], `stages`, `sizes`):
        partial cuts are dropped; returns the cut's count."""
        with self._lock:
            self.attempt = str(body["job_id"])
            self.workers = [(int(k), int(r)) for k, r in body["workers"]]
            self.stages = int(body["stages"])
            self.offsets = np.cumsum([0, *(int(n) for n in body["sizes"])])
            self.microbatches = int(body.get("microbatches", 0))
            self.backups.forget_partial()
            return {"done": self.backups.done}

    def state(self) -> dict[str, Any]:
        """Where stages back up to, and the cut it holds (a restarted supervisor resumes from
        it: `done` minibatches of `microbatches` per iteration)."""
        with self._lock:
            return {"endpoint": self.endpoint, "done": self.backups.done,
                    "microbatches": self.microbatches}  # fmt: skip

    def retarget(self, rendezvous: str) -> None:
        """Forward to this supervisor inbox from now on (a restarted supervisor's)."""
        with self._lock:
            if rendezvous != self.rendezvous:
                self.forward.close()
                self.forward = self.ctx.socket(zmq.PUSH)
                self.forward.setsockopt(zmq.LINGER, 1000)
                self.forward.connect(rendezvous)
                self.rendezvous = rendezvous

    def cut(self, body: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Layers `first`..`last` at the cut: `w` (absent: the initial weights) and `o` (the
        optimizer entries, a safetensors blob; absent: none)."""
        first, last = int(body["first"]), int(body["last"])
        with self._lock:
            flat, entries = self.backups.cut_of(first, last, self.offsets)
        out: dict[str, torch.Tensor] = {}
        if flat is not None:
            out["w"] = torch.from_numpy(flat.copy())
        if entries:
            out["o"] = torch.frombuffer(bytearray(save_entries(entries)), dtype=torch.uint8)
        return out

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if self.inbox.poll(100):
                    self._receive(self.inbox.recv_multipart())
        except Exception as exc:  # the socket itself failed: its node fails on it
            log.exception("backup holder crashed", extra={"job_id": self.job_id})
            self.crashed = f"the backup holder stopped serving: {exc!r}"

    def _receive(self, frames: list[bytes]) -> None:
        try:
            header, tensors = wire.decode(frames, self._token)
        except WireError as exc:
            self._drops.drop(str(exc))  # not ours or malformed: dropped unread
            return
        with self._lock:
            if header.job_id != self.attempt or header.detail != "backup":
                return  # an earlier attempt's
            try:
                self._file(header, tensors)
                self._forward(header, tensors)
            except Exception as exc:  # noqa: BLE001 - one message never ends the loop
                self._drops.drop(f"handling a backup failed: {exc!r}")

    def _file(self, header: wire.Header, tensors: dict[str, torch.Tensor]) -> None:
        try:
            worker = int((header.sender or "").removeprefix("worker"))
            stage, replica = self.workers[worker]
        except (ValueError, IndexError):
            return
        if replica != 0 or header.clock is None or "w" not in tensors:
            return  # replicas hold the same weights: replica 0 backs the stage up
        blob = tensors["o"].numpy().tobytes() if "o" in tensors else b""
        optimizer = load_entries(blob) if blob else None
        weights = tensors["w"].numpy().copy()
        self.backups.add(header.clock, stage, self.stages, weights, optimizer)

    def _forward(self, header: wire.Header, tensors: dict[str, torch.Tensor]) -> None:
        """The backup to the supervisor without its weights and optimizer state."""
        self._seq += 1
        fields = {"kind": MessageKind.PIPE, "job_id": header.job_id, "sender": header.sender,
                  "seq": self._seq, "clock": header.clock, "detail": "backup"}  # fmt: skip
        light = {k: v for k, v in tensors.items() if k in ("loss", "mb")}
        # never block (the lock is held): to a supervisor that is gone, once its queue is full,
        # they are dropped (a new one learns the cut from `begin`)
        with contextlib.suppress(zmq.Again):
            self.forward.send_multipart(wire.encode(fields, light, self._token), zmq.NOBLOCK)


class RemoteBackups(Backups):
    """The supervisor's view of the cut a `BackupHolder` keeps on node `holder`: counts from
    the forwarded backups; the weights and optimizer state asked for when needed.

    Raises (from `begin`, `cut_of`, `weights`):
        AgileMLError: the holder did not answer (its reliable instance is gone).
    """

    def __init__(self, pool: NodePool, holder: str, sizes: list[int]) -> None:
        super().__init__()
        self.pool, self.holder, self.sizes = pool, holder, sizes
        self.microbatches = 0  # told to the holder with each attempt

    def _keep(self, parts: list[tuple[np.ndarray, dict[str, torch.Tensor]]]) -> None:
        pass  # the forwarded backups carry no weights: the holder keeps them

    def begin(self, job_id: str, workers: list[tuple[int, int]], stages: int) -> None:
        self.forget_partial()
        body = {"job_id": job_id, "workers": workers, "stages": stages, "sizes": self.sizes,
                "microbatches": self.microbatches}  # fmt: skip
        answer, _ = self._ask("begin", body)
        self.done = int(answer["done"])

    def cut_of(
        self, first_layer: int, last_layer: int, offsets: np.ndarray
    ) -> tuple[np.ndarray | None, dict[str, torch.Tensor]]:
        _, tensors = self._ask("cut", {"first": first_layer, "last": last_layer})
        flat = tensors["w"].numpy().copy() if "w" in tensors else None
        entries = load_entries(tensors["o"].numpy().tobytes()) if "o" in tensors else {}
        return flat, entries

    @property
    def weights(self) -> np.ndarray | None:
        """The whole model at the holder's cut (None: the initial weights)."""
        if not self.sizes:
            return None
        flat, _ = self.cut_of(0, len(self.sizes) - 1, np.cumsum([0, *self.sizes]))
        return flat

    @weights.setter
    def weights(self, value: np.ndarray | None) -> None:
        pass  # set by Backups.__init__; the holder has the weights

    def _ask(
        self, detail: str, body: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        answer = self.pool.request(self.holder, detail, body, timeout_s=REQUEST_TIMEOUT_S)
        if answer is None:
            raise AgileMLError(
                f"the reliable instance {self.holder} holding the pipeline's backups did not "
                f"answer ({detail}); the job cannot resume without them"
            )
        return answer
