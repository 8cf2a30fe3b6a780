"""Which workers compute which clock, and which rows of the global batch each one takes.

A `Roster` is a schedule of worker sets by clock: entry `(from_clock, workers)` says that from
that clock on (until the next entry) exactly these workers compute. Parameter servers use it to
know whose pushes complete a clock; workers use it to know whether they compute a clock and
which share of the fixed global batch is theirs (strong scaling: the global batch never changes
as workers come and go, so the learning rate needs no retuning).

Changes are scheduled at a future clock (`with_change`), so a joining worker starts, and a
leaving worker stops, at a clock boundary that every node agrees on.
"""

from __future__ import annotations

import bisect
import functools
import zlib
from typing import Annotated

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from orchestrator.agileml.batches import micro_batches
from orchestrator.agileml.errors import RosterError

WorkerId = Annotated[str, Field(min_length=1, max_length=128)]


class RosterEntry(BaseModel):
    """From `from_clock` on, exactly `workers` compute each clock (sorted, unique)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    from_clock: Annotated[int, Field(ge=0)]
    workers: tuple[WorkerId, ...]

    @model_validator(mode="after")
    def _sorted_unique(self) -> RosterEntry:
        if list(self.workers) != sorted(set(self.workers)):
            raise ValueError(f"workers must be sorted and unique, got {list(self.workers)}")
        return self


class Roster(BaseModel):
    """A schedule of `RosterEntry`s with strictly increasing `from_clock`, the first at 0.

    `version` counts changes (`with_change` and `without` return version + 1) and `changes`
    records where each began, so that a server can tell a push computed on an older roster.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    entries: tuple[RosterEntry, ...]
    version: Annotated[int, Field(ge=0)] = 0
    # (version, first clock whose members it changed) of every change so far
    changes: tuple[tuple[Annotated[int, Field(ge=0)], Annotated[int, Field(ge=0)]], ...] = ()

    @model_validator(mode="after")
    def _ordered(self) -> Roster:
        clocks = [e.from_clock for e in self.entries]
        if not clocks or clocks[0] != 0:
            raise ValueError("a roster needs a first entry at clock 0")
        if any(b <= a for a, b in zip(clocks, clocks[1:], strict=False)):
            raise ValueError(f"from_clock must strictly increase, got {clocks}")
        return self

    @classmethod
    def starting(cls, workers: list[str] | tuple[str, ...]) -> Roster:
        """A roster of `workers` from clock 0."""
        return cls(entries=(RosterEntry(from_clock=0, workers=tuple(sorted(set(workers)))),))

    def members(self, clock: int) -> tuple[str, ...]:
        """The workers that compute `clock`."""
        i = bisect.bisect_right([e.from_clock for e in self.entries], clock) - 1
        return self.entries[max(i, 0)].workers

    def with_change(self, from_clock: int, workers: list[str] | tuple[str, ...]) -> Roster:
        """This roster with `workers` computing from `from_clock` on; later entries are dropped.

        Raises:
            RosterError: `from_clock` is negative.
        """
        if from_clock < 0:
            raise RosterError(f"from_clock must be >= 0, got {from_clock}")
        kept = tuple(e for e in self.entries if e.from_clock < from_clock)
        new = RosterEntry(from_clock=from_clock, workers=tuple(sorted(set(workers))))
        return self._changed((*kept, new))

    def without(self, removed: set[str] | frozenset[str], from_clock: int) -> Roster:
        """This roster with `removed` computing nothing from `from_clock` on (later scheduled
        changes are kept, minus those workers).

        Raises:
            RosterError: `from_clock` is negative.
        """
        if from_clock < 0:
            raise RosterError(f"from_clock must be >= 0, got {from_clock}")
        entries = [e for e in self.entries if e.from_clock < from_clock]
        rest = [e for e in self.entries if e.from_clock > from_clock]
        for entry in (RosterEntry(from_clock=from_clock, workers=self.members(from_clock)), *rest):
            workers = tuple(w for w in entry.workers if w not in removed)
            if entries and entries[-1].workers == workers:
                continue
            entries.append(RosterEntry(from_clock=entry.from_clock, workers=workers))
        return self._changed(tuple(entries))

    def _changed(self, entries: tuple[RosterEntry, ...]) -> Roster:
        """The next version with these entries, its change recorded (so that any holder of
        it can tell whether a push made on an older version is stale)."""
        new = Roster(entries=entries, version=self.version + 1)
        first = self.first_difference(new)
        changes = self.changes if first is None else (*self.changes, (new.version, first))
        return new.model_copy(update={"changes": changes})

    def first_difference(self, other: Roster) -> int | None:
        """The first clock whose members differ between the two rosters (None: never)."""
        clocks = sorted({e.from_clock for e in (*self.entries, *other.entries)})
        for clock in clocks:
            if self.members(clock) != other.members(clock):
                return clock
        return None

    def last_clock_of(self, worker: str, upto: int) -> int:
        """The last clock <= `upto` that `worker` computes (-1: none)."""
        ends = [e.from_clock for e in self.entries[1:]] + [upto + 1]
        for entry, end in reversed(list(zip(self.entries, ends, strict=True))):
            if entry.from_clock <= upto and worker in entry.workers:
                return min(end - 1, upto)
        return -1

    def first_clock_of(self, worker: str, at_or_after: int) -> int | None:
        """The first clock >= `at_or_after` that `worker` computes, or None if it never does."""
        if worker in self.members(at_or_after):
            return at_or_after
        for entry in self.entries:
            if entry.from_clock > at_or_after and worker in entry.workers:
                return entry.from_clock
        return None


def global_batch_indices(seed: int, clock: int, dataset_size: int, batch: int) -> torch.Tensor:
    """The rows of the global minibatch of `clock`: a deterministic function of (seed, clock).

    Epochs as a shuffled loader with `drop_last=True` makes them: epoch e is a permutation of
    the rows drawn from (seed, e), cut into `dataset_size // batch` batches in order. A batch
    larger than the data set draws its rows with replacement instead.
    """
    per_epoch = dataset_size // batch
    if per_epoch == 0:
        gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{clock}".encode()))
        return torch.randint(0, dataset_size, (batch,), generator=gen)
    epoch, index = divmod(clock, per_epoch)
    order = _epoch_permutation(seed, epoch, dataset_size)
    return order[index * batch : (index + 1) * batch].clone()


@functools.lru_cache(maxsize=4)
def _epoch_permutation(seed: int, epoch: int, dataset_size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}/epoch/{epoch}".encode()))
    return torch.randperm(dataset_size, generator=gen)


def worker_share(members: tuple[str, ...], worker: str, batch: int) -> slice:
    """The slice of the global batch that `worker` computes among `members` (near-equal parts).

    Raises:
        RosterError: the worker is not a member, or there are more members than rows.
    """
    if worker not in members:
        raise RosterError(f"worker {worker!r} is not in {list(members)}")
    if len(members) > batch:
        raise RosterError(f"{len(members)} workers for a global batch of {batch} rows")
    start, end = micro_batches(batch, len(members))[members.index(worker)]
    return slice(start, end)
