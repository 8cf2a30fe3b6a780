"""A test job as a user wrote it from the README's contract: an MLP on scikit-learn's
breast-cancer data, SGD with Nesterov momentum and a OneCycleLR told the run's length
(`scheduler(optimizer, total_iterations)`): a schedule that hard-coded it would raise past it."""

import torch
from sklearn.datasets import load_breast_cancer
from torch import nn
from torch.utils.data import TensorDataset


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(30, 16), nn.ReLU(), nn.Linear(16, 2))


def dataset() -> TensorDataset:
    x, y = load_breast_cancer(return_X_y=True)
    x = (x - x.mean(axis=0)) / x.std(axis=0)
    return TensorDataset(torch.tensor(x[:480], dtype=torch.float32), torch.tensor(y[:480]))


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)


def optimizer(params):  # type: ignore[no-untyped-def]
    return torch.optim.SGD(params, lr=0.01, momentum=0.9, nesterov=True)


def scheduler(opt, total_iterations):  # type: ignore[no-untyped-def]
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=total_iterations)


def evaluate(net: nn.Module) -> dict[str, float]:
    x, y = load_breast_cancer(return_X_y=True)
    mean, std = x[:480].mean(axis=0), x[:480].std(axis=0)
    held = torch.tensor((x[480:] - mean) / std, dtype=torch.float32)
    with torch.no_grad():
        predicted = net(held).argmax(dim=1).numpy()
    return {"held_out_accuracy": float((predicted == y[480:]).mean())}
