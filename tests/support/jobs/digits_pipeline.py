"""A test job for pipelines: a 7-module MLP as an nn.Sequential on scikit-learn's digits, with
the optimizer named by ORCHESTRATOR_TEST_OPTIMIZER (adamw with a cosine schedule, the default;
adamw_groups: no weight decay on biases, a second param group; or sgd without momentum, whose
state a restart does not need). ORCHESTRATOR_TEST_FROZEN=1 freezes the first layer."""

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
    m = _layers()
    if os.environ.get("ORCHESTRATOR_TEST_FROZEN") == "1":
        m[0].requires_grad_(False)
    return m


def _layers() -> nn.Sequential:
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
    kind = os.environ.get("ORCHESTRATOR_TEST_OPTIMIZER")
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.2)
    if kind == "adamw_groups":  # biases first: the state's order differs from the layers'
        params = list(params)
        groups = [
            {"params": [p for p in params if p.dim() == 1], "weight_decay": 0.0},
            {"params": [p for p in params if p.dim() > 1]},
        ]
        return torch.optim.AdamW(groups, lr=3e-3, weight_decay=0.01)
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


def scheduler(opt):  # type: ignore[no-untyped-def]
    if os.environ.get("ORCHESTRATOR_TEST_OPTIMIZER") == "sgd":
        return torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=0)
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=40)


def evaluate(m: nn.Module) -> dict[str, float]:
    with torch.no_grad():
        pred = m(X[TRAIN:]).argmax(1)
    return {"accuracy": float((pred == Y[TRAIN:]).float().mean())}
