"""Fixed partitions of a model's state, and which server owns each.

The model's parameters (`named_parameters()` order) and persistent buffers are flattened into
one float32 vector that is cut into N contiguous, nearly equal partitions. N never changes
during a job: when servers come and go, whole partitions move between owners
(`PartitionTable.move`), so the state is never re-sharded.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from orchestrator.agileml.errors import OwnershipConflictError, PartitionError


class PartitionLayout:
    """How a model's state maps onto N partitions of one float32 vector.

    The vector holds the parameters (`named_parameters()` order), then the persistent buffers
    (`named_buffers()` order, those in `state_dict()`: BatchNorm's running statistics and the
    like), each converted to float32. Partition p covers `[bounds(p)[0], bounds(p)[1])`; the
    first `total % N` partitions hold one element more than the others.

    Raises:
        PartitionError: on construction if N < 1 or N > the number of elements.
    """

    def __init__(self, model: nn.Module, num_partitions: int) -> None:
        self.names: tuple[str, ...] = tuple(n for n, _ in model.named_parameters())
        self.shapes: tuple[torch.Size, ...] = tuple(p.shape for _, p in model.named_parameters())
        buffers = _persistent_buffers(model)
        self.buffer_names: tuple[str, ...] = tuple(n for n, _ in buffers)
        self.buffer_shapes: tuple[torch.Size, ...] = tuple(b.shape for _, b in buffers)
        self.param_total = sum(s.numel() for s in self.shapes)
        self.buffer_sizes: tuple[int, ...] = tuple(s.numel() for s in self.buffer_shapes)
        self.total = self.param_total + sum(self.buffer_sizes)
        if not 1 <= num_partitions <= self.total:
            raise PartitionError(
                f"num_partitions must be in 1..{self.total} (the parameter count), "
                f"got {num_partitions}"
            )
        self.num_partitions = num_partitions
        base, extra = divmod(self.total, num_partitions)
        starts = [p * base + min(p, extra) for p in range(num_partitions + 1)]
        self._bounds = [(starts[p], starts[p + 1]) for p in range(num_partitions)]
        self._starts = starts[:-1]
        offsets = [0]
        for shape in self.shapes:
            offsets.append(offsets[-1] + shape.numel())
        self._param_starts = offsets[:-1]  # of each parameter in the flat vector
        # which partitions each parameter's values lie in, and which parameters each partition
        # holds values of: looked up per partition on every push and pull
        self._param_parts = tuple(
            self._overlapping(start, shape.numel())
            for start, shape in zip(self._param_starts, self.shapes, strict=True)
        )
        self._partition_params = tuple(
            tuple(i for i, parts in enumerate(self._param_parts) if p in parts)
            for p in range(num_partitions)
        )

    def bounds(self, p: int) -> tuple[int, int]:
        """Start and end (exclusive) of partition p in the flat vector. Raises PartitionError."""
        self._check(p)
        return self._bounds[p]

    def holds_buffers(self, p: int) -> bool:
        """Whether partition p holds buffers' values (they follow the parameters' in the flat
        vector). Raises PartitionError."""
        return self.bounds(p)[1] > self.param_total

    def slice(self, p: int) -> slice:
        """Partition p as a slice of the flat vector. Raises PartitionError."""
        start, stop = self.bounds(p)
        return slice(start, stop)

    def size(self, p: int) -> int:
        """Number of elements in partition p. Raises PartitionError."""
        start, stop = self.bounds(p)
        return stop - start

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Cut a flat vector into partition-sized copies. Raises PartitionError on a bad length."""
        if flat.shape != (self.total,):
            raise PartitionError(f"flat vector has shape {tuple(flat.shape)}, want ({self.total},)")
        return [flat[start:stop].clone() for start, stop in self._bounds]

    def gather(self, model: nn.Module) -> list[torch.Tensor]:
        """The model's parameters and buffers as N float32 partitions (copies).
        Raises PartitionError."""
        tensors = [*self._params(model), *self._buffers(model)]
        return self.split(torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors]))

    def gather_buffers(self, model: nn.Module) -> torch.Tensor:
        """The model's buffers as one float32 vector (on the model's device)."""
        buffers = self._buffers(model)
        if not buffers:
            return torch.empty(0)
        return torch.cat([b.detach().reshape(-1).float() for b in buffers])

    def load_buffers(self, model: nn.Module, flat: torch.Tensor) -> None:
        """Set the model's buffers from a `gather_buffers` vector (rounded for integer ones)."""
        offset = 0
        with torch.no_grad():
            for buf in self._buffers(model):
                n = buf.numel()
                chunk = flat[offset : offset + n].view(buf.shape)
                buf.copy_(chunk if buf.is_floating_point() else chunk.round())
                offset += n

    def gather_grads(
        self, model: nn.Module, buffer_delta: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """The parameters' gradients (a missing one counts as 0), then `buffer_delta` (zeros if
        None) as N float32 partitions on the CPU (views of one fresh vector)."""
        params = self._params(model)
        pieces = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float()
            for p in params
        ]
        if self.buffer_sizes:
            delta = (
                buffer_delta
                if buffer_delta is not None
                else torch.zeros(self.total - self.param_total)
            )
            pieces.append(delta.reshape(-1).float())
        flat = torch.cat([piece.cpu() for piece in pieces]) if pieces else torch.empty(0)
        return [flat[start:stop] for start, stop in self._bounds]

    def scatter(self, model: nn.Module, parts: Sequence[torch.Tensor]) -> None:
        """Load N partitions into the model's parameters and buffers in place.

        Raises:
            PartitionError: wrong number or sizes of partitions, or a model that does not match
                the layout; the model is then unchanged.
        """
        params = self._params(model)
        buffers = self._buffers(model)
        if len(parts) != self.num_partitions:
            raise PartitionError(f"got {len(parts)} partitions, want {self.num_partitions}")
        for p, part in enumerate(parts):
            if part.shape != (self.size(p),):
                raise PartitionError(
                    f"partition {p} has shape {tuple(part.shape)}, want ({self.size(p)},)",
                    partition=p,
                )
        with torch.no_grad():
            for param, start in zip(params, self._param_starts, strict=True):
                # straight from the partitions (a pulled frame) into the parameter: one copy
                if param.is_contiguous():
                    self._read(parts, start, param.view(-1))
                else:
                    param.copy_(self._slice(parts, start, param.numel()).view_as(param))
        if buffers:
            self.load_buffers(
                model, self._slice(parts, self.param_total, self.total - self.param_total)
            )

    def param_partitions(self) -> tuple[tuple[int, ...], ...]:
        """For each parameter (layout order), the partitions its values lie in."""
        return self._param_parts

    def buffer_partitions(self) -> tuple[int, ...]:
        """The partitions the buffers' values lie in (none without buffers)."""
        return self._overlapping(self.param_total, self.total - self.param_total)

    def partition_params(self, p: int) -> tuple[int, ...]:
        """The parameters (layout indices) with values in partition p. Raises PartitionError."""
        self._check(p)
        return self._partition_params[p]

    def load_partition(self, params: Sequence[torch.Tensor], p: int, values: torch.Tensor) -> None:
        """Copy partition p's values into the (contiguous) parameters it covers, in place; its
        buffer values, if any, are not loaded here (see `scatter`).

        Raises:
            PartitionError: a wrong size, or a parameter that is not contiguous.
        """
        lo, hi = self.bounds(p)
        if values.shape != (hi - lo,):
            raise PartitionError(
                f"partition {p} has shape {tuple(values.shape)}, want ({hi - lo},)", partition=p
            )
        with torch.no_grad():
            for i in self.partition_params(p):
                param, start = params[i], self._param_starts[i]
                if not param.is_contiguous():
                    raise PartitionError(f"parameter {self.names[i]} is not contiguous")
                a, b = max(lo, start), min(hi, start + param.numel())
                param.view(-1)[a - start : b - start].copy_(values[a - lo : b - lo])

    def partition_grad(
        self,
        params: Sequence[torch.Tensor],
        p: int,
        buffer_delta: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Partition p of the gradient vector (a missing gradient counts as 0; the buffer part
        is `buffer_delta`'s, zeros if None) as float32 on the CPU. A partition inside one
        float32 CPU gradient is a view of it (no copy): the caller must not write to it, and
        the gradient must not change while the partition is in use."""
        lo, hi = self.bounds(p)
        pieces: list[torch.Tensor] = []
        for i in self.partition_params(p):
            param, start = params[i], self._param_starts[i]
            a, b = max(lo, start), min(hi, start + param.numel())
            grad = param.grad
            if grad is None:
                pieces.append(torch.zeros(b - a))
            else:
                pieces.append(grad.detach().reshape(-1)[a - start : b - start].float().cpu())
        if hi > self.param_total:
            a = max(lo, self.param_total)
            if buffer_delta is None:
                pieces.append(torch.zeros(hi - a))
            else:
                delta = buffer_delta.reshape(-1).float().cpu()
                pieces.append(delta[a - self.param_total : hi - self.param_total])
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def params(self, model: nn.Module) -> list[nn.Parameter]:
        """The model's parameters in layout order. Raises PartitionError if they do not fit."""
        return self._params(model)

    def buffers(self, model: nn.Module) -> list[torch.Tensor]:
        """The model's persistent buffers in layout order. Raises PartitionError."""
        return self._buffers(model)

    def load_buffers_from(self, model: nn.Module, parts: Mapping[int, torch.Tensor]) -> None:
        """Set the model's buffers from the partitions that hold their values."""
        if self.buffer_sizes:
            self.load_buffers(model, self.buffer_values(parts))

    def buffer_values(self, parts: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """The buffers' values (as `gather_buffers` has them) from the partitions that hold
        them; a view of a partition when one holds them all (do not write to it)."""
        if not self.buffer_sizes:
            return torch.empty(0)
        return self._slice(parts, self.param_total, self.total - self.param_total)

    def _overlapping(self, start: int, n: int) -> tuple[int, ...]:
        """The partitions that values [start, start + n) of the flat vector lie in."""
        if n <= 0:
            return ()
        first = max(bisect.bisect_right(self._starts, start) - 1, 0)
        last = max(bisect.bisect_right(self._starts, start + n - 1) - 1, 0)
        return tuple(range(first, last + 1))

    def _pieces(
        self, parts: Sequence[torch.Tensor] | Mapping[int, torch.Tensor], start: int, n: int
    ) -> list[tuple[int, torch.Tensor]]:
        """Values [start, start + n) of the flat vector split into `parts`: (offset in the
        range, a view of a part) for each part it overlaps."""
        out: list[tuple[int, torch.Tensor]] = []
        p = max(bisect.bisect_right(self._starts, start) - 1, 0)
        while p < self.num_partitions and self._bounds[p][0] < start + n:
            lo, hi = self._bounds[p]
            a, b = max(lo, start), min(hi, start + n)
            if a < b:
                out.append((a - start, parts[p].reshape(-1)[a - lo : b - lo]))
            p += 1
        return out

    def _read(self, parts: Sequence[torch.Tensor], start: int, into: torch.Tensor) -> None:
        """Copy values [start, start + len(into)) of the flat vector into `into` (1-D)."""
        for offset, piece in self._pieces(parts, start, into.numel()):
            into[offset : offset + piece.numel()].copy_(piece)

    def _slice(
        self, parts: Sequence[torch.Tensor] | Mapping[int, torch.Tensor], start: int, n: int
    ) -> torch.Tensor:
        """Values [start, start + n) of the flat vector: a view when one part holds them."""
        pieces = [piece for _, piece in self._pieces(parts, start, n)]
        if len(pieces) == 1:
            return pieces[0]
        return torch.cat(pieces) if pieces else torch.empty(0)

    def _params(self, model: nn.Module) -> list[nn.Parameter]:
        named = list(model.named_parameters())
        if tuple(n for n, _ in named) != self.names or tuple(p.shape for _, p in named) != (
            self.shapes
        ):
            raise PartitionError("model parameters do not match the partition layout")
        return [p for _, p in named]

    def _buffers(self, model: nn.Module) -> list[torch.Tensor]:
        if not self.buffer_names:
            return []
        named = dict(model.named_buffers())
        try:
            buffers = [named[n] for n in self.buffer_names]
        except KeyError as exc:
            raise PartitionError(
                f"model has no buffer {exc}: it does not match the layout"
            ) from None
        if tuple(b.shape for b in buffers) != self.buffer_shapes:
            raise PartitionError("model buffers do not match the partition layout")
        return buffers

    def _check(self, p: int) -> None:
        if not 0 <= p < self.num_partitions:
            raise PartitionError(
                f"unknown partition {p}; valid: 0..{self.num_partitions - 1}", partition=p
            )


def _persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers that `state_dict()` saves, in `named_buffers()` order."""
    saved = set(model.state_dict().keys())
    return [(n, b) for n, b in model.named_buffers() if n in saved]


@dataclass(frozen=True)
class Ownership:
    """Who owns a partition, and how many times its owner has changed (0: never assigned)."""

    owner: str | None
    version: int


class PartitionTable:
    """The owner of each of N partitions, with a per-partition version. Thread-safe.

    Every change of owner bumps the partition's version; a move may name the version it was
    decided on (`expected_version`), so that a concurrent move is detected rather than lost.
    """

    def __init__(self, num_partitions: int) -> None:
        if num_partitions < 1:
            raise PartitionError(f"num_partitions must be >= 1, got {num_partitions}")
        self.num_partitions = num_partitions
        self._entries = [Ownership(None, 0) for _ in range(num_partitions)]
        self._lock = threading.Lock()

    def get(self, p: int) -> Ownership:
        """Owner and version of partition p. Raises PartitionError for an unknown partition."""
        self._check(p)
        with self._lock:
            return self._entries[p]

    def owner(self, p: int) -> str:
        """The owner of partition p. Raises PartitionError if unknown or not yet assigned."""
        owner = self.get(p).owner
        if owner is None:
            raise PartitionError(f"partition {p} has no owner", partition=p)
        return owner

    def move(self, p: int, new_owner: str, *, expected_version: int | None = None) -> int:
        """Give partition p to `new_owner`; returns the new version (unchanged if no-op).

        Raises:
            PartitionError: unknown partition or empty owner name; nothing changed.
            OwnershipConflictError: `expected_version` is stale; nothing changed.
        """
        self._check(p)
        if not new_owner:
            raise PartitionError("owner name must not be empty", partition=p)
        with self._lock:
            entry = self._entries[p]
            if expected_version is not None and expected_version != entry.version:
                raise OwnershipConflictError(p, expected_version, entry.version)
            if entry.owner == new_owner:
                return entry.version
            self._entries[p] = Ownership(new_owner, entry.version + 1)
            return entry.version + 1

    def set(self, p: int, owner: str, version: int) -> bool:
        """Record that `owner` holds p at `version` (as a server reported it), if newer.

        Returns whether the entry changed. Raises PartitionError for an unknown partition.
        """
        self._check(p)
        with self._lock:
            if version <= self._entries[p].version:
                return False
            self._entries[p] = Ownership(owner, version)
            return True

    def owned_by(self, node: str) -> list[int]:
        """The partitions `node` owns, in ascending order."""
        with self._lock:
            return [p for p, e in enumerate(self._entries) if e.owner == node]

    def assign_round_robin(self, nodes: Sequence[str]) -> None:
        """Give partition p to `nodes[p % len(nodes)]`. Raises PartitionError if no nodes."""
        if not nodes:
            raise PartitionError("cannot assign partitions to no nodes")
        for p in range(self.num_partitions):
            self.move(p, nodes[p % len(nodes)])

    def _check(self, p: int) -> None:
        if not 0 <= p < self.num_partitions:
            raise PartitionError(
                f"unknown partition {p}; valid: 0..{self.num_partitions - 1}", partition=p
            )
