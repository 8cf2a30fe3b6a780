"""Where a worker's rows come from: the job's training set, indexed by global row number.

A worker asks for the rows of its share of a clock's global batch (`RowSource.take`) and gets
one collated (inputs, targets) batch. The examples keep their data as two tensors
(`TensorRows`); a user's job gives a map-style `torch.utils.data.Dataset` whose items are
(input, target) pairs collated by PyTorch's default collate function, or items of any shape
its own collate function makes into (inputs, targets) (`DatasetRows`). Inputs may be a tensor
or any nesting of tuples (named too), lists and mappings of tensors.
"""

from __future__ import annotations

import copy
import time
from collections import UserDict
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from orchestrator.agileml.usercode import JobCodeError

Batch = tuple[Any, Any]  # (inputs, targets), as the model and the loss take them
Collate = Callable[[list[Any]], Any]


class RowSource(Protocol):
    """A training set addressed by row number."""

    def __len__(self) -> int: ...

    def take(self, rows: torch.Tensor) -> Batch:
        """The rows (int64 indices) as one batch, in the given order."""
        ...


class TensorRows:
    """Rows of two tensors of the same length (features, targets)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if len(x) != len(y) or len(x) == 0:
            raise ValueError("data must be two non-empty tensors of the same length")
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def take(self, rows: torch.Tensor) -> Batch:
        return self.x[rows], self.y[rows]


#: The most items `share_read_seconds` reads to time a dataset's items.
READ_SAMPLE_ITEMS = 16


class DatasetRows:
    """Rows of a map-style dataset of (input, target) pairs (or of items the job's collate
    makes into (inputs, targets)), collated into one batch."""

    def __init__(self, dataset: Dataset[Any], collate: Collate | None = None) -> None:
        self.dataset = dataset
        self.collate: Collate = collate or default_collate
        self._len = len(dataset)  # type: ignore[arg-type]
        if self._len == 0:
            raise ValueError("the dataset is empty")
        # a TensorDataset of (inputs, targets) under the default collate: index its two
        # tensors at once, as collating the rows one by one would give (without a Python loop)
        self._tensors: tuple[torch.Tensor, torch.Tensor] | None = None
        if (
            type(dataset) is TensorDataset
            and len(dataset.tensors) == 2
            and self.collate is default_collate
        ):
            self._tensors = (dataset.tensors[0], dataset.tensors[1])

    def __len__(self) -> int:
        return self._len

    @property
    def indexed_at_once(self) -> bool:
        """Whether its rows are taken by indexing two tensors (a plain TensorDataset), not
        item by item through the dataset and its collate function."""
        return self._tensors is not None

    def take(self, rows: torch.Tensor) -> Batch:
        if self._tensors is not None:
            return self._tensors[0][rows], self._tensors[1][rows]
        batch = self.collate([self.dataset[int(i)] for i in rows.tolist()])
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ValueError("a collated batch must be an (inputs, targets) pair")
        return batch[0], batch[1]


def share_read_seconds(rows: DatasetRows, share_rows: int, *, enough_s: float = 1.0) -> float:
    """About how long reading `share_rows` items of `rows` one by one takes, from reading up
    to `READ_SAMPLE_ITEMS` items spread over the dataset (fewer once they took `enough_s`).
    An item that raises ends the sample (the worker meets the error when it reads its rows);
    0 if none was read."""
    n = len(rows)
    count = min(READ_SAMPLE_ITEMS, n)
    spent, read = 0.0, 0
    for i in (k * n // count for k in range(count)):
        started = time.perf_counter()
        try:
            rows.dataset[i]
        except Exception:  # noqa: BLE001 - the job's own error: its worker reports it
            break
        spent += time.perf_counter() - started
        read += 1
        if spent >= enough_s:
            break
    return spent / read * share_rows if read else 0.0


def micro_batches(rows: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) spans splitting `rows` rows into `parts` near-equal parts in order (a
    worker's micro-batches; the workers' shares of a global batch, `roster.worker_share`),
    the first `rows % parts` one row larger (fewer spans when there are fewer rows; one when
    none)."""
    k = max(1, min(parts, rows))
    size, extra = divmod(rows, k)
    spans, start = [], 0
    for i in range(k):
        end = start + size + (1 if i < extra else 0)
        spans.append((start, end))
        start = end
    return spans


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`batch` with `fn` applied to each of its tensors, through tuples (named ones too),
    lists and mappings (a dict, Hugging Face's `BatchEncoding`, ...); anything else as it is."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return _rebuilt(batch, {k: map_tensors(v, fn) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(map_tensors(v, fn) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


def _rebuilt(like: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    """`items` in a mapping like `like`: a copy of it (its type and attributes: a defaultdict's
    factory, a BatchEncoding's encodings) with these values, else its type built from them,
    else a dict."""
    if type(like) is dict:
        return items
    if isinstance(like, (dict, UserDict)):  # their copies hold their own items
        out = copy.copy(like)
        out.update(items)  # the same keys: every value replaced
        return out
    try:
        return type(like)(items)  # type: ignore[call-arg]
    except (TypeError, ValueError):
        return items


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Rows [start, stop) of a collated batch (its tensors sliced on their first dimension;
    a 0-dim tensor, which has no rows, is kept whole)."""
    return map_tensors(batch, lambda t: t[start:stop] if t.dim() > 0 else t)


def micro_batch(batch: Batch, start: int, stop: int) -> Batch:
    """Rows [start, stop) of an (inputs, targets) batch, checked first: every tensor in it
    with a dimension holds the batch's rows on its first one.

    Raises:
        JobCodeError: a batch with no tensor, or a tensor whose first dimension is not the
            batch's rows; it cannot be split into micro-batches or FlexRR's chunks.
    """
    shapes: list[tuple[int, ...]] = []
    map_tensors(batch, lambda t: shapes.append(tuple(t.shape)) or t)  # type: ignore[func-returns-value]
    rows = next((s[0] for s in shapes if s), 0)  # the first tensor with rows (0-dim: none)
    wrong = sorted({s for s in shapes if s and s[0] != rows})
    if not shapes or wrong or not 0 <= start <= stop <= rows:
        found = f"tensors of shapes {', '.join(map(str, wrong))}" if wrong else "no tensor"
        raise JobCodeError(
            f"a batch of {rows} rows cannot be split into rows {start}-{stop}: it holds "
            f"{found}. A worker's batch is split (into micro-batches, FlexRR's chunks) on its "
            "tensors' first dimension, so the collated inputs and targets must be tensors, "
            "or tuples, lists or mappings of tensors, with the rows first"
        )
    x, y = slice_batch(batch, start, stop)
    return x, y


def to_device(batch: Any, device: torch.device) -> Any:
    """A collated batch with its tensors on `device` (the same object on the CPU)."""
    if device.type == "cpu":
        return batch
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))


def batch_rows(batch: Any) -> int:
    """How many rows a collated batch holds (its first tensor's first dimension)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else 1
    values = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(values, (tuple, list)) or isinstance(batch, Mapping):
        for v in values:
            return batch_rows(v)
    return len(batch)
