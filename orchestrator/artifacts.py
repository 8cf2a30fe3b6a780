"""A training job's artifacts on the controller's disk: its checkpoints and its final weights.

    ROOT/<job id>/checkpoints/ckpt-<clock>/   a checkpoint (see `agileml.checkpoints`); complete
                                              once its `checkpoint.json` exists; `model.safetensors`
                                              once the training host has assembled its weights
    ROOT/<job id>/final/model.safetensors     the weights when the job ended
    ROOT/<job id>/final/weights.json          where they came from and how far training was

The training host writes them, the API serves them (`orchestrator job ID --download DIR`),
and a restarted controller resumes each job from its newest checkpoint. Offline every node
shares this disk; on AWS the checkpoints' home is not yet shared with the workers (see README).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from orchestrator.errors import UserError

MANIFEST = "checkpoint.json"  # written last: the checkpoint is complete
WEIGHTS = "model.safetensors"  # a state_dict, loadable with safetensors.torch.load_file
FINAL_INFO = "weights.json"
_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The newest complete checkpoint (`ckpt-*` with a manifest) in `folder`, None if none."""
    base = Path(folder)
    if not base.is_dir():
        return None
    done = sorted(d for d in base.glob("ckpt-*") if (d / MANIFEST).is_file())
    return done[-1] if done else None


@dataclass(frozen=True)
class JobArtifacts:
    """Where one job's artifacts live under `root` (see the module docstring)."""

    root: Path
    job_id: str

    def __post_init__(self) -> None:
        if not _SAFE_ID.match(self.job_id) or ".." in self.job_id:
            raise UserError(f"job id {self.job_id!r} cannot name an artifacts folder")

    @property
    def folder(self) -> Path:
        return self.root / self.job_id

    @property
    def checkpoints(self) -> Path:
        return self.folder / "checkpoints"

    @property
    def final_weights(self) -> Path:
        return self.folder / "final" / WEIGHTS

    @property
    def final_info(self) -> Path:
        return self.folder / "final" / FINAL_INFO

    def latest_checkpoint(self) -> Path | None:
        return latest_checkpoint(self.checkpoints)

    def best_weights(self) -> tuple[Path, str] | None:
        """The weights to hand back now: the final ones, else the newest checkpoint's that
        have been assembled; with a label (`final`, or the checkpoint's folder name)."""
        if self.final_weights.is_file():
            return self.final_weights, "final"
        done = (
            sorted(self.checkpoints.glob(f"ckpt-*/{WEIGHTS}")) if self.checkpoints.is_dir() else []
        )
        done = [w for w in done if (w.parent / MANIFEST).is_file()]
        return (done[-1], done[-1].parent.name) if done else None
