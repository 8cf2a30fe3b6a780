"""The files the API moves in and out of the artifact store (`orchestrator.artifacts`): a job's
weights (the final ones, else the newest checkpoint's) and its newest checkpoint as a tar, out;
a job's packed code, in (`orchestrator submit` uploads it before it submits the job)."""

from __future__ import annotations

import io
import os
import tarfile
import tempfile
from pathlib import Path

from fastapi import Request, Response
from fastapi.responses import FileResponse
from starlette.background import BackgroundTask

from orchestrator.api.errors import ApiError
from orchestrator.artifacts import MANIFEST, Folder, JobArtifacts, LocalFolder, folder_name
from orchestrator.artifacts.code import CodeError, has_code, is_code_ref, store_code

#: How much of a log's end `GET /v1/jobs/{id}/logs/{node}` returns unless asked.
DEFAULT_LOG_TAIL = 65_536

NO_WEIGHTS_FIX = (
    "wait for the job's first checkpoint (the training section's checkpoint_every / "
    "checkpoint_every_s, or the controller's training.checkpoint_every_s) or its end"
)


def weights_folder(root: Folder, job_id: str) -> tuple[Folder, str]:
    """The folder holding the job's weights and where they come from (`final`, or a
    checkpoint's name).

    Raises:
        ApiError: 404, none yet.
    """
    best = JobArtifacts(root, job_id).best_weights()
    if best is None:
        raise ApiError(404, f"job {job_id} has no weights yet", fix=NO_WEIGHTS_FIX)
    return best


def file_response(folder: Folder, name: str, media_type: str, headers: dict[str, str]) -> Response:
    """The file `name` of `folder` as the response body (streamed from disk when local)."""
    if isinstance(folder, LocalFolder):
        return FileResponse(folder.path / name, media_type=media_type, headers=headers)
    fd, path = tempfile.mkstemp(prefix="orchestrator-download-")
    os.close(fd)
    try:  # through a temporary file: a large object is never held in memory whole
        folder.copy_to(name, Path(path))
    except FileNotFoundError as exc:  # pruned while being read: a newer one exists
        os.unlink(path)
        raise ApiError(409, f"{name} went away while it was read", fix="ask again") from exc
    except BaseException:
        os.unlink(path)
        raise
    return FileResponse(
        path, media_type=media_type, headers=headers,
        background=BackgroundTask(os.unlink, path),
    )  # fmt: skip


def checkpoint_tar(root: Folder, job_id: str) -> tuple[Path, str]:
    """The job's newest checkpoint as an uncompressed tar in a temporary file (the caller
    removes it), and the checkpoint's name.

    Raises:
        ApiError: 404, none yet; 409, it was pruned while being read.
    """
    latest = JobArtifacts(root, job_id).latest_checkpoint()
    if latest is None:
        raise ApiError(404, f"job {job_id} has no checkpoint yet", fix=NO_WEIGHTS_FIX)
    name = folder_name(latest)
    fd, tar_path = tempfile.mkstemp(prefix="orchestrator-ckpt-", suffix=".tar")
    os.close(fd)
    try:
        with tarfile.open(tar_path, "w") as tar:
            folder = tarfile.TarInfo(name)
            folder.type, folder.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(folder)
            members = latest.names()
            if MANIFEST not in members:  # pruned since it was found
                raise FileNotFoundError(latest.location)
            for member in members:
                data = latest.read_bytes(member)
                info = tarfile.TarInfo(f"{name}/{member}")
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
    except OSError as exc:  # pruned while being read: a newer one exists, ask again
        os.unlink(tar_path)
        raise ApiError(
            409, f"checkpoint {name} went away while it was read", fix="ask again"
        ) from exc
    except BaseException:  # any other failure: the temporary tar goes too
        os.unlink(tar_path)
        raise
    return Path(tar_path), name


async def read_limited(request: Request, limit: int) -> bytes:
    """The request's body, refused (413) past `limit` bytes without reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"body of {declared} bytes is over {limit}", fix="send less")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"body over {limit} bytes", fix="send less")
        chunks.append(chunk)
    return b"".join(chunks)


def save_code(root: Folder, ref: str, body: bytes) -> str:
    """Store uploaded code under `ref`, which must be its digest.

    Raises:
        ApiError: 400, not a code reference or not the body's digest.
    """
    if not is_code_ref(ref):
        raise ApiError(400, f"{ref!r} is not a code reference", fix="PUT /v1/code/sha256:<hex>")
    try:
        return store_code(root, body, ref)
    except CodeError as exc:
        raise ApiError(400, exc.message, fix=exc.fix or "upload it again") from None


def check_code_uploaded(root: Folder, code: str | None) -> None:
    """A submission that names uploaded code must find it in the store.

    Raises:
        ApiError: 422, the code is not there.
    """
    if code is None or not is_code_ref(code):
        return
    try:
        present = has_code(root, code)
    except CodeError as exc:
        raise ApiError(422, f"training.code: {exc.message}", fix=exc.fix) from None
    if not present:
        raise ApiError(
            422,
            f"training.code: {code} was not uploaded to this controller",
            fix="submit with `orchestrator submit JOB.yaml`, which uploads the code it names",
        )


def job_log_names(root: Folder, job_id: str) -> list[str]:
    """The instances whose logs the job's artifacts hold, sorted."""
    names = JobArtifacts(root, job_id).logs.names()
    return sorted(n.removesuffix(".log") for n in names if n.endswith(".log"))


def job_log(root: Folder, job_id: str, node: str, tail_bytes: int) -> tuple[str, int]:
    """The last `tail_bytes` of an instance's log as text, and the whole log's size.

    Raises:
        ApiError: 404, no such log (yet: an agent ships its log every few seconds once its
            node has joined).
    """
    logs = JobArtifacts(root, job_id).logs
    name = f"{node}.log"
    if not logs.exists(name):
        known = ", ".join(job_log_names(root, job_id)) or "none yet"
        raise ApiError(404, f"job {job_id} has no log of {node}", fix=f"ask for one of: {known}")
    try:
        data = logs.read_bytes(name)
    except FileNotFoundError as exc:
        raise ApiError(
            409, f"the log of {node} went away while it was read", fix="ask again"
        ) from exc
    return data[-tail_bytes:].decode(errors="replace"), len(data)
