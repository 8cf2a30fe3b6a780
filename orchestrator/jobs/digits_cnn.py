"""A small CNN on scikit-learn's bundled handwritten digits (1,797 8x8 images, no download):
the first 1,500 images train, the last 297 are held out for `evaluate`. AdamW at a constant
learning rate, so the job trains for as many iterations as it is given."""

from collections.abc import Iterable

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

TRAIN_ROWS = 1500


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = load_digits(return_X_y=True)
    images = torch.tensor(x / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    return images, torch.tensor(y)


def model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 16, 10),
    )


def dataset() -> TensorDataset:
    x, y = _digits()
    return TensorDataset(x[:TRAIN_ROWS], y[:TRAIN_ROWS])


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)


def optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=2e-3, weight_decay=0.01)


def evaluate(m: nn.Module) -> dict[str, float]:
    x, y = _digits()
    with torch.no_grad():
        out = m(x[TRAIN_ROWS:])
    return {
        "held_out_accuracy": float((out.argmax(1) == y[TRAIN_ROWS:]).float().mean()),
        "held_out_loss": float(nn.functional.cross_entropy(out, y[TRAIN_ROWS:])),
    }
