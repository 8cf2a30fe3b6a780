"""A job's code in the artifact store: packed by the CLI, stored by content, fetched by the nodes.

`orchestrator submit` packs the training section's `code` (a job file, or a directory with
`job.py`, as SkyPilot's `workdir`) into a reproducible `.tar.gz`, uploads it through the API and
names it in the spec by its digest (`sha256:<hex>`). A node fetches it from the store before it
joins (`fetch_code`): the archive is checked against its digest, unpacked into a cache folder
(no member may leave it: no absolute paths, `..` or links), and the lines of its
`requirements.txt` that the node's environment does not meet are pip-installed into a folder
beside the code (`--target`, `--no-deps`: list every package the job needs beyond the
orchestrator's environment; the runtime's own torch and numpy are never replaced), which is put
first on `sys.path`.

    ref = store_code(store, pack_code(Path("my_job/")))   # "sha256:3f2a..."
    path = fetch_code(store, ref, cache_dir)               # .../3f2a.../src, holding job.py
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path

from orchestrator.artifacts.folders import Folder
from orchestrator.artifacts.jobs import CODE_FOLDER
from orchestrator.errors import UserError

log = logging.getLogger(__name__)

CODE_REF_PREFIX = "sha256:"
ENTRY_FILE = "job.py"
REQUIREMENTS = "requirements.txt"
MAX_CODE_BYTES = 64 * 1024 * 1024  # packed; data belongs in the dataset's download or S3
MAX_UNPACKED_BYTES = 4 * MAX_CODE_BYTES  # what an archive may unpack to on a node
MAX_MEMBERS = 10_000  # files and folders in one archive (a job's code, not a dataset)
SKIPPED = {"__pycache__", ".git", ".hg", ".venv", "venv", ".mypy_cache", ".pytest_cache"}
PIP_TIMEOUT_S = 900.0
CACHE_ENV = "ORCHESTRATOR_CODE_CACHE"
_READY = ".ready"
_SITE = "site-packages"


class CodeError(UserError):
    """The job's code cannot be packed, stored or fetched (named, with the fix)."""


def is_code_ref(code: str | None) -> bool:
    """Whether a training section's `code` names uploaded code (`sha256:<hex>`)."""
    return code is not None and code.startswith(CODE_REF_PREFIX)


def code_ref(packed: bytes) -> str:
    return CODE_REF_PREFIX + hashlib.sha256(packed).hexdigest()


def pack_code(path: str | Path) -> bytes:
    """The job's code as a reproducible `.tar.gz` (the same bytes for the same files): a
    directory's files (without caches and VCS folders; it must hold `job.py`), or a job file
    as `job.py` with the `requirements.txt` beside it, if any.

    Raises:
        CodeError: no such file or directory, no `job.py` in the directory, or too large.
    """
    source = Path(path).expanduser()
    if source.is_dir():
        if not (source / ENTRY_FILE).is_file():
            raise CodeError(
                f"code directory {source} has no {ENTRY_FILE}",
                fix=f"put the job's functions in {source / ENTRY_FILE}",
            )
        files = {str(f.relative_to(source)): f for f in _walk(source)}
        raw_size = sum(f.stat().st_size for f in files.values())
        if raw_size > MAX_UNPACKED_BYTES:
            raise CodeError(
                f"code {path} holds {raw_size / 2**20:.0f} MiB of files, over "
                f"{MAX_UNPACKED_BYTES // 2**20} MiB",
                fix="leave data and checkpoints out of the code folder (training.data, or "
                "download them in dataset())",
            )
    elif source.is_file():
        files = {ENTRY_FILE: source}
        if (source.parent / REQUIREMENTS).is_file():
            files[REQUIREMENTS] = source.parent / REQUIREMENTS
    else:
        raise CodeError(f"code {path} does not exist", fix="name the job file or its directory")
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            data = files[name].read_bytes()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    packed = gzip.compress(raw.getvalue(), mtime=0)
    if len(packed) > MAX_CODE_BYTES:
        raise CodeError(
            f"code {path} packs to {len(packed) / 2**20:.0f} MiB, over "
            f"{MAX_CODE_BYTES // 2**20} MiB",
            fix="leave data and checkpoints out of the code folder (download them in dataset())",
        )
    return packed


def store_code(store: Folder, packed: bytes, ref: str | None = None) -> str:
    """Store packed code under its digest; returns the reference (`sha256:<hex>`).

    Raises:
        CodeError: `ref` given and not the digest of `packed` (a corrupted upload), or not an
            archive of a job's code (`check_archive`).
    """
    actual = code_ref(packed)
    if ref is not None and ref != actual:
        raise CodeError(f"uploaded code is {actual}, not {ref}", fix="upload it again")
    if len(packed) > MAX_CODE_BYTES:
        raise CodeError(f"code archive over {MAX_CODE_BYTES // 2**20} MiB", fix="make it smaller")
    check_archive(packed)
    name = _archive_name(actual)
    folder = store.sub(CODE_FOLDER)
    if not folder.exists(name):
        folder.write_bytes(name, packed)
    return actual


def has_code(store: Folder, ref: str) -> bool:
    """Whether the store holds the code `ref` names."""
    return store.sub(CODE_FOLDER).exists(_archive_name(ref))


def default_cache() -> Path:
    """Where nodes unpack fetched code: `$ORCHESTRATOR_CODE_CACHE`, else ~/.cache."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "orchestrator" / "code"


def fetch_code(store: Folder, ref: str, cache: Path | None = None) -> Path:
    """The local folder of the code `ref` names (holding `job.py`): fetched, checked,
    unpacked and its unmet requirements installed the first time; those are put first on
    `sys.path`.

    Raises:
        CodeError: not in the store, not matching its digest, an unsafe member, or its
            requirements cannot be installed.
    """
    cache = cache or default_cache()
    digest = _digest_of(ref)
    home = cache / digest
    if not is_ready(home):
        try:
            packed = store.sub(CODE_FOLDER).read_bytes(_archive_name(ref))
        except FileNotFoundError:
            raise CodeError(
                f"code {ref} is not in the artifact store {store.location}",
                fix="submit the job with `orchestrator submit`, which uploads its code",
            ) from None
        if code_ref(packed) != ref:
            raise CodeError(f"code {ref} in the store is corrupted", fix="submit the job again")
        _install(packed, home)
    site = home / _SITE
    if site.is_dir() and str(site) not in sys.path:
        sys.path.insert(0, str(site))
    return home / "src"


def unmet_requirements(lines: list[str]) -> list[str]:
    """The requirement lines this environment does not satisfy (a line that is not a plain
    requirement, such as a URL or an option, counts as unmet: pip decides)."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import InvalidRequirement, Requirement

    unmet = []
    for line in lines:
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            req = Requirement(text)
        except InvalidRequirement:
            unmet.append(text)
            continue
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            installed = version(req.name)
        except PackageNotFoundError:
            unmet.append(text)
            continue
        if req.specifier and not req.specifier.contains(installed, prereleases=True):
            unmet.append(text)
    return unmet


def _install(packed: bytes, home: Path) -> None:
    """Unpack into a temporary folder beside `home`, install the unmet requirements, then
    rename it into place (a crash leaves no half-made `home`)."""
    with cache_entry(home) as work:
        _unpack(packed, work / "src")
        requirements = work / "src" / REQUIREMENTS
        if requirements.is_file():
            unmet = unmet_requirements(requirements.read_text().splitlines())
            if unmet:
                _pip_install(unmet, work / _SITE)


@contextlib.contextmanager
def cache_entry(home: Path) -> Iterator[Path]:
    """A temporary folder beside `home` to fill; when the block ends cleanly it becomes `home`,
    marked ready (unless another process on this machine got there first); it is removed in
    any case, so a crash leaves no half-made `home`."""
    home.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=home.name + ".", dir=home.parent))
    try:
        yield work
        (work / _READY).write_text("")
        try:
            os.replace(work, home)
        except OSError:  # another node on this machine got there first
            if not is_ready(home):
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def is_ready(home: Path) -> bool:
    """Whether a cache entry made by `cache_entry` is complete."""
    return (home / _READY).is_file()


def check_archive(packed: bytes) -> None:
    """Check that `packed` is a job's code as `pack_code` makes it, reading its member list
    only (never more than `MAX_MEMBERS` of them): a gzip tar holding `job.py`, only plain files
    and folders inside it, at most `MAX_UNPACKED_BYTES` unpacked.

    Raises:
        CodeError: the first way it is not, with the fix.
    """
    _checked_members(packed)


def _checked_members(packed: bytes) -> list[tarfile.TarInfo]:
    fix = "pack the code with `orchestrator submit` (a .tar.gz holding job.py)"
    members: list[tarfile.TarInfo] = []
    size = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(packed), mode="r:gz") as tar:
            while (member := tar.next()) is not None:
                members.append(member)
                size += member.size
                if len(members) > MAX_MEMBERS:
                    raise CodeError(f"code archive holds over {MAX_MEMBERS} files", fix=fix)
                if size > MAX_UNPACKED_BYTES:
                    raise CodeError(
                        f"code archive unpacks to over {MAX_UNPACKED_BYTES // 2**20} MiB", fix=fix
                    )
                _check_member(member)
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:  # not gzip, truncated
        raise CodeError(f"code archive is not a readable .tar.gz: {exc}", fix=fix) from None
    if not any(m.isfile() and m.name in (ENTRY_FILE, f"./{ENTRY_FILE}") for m in members):
        raise CodeError(f"code archive holds no {ENTRY_FILE} at its top", fix=fix)
    return members


def _check_member(member: tarfile.TarInfo) -> None:
    parts = Path(member.name).parts
    unsafe = not member.isfile() and not member.isdir()
    if unsafe or member.name.startswith("/") or ".." in parts or not parts:
        raise CodeError(
            f"code archive member {member.name!r} is not a plain file inside the job",
            fix="pack the code with `orchestrator submit` (no links, no absolute paths)",
        )


def _unpack(packed: bytes, target: Path) -> None:
    target.mkdir(parents=True)
    root = target.resolve()
    members = _checked_members(packed)
    for member in members:
        if not (target / member.name).resolve().is_relative_to(root):
            _check_member(tarfile.TarInfo("/" + member.name))  # raises: outside the job
    try:
        with tarfile.open(fileobj=io.BytesIO(packed), mode="r:gz") as tar:
            tar.extractall(target, members=members, filter="data")
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise CodeError(f"code archive could not be unpacked: {exc}", fix="submit again") from None


def _pip_install(requirements: list[str], site: Path) -> None:
    log.info("installing job requirements", extra={"requirements": requirements})
    listed = site.parent / "unmet-requirements.txt"
    listed.write_text("\n".join(requirements) + "\n")
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    cmd += ["--no-deps", "--target", str(site), "-r", str(listed)]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.CalledProcessError as exc:
        last = (exc.stderr or exc.stdout or "").strip().splitlines()[-1:] or ["(no output)"]
        raise CodeError(
            f"installing the job's requirements {requirements} failed: {last[0]}",
            fix=f"check {REQUIREMENTS} (pip install -r {REQUIREMENTS} must work on a node)",
        ) from None
    except subprocess.TimeoutExpired:
        raise CodeError(
            f"installing the job's requirements took over {PIP_TIMEOUT_S:.0f} s",
            fix=f"trim {REQUIREMENTS}",
        ) from None


def _walk(folder: Path) -> list[Path]:
    out = []
    for entry in sorted(folder.iterdir()):
        if entry.name in SKIPPED or entry.suffix == ".pyc" or entry.is_symlink():
            continue
        if entry.is_dir():
            out.extend(_walk(entry))
        elif entry.is_file():
            out.append(entry)
    return out


def _digest_of(ref: str) -> str:
    hexpart = ref[len(CODE_REF_PREFIX) :] if is_code_ref(ref) else ""
    if len(hexpart) != 64 or any(c not in "0123456789abcdef" for c in hexpart):
        raise CodeError(f"{ref!r} is not a code reference", fix="write it as sha256:<64 hex>")
    return hexpart


def _archive_name(ref: str) -> str:
    return _digest_of(ref) + ".tar.gz"
