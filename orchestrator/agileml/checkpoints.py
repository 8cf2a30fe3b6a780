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

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from orchestrator.agileml.errors import AgileMLError
from orchestrator.artifacts import MANIFEST, latest_checkpoint

KEEP = 2  # complete checkpoints kept; older ones are removed


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
    manifest = {
        "job_id": job_id,
        "clock": clock,
        "iterations_done": clock + 1,
        "num_partitions": num_partitions,
        "created_unix": round(time.time(), 3),
    }
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
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


def read_manifest(directory: str | Path) -> dict[str, object]:
    """The manifest of a complete checkpoint.

    Raises:
        AgileMLError: not a complete checkpoint.
    """
    path = Path(directory) / MANIFEST
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AgileMLError(
            f"{directory} is not a complete checkpoint ({exc}). To fix: name a ckpt-* "
            f"directory that has a {MANIFEST}."
        ) from exc
    if not isinstance(data, dict) or not isinstance(data.get("clock"), int):
        raise AgileMLError(f"{path}: no clock in the manifest")
    return data


def read(directory: str | Path, num_partitions: int) -> Checkpoint:
    """Read a complete checkpoint of `num_partitions` partitions.

    Raises:
        AgileMLError: incomplete, another partitioning, or a file that does not load.
    """
    folder = Path(directory)
    manifest = read_manifest(folder)
    if manifest.get("num_partitions") != num_partitions:
        raise AgileMLError(
            f"checkpoint {folder} has {manifest.get('num_partitions')} partitions, the job "
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
    clock = manifest["clock"]
    assert isinstance(clock, int)
    return Checkpoint(folder, str(manifest.get("job_id", "")), clock, values, states)


def prune(root: str | Path, keep: int = KEEP) -> None:
    """Remove all but the newest `keep` complete checkpoints, and incomplete ones older than
    the newest complete one."""
    base = Path(root)
    newest = latest(base)
    if newest is None:
        return
    done = sorted(d for d in base.glob("ckpt-*") if (d / MANIFEST).is_file())
    stale = done[:-keep] if keep > 0 else done
    stale += [d for d in base.glob("ckpt-*") if not (d / MANIFEST).is_file() and d < newest]
    for d in stale:
        shutil.rmtree(d, ignore_errors=True)


def _part_name(p: int) -> str:
    return f"part-{p:04d}.safetensors"
