"""A `PartitionSnapshot` on the wire: the `workers` header list and the tensors of a `handoff` or
`restore` message, and their strict parsing (a malformed snapshot never changes state)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from orchestrator.agileml.clipping import check_coefficient
from orchestrator.agileml.partition_state import PartitionSnapshot, PendingChunk
from orchestrator.agileml.rejections import RejectedError, RejectReason
from orchestrator.agileml.wire import Header


def snapshot_fields(
    snapshot: PartitionSnapshot, **extra: Any
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    workers, tensors = snapshot_to_wire(snapshot)
    return {"workers": workers, **extra}, tensors


def snapshot_to_wire(snapshot: PartitionSnapshot) -> tuple[list[str], dict[str, torch.Tensor]]:
    """The `workers` header list and the tensors of a `handoff`/`restore` for `snapshot`."""
    names = set(snapshot.workers) | {w for w, _ in snapshot.applied}
    for chunk in snapshot.pending:
        names |= chunk.workers
    workers = sorted(names)
    index = {w: i for i, w in enumerate(workers)}

    def pairs(items: Iterable[tuple[str, int]]) -> torch.Tensor:
        rows = sorted((index[w], clock) for w, clock in items)
        return torch.tensor(rows, dtype=torch.int64).reshape(-1, 2)

    size = snapshot.values.shape[0]
    pending = (
        torch.stack([c.delta for c in snapshot.pending])
        if snapshot.pending
        else torch.empty(0, size, dtype=torch.float32)
    )
    return workers, {
        "values": snapshot.values,
        "applied": pairs(snapshot.applied),
        "version": torch.tensor([snapshot.version], dtype=torch.int64),
        "consistent": torch.tensor([snapshot.consistent], dtype=torch.int64),
        "pending": pending,
        "pending_clocks": torch.tensor([c.clock for c in snapshot.pending], dtype=torch.int64),
        "pending_pairs": pairs((w, c.clock) for c in snapshot.pending for w in c.workers),
        "accum": (
            torch.stack([a for _, a in snapshot.accum])
            if snapshot.accum
            else torch.empty(0, size, dtype=torch.float32)
        ),
        "accum_clocks": torch.tensor([c for c, _ in snapshot.accum], dtype=torch.int64),
        "rule_state": torch.frombuffer(bytearray(snapshot.rule_state), dtype=torch.uint8)
        if snapshot.rule_state
        else torch.empty(0, dtype=torch.uint8),
        "coef_clocks": torch.tensor([c for c, _ in snapshot.coefs], dtype=torch.int64),
        "coefs": torch.tensor([k for _, k in snapshot.coefs], dtype=torch.float64),
    }


_SNAPSHOT_TENSORS = (
    "values",
    "applied",
    "version",
    "consistent",
    "pending",
    "pending_clocks",
    "pending_pairs",
    "accum",
    "accum_clocks",
    "rule_state",
    "coef_clocks",
    "coefs",
)


def snapshot_from_wire(header: Header, tensors: dict[str, torch.Tensor]) -> PartitionSnapshot:
    """Parse an authenticated `handoff` or `restore` message. Raises RejectedError(BAD_SNAPSHOT)."""
    bad = RejectedError(RejectReason.BAD_SNAPSHOT, "want the snapshot tensors (see MessageKind)")
    if header.partition is None or set(tensors) != set(_SNAPSHOT_TENSORS):
        raise bad
    values, applied, version, consistent, pending, p_clocks, p_pairs, accum, a_clocks, rule = (
        tensors[k] for k in _SNAPSHOT_TENSORS[:10]
    )
    coefs = _coefficients(tensors["coef_clocks"], tensors["coefs"])
    workers = header.workers or ()
    if (
        values.dtype != torch.float32
        or values.dim() != 1
        or any(t.dtype != torch.int64 or t.dim() != 2 for t in (applied, p_pairs))
        or any(t.shape[1] != 2 for t in (applied, p_pairs))
        or any(t.dtype != torch.int64 or t.shape != (1,) for t in (version, consistent))
        or pending.dtype != torch.float32
        or pending.dim() != 2
        or pending.shape[1] != values.shape[0]
        or p_clocks.dtype != torch.int64
        or p_clocks.shape != (pending.shape[0],)
        or accum.dtype != torch.float32
        or accum.dim() != 2
        or accum.shape[1] != values.shape[0]
        or a_clocks.dtype != torch.int64
        or a_clocks.shape != (accum.shape[0],)
        or rule.dtype != torch.uint8
        or rule.dim() != 1
    ):
        raise bad

    def named(t: torch.Tensor) -> list[tuple[str, int]]:
        rows = [(int(i), int(c)) for i, c in t.tolist()]
        if any(not 0 <= i < len(workers) or c < 0 for i, c in rows):
            raise RejectedError(RejectReason.BAD_SNAPSHOT, "worker index or clock out of range")
        return [(workers[i], c) for i, c in rows]

    by_clock: dict[int, set[str]] = {}
    for w, c in named(p_pairs):
        by_clock.setdefault(c, set()).add(w)
    clocks = [int(c) for c in p_clocks.tolist()]
    if len(set(clocks)) != len(clocks) or set(by_clock) - set(clocks):
        raise RejectedError(RejectReason.BAD_SNAPSHOT, "pending clocks do not match their pairs")
    return PartitionSnapshot(
        header.partition,
        values,
        frozenset(named(applied)),
        int(version.item()),
        tuple(workers),
        int(consistent.item()),
        tuple(
            PendingChunk(c, pending[i].clone(), frozenset(by_clock.get(c, ())))
            for i, c in enumerate(clocks)
        ),
        tuple((int(c), accum[i].clone()) for i, c in enumerate(a_clocks.tolist())),
        rule.numpy().tobytes(),
        coefs,
    )


def _coefficients(clocks: torch.Tensor, coefs: torch.Tensor) -> tuple[tuple[int, float], ...]:
    """The snapshot's clipping coefficients, checked. Raises RejectedError(BAD_SNAPSHOT)."""
    if (
        clocks.dtype != torch.int64
        or coefs.dtype != torch.float64
        or clocks.dim() != 1
        or clocks.shape != coefs.shape
    ):
        raise RejectedError(RejectReason.BAD_SNAPSHOT, "want coef_clocks and coefs alike")
    pairs = list(zip(clocks.tolist(), coefs.tolist(), strict=True))
    try:
        checked = tuple((int(c), check_coefficient(float(k))) for c, k in pairs)
    except ValueError as exc:
        raise RejectedError(RejectReason.BAD_SNAPSHOT, str(exc)) from exc
    if any(c < 0 for c, _ in checked) or len({c for c, _ in checked}) != len(checked):
        raise RejectedError(RejectReason.BAD_SNAPSHOT, "coefficient clocks out of range")
    return checked
