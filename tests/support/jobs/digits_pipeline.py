"""A test job for pipelines: a 7-module MLP as an nn.Sequential on scikit-learn's digits, with
the optimizer named by ORCHESTRATOR_TEST_OPTIMIZER (adamw with a cosine schedule, the default;
or sgd without momentum, whose state a restart does not need)."""

import os

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

X, Y = load_digits(return_X_y=True)
X = torch.tensor(X / 16.0, dtype=torch.float32)
Y = torch.tensor(Y)
TRAIN = 1400


def model() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(64, 96),
        nn.ReLU(),
        nn.Linear(96, 96),
        nn.Tanh(),
        nn.Linear(96, 48),
        nn.ReLU(),
        nn.Linear(48, 10),
    )


def dataset() -> TensorDataset:
    return TensorDataset(X[:TRAIN], Y[:TRAIN])


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)


def optimizer(params):  # type: ignore[no-untyped-def]
    if os.environ.get("ORCHESTRATOR_TEST_OPTIMIZER") == "sgd":
        return torch.optim.SGD(params, lr=0.2)
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


def scheduler(opt):  # type: ignore[no-untyped-def]
    if os.environ.get("ORCHESTRATOR_TEST_OPTIMIZER") == "sgd":
        return torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=0)
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=40)


def evaluate(m: nn.Module) -> dict[str, float]:
    with torch.no_grad():
        pred = m(X[TRAIN:]).argmax(1)
    return {"accuracy": float((pred == Y[TRAIN:]).float().mean())}
