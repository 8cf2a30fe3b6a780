"""What every node of a job builds from its `TrainingSpec`: the model, the rows, the loss, the
partition layout and initial partitions, and the parameter servers' update rule.

For a user's job (`spec.code`) these come from the job's file (`jobcode`) and its own
optimizer; for the built-in examples from `examples`, trained by plain SGD with `spec.lr`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from orchestrator.agileml.batches import RowSource, TensorRows, batch_rows
from orchestrator.agileml.control import TrainingSpec
from orchestrator.agileml.examples import build_data, build_loss, build_model, initial_model
from orchestrator.agileml.jobcode import (
    JobCode,
    code_path,
    dataset_rows,
    load_job_code,
    optimizer_plan,
    seeded_model,
)
from orchestrator.agileml.partitions import PartitionLayout
from orchestrator.agileml.updates import RuleFactory, sgd_rules
from orchestrator.agileml.worker import LossFn

EVAL_ROWS = 4096  # rows `loss_of` measures a user's model on
EVAL_BATCH = 256


@dataclass(frozen=True)
class ModelParts:
    """A job's model and how partitions map onto it: what assembling its weights needs (no
    data, no optimizer: what the controller builds)."""

    model_factory: Callable[[], nn.Module]  # a scratch model (values are pulled into it)
    initial_model: nn.Module  # the job's model at its initial values (the seed's)
    layout: PartitionLayout
    code: JobCode | None  # the user's job; None for a built-in example

    def model_with(self, parts: list[torch.Tensor]) -> nn.Module:
        """A fresh model holding the given partitions (parameters and buffers)."""
        model = self.model_factory()
        self.layout.scatter(model, parts)
        return model


@dataclass(frozen=True)
class TrainingParts(ModelParts):
    """A job's pieces as a node builds them (see the module docstring)."""

    rows: RowSource
    loss_fn: LossFn  # summed over a batch's rows, as roster workers need it
    rules: RuleFactory

    def loss_of(self, model: nn.Module) -> float:
        """The mean loss of `model` over the training set (its first rows for a user's job)."""
        was_training = model.training
        model.eval()
        total, count = 0.0, 0
        n = len(self.rows) if self.code is None else min(len(self.rows), EVAL_ROWS)
        try:
            with torch.no_grad():
                for start in range(0, n, EVAL_BATCH):
                    rows = torch.arange(start, min(start + EVAL_BATCH, n))
                    x, y = self.rows.take(rows)
                    total += float(self.loss_fn(model(x), y).item())
                    count += len(rows)
        finally:
            model.train(was_training)
        return total / max(count, 1)


def model_parts(spec: TrainingSpec, *, with_data: bool = False) -> ModelParts:
    """The job's model and partition layout; its `training.data` is fetched only
    `with_data` (see `jobcode.code_path`).

    Raises:
        JobCodeError: the job's code cannot be loaded.
        PartitionError: more partitions than the model has elements.
    """
    if spec.code is None:
        factory = build_model(spec)
        model = initial_model(factory, spec.seed)
        return ModelParts(factory, model, PartitionLayout(model, spec.num_partitions), None)
    code = load_job_code(code_path(spec, with_data=with_data), iterations=spec.iterations)
    model = seeded_model(code, spec.seed)
    return ModelParts(code.model, model, PartitionLayout(model, spec.num_partitions), code)


def training_parts(spec: TrainingSpec) -> TrainingParts:
    """Build the job's pieces.

    Raises:
        JobCodeError: the job's code cannot be loaded or its optimizer cannot be run.
        PartitionError: more partitions than the model has elements.
    """
    m = model_parts(spec, with_data=True)
    if m.code is None:
        x, y = build_data(spec)
        rows: RowSource = TensorRows(x, y)
        loss_fn, rules = build_loss(spec), sgd_rules(spec.lr)
    else:
        plan = optimizer_plan(m.code, m.initial_model, m.layout.buffer_sizes)
        rows, loss_fn = dataset_rows(m.code), _summed(m.code.loss)
        rules = plan.rules(m.layout.bounds, skip_nonfinite=spec.precision == "fp16")
    return TrainingParts(
        model_factory=m.model_factory,
        initial_model=m.initial_model,
        layout=m.layout,
        code=m.code,
        rows=rows,
        loss_fn=loss_fn,
        rules=rules,
    )


def _summed(loss: Callable[[Any, Any], torch.Tensor]) -> LossFn:
    """A mean loss turned into the sum over the batch's rows."""

    def summed(output: Any, target: Any) -> torch.Tensor:
        return loss(output, target) * batch_rows(target)

    return summed
