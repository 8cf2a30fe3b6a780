"""A training job's artifacts in the artifact store (a local directory or an S3 prefix, see
`folders`): its checkpoints, its final weights, and the job code users upload.

    ROOT/<job id>/checkpoints/ckpt-<clock>/   a checkpoint (see `agileml.checkpoints`); complete
                                              once its `checkpoint.json` exists; `model.safetensors`
                                              once the training host has assembled its weights
    ROOT/<job id>/final/model.safetensors     the weights when the job ended
    ROOT/<job id>/final/weights.json          where they came from and how far training was
    ROOT/<job id>/tensorboard/events.out.*    the loss per iteration and the evaluations
    ROOT/_code/<sha256>.tar.gz                uploaded job code (see `code`), by content

The job's reliable nodes write the checkpoints, the training host the weights, the API serves
both (`orchestrator job ID --download DIR`), and a restarted controller resumes each job from
its newest checkpoint. Job ids start with a letter or digit, so no job folder is `_code`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from orchestrator.artifacts.folders import Folder, folder_at
from orchestrator.errors import UserError

MANIFEST = "checkpoint.json"  # written last: the checkpoint is complete
WEIGHTS = "model.safetensors"  # a state_dict, loadable with safetensors.torch.load_file
FINAL_INFO = "weights.json"
CODE_FOLDER = "_code"
CHECKPOINT_PREFIX = "ckpt-"
_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def checkpoints_newest_first(folder: Folder | str | Path) -> Iterator[tuple[str, Folder]]:
    """The `ckpt-*` folders in `folder` (complete or not), newest first, with their names."""
    base = folder_at(folder)
    for name in reversed([n for n in base.names() if n.startswith(CHECKPOINT_PREFIX)]):
        yield name, base.sub(name)


def latest_checkpoint(folder: Folder | str | Path) -> Folder | None:
    """The newest complete checkpoint (`ckpt-*` with a manifest) in `folder`, None if none."""
    for _, checkpoint in checkpoints_newest_first(folder):
        if checkpoint.exists(MANIFEST):
            return checkpoint
    return None


def folder_name(folder: Folder) -> str:
    """The last part of a folder's location (`ckpt-00000099`)."""
    return folder.location.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]


#: The most bytes of an instance's log kept in the store (its end: `agent.logship`), and so
#: the most one request for it returns.
MAX_LOG_BYTES = 1_000_000


@dataclass(frozen=True)
class JobArtifacts:
    """Where one job's artifacts live under `root` (see the module docstring)."""

    root: Folder
    job_id: str

    def __init__(self, root: Folder | str | Path, job_id: str) -> None:
        if not _SAFE_ID.match(job_id) or ".." in job_id:
            raise UserError(f"job id {job_id!r} cannot name an artifacts folder")
        object.__setattr__(self, "root", folder_at(root))
        object.__setattr__(self, "job_id", job_id)

    @property
    def folder(self) -> Folder:
        return self.root.sub(self.job_id)

    @property
    def checkpoints(self) -> Folder:
        return self.folder.sub("checkpoints")

    @property
    def final(self) -> Folder:
        return self.folder.sub("final")

    @property
    def tensorboard(self) -> Folder:
        """TensorBoard's event files of the job's training (the loss, the evaluations)."""
        return self.folder.sub("tensorboard")

    @property
    def logs(self) -> Folder:
        """The job's instances' logs, `<instance>.log` each (`agent.logship`)."""
        return self.folder.sub("logs")

    def latest_checkpoint(self) -> Folder | None:
        return latest_checkpoint(self.checkpoints)

    def has_final(self) -> bool:
        return self.final.exists(FINAL_INFO)

    def best_weights(self) -> tuple[Folder, str] | None:
        """The folder whose `model.safetensors` to hand back now: the final one, else the
        newest complete checkpoint's that has been assembled; with a label (`final`, or the
        checkpoint's folder name)."""
        if self.final.exists(WEIGHTS):
            return self.final, "final"
        for name, checkpoint in checkpoints_newest_first(self.checkpoints):
            if checkpoint.exists(WEIGHTS) and checkpoint.exists(MANIFEST):
                return checkpoint, name
        return None
