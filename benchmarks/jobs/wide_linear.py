"""A benchmark job: the AgileML benchmark's 5,001,000-parameter multinomial logistic regression
(5,000 features, 1,000 classes) on seeded random data, with Adam (its state doubles what a
checkpoint holds)."""

from collections.abc import Iterable

import torch
from torch import nn
from torch.utils.data import TensorDataset

FEATURES, CLASSES, ROWS = 5000, 1000, 2048


def model() -> nn.Module:
    return nn.Linear(FEATURES, CLASSES)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, FEATURES, generator=g)
    return TensorDataset(x, torch.randint(0, CLASSES, (ROWS,), generator=g))


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)


def optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)
