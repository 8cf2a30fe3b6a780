"""A test job whose data is not in its code: `dataset()` reads `digits.npz` from the folder the
runtime names in $ORCHESTRATOR_DATA_DIR (the spec's `training.data`)."""

import os
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))


def dataset() -> TensorDataset:
    arrays = np.load(Path(os.environ["ORCHESTRATOR_DATA_DIR"]) / "sets" / "digits.npz")
    x = torch.tensor(arrays["x"] / 16.0, dtype=torch.float32)
    return TensorDataset(x, torch.tensor(arrays["y"]))


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)


def optimizer(params):  # type: ignore[no-untyped-def]
    return torch.optim.Adam(params, lr=0.01)
