"""A test job: a small CNN with BatchNorm on scikit-learn's digits (as 8x8 images), AdamW with
a cosine schedule."""

import os
import time

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

ITERATIONS = 300


def model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 64, 10),
    )


def dataset() -> TensorDataset:
    x, y = load_digits(return_X_y=True)
    images = torch.tensor(x[:1500] / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    return TensorDataset(images, torch.tensor(y[:1500]))


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # the exactness tests slow iterations down so that a joining node computes before the job
    # ends (a node process takes seconds to start on a small machine)
    time.sleep(float(os.environ.get("ORCHESTRATOR_TEST_JOB_PAUSE_S", "0")))
    return nn.functional.cross_entropy(output, target)


def optimizer(params):  # type: ignore[no-untyped-def]
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.05)


def scheduler(opt):  # type: ignore[no-untyped-def]
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=ITERATIONS)
