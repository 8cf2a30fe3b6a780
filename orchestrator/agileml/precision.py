"""Mixed precision (`TrainingSpec.precision`): `bf16` runs a worker's forward and loss under
autocast to bfloat16, and autograd runs their backward the same way; the parameters, their
gradients, what travels on the wire and the parameter servers' weights and optimizer state
stay fp32 (bfloat16 has fp32's range, so no loss scale is needed)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

PRECISIONS = ("fp32", "bf16")


def autocast(precision: str, device: torch.device) -> AbstractContextManager[Any]:
    """Around a forward and its loss: autocast to bfloat16 for `bf16`, nothing for `fp32`.

    Raises:
        ValueError: an unknown precision.
    """
    if precision == "fp32":
        return nullcontext()
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
