"""A training job's data named in its spec (`training.data`): an S3 prefix, copied once to each
node that trains the job (sub-folders included), or a folder that is already on the nodes. The
job's `dataset()` finds it at `$ORCHESTRATOR_DATA_DIR`; read it there, not when the module is
imported (the controller imports the job's code to assemble weights and has no copy).

    use_data("s3://my-bucket/artifacts/data/cifar10")   # on a node, before dataset() is called
    os.environ["ORCHESTRATOR_DATA_DIR"]                 # .../data/<hash>/files
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from orchestrator.artifacts.code import CodeError, cache_entry, default_cache, is_ready
from orchestrator.artifacts.folders import Folder, LocalFolder, folder_at

DATA_ENV = "ORCHESTRATOR_DATA_DIR"


def fetch_data(location: str, cache: Path | None = None) -> Path:
    """The local folder of a job's data: a local location as it is; an S3 prefix copied into
    the cache the first time.

    Raises:
        CodeError: not a folder on this machine, the prefix holds nothing, or S3 refused.
    """
    source = folder_at(location)
    if isinstance(source, LocalFolder):
        if not source.path.is_dir():
            raise CodeError(
                f"training.data: {location} is not a folder on this machine",
                fix="name an S3 prefix, or a folder every node has",
            )
        return source.path
    cache = cache or default_cache()
    home = cache / "data" / hashlib.sha256(location.encode()).hexdigest()[:24]
    if is_ready(home):
        return home / "files"
    with cache_entry(home) as work:
        try:
            copied = _copy_tree(source, work / "files")
        except OSError as exc:
            raise CodeError(f"training.data: copying {location} failed: {exc}") from exc
        if copied == 0:
            raise CodeError(
                f"training.data: {location} holds no files", fix="name the prefix of the data"
            )
    return home / "files"


def use_data(location: str | None) -> None:
    """Fetch the job's data (if it names any) and tell the job's functions where it is."""
    if location is not None:
        os.environ[DATA_ENV] = str(fetch_data(location))


def _copy_tree(source: Folder, target: Path) -> int:
    target.mkdir(parents=True, exist_ok=True)
    copied = 0
    for name in source.names():
        if source.exists(name):
            source.copy_to(name, target / name)
            copied += 1
        else:
            copied += _copy_tree(source.sub(name), target / name)
    return copied
