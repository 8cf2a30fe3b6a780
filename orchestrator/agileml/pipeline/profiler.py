"""Per-layer profiles of a sequential model: the input of the pipeline planner.

A profile holds, for each layer in order, what PipeDream's profiler records (seed 001 §3.1):
forward and backward compute time, the bytes of the layer's output activations (also the bytes
of the gradient sent back), and the bytes of its parameters. On disk it is PROFILE.json:

    {"layers": [{"name": "0:Linear", "forward_ms": 0.12, "backward_ms": 0.25,
                 "activation_bytes": 4096, "parameter_bytes": 33280}, ...]}

`profile_sequential` measures one on this machine. torch is imported only there, so reading a
profile (the `plan` command) stays fast.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orchestrator.errors import UserError

if TYPE_CHECKING:
    import torch
    from torch import nn

_LAYER_KEYS = "name, forward_ms, backward_ms, activation_bytes, parameter_bytes"

#: Fixes for the pydantic error types a hand-written profile most often hits.
_FIX_OF_ERROR_TYPE = {
    "too_short": "profile at least one layer: "
    '{"layers": [{"name": "fc1", "forward_ms": 1.0, "backward_ms": 2.0, '
    '"activation_bytes": 4096, "parameter_bytes": 1024}]}',
    "greater_than_equal": "times and sizes must be >= 0; re-run the profiler",
    "missing": f"give every layer all of: {_LAYER_KEYS}",
    "extra_forbidden": f"remove the key; a layer has exactly: {_LAYER_KEYS}",
}


class ProfileError(UserError):
    """A profile that cannot be read or measured: a missing or malformed file, a layer with
    negative sizes, no layers, or a model `profile_sequential` cannot run. Nothing is written."""


class LayerProfile(BaseModel):
    """One layer: compute per minibatch and the bytes it sends (activations) and syncs (weights)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    name: Annotated[str, Field(min_length=1)]
    forward_ms: Annotated[float, Field(ge=0)]
    backward_ms: Annotated[float, Field(ge=0)]
    activation_bytes: Annotated[int, Field(ge=0)]
    parameter_bytes: Annotated[int, Field(ge=0)]

    @property
    def compute_ms(self) -> float:
        """T_l of the paper: forward plus backward time of one minibatch."""
        return self.forward_ms + self.backward_ms


class ModelProfile(BaseModel):
    """The layers of a model in execution order (at least one).

    `ModelProfile.model_validate(data)` raises pydantic's `ValidationError`; `from_json` turns
    every problem into a `ProfileError` naming the file and the field (`layers[2].forward_ms`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    layers: Annotated[tuple[LayerProfile, ...], Field(min_length=1)]

    @classmethod
    def from_json(cls, path: Path | str) -> ModelProfile:
        """Read PROFILE.json. Raises ProfileError (missing file, bad JSON, invalid field)."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise ProfileError(
                f"cannot read profile {path}: {exc.strerror}",
                fix="pass an existing PROFILE.json (`profile_sequential` writes one)",
                field="--profile",
                path=str(path),
            ) from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ProfileError(
                f"profile {path} is not valid JSON: {exc}",
                fix='write {"layers": [{' + _LAYER_KEYS + "}, ...]}",
                field="--profile",
                path=str(path),
            ) from None
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise profile_error(exc, path) from None

    def to_json(self, path: Path | str) -> None:
        """Write PROFILE.json (the format `from_json` reads)."""
        Path(path).write_text(self.model_dump_json(indent=1) + "\n")


def profile_error(exc: ValidationError, path: Path | str | None = None) -> ProfileError:
    """The first problem of a profile's ValidationError as a ProfileError naming the field."""
    first = exc.errors()[0]
    field = _dotted(first.get("loc", ())) or "profile"
    where = f"profile {path}: " if path is not None else "profile: "
    problem = f"{first.get('msg', 'invalid value')} (got {first.get('input')!r})"
    if first.get("type") == "too_short":
        problem = "is empty; a profile needs at least one layer"
    return ProfileError(
        f"{where}{field}: {problem}",
        fix=_FIX_OF_ERROR_TYPE.get(first.get("type", ""), f"fix {field}"),
        field=field,
        path=str(path) if path is not None else None,
    )


def _dotted(loc: Sequence[int | str]) -> str:
    """('layers', 2, 'forward_ms') -> 'layers[2].forward_ms'."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def profile_sequential(
    model: nn.Module | Iterable[nn.Module],
    sample_input: torch.Tensor,
    *,
    repeats: int = 5,
    warmup: int = 2,
    clock: Callable[[], float] = time.perf_counter,
) -> ModelProfile:
    """Time each layer's forward and backward pass on one sample minibatch.

    Each layer runs on the previous layer's output (detached, requiring grad when it is a float
    tensor). Per repeat: a forward pass, then `torch.autograd.backward` of its output with a
    gradient of ones. Times are the median over `repeats` after `warmup` discarded runs, read
    from `clock` in seconds and reported in ms. Gradients the runs accumulate in the layers'
    parameters are cleared before returning; the model's train/eval mode is left as given.
    CUDA tensors are synchronised around each timed region.

    Raises:
        ProfileError: `repeats` < 1 or `warmup` < 0, an empty model, or a layer that does not
            return a single tensor.
    """
    import torch

    if repeats < 1:
        raise ProfileError(
            f"repeats must be >= 1, got {repeats}", fix="pass repeats=5", field="repeats"
        )
    if warmup < 0:
        raise ProfileError(
            f"warmup must be >= 0, got {warmup}", fix="pass warmup=2", field="warmup"
        )
    named = _named_layers(model)
    if not named:
        raise ProfileError(
            "the model has no layers to profile",
            fix="pass an nn.Sequential (or a list) of modules",
            field="model",
        )
    layers: list[LayerProfile] = []
    x = sample_input.detach()
    with torch.enable_grad():
        for name, layer in named:
            x_in = x.detach().requires_grad_(x.is_floating_point())
            forward_s: list[float] = []
            backward_s: list[float] = []
            out = x_in
            for run in range(warmup + repeats):
                layer.zero_grad(set_to_none=True)
                _sync(x_in)
                start = clock()
                out = layer(x_in)
                if not isinstance(out, torch.Tensor):
                    raise ProfileError(
                        f"layer {name} returned {type(out).__name__}, not a tensor",
                        fix="wrap the layer so that it returns one tensor",
                        field="model",
                    )
                _sync(out)
                mid = clock()
                if out.requires_grad:
                    torch.autograd.backward(out, grad_tensors=torch.ones_like(out))
                    _sync(out)
                end = clock()
                if run >= warmup:
                    forward_s.append(mid - start)
                    backward_s.append(end - mid if out.requires_grad else 0.0)
            layer.zero_grad(set_to_none=True)
            layers.append(
                LayerProfile(
                    name=name,
                    forward_ms=statistics.median(forward_s) * 1000.0,
                    backward_ms=statistics.median(backward_s) * 1000.0,
                    activation_bytes=out.numel() * out.element_size(),
                    parameter_bytes=sum(p.numel() * p.element_size() for p in layer.parameters()),
                )
            )
            x = out.detach()
    return ModelProfile(layers=tuple(layers))


def _named_layers(model: nn.Module | Iterable[nn.Module]) -> list[tuple[str, nn.Module]]:
    """`key:ClassName` and the module, for each child of a module or item of an iterable."""
    from torch import nn

    pairs = (
        list(model.named_children())
        if isinstance(model, nn.Module)
        else [(str(i), layer) for i, layer in enumerate(model)]
    )
    return [(f"{key}:{type(layer).__name__}", layer) for key, layer in pairs]


def _sync(tensor: torch.Tensor) -> None:
    """Wait for queued GPU work, so that the clock measures it (a no-op on CPU)."""
    if tensor.is_cuda:
        import torch

        torch.cuda.synchronize(tensor.device)
