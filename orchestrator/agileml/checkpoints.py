"""A job's checkpoints in the artifact store (a local directory or an S3 prefix, see
`orchestrator.artifacts.folders`): its whole training state at one clock, to resume from and to
hand the weights back.

The BackupPSs hold every partition at one common clock (the ceiling the elasticity controller
raises, see `server_calls.advance_backups`), so a checkpoint costs the workers nothing: each
node that backs partitions up writes them as they are at that clock, and the controller then
writes the manifest that makes the checkpoint complete. A directory per checkpoint:

    ROOT/ckpt-00000099/part-0003.safetensors   values + the optimizer's state of partition 3
    ROOT/ckpt-00000099/checkpoint.json         written last: clock, partitions, job, time

The data position is the clock: the global batches are a function of (seed, clock). Resuming
from a checkpoint at clock c (`TrainingSpec.resume_from`) starts every partition there, with
its optimizer state, and the workers at clock c + 1: the run goes on exactly as if it had not
stopped. Every file is written whole (a temporary name renamed locally; one PUT on S3), so a
crash leaves no torn file; an incomplete checkpoint (no manifest) is never read and is removed
by `prune`. Folders are named by location strings (`folder_at`), which travel in the spec.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load, save
from torch import nn

from orchestrator.agileml.errors import AgileMLError
from orchestrator.artifacts import (
    CHECKPOINT_PREFIX,
    MANIFEST,
    WEIGHTS,
    Folder,
    folder_at,
    folder_name,
    latest_checkpoint,
)

KEEP_CHECKPOINTS = 2  # complete checkpoints kept; older ones are removed


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint read back: every partition's values and optimizer state."""

    location: str
    job_id: str
    clock: int  # the last clock applied: iterations done = clock + 1
    values: list[torch.Tensor]
    rule_states: list[bytes]


@dataclass
class CheckpointSchedule:
    """When the next checkpoint is due: every `every` clocks and every `every_s` seconds
    (0: not by that measure), counted from the last one (or the clock the job started at)."""

    every: int
    every_s: float
    last_clock: int
    last_s: float

    def due(self, clock: int, now_s: float) -> bool:
        if clock <= self.last_clock:
            return False
        by_clock = self.every > 0 and clock - self.last_clock >= self.every
        by_time = self.every_s > 0 and now_s - self.last_s >= self.every_s
        return by_clock or by_time

    def taken(self, clock: int, now_s: float) -> None:
        self.last_clock, self.last_s = clock, now_s


Location = str | Path | Folder  # a folder, or a location string that names one (`folder_at`)


def checkpoint_dir(root: Location, clock: int) -> Folder:
    return folder_at(root).sub(f"{CHECKPOINT_PREFIX}{clock:08d}")


def write_part(
    directory: Location, p: int, *, clock: int, values: torch.Tensor, rule_state: bytes
) -> None:
    """Write partition p's values and optimizer state at `clock` (atomically)."""
    state = torch.frombuffer(bytearray(rule_state), dtype=torch.uint8) if rule_state else None
    tensors = {"values": values.detach().to(torch.float32).contiguous().clone()}
    if state is not None:
        tensors["rule_state"] = state
    data = save(tensors, metadata={"partition": str(p), "clock": str(clock)})
    folder = folder_at(directory)
    try:
        folder.write_bytes(_part_name(p), data)
    except OSError as exc:
        raise AgileMLError(f"checkpoint {folder.location}: partition {p}: {exc}") from exc


def complete(directory: Location, *, job_id: str, clock: int, num_partitions: int) -> Folder:
    """Check that every partition is written at `clock`, then write the manifest.

    Raises:
        AgileMLError: a partition file is missing.
    """
    folder = folder_at(directory)
    try:
        written = set(folder.names())
        missing = [p for p in range(num_partitions) if _part_name(p) not in written]
        if missing:
            raise AgileMLError(
                f"checkpoint {folder.location}: partitions {missing} were not written"
            )
        manifest = CheckpointManifest(
            job_id=job_id, clock=clock, num_partitions=num_partitions, created_unix=time.time()
        )
        data = {**manifest.model_dump(), "iterations_done": manifest.iterations_done}
        folder.write_bytes(MANIFEST, (json.dumps(data, indent=2) + "\n").encode())
    except OSError as exc:
        raise AgileMLError(f"checkpoint {folder.location}: {exc}") from exc
    return folder


def latest(root: Location) -> Folder | None:
    """The newest complete checkpoint under `root` (None: none yet)."""
    return latest_checkpoint(folder_at(root))


def save_weights(model: nn.Module, folder: Location, name: str = WEIGHTS) -> None:
    """Write the model's whole `state_dict` (parameters and buffers) as safetensors into
    `folder`, atomically: `model.load_state_dict(safetensors.torch.load_file(path))` reads it
    back."""
    state = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    folder_at(folder).write_bytes(name, save(state))


class CheckpointManifest(BaseModel):
    """What `checkpoint.json` says: the checkpoint is complete at `clock`."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    job_id: str = ""
    clock: Annotated[int, Field(ge=-1)]  # the last clock applied
    num_partitions: Annotated[int, Field(ge=1)]
    created_unix: float = 0.0

    @property
    def iterations_done(self) -> int:
        return self.clock + 1


def read_manifest(directory: Location) -> CheckpointManifest:
    """The manifest of a complete checkpoint.

    Raises:
        AgileMLError: not a complete checkpoint, or a manifest that does not parse (named).
    """
    folder = folder_at(directory)
    try:
        text = folder.read_bytes(MANIFEST)
    except OSError as exc:
        raise AgileMLError(
            f"{folder.location} is not a complete checkpoint ({exc.strerror or exc}). To fix: "
            f"name a ckpt-* directory that has a {MANIFEST}."
        ) from exc
    try:
        return CheckpointManifest.model_validate_json(text)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise AgileMLError(f"{folder.location}/{MANIFEST}: {where}: {first['msg']}") from exc


def read(directory: Location, num_partitions: int) -> Checkpoint:
    """Read a complete checkpoint of `num_partitions` partitions.

    Raises:
        AgileMLError: incomplete, another partitioning, or a file that does not load.
    """
    folder = folder_at(directory)
    manifest = read_manifest(folder)
    if manifest.num_partitions != num_partitions:
        raise AgileMLError(
            f"checkpoint {folder.location} has {manifest.num_partitions} partitions, the job "
            f"{num_partitions}. To fix: resume with the num_partitions it was written with."
        )
    values, states = [], []
    for p in range(num_partitions):
        try:
            tensors = load(folder.read_bytes(_part_name(p)))
        except (OSError, SafetensorError) as exc:
            raise AgileMLError(f"checkpoint {folder.location}: partition {p}: {exc}") from exc
        values.append(tensors["values"])
        state = tensors.get("rule_state")
        states.append(bytes(state.numpy().tobytes()) if state is not None else b"")
    return Checkpoint(folder.location, manifest.job_id, manifest.clock, values, states)


def prune(root: Location, keep: int = KEEP_CHECKPOINTS, spare: Location | None = None) -> None:
    """Remove all but the newest `keep` complete checkpoints, and incomplete ones older than
    the newest complete one; never `spare` (the checkpoint the run resumed from)."""
    base = folder_at(root)
    try:
        names = [n for n in base.names() if n.startswith(CHECKPOINT_PREFIX)]
        done = [n for n in names if base.sub(n).exists(MANIFEST)]
        if not done:
            return
        stale = done[:-keep] if keep > 0 else done
        stale += [n for n in names if n not in done and n < done[-1]]
        kept = None if spare is None else folder_name(folder_at(spare))
        for name in stale:
            if name != kept:
                base.sub(name).remove()
    except OSError as exc:  # the next checkpoint prunes again
        raise AgileMLError(f"pruning checkpoints in {base.location}: {exc}") from exc


def _part_name(p: int) -> str:
    return f"part-{p:04d}.safetensors"
