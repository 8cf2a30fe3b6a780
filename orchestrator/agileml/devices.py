"""Every device of a node (`TrainingSpec.devices_per_node`): one worker per device, reduced
inside the node before its single push per partition.

A node with K devices runs its `Worker` on device 0 and starts K-1 device processes
(`device_process`), each building the job's model, rows and loss itself. For every batch of rows
the worker computes, the node's process (rank 0) sends the others, over a torch.distributed
group (gloo on CPUs, NCCL on GPUs) bound to 127.0.0.1:

1. a header (the operation and the number of rows);
2. the parameters, when they changed since the last batch (a pull), and the buffers;
3. the rows (global row numbers): each rank computes the r-th of K contiguous slices.

Then every rank's gradient, the change to its buffers and its loss sum are reduced (summed)
into rank 0, which adds them to its own model: the node's push is the gradient of all its rows,
so the wire traffic per node does not grow with K. The sum over slices is the whole batch's
gradient (the loss is a sum over rows, scaled by the global batch); buffers move by the mean of
the devices' changes, as they do across workers.

A device process that is gone (killed, crashed) fails the next collective at once: the group
raises `DeviceLostError`, and the node goes on with its first device alone (see `node`). A job
code error in a device process comes back as that process's failure report (`ReportedJobCodeError`).
The group's own channel is unauthenticated and bound to the loopback interface: only processes
on the node's machine reach it, as with torchrun's workers.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from orchestrator.agileml.errors import AgileMLError
from orchestrator.agileml.partitions import PartitionLayout
from orchestrator.agileml.spec import MAX_DEVICES
from orchestrator.agileml.usercode import ReportedJobCodeError

log = logging.getLogger(__name__)

#: How long a collective waits for a live peer: long, since a device process waits in one for
#: the node's next batch (a joiner waits for its first clock, a paused job for its resume);
#: a peer that is gone fails it at once (the connection closes).
COLLECTIVE_TIMEOUT = datetime.timedelta(hours=24)
#: How often the node checks whether its device processes are ready while they start.
START_POLL_S = 0.05
#: How often a node on GPUs checks that its device processes live (`DeviceGroup._watch`).
WATCH_POLL_S = 0.5
#: How long closing a group waits for the stop to be taken, then for each process to exit.
STOP_WAIT_S = 5.0
#: How long a failed collective waits for a device process's exit code, to report it.
EXIT_CODE_WAIT_S = 2.0

OP_BACKWARD, OP_STOP = 1, 2
HEADER = 4  # op, rows, whether the parameters follow, fp16's loss scale exponent


class DeviceLostError(AgileMLError):
    """A device process of this node is gone: its collective failed."""


@dataclass(frozen=True)
class DeviceSlot:
    """One device of a node: its rank in the node's group and its torch device."""

    rank: int
    device: torch.device


def node_devices(
    requested: int | None, cap: int | None = None, *, first: int = 0
) -> list[torch.device]:
    """The devices a node trains on: every GPU it has (at most `requested` and `cap`, when
    given; from GPU `first` on, wrapping around, for nodes that share a machine), else
    `requested` CPU processes standing in for devices (1 if not given).

    Raises:
        ValueError: `requested` or `cap` out of 1..MAX_DEVICES.
    """
    for name, value in (("devices", requested), ("devices_per_node", cap)):
        if value is not None and not 1 <= value <= MAX_DEVICES:
            raise ValueError(f"{name} must be in 1..{MAX_DEVICES}, got {value}")
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        k = min(count, requested or count, cap or count)
        return [torch.device("cuda", (first + i) % count) for i in range(k)]
    k = min(requested or 1, cap or MAX_DEVICES)
    return [torch.device("cpu")] * k


def backend_for(device: torch.device) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


def open_group(store: dist.Store, rank: int, size: int, device: torch.device) -> dist.ProcessGroup:
    """The node's process group (a collective rendezvous: every rank must call it)."""
    prefixed = dist.PrefixStore("devices", store)
    group: Any
    if backend_for(device) == "nccl":  # never run: no GPU was at hand (see the README)
        nccl = dist.ProcessGroupNCCL.Options()
        nccl._timeout = COLLECTIVE_TIMEOUT
        group = dist.ProcessGroupNCCL(prefixed, rank, size, nccl)
    else:
        gloo = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        gloo._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        gloo._timeout = COLLECTIVE_TIMEOUT
        group = dist.ProcessGroupGloo(prefixed, rank, size, gloo)
    return cast(dist.ProcessGroup, group)


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """Rank 0's `tensor` into every rank's `tensor`, in place."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def reduce_to_first(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """The sum of every rank's `tensor` into rank 0's (the others' are left undefined)."""
    options = dist.ReduceOptions()
    options.rootRank = 0
    options.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]
    group.reduce([tensor], options).wait()


def state_into(layout: PartitionLayout, model: nn.Module, out: torch.Tensor) -> None:
    """The model's parameters in layout order into the float32 vector `out`."""
    offset = 0
    for p in layout.params(model):
        n = p.numel()
        out[offset : offset + n].copy_(p.detach().reshape(-1))
        offset += n


def load_state(layout: PartitionLayout, model: nn.Module, flat: torch.Tensor) -> None:
    """Set the model's parameters from a `state_into` vector."""
    offset = 0
    with torch.no_grad():
        for p in layout.params(model):
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p))
            offset += n


def grads_into(layout: PartitionLayout, model: nn.Module, out: torch.Tensor) -> None:
    """The model's gradients (a missing one as 0) into the start of `out`."""
    offset = 0
    for p in layout.params(model):
        n = p.numel()
        if p.grad is None:
            out[offset : offset + n].zero_()
        else:
            out[offset : offset + n].copy_(p.grad.detach().reshape(-1))
        offset += n


def add_grads(layout: PartitionLayout, model: nn.Module, flat: torch.Tensor) -> None:
    """Add the start of `flat` to the model's gradients (a missing gradient is made)."""
    offset = 0
    for p in layout.params(model):
        n = p.numel()
        part = flat[offset : offset + n].view_as(p).to(p.dtype)
        if p.grad is None:
            p.grad = part.clone()
        else:
            p.grad.add_(part)
        offset += n


def slice_of(rows: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The rank-th of `size` contiguous slices of `rows` (empty when there are fewer rows)."""
    return torch.tensor_split(rows, size)[rank]


class DeviceGroup:
    """Rank 0 of a node's devices: starts the other device processes and runs each batch of
    rows across all of them (see the module docstring). Not thread-safe: the worker's thread
    calls `backward`.

    Raises (from `start`):
        ReportedJobCodeError: the job's code failed in a device process while it loaded.
        DeviceLostError: a device process exited while starting, or `stopping()` turned true.
    """

    def __init__(
        self,
        node_id: str,
        spec_json: str,
        layout: PartitionLayout,
        devices: Sequence[torch.device],
    ) -> None:
        if len(devices) < 2:
            raise ValueError("a device group needs at least two devices")
        self.node_id = node_id
        self.size = len(devices)
        self.device = devices[0]
        self._spec_json = spec_json
        self._devices = list(devices)
        self._layout = layout
        self._buffers = sum(layout.buffer_sizes)
        self._procs: list[subprocess.Popen[bytes]] = []
        self._store: dist.TCPStore | None = None
        self._group: dist.ProcessGroup | None = None
        self._synced_version = -1  # the worker's state version the others have
        self._state = torch.empty(layout.param_total, device=self.device)  # sent parameters
        # reduced: gradients, buffer changes, loss sum, failed ranks
        self._reduced = torch.zeros(layout.param_total + self._buffers + 2, device=self.device)
        self.lost = False
        self._closed = threading.Event()

    def start(self, stopping: Callable[[], bool] = lambda: False) -> None:
        """Start the device processes and wait until they have loaded the job and joined
        (as long as they live and `stopping()` is false: slow is not dead)."""
        self._store = dist.TCPStore("127.0.0.1", 0, self.size, True, wait_for_workers=False)
        for rank in range(1, self.size):
            cmd = [
                sys.executable, "-m", "orchestrator.agileml.device_process",
                "--node-id", self.node_id, "--rank", str(rank), "--size", str(self.size),
                "--port", str(self._store.port), "--device", str(self._devices[rank]),
            ]  # fmt: skip
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE)
            assert proc.stdin is not None
            proc.stdin.write(self._spec_json.encode())
            proc.stdin.close()
            self._procs.append(proc)
        self._await_ready(stopping)
        self._group = open_group(self._store, 0, self.size, self.device)
        if backend_for(self.device) == "nccl":  # NCCL may not notice a peer that died
            threading.Thread(
                target=self._watch, name=f"devices-{self.node_id}", daemon=True
            ).start()
        log.info("devices ready", extra={"node": self.node_id, "devices": self.size})

    def _await_ready(self, stopping: Callable[[], bool]) -> None:
        assert self._store is not None
        waiting = set(range(1, self.size))
        while waiting:
            if stopping():
                raise DeviceLostError(f"node {self.node_id}: stopped while its devices started")
            for rank in sorted(waiting):
                if self._store.check([f"error/{rank}"]):
                    report = self._store.get(f"error/{rank}").decode(errors="replace")
                    raise ReportedJobCodeError(report)
                if self._store.check([f"ready/{rank}"]):
                    waiting.discard(rank)
                    continue
                code = self._procs[rank - 1].poll()
                if code is not None:
                    raise DeviceLostError(
                        f"node {self.node_id}: device process {rank} exited with code {code} "
                        "while it loaded the job (its error is in the node's log)"
                    )
            time.sleep(START_POLL_S)

    def _watch(self) -> None:
        """Abort the group when a device process exits (for NCCL, which may wait on a dead
        peer until its timeout): the batch waiting on it fails, and the node goes on without
        it. Never run: no GPU was at hand."""
        while not self._closed.wait(WATCH_POLL_S):
            if any(p.poll() is not None for p in self._procs):
                group = self._group
                if group is not None:
                    group.abort()
                return

    def backward(
        self,
        model: nn.Module,
        rows: torch.Tensor,
        local: Callable[[torch.Tensor], float],
        version: int,
        scale_exponent: int = 0,
    ) -> float:
        """`rows` through every device: `local(rows)` computes this process's slice on
        `model` (its gradients accumulate there), the others' are added to it. `version`: the
        worker's parameter version (the parameters are sent when it changed);
        `scale_exponent`: fp16's loss scale is 2 ** it (`precision.LossScale`). Returns the
        loss sum over all rows. What `local` raises goes on as it is (after the others'
        batch is ended with them, so the group stays in step).

        Raises:
            DeviceLostError: a device process is gone (the group is closed).
            ReportedJobCodeError: the job's code failed in a device process.
        """
        group = self._group
        if group is None or self.lost:
            raise DeviceLostError(f"node {self.node_id}: its device group is closed")
        if not len(rows):
            return 0.0
        layout, sync = self._layout, version != self._synced_version
        header = torch.tensor(
            [OP_BACKWARD, len(rows), int(sync), scale_exponent], device=self.device
        )
        self._collective(broadcast, header)
        if sync:
            state_into(layout, model, self._state)
            self._collective(broadcast, self._state)
            self._synced_version = version
        before = layout.gather_buffers(model).to(self.device) if self._buffers else None
        if before is not None:
            self._collective(broadcast, before)
        self._collective(broadcast, rows.to(self.device, torch.int64).contiguous())
        own = slice_of(rows, 0, self.size)
        reduced = self._reduced
        reduced.zero_()
        try:
            loss = local(own) if len(own) else 0.0
        except BaseException:  # the others wait in the reduce: end the batch with them
            self._collective(reduce_to_first, reduced)
            raise
        self._collective(reduce_to_first, reduced)
        if reduced[-1].item() > 0:
            raise ReportedJobCodeError(self._error_report())
        add_grads(layout, model, reduced)
        if before is not None:
            computing = min(self.size, len(rows))  # ranks with rows
            own_change = layout.gather_buffers(model).to(self.device) - before
            start = layout.param_total
            change = (own_change + reduced[start : start + self._buffers]) / computing
            layout.load_buffers(model, before + change)
        return loss + float(reduced[-2].item())

    def _collective(
        self, op: Callable[[dist.ProcessGroup, torch.Tensor], None], tensor: torch.Tensor
    ) -> None:
        """`op(group, tensor)`; a failure (gloo: "Connection closed by peer", an aborted
        group) means a device process is gone: the group is closed.

        Raises:
            DeviceLostError: see above.
        """
        group = self._group
        try:
            if group is None:
                raise RuntimeError("the group is closed")
            op(group, tensor)
        except RuntimeError as exc:
            codes = self._exit_codes()
            self._lose(exc)
            raise DeviceLostError(
                f"node {self.node_id}: a device process is gone ({codes}): "
                f"{str(exc).splitlines()[0][:300]}"
            ) from exc

    def _error_report(self) -> str:
        assert self._store is not None
        for rank in range(1, self.size):
            if self._store.check([f"error/{rank}"]):
                return self._store.get(f"error/{rank}").decode(errors="replace")
        return f"node {self.node_id}: a device process failed in the job's code (see its log)"

    def _exit_codes(self) -> str:
        """Each device process's exit code ("running": none yet), waiting a little for one to
        end: the connection of a killed process closes before its parent reaps it."""
        deadline = time.monotonic() + EXIT_CODE_WAIT_S
        while (
            self._procs
            and all(p.poll() is None for p in self._procs)
            and time.monotonic() < deadline
        ):
            time.sleep(START_POLL_S)
        codes = [p.poll() for p in self._procs]
        return "exit codes " + ", ".join(
            f"{r + 1}: {'running' if code is None else code}" for r, code in enumerate(codes)
        )

    def _lose(self, exc: BaseException) -> None:
        log.warning("a device process is gone", extra={"node": self.node_id, "error": str(exc)})
        self.lost = True
        self.close()

    def close(self) -> None:
        """Stop the device processes: told to stop if the group works (waiting at most
        STOP_WAIT_S: a group out of step would wait for good), then killed if still there."""
        self._closed.set()
        group, self._group = self._group, None
        if group is not None and not self.lost:
            stop = threading.Thread(
                target=_stop_group, args=(group, self.device), name="devices-stop", daemon=True
            )
            stop.start()
            stop.join(STOP_WAIT_S)
        for proc in self._procs:
            try:
                proc.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if group is not None:
            group.abort()  # else a broken group aborts the process at exit
        self._procs = []
        self._store = None

    def pids(self) -> list[int]:
        """The device processes' ids (fault injection in tests)."""
        return [p.pid for p in self._procs]


def _stop_group(group: dist.ProcessGroup, device: torch.device) -> None:
    with contextlib.suppress(RuntimeError):  # a device process is gone: it is killed next
        broadcast(group, torch.tensor([OP_STOP, 0, 0, 0], device=device))
