"""What the download routes hand back from a job's artifacts folder (`orchestrator.artifacts`):
its weights (the final ones, else the newest checkpoint's) and its newest checkpoint as a tar.
The files are on the controller's disk, so these routes need the API to run beside the
training host (as `controller start` runs it)."""

from __future__ import annotations

import os
import tarfile
import tempfile
from pathlib import Path

from orchestrator.api.errors import ApiError
from orchestrator.artifacts import JobArtifacts

NO_WEIGHTS_FIX = (
    "wait for the job's first checkpoint (the training section's checkpoint_every / "
    "checkpoint_every_s, or the controller's training.checkpoint_every_s) or its end"
)


def weights_file(root: Path, job_id: str) -> tuple[Path, str]:
    """The job's weights and where they come from (`final`, or a checkpoint's name).

    Raises:
        ApiError: 404, none yet.
    """
    best = JobArtifacts(root, job_id).best_weights()
    if best is None:
        raise ApiError(404, f"job {job_id} has no weights yet", fix=NO_WEIGHTS_FIX)
    return best


def checkpoint_tar(root: Path, job_id: str) -> tuple[Path, str]:
    """The job's newest checkpoint as an uncompressed tar in a temporary file (the caller
    removes it), and the checkpoint's name.

    Raises:
        ApiError: 404, none yet.
    """
    latest = JobArtifacts(root, job_id).latest_checkpoint()
    if latest is None:
        raise ApiError(404, f"job {job_id} has no checkpoint yet", fix=NO_WEIGHTS_FIX)
    fd, name = tempfile.mkstemp(prefix="orchestrator-ckpt-", suffix=".tar")
    os.close(fd)
    try:
        with tarfile.open(name, "w") as tar:
            tar.add(latest, arcname=latest.name)
    except OSError as exc:  # pruned while being read: a newer one exists, ask again
        os.unlink(name)
        raise ApiError(
            409, f"checkpoint {latest.name} went away while it was read", fix="ask again"
        ) from exc
    return Path(name), latest.name
