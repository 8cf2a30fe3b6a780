"""The wine data set, shuffled once with a fixed seed and standardised."""

import torch
from sklearn.datasets import load_wine


def standardised_wine() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = load_wine(return_X_y=True)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    features = torch.tensor(x, dtype=torch.float32)[order]
    features = (features - features.mean(0)) / features.std(0)
    return features, torch.tensor(y)[order]
