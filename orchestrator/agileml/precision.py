"""Mixed precision (`TrainingSpec.precision`): a worker's forward and loss run under autocast
to bfloat16 (`bf16`) or float16 (`fp16`), and autograd runs their backward the same way; the
parameters, their gradients, what travels on the wire and the parameter servers' weights and
optimizer state stay fp32.

bfloat16 has fp32's range, so it needs no loss scale. float16 does (its smallest gradients
underflow, its largest overflow): each worker multiplies its loss by a dynamic `LossScale`
before backward and divides the gradients by it before it pushes them, as GradScaler does.
A gradient with an inf or a NaN is pushed as NaN in every parameter element, so every
partition's sum of that clock is not finite and every parameter server skips the optimizer's
step alike (`updates`: the scheduler still steps, buffers still move), exactly once: a redone
push is the same push.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> AbstractContextManager[Any]:
    """Around a forward and its loss: autocast to `precision`'s dtype, nothing for `fp32`.

    Raises:
        ValueError: an unknown precision.
    """
    if precision == "fp32":
        return nullcontext()
    if precision in _DTYPES:
        return torch.autocast(device_type=device.type, dtype=_DTYPES[precision])
    raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")


class LossScale:
    """fp16's dynamic loss scale, GradScaler's rule: start at 2**16, halve on a gradient that
    is not finite, double after `growth_interval` finite ones in a row. Always a power of two
    (`exponent`), so scaling and unscaling are exact."""

    def __init__(self, exponent: int = 16, growth_interval: int = 2000) -> None:
        self.exponent = exponent
        self.growth_interval = growth_interval
        self._good = 0  # finite gradients since the last change

    @property
    def scale(self) -> float:
        return math.ldexp(1.0, self.exponent)

    def unscale(self, params: Sequence[torch.Tensor]) -> bool:
        """Divide the parameters' gradients by the scale, in place (the scale itself changes
        only in `update`). Returns whether every gradient was finite; if not, every
        parameter's gradient is set to NaN (its step is then skipped everywhere; see the
        module docstring)."""
        grads = [p.grad for p in params if p.grad is not None]
        found = torch.zeros(1, device=grads[0].device if grads else "cpu")
        if grads:
            inverse = torch.full((1,), 1.0 / self.scale, device=found.device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inverse)
        finite = found.item() == 0
        if not finite:
            for p in params:
                p.grad = torch.full_like(p, math.nan)
        return finite

    def update(self, finite: bool) -> None:
        """After an iteration whose pushes all went through: halve the scale if a gradient
        was not finite, double it after `growth_interval` finite iterations in a row. Never
        in between: an iteration redone after a failed push computes at the same scale, so
        it pushes what it pushed before (the servers keep the first of each push)."""
        if finite:
            self._good += 1
            if self._good >= self.growth_interval:
                self.exponent, self._good = min(self.exponent + 1, 64), 0
        else:
            self.exponent, self._good = max(self.exponent - 1, -64), 0
