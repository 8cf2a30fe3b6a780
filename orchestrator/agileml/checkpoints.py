"""A job's checkpoints on disk: its whole training state at one clock, to resume from and to
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
stopped. Files are written to a temporary name and renamed, so a crash leaves no torn file;
an incomplete checkpoint (no manifest) is never read and is removed by `prune`.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from orchestrator.agileml.errors import AgileMLError
from orchestrator.artifacts import MANIFEST, latest_checkpoint

KEEP_CHECKPOINTS = 2  # complete checkpoints kept; older ones are removed


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint read back: every partition's values and optimizer state."""

    path: Path
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


def checkpoint_dir(root: str | Path, clock: int) -> Path:
    return Path(root) / f"ckpt-{clock:08d}"


def write_part(
    directory: str | Path, p: int, *, clock: int, values: torch.Tensor, rule_state: bytes
) -> None:
    """Write partition p's values and optimizer state at `clock` (atomically)."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    state = torch.frombuffer(bytearray(rule_state), dtype=torch.uint8) if rule_state else None
    tensors = {"values": values.detach().to(torch.float32).contiguous().clone()}
    if state is not None:
        tensors["rule_state"] = state
    target = folder / f"part-{p:04d}.safetensors"
    tmp = target.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"partition": str(p), "clock": str(clock)})
    os.replace(tmp, target)


def complete(directory: str | Path, *, job_id: str, clock: int, num_partitions: int) -> Path:
    """Check that every partition is written at `clock`, then write the manifest.

    Raises:
        AgileMLError: a partition file is missing.
    """
    folder = Path(directory)
    missing = [p for p in range(num_partitions) if not (folder / _part_name(p)).is_file()]
    if missing:
        raise AgileMLError(f"checkpoint {folder}: partitions {missing} were not written")
    manifest = CheckpointManifest(
        job_id=job_id, clock=clock, num_partitions=num_partitions, created_unix=time.time()
    )
    data = {**manifest.model_dump(), "iterations_done": manifest.iterations_done}
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, folder / MANIFEST)
    return folder


latest = latest_checkpoint  # the newest complete checkpoint under a folder (None: none yet)


def save_weights(model: nn.Module, path: str | Path) -> None:
    """Write the model's whole `state_dict` (parameters and buffers) as safetensors,
    atomically: `model.load_state_dict(safetensors.torch.load_file(path))` reads it back."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    tmp = target.with_suffix(".tmp")
    save_file(state, str(tmp))
    os.chmod(tmp, 0o644)  # an output file, readable like the summary beside it
    os.replace(tmp, target)


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


def read_manifest(directory: str | Path) -> CheckpointManifest:
    """The manifest of a complete checkpoint.

    Raises:
        AgileMLError: not a complete checkpoint, or a manifest that does not parse (named).
    """
    path = Path(directory) / MANIFEST
    try:
        return CheckpointManifest.model_validate_json(path.read_text())
    except OSError as exc:
        raise AgileMLError(
            f"{directory} is not a complete checkpoint ({exc.strerror}). To fix: name a ckpt-* "
            f"directory that has a {MANIFEST}."
        ) from exc
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise AgileMLError(f"{path}: {where}: {first['msg']}") from exc


def read(directory: str | Path, num_partitions: int) -> Checkpoint:
    """Read a complete checkpoint of `num_partitions` partitions.

    Raises:
        AgileMLError: incomplete, another partitioning, or a file that does not load.
    """
    folder = Path(directory)
    manifest = read_manifest(folder)
    if manifest.num_partitions != num_partitions:
        raise AgileMLError(
            f"checkpoint {folder} has {manifest.num_partitions} partitions, the job "
            f"{num_partitions}. To fix: resume with the num_partitions it was written with."
        )
    values, states = [], []
    for p in range(num_partitions):
        try:
            tensors = load_file(str(folder / _part_name(p)))
        except (OSError, SafetensorError) as exc:
            raise AgileMLError(f"checkpoint {folder}: partition {p}: {exc}") from exc
        values.append(tensors["values"])
        state = tensors.get("rule_state")
        states.append(bytes(state.numpy().tobytes()) if state is not None else b"")
    return Checkpoint(folder, manifest.job_id, manifest.clock, values, states)


def prune(root: str | Path, keep: int = KEEP_CHECKPOINTS, spare: str | Path | None = None) -> None:
    """Remove all but the newest `keep` complete checkpoints, and incomplete ones older than
    the newest complete one; never `spare` (the checkpoint the run resumed from)."""
    folders = sorted(Path(root).glob("ckpt-*"))
    done = [d for d in folders if (d / MANIFEST).is_file()]
    if not done:
        return
    stale = done[:-keep] if keep > 0 else done
    stale += [d for d in folders if d not in done and d < done[-1]]
    kept = Path(spare).resolve() if spare is not None else None
    for d in stale:
        if d.resolve() != kept:
            shutil.rmtree(d, ignore_errors=True)


def _part_name(p: int) -> str:
    return f"part-{p:04d}.safetensors"
