"""A test job whose own code fails mid-run, deterministically, where the environment says:
`ORCHESTRATOR_TEST_FAIL=schedule` gives it a OneCycleLR of 20 steps (it raises on the
parameter servers at the 21st update), `ORCHESTRATOR_TEST_FAIL=loss` a loss that raises on a
worker after its 15th call (a node's check and warm-up calls count), `ORCHESTRATOR_TEST_FAIL=data`
a data set that cannot be built (a node fails as it loads the job)."""

import os

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

FAIL = os.environ.get("ORCHESTRATOR_TEST_FAIL", "")
_calls = 0


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def dataset() -> TensorDataset:
    if FAIL == "data":
        raise FileNotFoundError("/data/digits.npz: the user's data is not on this node")
    x, y = load_digits(return_X_y=True)
    return TensorDataset(torch.tensor(x[:1500] / 16.0, dtype=torch.float32), torch.tensor(y[:1500]))


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    global _calls
    _calls += 1
    if FAIL == "loss" and _calls > 15:
        raise RuntimeError("a bug in the user's loss")
    return nn.functional.cross_entropy(output, target)


def optimizer(params):  # type: ignore[no-untyped-def]
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def scheduler(opt):  # type: ignore[no-untyped-def]
    total = 20 if FAIL == "schedule" else 10_000
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=total)
