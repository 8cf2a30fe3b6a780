"""A test job shipped as a directory: an MLP with BatchNorm on scikit-learn's wine data set
(standardised by a helper module next to it), RMSprop with OneCycleLR, a held-out evaluation."""

import torch
from features import standardised_wine
from torch import nn
from torch.utils.data import TensorDataset

TRAIN = 140  # of 178 rows; the rest are held out


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(13, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 3))


def dataset() -> TensorDataset:
    x, y = standardised_wine()
    return TensorDataset(x[:TRAIN], y[:TRAIN])


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)


def optimizer(params):  # type: ignore[no-untyped-def]
    return torch.optim.RMSprop(params, lr=0.01, momentum=0.5)


def scheduler(opt):  # type: ignore[no-untyped-def]
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.02, total_steps=100)


def evaluate(m: nn.Module) -> dict[str, float]:
    x, y = standardised_wine()
    predicted = m(x[TRAIN:]).argmax(dim=1)
    return {"held_out_accuracy": float((predicted == y[TRAIN:]).float().mean())}
