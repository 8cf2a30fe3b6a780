"""Rows of a user's dataset as batches: the TensorDataset shortcut gives exactly what collating
the rows one by one gives."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset, default_collate

from orchestrator.agileml.batches import DatasetRows


def _per_row(dataset: TensorDataset, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    batch = default_collate([dataset[int(i)] for i in rows])
    return batch[0], batch[1]


def test_a_tensor_dataset_batch_equals_the_collated_rows() -> None:
    gen = torch.Generator().manual_seed(3)
    dataset = TensorDataset(torch.randn(50, 1, 8, 8, generator=gen), torch.arange(50) % 10)
    rows = torch.randint(0, 50, (17,), generator=gen)  # repeats and any order
    x, y = DatasetRows(dataset).take(rows)
    want_x, want_y = _per_row(dataset, rows)
    assert torch.equal(x, want_x) and torch.equal(y, want_y)
    assert x.dtype == want_x.dtype and y.dtype == want_y.dtype and y.shape == (17,)


def test_a_dataset_with_its_own_collate_or_items_is_collated_row_by_row() -> None:
    class Doubled(TensorDataset):  # a subclass may change its items: not indexed directly
        def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
            x, y = super().__getitem__(i)
            return x * 2, y

    dataset = Doubled(torch.ones(4, 3), torch.zeros(4, dtype=torch.long))
    x, _ = DatasetRows(dataset).take(torch.tensor([0, 1]))
    assert torch.equal(x, torch.full((2, 3), 2.0))
    seen: list[int] = []

    def collate(items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
        seen.append(len(items))
        return default_collate(items)

    DatasetRows(TensorDataset(torch.ones(4, 3), torch.zeros(4)), collate).take(torch.tensor([2]))
    assert seen == [1]
