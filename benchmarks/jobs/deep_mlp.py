"""A benchmark job: a 6-layer MLP (4,564,068 parameters, 18 MB) on seeded random data with
SGD: several layers in several partitions, so pushes can leave while backward runs on the layers
below and the next forward can start on the first partitions (`agileml.streams`)."""

from collections.abc import Iterable

import torch
from torch import nn
from torch.utils.data import TensorDataset

FEATURES, HIDDEN, CLASSES, ROWS = 256, 1024, 100, 4096


def model() -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(FEATURES, HIDDEN), nn.ReLU()]
    for _ in range(4):
        layers += [nn.Linear(HIDDEN, HIDDEN), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(HIDDEN, CLASSES))


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, FEATURES, generator=g)
    teacher = torch.randn(FEATURES, CLASSES, generator=g)
    return TensorDataset(x, (x @ teacher).argmax(1))


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)


def optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)
