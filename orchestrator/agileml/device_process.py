"""A device process of a node (`devices`): builds the job's model, rows and loss from the
`TrainingSpec` on its stdin, joins the node's group, and computes its slice of every batch
of rows the node sends until told to stop (or its node is gone).

    python -m orchestrator.agileml.device_process --node-id t0 --rank 1 --size 2 \\
        --port 41234 --device cpu < spec.json
"""

from __future__ import annotations

import argparse
import logging
import math
import sys

import torch
import torch.distributed as dist

from orchestrator.agileml.batches import to_device
from orchestrator.agileml.devices import (
    HEADER,
    OP_STOP,
    broadcast,
    grads_into,
    load_state,
    open_group,
    reduce_to_first,
    slice_of,
)
from orchestrator.agileml.parts import TrainingParts, training_parts
from orchestrator.agileml.precision import autocast
from orchestrator.agileml.spec import TrainingSpec
from orchestrator.agileml.usercode import JobCodeError, failure_report, job_code_call
from orchestrator.agileml.worker import BACKWARD, DATA, FORWARD
from orchestrator.lifecycle import exit_with_parent
from orchestrator.logfmt import log_to_stderr

log = logging.getLogger("orchestrator.agileml.device_process")


class DeviceLoop:
    """Rank `rank` (> 0) of a node's devices: one batch slice per operation (see `devices`)."""

    def __init__(
        self,
        spec: TrainingSpec,
        parts: TrainingParts,
        group: dist.ProcessGroup,
        *,
        rank: int,
        size: int,
        device: torch.device,
        store: dist.Store,
    ) -> None:
        self.spec, self.layout = spec, parts.layout
        self.rank, self.size, self.device = rank, size, device
        self._group, self._store = group, store
        self._rows, self._loss_fn = parts.rows, parts.loss_fn
        self._model = parts.model_factory().to(device)
        self._model.train()
        buffers = sum(self.layout.buffer_sizes)
        self._header = torch.zeros(HEADER, dtype=torch.int64, device=device)
        self._state = torch.empty(self.layout.param_total, device=device)
        self._before = torch.empty(buffers, device=device)
        self._out = torch.zeros(self.layout.param_total + buffers + 2, device=device)

    def run(self) -> None:
        """Serve the node's batches until it says stop."""
        group = self._group
        while True:
            broadcast(group, self._header)
            op, n, sync, exponent = (int(v) for v in self._header.tolist())
            if op == OP_STOP:
                return
            if sync:
                broadcast(group, self._state)
                load_state(self.layout, self._model, self._state)
            if self._before.numel():
                broadcast(group, self._before)
                self.layout.load_buffers(self._model, self._before)
            rows = torch.empty(n, dtype=torch.int64, device=self.device)
            broadcast(group, rows)
            self._compute(slice_of(rows, self.rank, self.size).cpu(), math.ldexp(1.0, exponent))
            reduce_to_first(group, self._out)

    def _compute(self, rows: torch.Tensor, scale: float) -> None:
        """This slice's gradient (of the loss times `scale`: fp16's loss scale), buffer
        change and loss sum into `_out`; a job code error is reported through the store and
        flagged in the last element."""
        out, layout = self._out, self.layout
        out.zero_()
        if not len(rows):
            return
        self._model.zero_grad(set_to_none=True)
        try:
            with job_code_call(DATA):
                x, y = self._rows.take(rows)
            x, y = to_device(x, self.device), to_device(y, self.device)
            with autocast(self.spec.precision, self.device), job_code_call(FORWARD):
                loss = self._loss_fn(self._model(x), y)
            with job_code_call(BACKWARD):
                (loss * (scale / self.spec.global_batch)).backward()
        except JobCodeError as exc:
            log.error("the job's code failed", extra={"error": str(exc)})
            self._store.set(f"error/{self.rank}", failure_report(exc))
            out[-1] = 1.0
            return
        grads_into(layout, self._model, out)
        if self._before.numel():
            after = layout.gather_buffers(self._model)
            start = layout.param_total
            out[start : start + self._before.numel()] = after - self._before
        out[-2] = float(loss.item())


def main(argv: list[str] | None = None) -> int:
    """Run one device process of a node (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--node-id", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True, help="the node's TCPStore port")
    parser.add_argument("--device", required=True, help="cpu, or cuda:N")
    args = parser.parse_args(argv)
    exit_with_parent()  # a SIGKILLed node leaves no device process behind
    log_to_stderr(f"agileml[{args.node_id}/device{args.rank}]", "WARNING")
    torch.set_num_threads(1)  # as the node's worker
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", args.port, args.size, False)
    spec = TrainingSpec.model_validate_json(sys.stdin.read())
    try:
        parts = training_parts(spec)
    except JobCodeError as exc:
        store.set(f"error/{args.rank}", failure_report(exc))
        return 1
    store.set(f"ready/{args.rank}", "1")
    group = open_group(store, args.rank, args.size, device)
    loop = DeviceLoop(
        spec, parts, group, rank=args.rank, size=args.size, device=device, store=store
    )
    try:
        loop.run()
    except RuntimeError as exc:  # the node is gone: its connection closed
        log.warning("the node's group failed; exiting", extra={"error": str(exc)})
        group.abort()
        return 1
    group.abort()
    return 0


if __name__ == "__main__":
    sys.exit(main())
