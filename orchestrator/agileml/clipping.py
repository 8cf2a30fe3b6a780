"""Gradient clipping by the global norm, over partitions held by different servers.

`torch.nn.utils.clip_grad_norm_(params, max_norm)` on one process scales every gradient by
`min(1, max_norm / (total_norm + 1e-6))`, where `total_norm` is the 2-norm of all of them. Here
the gradient of a clock is summed per partition on the partition's server, so no one process
holds it whole. Each clock therefore takes one more round between the workers and the servers:

1. a worker asks every partition for the squared norm of its clock-c sum (`norm`); a server
   answers once every roster member has pushed c (the reply is held until then, like a pull);
2. the worker adds them up in partition order and sends each partition the coefficient
   (`clip`); a server applies clock c only once it knows c's coefficient, scaling the
   parameters' gradients (not the buffers' changes) by it before the optimizer's step.

Every worker does this and computes the same coefficient from the same sums; a server keeps the
first it is sent. A partition that has its coefficient already answers with it, so a worker
that comes later sends that one. The coefficient travels with the partition (hand-offs, the
stream to its BackupPS, roll-backs), and the clock is applied with it wherever it is applied.

Only bulk-synchronous jobs (slack 0) clip: the global norm of clock c needs every worker's
push of c before any partition may apply it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

#: torch's `clip_grad_norm_` adds this to the norm before dividing.
EPSILON = 1e-6
#: Coefficients of applied clocks a partition keeps to answer late `norm` requests with (a
#: roll-back redoes clocks its BackupPSs held back; a partition no BackupPS holds keeps its
#: values, and answers with these).
KEEP_APPLIED = 1024


@dataclass(frozen=True)
class NormAnswer:
    """A partition's answer to `norm` for a clock: its coefficient if known, else the squared
    norm of the clock's summed gradient; neither: applied with no coefficient recorded (before
    clipping started, e.g. a resumed checkpoint's clocks)."""

    coef: float | None = None
    sq_norm: float | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The reply's tensors."""
        if self.coef is not None:
            return coefficient_tensors(self.coef)
        if self.sq_norm is not None:
            return {"sq_norm": torch.tensor([self.sq_norm], dtype=torch.float64)}
        return {}


def squared_norm(grad: torch.Tensor, slices: Iterable[slice]) -> float:
    """The squared 2-norm of `grad`'s elements in `slices`: each slice's norm in float32, as
    `clip_grad_norm_` takes each tensor's, their squares summed."""
    total = 0.0
    for s in slices:
        part = grad[s]
        if part.numel():
            total += float(torch.linalg.vector_norm(part)) ** 2
    return total


def coefficient(sq_norms: Sequence[float], max_norm: float) -> float:
    """What `clip_grad_norm_` multiplies the gradients by, from the partitions' squared norms
    (in partition order); 1.0 when the norm is not finite (fp16 then skips the step), 0.0
    when it is past float32's range (torch's norm is then inf)."""
    total = math.sqrt(math.fsum(sq_norms))
    if not math.isfinite(total):
        return 1.0
    norm32 = torch.tensor(total, dtype=torch.float32)
    coef = torch.tensor(max_norm, dtype=torch.float32) / (norm32 + EPSILON)
    return min(1.0, float(coef))


def scale(grad: torch.Tensor, slices: Iterable[slice], coef: float) -> None:
    """Multiply `grad`'s elements in `slices` by `coef`, in place."""
    if coef == 1.0:
        return
    factor = torch.tensor(coef, dtype=torch.float32)
    for s in slices:
        grad[s].mul_(factor)


def check_coefficient(value: float) -> float:
    """`value` if it is a coefficient a worker may send (in [0, 1]); raises ValueError."""
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"clipping coefficient {value} is not in [0, 1]")
    return value


def coefficient_tensors(coef: float) -> dict[str, torch.Tensor]:
    """A coefficient as the `coef` tensor of a message (float64 (1,))."""
    return {"coef": torch.tensor([coef], dtype=torch.float64)}


def coefficient_of(tensors: dict[str, torch.Tensor]) -> float | None:
    """A message's `coef` tensor as a coefficient (float64 (1,), in [0, 1]); None if it has
    none or it is not one."""
    t = tensors.get("coef")
    if t is None or t.dtype != torch.float64 or t.shape != (1,):
        return None
    try:
        return check_coefficient(float(t.item()))
    except ValueError:
        return None


def check_squared_norm(value: float) -> float:
    """`value` if it is a squared norm a server may answer (>= 0, or not finite after an fp16
    overflow); raises ValueError."""
    if value < 0.0:
        raise ValueError(f"squared norm {value} is negative")
    return value


def answer_from_tensors(tensors: dict[str, torch.Tensor]) -> NormAnswer:
    """Parse a `norm_reply`'s tensors (see `NormAnswer.tensors`); raises ValueError."""
    if not tensors:
        return NormAnswer()
    if len(tensors) != 1:
        raise ValueError(f"norm reply with tensors {sorted(tensors)}")
    ((name, t),) = tensors.items()
    if name not in ("coef", "sq_norm") or t.dtype != torch.float64 or t.shape != (1,):
        raise ValueError(f"norm reply tensor {name!r} {t.dtype} {tuple(t.shape)}")
    value = float(t.item())
    if name == "coef":
        return NormAnswer(coef=check_coefficient(value))
    return NormAnswer(sq_norm=check_squared_norm(value))
