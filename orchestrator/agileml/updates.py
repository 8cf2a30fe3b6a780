"""How a parameter server turns a clock's summed gradient into new partition values.

Workers push gradients (scaled so that the pushes of a clock add up to the global batch's mean
gradient); a server sums a partition's pushes per clock and, once every roster member's push of
that clock is in, applies the partition's `UpdateRule` once. The rule owns the optimizer state
of its partition (momentum, Adam's moments, step counts, the scheduler's position), which
travels with the partition as `state()` bytes: in hand-offs, to the BackupPS, and back on a
roll-back. Every clock is applied exactly once, so the state is that of a single-process run.

`OptimizerRule` runs the user's own `torch.optim` optimizer over the partition's slice of each
parameter. That is exact only for optimizers whose update is elementwise (`ELEMENTWISE`);
others (LBFGS, LAMB-like layer-wise ones) are refused when the job is checked.
"""

from __future__ import annotations

import inspect
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from orchestrator.agileml.errors import AgileMLError
from orchestrator.agileml.usercode import job_code_call

# torch.optim classes whose update of an element depends only on that element's history
ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adadelta,
)

#: torch.optim classes with a fused CPU step: one kernel over a partition's tensors, several
#: times the per-tensor loop's speed (Adam over 10M elements on one core: 4.3 ms against 48),
#: equal to rounding (3e-9 relative after 50 steps; SGD to the bit). A server runs them fused
#: unless the job asked for `fused=False` or `foreach=True` (`fused_step`).
FUSED_ON_CPU: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
    torch.optim.Adagrad,
)

OptimizerFn = Callable[[Any], torch.optim.Optimizer]
SchedulerFn = Callable[[torch.optim.Optimizer], Any]


class UpdateRule(Protocol):
    """One partition's update: applied once per complete clock, in clock order."""

    def apply(self, grad: torch.Tensor) -> None:
        """Update the partition's values (bound at construction) with a clock's summed push."""

    def gradient_slices(self) -> list[slice]:
        """The elements of a push that are gradients of parameters (not buffer changes): what
        gradient clipping measures and scales (`clipping`)."""

    def state(self) -> bytes:
        """The rule's state (empty: stateless), to rebuild it elsewhere with `load_state`."""

    def load_state(self, blob: bytes) -> None:
        """Take over a state from `state()`. Raises AgileMLError if it does not fit."""


RuleFactory = Callable[[int, torch.Tensor], UpdateRule]
"""Builds partition p's rule bound to its values tensor (updated in place)."""


class SumRule:
    """values += the summed pushes (pushes are ready-made deltas). Stateless."""

    def __init__(self, values: torch.Tensor) -> None:
        self._values = values

    def apply(self, grad: torch.Tensor) -> None:
        self._values += grad

    def gradient_slices(self) -> list[slice]:
        return [slice(None)]

    def state(self) -> bytes:
        return b""

    def load_state(self, blob: bytes) -> None:
        del blob


class SGDRule:
    """Plain SGD with a fixed learning rate: values -= lr x gradient. Stateless."""

    def __init__(self, values: torch.Tensor, lr: float) -> None:
        self._values, self._lr = values, lr

    def apply(self, grad: torch.Tensor) -> None:
        self._values.add_(grad, alpha=-self._lr)

    def gradient_slices(self) -> list[slice]:
        return [slice(None)]

    def state(self) -> bytes:
        return b""

    def load_state(self, blob: bytes) -> None:
        del blob


def sum_rules(p: int, values: torch.Tensor) -> UpdateRule:
    """The default factory: pushes are deltas, added as they are."""
    del p
    return SumRule(values)


def sgd_rules(lr: float) -> RuleFactory:
    """A factory of `SGDRule`s with learning rate `lr`."""
    return lambda _p, values: SGDRule(values, lr)


@dataclass(frozen=True)
class Segment:
    """Elements [start, stop) of the flat vector that belong to one tensor of the model:
    `group` is its optimizer parameter group (None: a buffer, or a parameter no group
    optimizes)."""

    start: int
    stop: int
    group: int | None
    buffer: bool = False


@dataclass(frozen=True)
class OptimizerPlan:
    """The user's optimizer, decomposed so that each partition can run its own copy.

    `segments` cover the flat vector in order (parameters, then buffers); `groups` are the
    parameter groups' hyperparameters (without their parameters); `kind` the optimizer class.
    """

    kind: type[torch.optim.Optimizer]
    defaults: dict[str, Any]
    groups: tuple[dict[str, Any], ...]
    segments: tuple[Segment, ...]
    scheduler: SchedulerFn | None

    @classmethod
    def from_model(
        cls,
        model: nn.Module,
        optimizer: OptimizerFn,
        scheduler: SchedulerFn | None,
        buffer_sizes: Sequence[int] = (),
    ) -> OptimizerPlan:
        """Call `optimizer(model.parameters())` once and record which group holds which
        parameter (`named_parameters()` order); `buffer_sizes` are the buffers after them.

        Raises:
            AgileMLError: not a torch optimizer, not elementwise, or it holds tensors that are
                not the model's parameters.
        """
        opt = optimizer(model.parameters())
        kind = type(opt)
        if not isinstance(opt, torch.optim.Optimizer):
            raise AgileMLError(
                f"optimizer(params) returned {kind.__name__}, not a torch.optim.Optimizer"
            )
        if kind not in ELEMENTWISE:
            names = ", ".join(k.__name__ for k in ELEMENTWISE)
            raise AgileMLError(
                f"optimizer {kind.__name__} is not supported: the parameter servers apply the "
                f"update per partition, which is exact only for elementwise optimizers "
                f"({names}). To fix: use one of these."
            )
        index = {id(p): i for i, (_, p) in enumerate(model.named_parameters())}
        group_of: dict[int, int] = {}
        for g, group in enumerate(opt.param_groups):
            for param in group["params"]:
                if id(param) not in index:
                    raise AgileMLError(
                        "optimizer(params) holds a tensor that is not one of the model's "
                        "parameters. To fix: build it from the `params` argument only."
                    )
                group_of[index[id(param)]] = g
        segments, offset = [], 0
        for i, (_, param) in enumerate(model.named_parameters()):
            segments.append(Segment(offset, offset + param.numel(), group_of.get(i)))
            offset += param.numel()
        for size in buffer_sizes:
            segments.append(Segment(offset, offset + size, None, buffer=True))
            offset += size
        accepted = set(inspect.signature(kind.__init__).parameters)
        groups = tuple({k: v for k, v in g.items() if k != "params"} for g in opt.param_groups)
        return cls(
            kind,
            {k: v for k, v in opt.defaults.items() if k in accepted},
            groups,
            tuple(segments),
            scheduler,
        )

    def rules(
        self, bounds: Callable[[int], tuple[int, int]], *, skip_nonfinite: bool = False
    ) -> RuleFactory:
        """A factory of partition rules, partition p covering `bounds(p)` of the flat vector;
        `skip_nonfinite` (fp16): see `OptimizerRule`."""
        return lambda p, values: OptimizerRule(
            self, bounds(p), values, skip_nonfinite=skip_nonfinite
        )


class OptimizerRule:
    """The user's optimizer (and scheduler) over one partition (see `OptimizerPlan`).

    With `skip_nonfinite` (fp16, `precision`): a clock whose summed gradient has an inf or a
    NaN in a parameter element skips the optimizer's step (GradScaler's rule); the buffers
    still move and the scheduler still steps, as in a loop that calls `scaler.step(opt)` and
    then `scheduler.step()`. Every partition sees the same clocks not finite (a worker whose
    gradient overflowed pushes NaN in every parameter element), so all skip alike.
    """

    def __init__(
        self,
        plan: OptimizerPlan,
        bounds: tuple[int, int],
        values: torch.Tensor,
        *,
        skip_nonfinite: bool = False,
    ) -> None:
        start, stop = bounds
        if values.shape != (stop - start,):
            raise AgileMLError(f"partition values {tuple(values.shape)} do not fit {bounds}")
        self._values = values
        self._params: list[tuple[nn.Parameter, slice]] = []
        self._buffers: list[slice] = []
        self._gradients: list[slice] = []  # every parameter's, optimized or not
        groups: list[dict[str, Any]] = [{**g, "params": []} for g in plan.groups]
        for seg in plan.segments:
            lo, hi = max(seg.start, start), min(seg.stop, stop)
            if lo >= hi:
                continue
            local = slice(lo - start, hi - start)
            if seg.buffer:
                self._buffers.append(local)
                continue
            self._gradients.append(local)
            if seg.group is not None:
                param = nn.Parameter(values[local])  # a view: the optimizer updates `values`
                groups[seg.group]["params"].append(param)
                self._params.append((param, local))
        self._optimizer: torch.optim.Optimizer | None = None
        self._scheduler: Any = None
        self._skip_nonfinite = skip_nonfinite
        self.skipped = 0  # steps skipped for a gradient that was not finite
        if self._params:
            with job_code_call("optimizer(params) on a parameter server"):
                self._optimizer = fused_step(plan, groups, values.device)
            if plan.scheduler is not None:
                with job_code_call("scheduler(optimizer) on a parameter server"):
                    self._scheduler = plan.scheduler(self._optimizer)

    def apply(self, grad: torch.Tensor) -> None:
        for local in self._buffers:
            self._values[local] += grad[local]
        if self._optimizer is None:
            return
        if self._skip_nonfinite and not all(
            bool(torch.isfinite(grad[local]).all()) for _, local in self._params
        ):
            self.skipped += 1
        else:
            for param, local in self._params:
                param.grad = grad[local]
            with job_code_call("the optimizer's step on a parameter server"):
                self._optimizer.step()
        if self._scheduler is not None:
            with job_code_call("the scheduler's step on a parameter server"):
                self._scheduler.step()
        for param, _ in self._params:
            param.grad = None

    def gradient_slices(self) -> list[slice]:
        return list(self._gradients)

    def state(self) -> bytes:
        if self._optimizer is None:
            return b""
        out = io.BytesIO()
        scheduler = self._scheduler.state_dict() if self._scheduler is not None else None
        torch.save({"optimizer": self._optimizer.state_dict(), "scheduler": scheduler}, out)
        return out.getvalue()

    def load_state(self, blob: bytes) -> None:
        if self._optimizer is None or not blob:
            return
        try:
            state = torch.load(io.BytesIO(blob), weights_only=True)
            fused = bool(self._optimizer.defaults.get("fused"))
            self._optimizer.load_state_dict(state["optimizer"])
            for group in self._optimizer.param_groups:  # a state saved unfused says None
                if fused and group.get("fused") is None:
                    group["fused"] = True
            if self._scheduler is not None and state["scheduler"] is not None:
                self._scheduler.load_state_dict(state["scheduler"])
        except Exception as exc:  # a malformed archive raises many kinds (pickle's too)
            raise AgileMLError(f"optimizer state does not fit this partition: {exc}") from exc


def fused_step(
    plan: OptimizerPlan, groups: list[dict[str, Any]], device: torch.device
) -> torch.optim.Optimizer:
    """The plan's optimizer over `groups`, with its fused step where torch has one for the
    device (`FUSED_ON_CPU` on the CPU) and the job left `fused` and `foreach` unset; else (or
    if torch refuses the fused step for these options) as the job wrote it."""
    defaults = plan.defaults
    options = [defaults, *groups]  # a group may set its own
    asked = any(o.get("fused") is not None or o.get("foreach") for o in options)
    if device.type != "cpu" or plan.kind not in FUSED_ON_CPU or asked:
        return plan.kind(groups, **defaults)
    if any(o.get("differentiable") for o in options) or "fused" not in defaults:
        return plan.kind(groups, **defaults)
    fused = [{**g, "fused": True} if g.get("fused") is None else g for g in groups]
    try:
        return plan.kind(fused, **{**defaults, "fused": True})
    except (RuntimeError, ValueError):  # an option the fused step does not take
        return plan.kind(groups, **defaults)
