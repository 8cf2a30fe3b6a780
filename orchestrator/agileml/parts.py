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
class TrainingParts:
    """A job's pieces as a node builds them (see the module docstring)."""

    model_factory: Callable[[], nn.Module]  # a scratch model (values are pulled into it)
    initial_model: nn.Module  # the job's model at its initial values (the seed's)
    layout: PartitionLayout
    rows: RowSource
    loss_fn: LossFn  # summed over a batch's rows, as roster workers need it
    rules: RuleFactory
    code: JobCode | None = None

    def model_with(self, parts: list[torch.Tensor]) -> nn.Module:
        """A fresh model holding the given partitions (parameters and buffers)."""
        model = self.model_factory()
        self.layout.scatter(model, parts)
        return model

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


@dataclass(frozen=True)
class ModelParts:
    """What assembling a job's weights needs: the model and how partitions map onto it (no
    data, no optimizer: what the controller builds)."""

    model_factory: Callable[[], nn.Module]
    layout: PartitionLayout

    def model_with(self, parts: list[torch.Tensor]) -> nn.Module:
        """A fresh model holding the given partitions (parameters and buffers)."""
        model = self.model_factory()
        self.layout.scatter(model, parts)
        return model


def model_parts(spec: TrainingSpec) -> ModelParts:
    """The job's model and partition layout (its data is not fetched).

    Raises:
        JobCodeError: the job's code cannot be loaded.
    """
    if spec.code is None:
        factory = build_model(spec)
        return ModelParts(
            factory, PartitionLayout(initial_model(factory, spec.seed), spec.num_partitions)
        )
    code = load_job_code(code_path(spec, with_data=False))
    return ModelParts(
        code.model, PartitionLayout(seeded_model(code, spec.seed), spec.num_partitions)
    )


def training_parts(spec: TrainingSpec) -> TrainingParts:
    """Build the job's pieces.

    Raises:
        JobCodeError: the job's code cannot be loaded or its optimizer cannot be run.
        PartitionError: more partitions than the model has elements.
    """
    if spec.code is None:
        factory = build_model(spec)
        model = initial_model(factory, spec.seed)
        x, y = build_data(spec)
        return TrainingParts(
            model_factory=factory,
            initial_model=model,
            layout=PartitionLayout(model, spec.num_partitions),
            rows=TensorRows(x, y),
            loss_fn=build_loss(spec),
            rules=sgd_rules(spec.lr),
        )
    code = load_job_code(code_path(spec))
    model = seeded_model(code, spec.seed)
    layout = PartitionLayout(model, spec.num_partitions)
    plan = optimizer_plan(code, model, layout.buffer_sizes)
    return TrainingParts(
        model_factory=code.model,
        initial_model=model,
        layout=layout,
        rows=dataset_rows(code),
        loss_fn=_summed(code.loss),
        rules=plan.rules(layout.bounds),
        code=code,
    )


def _summed(loss: Callable[[Any, Any], torch.Tensor]) -> LossFn:
    """A mean loss turned into the sum over the batch's rows."""

    def summed(output: Any, target: Any) -> torch.Tensor:
        return loss(output, target) * batch_rows(target)

    return summed
