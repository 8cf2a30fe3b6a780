"""A benchmark job for a GPU: a 4-layer MLP of 102,730,728 parameters (411 MB) on seeded random
data with AdamW: a model whose pushes and pulls are large enough that the parameter servers'
data path, not the GPU, could set the pace (`benchmarks.gpu_check`)."""

from collections.abc import Iterable

import torch
from torch import nn
from torch.utils.data import TensorDataset

FEATURES, HIDDEN, CLASSES, ROWS = 2048, 8192, 1000, 8192


def model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, FEATURES), nn.ReLU(),
        nn.Linear(FEATURES, CLASSES),
    )  # fmt: skip


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, FEATURES, generator=g)
    teacher = torch.randn(FEATURES, CLASSES, generator=g)
    return TensorDataset(x, (x @ teacher).argmax(1))


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)


def optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)
