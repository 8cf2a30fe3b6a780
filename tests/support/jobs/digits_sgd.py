"""A test job: an MLP on scikit-learn's digits, SGD with Nesterov momentum and weight decay,
two parameter groups (no decay on biases)."""

import os
import time

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))


def dataset() -> TensorDataset:
    x, y = load_digits(return_X_y=True)
    return TensorDataset(torch.tensor(x[:1500] / 16.0, dtype=torch.float32), torch.tensor(y[:1500]))


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # the exactness tests slow iterations down so that a joining node computes before the job
    # ends (a node process takes seconds to start on a small machine)
    time.sleep(float(os.environ.get("ORCHESTRATOR_TEST_JOB_PAUSE_S", "0")))
    rows_log = os.environ.get("ORCHESTRATOR_TEST_ROWS_LOG")
    if rows_log:  # how many rows each loss call saw, in which process and precision
        with open(rows_log, "a") as log:
            log.write(f"{os.getpid()} {len(target)} {output.dtype}\n")
    return nn.functional.cross_entropy(output, target)


def optimizer(params):  # type: ignore[no-untyped-def]
    params = list(params)
    weights = [p for p in params if p.dim() > 1]
    biases = [p for p in params if p.dim() <= 1]
    return torch.optim.SGD(
        [{"params": weights, "weight_decay": 1e-3}, {"params": biases, "weight_decay": 0.0}],
        lr=0.1,
        momentum=0.9,
        nesterov=True,
    )
