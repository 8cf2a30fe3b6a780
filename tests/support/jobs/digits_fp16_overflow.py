"""A test job for fp16: digits_sgd's MLP and optimizer, with a few training rows scaled so far
up that a float16 forward overflows on them (the iterations whose global batch holds one must
be skipped on every partition); in fp32 they are merely large."""

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

#: The rows whose float16 forward overflows (an input of 1e5 is past float16's 65504).
OVERFLOW_ROWS = (7, 300, 900)


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))


def dataset() -> TensorDataset:
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x[:1500] / 16.0, dtype=torch.float32)
    x[list(OVERFLOW_ROWS)] = 1e5
    return TensorDataset(x, torch.tensor(y[:1500]))


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)


def optimizer(params):  # type: ignore[no-untyped-def]
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def scheduler(opt, total_iterations):  # type: ignore[no-untyped-def]
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total_iterations)


def evaluate(m: nn.Module) -> dict[str, float]:
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x[1500:] / 16.0, dtype=torch.float32), torch.tensor(y[1500:])
    m.eval()
    with torch.no_grad():
        return {"held_out_accuracy": float((m(x).argmax(1) == y).float().mean())}
