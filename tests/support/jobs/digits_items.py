"""A test job whose dataset is read item by item (as one that decodes images is): digits_sgd's
MLP and optimizer over a map-style Dataset; with ORCHESTRATOR_TEST_ITEMS_LOG set, every item
read writes the process that read it and that process's parent; ORCHESTRATOR_TEST_ITEM_S
seconds per item read (a decode)."""

import os
import time

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import Dataset


class Digits(Dataset):
    def __init__(self) -> None:
        x, y = load_digits(return_X_y=True)
        self.x = torch.tensor(x[:1500] / 16.0, dtype=torch.float32)
        self.y = torch.tensor(y[:1500])

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
        time.sleep(float(os.environ.get("ORCHESTRATOR_TEST_ITEM_S", "0")))
        log = os.environ.get("ORCHESTRATOR_TEST_ITEMS_LOG")
        if log:
            with open(log, "a") as out:
                out.write(f"{os.getpid()} {os.getppid()}\n")
        return self.x[i], self.y[i]


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))


def dataset() -> Dataset:
    return Digits()


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)


def optimizer(params):  # type: ignore[no-untyped-def]
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True)
