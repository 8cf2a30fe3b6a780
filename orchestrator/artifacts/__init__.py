"""The artifact store: where a job's code, checkpoints and weights live, shared by the
controller and the job's nodes (a local directory, or an S3 prefix on AWS). See `folders` for
the store, `jobs` for a job's layout in it, `code` for uploaded job code."""

from orchestrator.artifacts.folders import Folder, LocalFolder, S3Folder, folder_at
from orchestrator.artifacts.jobs import (
    CHECKPOINT_PREFIX,
    CODE_FOLDER,
    FINAL_INFO,
    MANIFEST,
    WEIGHTS,
    JobArtifacts,
    folder_name,
    latest_checkpoint,
)

__all__ = [
    "CHECKPOINT_PREFIX",
    "CODE_FOLDER",
    "FINAL_INFO",
    "MANIFEST",
    "WEIGHTS",
    "Folder",
    "JobArtifacts",
    "LocalFolder",
    "S3Folder",
    "folder_at",
    "folder_name",
    "latest_checkpoint",
]
