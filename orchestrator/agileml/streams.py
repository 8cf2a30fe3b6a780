"""A worker's communication overlapped with its computation (issue #17).

* `PullStream`: the forward pass starts as soon as the first pulled partition is in; the
  others are loaded when a torch operation first reads one of their tensors (`LoadOnUse`, a
  `TorchFunctionMode` that sees every parameter and buffer an operation is given, whoever
  holds it: a module, a functional call, a tied weight, a view kept of one). BSP semantics
  are kept: a server answers a pull only once the clock's update of that partition is
  applied, so a layer is used only once it is fresh. What the mode cannot see: TorchScript
  modules and compiled graphs (`streaming_safe` turns streaming off for those it recognises)
  and C++ code that reads a parameter without a torch operation; run such a job with
  `overlap` off.
* `EarlyPushes`: hooks on the parameters count, per partition, the gradients accumulated by
  the backward pass; a partition is pushed the moment its last one is in, while backward goes
  on with the layers below. Partitions that hold buffer values (BatchNorm statistics: their
  change is known only at the end) or gradients that never came (unused or frozen parameters)
  go when backward is done, with the rest. A parameter whose gradient is accumulated twice in
  one backward (reentrant activation checkpointing) would make a partition leave short of its
  gradient: `probe` finds that on the warm-up backward and turns early pushes off, and a
  second accumulation while armed fails the iteration (`AgileMLError`) instead.

Neither changes what is computed: the same values are loaded and the same gradients pushed,
only sooner (the servers sum a clock's pushes in arrival order, so with more than two workers
the weights of any two runs differ by float rounding, with or without overlap). Both are off
with `TrainingSpec.overlap = False`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from orchestrator.agileml.errors import AgileMLError, PartitionError
from orchestrator.agileml.partitions import PartitionLayout

# waits until the predicate holds, receiving replies meanwhile
WaitFn = Callable[[Callable[[], bool]], None]


def streaming_safe(model: nn.Module) -> bool:
    """Whether `LoadOnUse` sees every read of the model's parameters, as far as can be told:
    no TorchScript module and no `torch.compile`d one (their operations run outside Python)."""
    return not any(
        isinstance(m, torch.jit.ScriptModule) or hasattr(m, "_orig_mod") for m in model.modules()
    )


class PullStream:
    """The partitions of one pull, loaded into the model when first needed.

    `arrived` records a reply; `ensure` waits for partitions (through `wait`) and loads them;
    `finish` loads everything. Parameters must be contiguous (`PartitionLayout.load_partition`).
    """

    def __init__(self, layout: PartitionLayout, model: nn.Module, wait: WaitFn) -> None:
        self.layout = layout
        self._model = model
        self._params = layout.params(model)
        self._wait = wait
        self._received: dict[int, torch.Tensor] = {}
        self._loaded: set[int] = set()
        self._buffer_parts = frozenset(layout.buffer_partitions())
        # id of a tensor not yet loaded -> the partitions it needs (ids are stable: the
        # tensors are the model's own and outlive the stream)
        self.pending: dict[int, tuple[int, ...]] = {
            id(t): parts
            for t, parts in zip(self._params, layout.param_partitions(), strict=True)
            if parts
        }
        for buf in layout.buffers(model):
            self.pending[id(buf)] = tuple(sorted(self._buffer_parts))
        self.waited_s = 0.0  # spent waiting for replies inside the computation

    def arrived(self, p: int, values: torch.Tensor) -> None:
        """A pull reply's float32 values for partition p (not loaded yet).

        Raises:
            PartitionError: the values are not of the partition's size.
        """
        if values.shape != (self.layout.size(p),):
            raise PartitionError(
                f"partition {p} has shape {tuple(values.shape)}, want ({self.layout.size(p)},)",
                partition=p,
            )
        self._received[p] = values

    def ensure(self, parts: Iterable[int]) -> None:
        """Wait for partitions `parts` and load them (a no-op for those already loaded)."""
        want = [p for p in parts if p not in self._loaded]
        if not want:
            return
        if any(p not in self._received for p in want):
            started = time.perf_counter()
            self._wait(lambda: all(p in self._received for p in want))
            self.waited_s += time.perf_counter() - started
        for p in want:
            self._load(p)

    def ensure_buffers(self) -> None:
        """Wait for and load the partitions that hold buffer values."""
        self.ensure(sorted(self._buffer_parts))

    def finish(self) -> None:
        """Wait for and load every partition."""
        self.ensure(range(self.layout.num_partitions))

    def pulled_buffers(self) -> torch.Tensor:
        """The buffers' values as pulled (`gather_buffers` of the model as loaded, before
        the forward pass changed them), loading them if no operation has read them yet."""
        self.ensure_buffers()
        return self.layout.buffer_values(self._received)

    def guard(self) -> AbstractContextManager[Any]:
        """Around the forward pass: loads what an operation reads before it runs."""
        return LoadOnUse(self) if self.pending else nullcontext()

    def _load(self, p: int) -> None:
        self.layout.load_partition(self._params, p, self._received[p])
        self._loaded.add(p)
        if p in self._buffer_parts and self._buffer_parts <= self._loaded:
            self.layout.load_buffers_from(self._model, self._received)
        self.pending = {
            key: parts
            for key, parts in self.pending.items()
            if not all(q in self._loaded for q in parts)
        }


class LoadOnUse(TorchFunctionMode):
    """Before a torch operation runs, load the partitions of the parameters and buffers it is
    given that are still on their way (one level of lists, e.g. an RNN's flat weights)."""

    def __init__(self, stream: PullStream) -> None:
        super().__init__()
        self._stream = stream

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        pending = self._stream.pending
        if pending:
            need: set[int] = set()
            for arg in (*args, *kwargs.values()):
                items = arg if isinstance(arg, list | tuple) else (arg,)
                for item in items:
                    parts = pending.get(id(item))
                    if parts is None and isinstance(item, torch.Tensor):
                        parts = pending.get(id(item._base))  # a view kept of a parameter
                    if parts is not None:
                        need.update(parts)
            if need:
                self._stream.ensure(sorted(need))
        return func(*args, **kwargs)


class EarlyPushes:
    """Gradient hooks that hand each partition to `send` as soon as backward has produced all
    of its gradients; `arm` before one backward, `disarm` after it.

    Hooks are registered once, on the parameters that require gradients then; `arm` refuses
    (returns False) if that set changed since, so a partition is never sent short of one.
    """

    def __init__(self, layout: PartitionLayout, model: nn.Module) -> None:
        self._params = layout.params(model)
        self._hooked = tuple(p.requires_grad for p in self._params)
        param_parts = layout.param_partitions()
        self._param_parts = param_parts
        buffer_parts = set(layout.buffer_partitions())
        # partition -> how many hooked parameters lie in it (those with buffers: never early)
        self._counts: dict[int, int] = {}
        for i, parts in enumerate(param_parts):
            if self._hooked[i]:
                for p in parts:
                    if p not in buffer_parts:
                        self._counts[p] = self._counts.get(p, 0) + 1
        for i, param in enumerate(self._params):
            if self._hooked[i]:
                param.register_post_accumulate_grad_hook(functools.partial(self._ready, i))
        self._send: Callable[[int], None] | None = None
        self._remaining: dict[int, int] = {}
        self._fired: set[int] | None = None  # parameters whose hook ran (armed or probing)
        self._twice = False  # a hook ran twice in one backward
        self.disabled = False  # by `probe`: early pushes would not be safe for this model
        self.sent: list[int] = []  # partitions sent since the last `arm`

    @contextmanager
    def probe(self) -> Iterator[None]:
        """Around a backward with nothing armed (the warm-up): if a gradient is accumulated
        twice in it, early pushes are turned off for good."""
        self._fired, self._twice = set(), False
        try:
            yield
        finally:
            self.disabled = self.disabled or self._twice
            self._fired = None

    def arm(self, send: Callable[[int], None]) -> bool:
        """Send partitions through `send(p)` as they complete in the next backward. False
        (nothing armed) if `probe` turned early pushes off, or if which parameters require
        gradients changed since construction."""
        self.sent = []
        if self.disabled or tuple(p.requires_grad for p in self._params) != self._hooked:
            return False
        self._send, self._remaining, self._fired = send, dict(self._counts), set()
        return True

    def disarm(self) -> list[int]:
        """Stop sending; returns the partitions sent since `arm`."""
        self._send, self._fired = None, None
        return self.sent

    def _ready(self, i: int, _param: torch.Tensor) -> None:
        if self._fired is None:
            return
        if i in self._fired:
            self._twice = True
            if self._send is not None:
                self.disabled = True
                raise AgileMLError(
                    "a parameter's gradient was accumulated twice in one backward (reentrant "
                    "checkpointing?): a partition may have been pushed short of it; early "
                    "pushes are now off (set `overlap` false for this job)"
                )
            return
        self._fired.add(i)
        if self._send is None:
            return
        for p in self._param_parts[i]:
            left = self._remaining.get(p)
            if left is None:
                continue  # holds buffer values: sent after backward
            self._remaining[p] = left - 1
            if left == 1:
                self.sent.append(p)
                self._send(p)
