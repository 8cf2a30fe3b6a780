"""What a pipeline trains: the chain of layers, the rows, the loss and the optimizer.

Two sources: the built-in generated MLP (`ChainModelSpec`, the benchmarks' model, trained by
plain SGD) and a user's job file (`agileml.jobcode`) whose `model()` returns an
`nn.Sequential`, or which defines `stages(model)` returning the model's layers in the order
they run. Every stage process builds the whole model under the job's seed and keeps its slice;
the launcher maps the stages' trained layers back into the user's model, so the weights load
into `model()` as they are.

A layer's state on the wire (backups, restarts, final weights) is its parameters followed by
its buffers (BatchNorm's running statistics and batch count), flat float32 (an integer buffer
is exact up to 2**24).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from orchestrator.agileml.batches import RowSource, TensorRows
from orchestrator.agileml.jobcode import (
    JobCode,
    JobCodeError,
    dataset_rows,
    job_code_call,
    load_job_code,
    seeded_model,
)


@dataclass(frozen=True)
class ChainSource:
    """A pipeline's model and data (see the module docstring); `optimizer` None means plain
    SGD at the stage's `lr`."""

    layers: Callable[[], list[nn.Module]]  # the whole chain, freshly built under the seed
    rows: Callable[[], RowSource]
    loss: Callable[[Any, Any], torch.Tensor]  # the mean over a microbatch's rows
    optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None
    # (optimizer, the updates the stage makes in the run) -> the job's scheduler
    scheduler: Callable[[torch.optim.Optimizer, int], Any] | None = None


class ChainModelSpec(BaseModel):
    """An MLP as a chain of `depth` Linear layers with ReLUs between them (2 * depth - 1
    modules), on a generated Gaussian-mixture classification task."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    features: Annotated[int, Field(ge=1, le=100_000)] = 32
    hidden: Annotated[int, Field(ge=1, le=100_000)] = 64
    classes: Annotated[int, Field(ge=2, le=100_000)] = 8
    depth: Annotated[int, Field(ge=1, le=1000)] = 5
    samples: Annotated[int, Field(ge=1)] = 4096
    data_seed: int = 0


def build_chain(spec: ChainModelSpec, seed: int) -> nn.Sequential:
    """The whole model, initialised from `seed` (every stage builds it, then keeps its slice)."""
    torch.manual_seed(seed)
    dims = [spec.features] + [spec.hidden] * (spec.depth - 1) + [spec.classes]
    layers: list[nn.Module] = []
    for k in range(spec.depth):
        layers.append(nn.Linear(dims[k], dims[k + 1]))
        if k < spec.depth - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def build_chain_data(spec: ChainModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    from orchestrator.agileml.examples import gaussian_mixture

    return gaussian_mixture(spec.samples, spec.features, spec.classes, seed=spec.data_seed)


def builtin_source(spec: ChainModelSpec, seed: int) -> ChainSource:
    """The generated MLP of a `ChainModelSpec` and its Gaussian-mixture rows."""

    def rows() -> RowSource:
        return TensorRows(*build_chain_data(spec))

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, y, reduction="sum") / len(y)

    return ChainSource(layers=lambda: list(build_chain(spec, seed)), rows=rows, loss=loss)


def job_source(path: str, seed: int) -> ChainSource:
    """A user's job file as a chain (see the module docstring). Raises JobCodeError."""
    code = load_job_code(path)
    return ChainSource(
        layers=lambda: job_layers(code, seeded_model(code, seed)),
        rows=lambda: dataset_rows(code),
        loss=code.loss,
        optimizer=code.optimizer,
        scheduler=None if code.scheduler is None else functools.partial(_scheduler, code),
    )


def _scheduler(code: JobCode, optimizer: torch.optim.Optimizer, updates: int) -> Any:
    """The job's scheduler on a stage's optimizer, told the `updates` of the run."""
    make = code.for_run(updates).make_scheduler
    assert make is not None  # only made for a job with a scheduler
    return make(optimizer)


def job_layers(code: JobCode, model: nn.Module) -> list[nn.Module]:
    """The layers of `model` to split into stages, in the order they run: `stages(model)` if
    the job defines it, else the modules of an `nn.Sequential`.

    Raises:
        JobCodeError: neither applies, or `stages` returned something else than modules.
    """
    if code.stages is not None:
        with job_code_call("stages(model)"):
            layers = list(code.stages(model))
        if not layers or not all(isinstance(m, nn.Module) for m in layers):
            raise JobCodeError(
                "stages(model) must return the model's layers (nn.Module objects) in the "
                "order they run"
            )
        return layers
    if isinstance(model, nn.Sequential):
        return list(model)
    raise JobCodeError(
        f"model() returns a {type(model).__name__}, not an nn.Sequential, so it cannot be "
        "split into pipeline stages. To fix: return an nn.Sequential, or define "
        "`stages(model)` returning its layers in the order they run (each one's output the "
        "next one's input)."
    )


def layer_state(layer: nn.Module) -> list[torch.Tensor]:
    """The tensors of a layer that travel (see the module docstring): its parameters, then its
    buffers, as they are (not copies)."""
    return [*layer.parameters(), *layer.buffers()]


def layer_sizes(layers: list[nn.Module]) -> list[int]:
    """Values of each layer's travelling state, in layer order."""
    return [sum(t.numel() for t in layer_state(layer)) for layer in layers]


def load_layers(layers: list[nn.Module], flat: torch.Tensor) -> None:
    """Copy a flat state (every layer's `layer_state`, in order) into `layers`.

    Raises:
        ValueError: `flat` is not the layers' size.
    """
    total = sum(layer_sizes(layers))
    if flat.numel() != total:
        raise ValueError(f"weights of {flat.numel()} values for layers of {total}")
    offset = 0
    with torch.no_grad():
        for layer in layers:
            for t in layer_state(layer):
                t.copy_(flat[offset : offset + t.numel()].view_as(t))  # cast back to t's dtype
                offset += t.numel()
