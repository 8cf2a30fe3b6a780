"""Folders that the controller and a job's nodes share: a local directory (offline, and for local
runs) or an S3 prefix (on AWS; moto's S3 in tests). One small interface, so that checkpoints, the
final weights and uploaded job code are written and read the same way wherever they live.

A folder is named by a location string that travels in the job's spec to every node:

    /var/lib/orchestrator/artifacts/job-1/checkpoints         a local directory
    s3://my-bucket/orchestrator/job-1/checkpoints             an S3 prefix
    s3://bucket/prefix?endpoint=http://127.0.0.1:5000         ... on an S3-compatible endpoint
                                                              (moto's server offline)

Writes are whole-object and atomic on both (a local file is written to a temporary name and
renamed; an S3 PUT is atomic), so a reader never sees a torn file. On S3, a folder exists as
soon as one object is under it; `names` lists its direct children (files and sub-folders).
"""

from __future__ import annotations

import abc
import contextlib
import os
import shutil
import tempfile
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from orchestrator.aws import aws_client
from orchestrator.errors import UserError

S3_SCHEME = "s3://"
#: An S3-compatible endpoint on loopback (moto's server) accepts any credentials; these are
#: used there when the environment has none.
LOOPBACK_CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}


class Folder(Protocol):
    """A shared folder (see the module docstring)."""

    @property
    def location(self) -> str:
        """The folder's location string (`folder_at(location)` opens it again)."""
        ...

    def sub(self, name: str) -> Folder:
        """The sub-folder `name` (it need not exist yet)."""
        ...

    def names(self) -> list[str]:
        """The names of the files and sub-folders directly in the folder, sorted ([] when it
        does not exist)."""
        ...

    def exists(self, name: str) -> bool:
        """Whether the file `name` is in the folder."""
        ...

    def write_bytes(self, name: str, data: bytes) -> None:
        """Write the file `name` atomically."""
        ...

    def read_bytes(self, name: str) -> bytes:
        """The file `name`'s bytes.

        Raises:
            FileNotFoundError: no such file.
        """
        ...

    def copy_to(self, name: str, target: Path) -> None:
        """Copy the file `name` to the local path `target`.

        Raises:
            FileNotFoundError: no such file.
        """
        ...

    def remove(self) -> None:
        """Remove the folder and everything in it (nothing when it does not exist)."""
        ...


class _Named(abc.ABC):
    """Folders are equal when their locations are."""

    @property
    @abc.abstractmethod
    def location(self) -> str: ...

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Named) and other.location == self.location

    def __hash__(self) -> int:
        return hash(self.location)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.location!r})"


class LocalFolder(_Named):
    """A folder on this machine's disk."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()

    @property
    def location(self) -> str:
        return str(self.path)

    def sub(self, name: str) -> LocalFolder:
        return LocalFolder(self.path / _checked_name(name))

    def names(self) -> list[str]:
        if not self.path.is_dir():
            return []
        return sorted(p.name for p in self.path.iterdir() if not p.name.endswith(".tmp"))

    def exists(self, name: str) -> bool:
        return (self.path / _checked_name(name)).is_file()

    def write_bytes(self, name: str, data: bytes) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        target = self.path / _checked_name(name)
        # a temporary name of its own: two writers of one name never share it
        fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())  # a checkpoint's manifest must not point at lost data
            os.chmod(tmp, 0o644)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def read_bytes(self, name: str) -> bytes:
        return (self.path / _checked_name(name)).read_bytes()

    def copy_to(self, name: str, target: Path) -> None:
        shutil.copyfile(self.path / _checked_name(name), target)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class S3Folder(_Named):
    """A folder under an S3 prefix; `client` is a boto3 S3 client (made from the location's
    endpoint when not given). S3 errors (throttling, timeouts, access) come out as `OSError`,
    a missing file as `FileNotFoundError`, like a local folder's."""

    def __init__(
        self, bucket: str, prefix: str, *, endpoint: str | None = None, client: Any = None
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint = endpoint
        self._client = client

    @property
    def location(self) -> str:
        where = f"{S3_SCHEME}{self.bucket}/{self.prefix}"
        if self.endpoint:
            where += "?" + urllib.parse.urlencode({"endpoint": self.endpoint})
        return where

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = s3_client(self.endpoint)
        return self._client

    def sub(self, name: str) -> S3Folder:
        return S3Folder(self.bucket, self._key(name), endpoint=self.endpoint, client=self.client)

    def names(self) -> list[str]:
        with _as_os_error(self.location):
            return self._names()

    def _names(self) -> list[str]:
        base = self.prefix + "/" if self.prefix else ""
        found: set[str] = set()
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=base, Delimiter="/"
        )
        for page in pages:
            found.update(o["Key"][len(base) :] for o in page.get("Contents", []))
            found.update(
                p["Prefix"][len(base) :].rstrip("/") for p in page.get("CommonPrefixes", [])
            )
        return sorted(n for n in found if n)

    def exists(self, name: str) -> bool:
        try:
            with _as_os_error(f"{self.location}/{name}"):
                self.client.head_object(Bucket=self.bucket, Key=self._key(name))
        except FileNotFoundError:
            return False
        return True

    def write_bytes(self, name: str, data: bytes) -> None:
        with _as_os_error(f"{self.location}/{name}"):
            self.client.put_object(Bucket=self.bucket, Key=self._key(name), Body=data)

    def read_bytes(self, name: str) -> bytes:
        with _as_os_error(f"{self.location}/{name}"):
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(name))
            return bytes(response["Body"].read())

    def copy_to(self, name: str, target: Path) -> None:
        with _as_os_error(f"{self.location}/{name}"):  # streamed to disk, not held in memory
            self.client.download_file(self.bucket, self._key(name), str(target))

    def remove(self) -> None:
        with _as_os_error(self.location):
            self._remove()

    def _remove(self) -> None:
        base = self.prefix + "/" if self.prefix else ""
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=base
        )
        for page in pages:
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                done = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys})
                if done.get("Errors"):
                    first = done["Errors"][0]
                    raise OSError(
                        f"{len(done['Errors'])} objects not removed, e.g. {first.get('Key')}: "
                        f"{first.get('Code')} {first.get('Message', '')}".strip()
                    )

    def _key(self, name: str) -> str:
        name = _checked_name(name)
        return f"{self.prefix}/{name}" if self.prefix else name


def folder_at(location: str | Path | Folder) -> Folder:
    """Open the folder a location string names (see the module docstring); a folder is
    returned as it is.

    Raises:
        UserError: an `s3://` location without a bucket.
    """
    if not isinstance(location, (str, Path)):
        return location
    text = str(location)
    if not text.startswith(S3_SCHEME):
        return LocalFolder(text)
    parsed = urllib.parse.urlsplit(text)
    if not parsed.netloc:
        raise UserError(
            f"artifact location {text!r} names no bucket", fix="write it as s3://BUCKET/PREFIX"
        )
    endpoint = urllib.parse.parse_qs(parsed.query).get("endpoint", [None])[0]
    return S3Folder(parsed.netloc, parsed.path, endpoint=endpoint)


def s3_client(endpoint: str | None = None) -> Any:
    """An S3 client in the environment's region (AWS_REGION, AWS_DEFAULT_REGION or the
    instance's ORCHESTRATOR_REGION; us-east-1 when none is set); on a loopback
    `endpoint`, moto's, with `LOOPBACK_CREDENTIALS` when the environment has none."""
    import boto3

    region = (
        os.environ.get("AWS_REGION")
        or os.environ.get("AWS_DEFAULT_REGION")
        or os.environ.get("ORCHESTRATOR_REGION")  # the instance's env file (infra/*.yaml)
        or "us-east-1"
    )
    session = boto3.Session()
    host = urllib.parse.urlsplit(endpoint).hostname if endpoint else None
    if host in _LOOPBACK_HOSTS and session.get_credentials() is None:
        session = boto3.Session(**LOOPBACK_CREDENTIALS)
    return aws_client("s3", region, endpoint_url=endpoint, session=session)


def _checked_name(name: str) -> str:
    parts = name.split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"{name!r} is not a name inside a folder")
    return name


@contextlib.contextmanager
def _as_os_error(where: str) -> Iterator[None]:
    """botocore's errors as `OSError` (`FileNotFoundError` for a missing key)."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in ("404", "NoSuchKey", "NotFound"):
            raise FileNotFoundError(where) from None
        raise OSError(f"S3 {where}: {exc}") from exc
    except BotoCoreError as exc:
        raise OSError(f"S3 {where}: {exc}") from exc
