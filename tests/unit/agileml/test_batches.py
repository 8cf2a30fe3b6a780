"""Rows of a user's dataset as batches: the TensorDataset shortcut gives exactly what collating
the rows one by one gives."""

from __future__ import annotations

import time
from collections import UserDict, defaultdict
from collections.abc import MutableMapping
from typing import NamedTuple

import pytest
import torch
from torch.utils.data import TensorDataset, default_collate

from orchestrator.agileml.batches import (
    DatasetRows,
    batch_rows,
    micro_batch,
    share_read_seconds,
)
from orchestrator.agileml.node import LOADER_MIN_SHARE_S
from orchestrator.agileml.usercode import JobCodeError


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


class Pair(NamedTuple):
    image: torch.Tensor
    mask: torch.Tensor


class Encoding(UserDict):  # type: ignore[type-arg]
    """Like Hugging Face's BatchEncoding: a Mapping that is not a dict."""


def test_a_micro_batch_slices_tensors_through_named_tuples_and_mappings() -> None:
    rows = torch.arange(10)
    inputs = {"pair": Pair(rows * 2, rows * 3), "enc": Encoding(ids=rows), "n": 7}
    x, y = micro_batch((inputs, rows), 2, 5)
    assert isinstance(x["pair"], Pair) and x["pair"].mask.tolist() == [6, 9, 12]
    assert isinstance(x["enc"], Encoding) and x["enc"]["ids"].tolist() == [2, 3, 4]
    assert x["n"] == 7 and y.tolist() == [2, 3, 4]
    assert batch_rows(Encoding(ids=rows)) == 10


def test_a_batch_whose_rows_are_not_first_cannot_be_split_and_says_why() -> None:
    rows = torch.arange(10)
    for inputs in (
        torch.zeros(3, 10),  # rows on the second dimension
        (torch.zeros(10, 3), torch.zeros(3, 10)),  # one tensor of two
        {"ids": torch.zeros(10, 4), "pos": torch.zeros(4)},
    ):
        with pytest.raises(JobCodeError, match="cannot be split into rows 0-5"):
            micro_batch((inputs, rows), 0, 5)
    with pytest.raises(JobCodeError, match="it holds no tensor"):
        micro_batch((["a", "b", "c"], ["x", "y", "z"]), 0, 2)


def test_a_micro_batch_keeps_what_has_no_rows_and_the_mappings_own_kind() -> None:
    rows = torch.arange(6)
    scale = torch.tensor(2.0)  # 0-dim: no rows, kept whole
    table = defaultdict(list, {"x": rows})
    (got_rows, got_scale, got_table), y = micro_batch(((rows, scale, table), rows), 1, 3)
    assert got_rows.tolist() == [1, 2] and got_scale is scale and y.tolist() == [1, 2]
    assert isinstance(got_table, defaultdict) and got_table.default_factory is list
    assert got_table["x"].tolist() == [1, 2]


class Shared(MutableMapping):  # type: ignore[type-arg]
    """A mapping whose copy (no __copy__) would share its items."""

    def __init__(self, items: dict) -> None:  # type: ignore[type-arg]
        self.items_ = dict(items)

    def __getitem__(self, k):  # type: ignore[no-untyped-def]
        return self.items_[k]

    def __setitem__(self, k, v) -> None:  # type: ignore[no-untyped-def]
        self.items_[k] = v

    def __delitem__(self, k) -> None:  # type: ignore[no-untyped-def]
        del self.items_[k]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.items_)

    def __len__(self) -> int:
        return len(self.items_)


def test_slicing_never_changes_the_users_batch_and_a_leading_scalar_has_no_rows() -> None:
    rows = torch.arange(8)
    batch = Shared({"x": rows})
    first, _ = micro_batch((batch, rows), 0, 4)
    assert batch["x"].tolist() == list(range(8))  # the user's batch as it was
    assert isinstance(first, Shared) and first["x"].tolist() == [0, 1, 2, 3]
    inputs = {"t": torch.tensor(0.5), "x": torch.zeros(8, 3)}  # a 0-dim tensor first
    got, y = micro_batch((inputs, rows), 4, 8)
    assert got["x"].shape == (4, 3) and got["t"] is inputs["t"] and y.tolist() == [4, 5, 6, 7]


class _Items(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Items read one by one, each taking `item_s` (a decode), or raising from `bad` on."""

    def __init__(self, n: int, item_s: float = 0.0, bad: int | None = None) -> None:
        self.n, self.item_s, self.bad = n, item_s, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.bad is not None and i >= self.bad:
            raise KeyError(i)
        if self.item_s:
            time.sleep(self.item_s)
        return torch.zeros(3), torch.tensor(i)


def test_a_shares_read_time_comes_from_a_sample_of_items() -> None:
    """What decides whether a node reads its rows ahead (`node.LOADER_MIN_SHARE_S`): items
    indexed in Python take microseconds (a loader costs more than it saves), a decode of a few
    milliseconds adds up over a share."""
    cheap = share_read_seconds(DatasetRows(_Items(1000)), 32)
    slow = share_read_seconds(DatasetRows(_Items(1000, item_s=0.002)), 32)
    assert cheap < LOADER_MIN_SHARE_S <= 0.064 <= slow
    # an item that raises ends the sample: the worker meets the error reading its rows
    assert share_read_seconds(DatasetRows(_Items(1000, bad=0)), 32) == 0.0
    assert share_read_seconds(DatasetRows(_Items(1000, item_s=0.002, bad=500)), 32) >= 0.064
    started = time.monotonic()  # a very slow dataset is sampled for about `enough_s`
    assert share_read_seconds(DatasetRows(_Items(50, item_s=0.1)), 8, enough_s=0.2) >= 0.8
    assert time.monotonic() - started < 1.0
