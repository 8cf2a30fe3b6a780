"""Uploaded job code: packed reproducibly (a file with its requirements, a directory without its
caches), stored by digest, fetched and checked, never unpacked outside its folder, and its
requirements installed only when the environment does not meet them."""

from __future__ import annotations

import gzip
import io
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from moto import mock_aws

from orchestrator.artifacts import CODE_FOLDER, Folder, LocalFolder, S3Folder
from orchestrator.artifacts.code import (
    MAX_MEMBERS,
    CodeError,
    code_ref,
    fetch_code,
    has_code,
    pack_code,
    store_code,
    unmet_requirements,
)
from orchestrator.artifacts.folders import s3_client

JOBS = Path(__file__).parents[2] / "support" / "jobs"


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Folder]:
    if request.param == "local":
        yield LocalFolder(tmp_path / "store")
        return
    with mock_aws():
        s3_client().create_bucket(Bucket="artifacts")
        yield S3Folder("artifacts", "orchestrator")


def _members(packed: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(packed), mode="r:gz") as tar:
        return tar.getnames()


def test_a_directory_packs_to_the_same_bytes_without_its_caches(tmp_path: Path) -> None:
    job = tmp_path / "job"
    (job / "__pycache__").mkdir(parents=True)
    (job / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"cache")
    (job / "lib").mkdir()
    (job / "job.py").write_text("from lib.net import model\n")
    (job / "lib" / "net.py").write_text("def model(): ...\n")
    first = pack_code(job)
    (job / "job.py").touch()  # a newer mtime changes nothing
    assert pack_code(job) == first
    assert _members(first) == ["job.py", "lib/net.py"]


def test_a_job_file_packs_as_job_py_with_the_requirements_beside_it(tmp_path: Path) -> None:
    (tmp_path / "train_me.py").write_text("x = 1\n")
    assert _members(pack_code(tmp_path / "train_me.py")) == ["job.py"]
    (tmp_path / "requirements.txt").write_text("numpy\n")
    assert _members(pack_code(tmp_path / "train_me.py")) == ["job.py", "requirements.txt"]


def test_packing_names_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(CodeError, match="does not exist"):
        pack_code(tmp_path / "nope.py")
    (tmp_path / "d").mkdir()
    with pytest.raises(CodeError, match="has no job.py"):
        pack_code(tmp_path / "d")


def test_stored_code_is_fetched_checked_and_cached(store: Folder, tmp_path: Path) -> None:
    ref = store_code(store, pack_code(JOBS / "bn_rmsprop"))
    assert ref == code_ref(pack_code(JOBS / "bn_rmsprop")) and has_code(store, ref)
    home = fetch_code(store, ref, tmp_path / "cache")
    assert sorted(p.name for p in home.iterdir()) == ["features.py", "job.py"]
    store.sub(CODE_FOLDER).remove()  # fetched once: the cache answers from now on
    assert fetch_code(store, ref, tmp_path / "cache") == home


def test_code_that_is_missing_or_corrupted_is_refused(store: Folder, tmp_path: Path) -> None:
    packed = pack_code(JOBS / "digits_sgd.py")
    ref = code_ref(packed)
    with pytest.raises(CodeError, match="not in the artifact store"):
        fetch_code(store, ref, tmp_path / "cache")
    with pytest.raises(CodeError, match="not sha256:"):
        store_code(store, packed, ref="sha256:" + "0" * 64)
    store.sub(CODE_FOLDER).write_bytes(ref.removeprefix("sha256:") + ".tar.gz", packed + b"x")
    with pytest.raises(CodeError, match="corrupted"):
        fetch_code(store, ref, tmp_path / "cache")
    with pytest.raises(CodeError, match="not a code reference"):
        fetch_code(store, "sha256:../../etc", tmp_path / "cache")


def _archive(members: list[tarfile.TarInfo | str], *, job: bool = True) -> bytes:
    """A .tar.gz of `members` (a name: a 1-byte file), with job.py first unless not `job`."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for member in (["job.py"] if job else []) + members:
            info = tarfile.TarInfo(member) if isinstance(member, str) else member
            if info.isfile():
                info.size = 1
                tar.addfile(info, io.BytesIO(b"x"))
            else:
                tar.addfile(info)
    return gzip.compress(raw.getvalue())


def _link() -> tarfile.TarInfo:
    info = tarfile.TarInfo("link")
    info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
    return info


def _device() -> tarfile.TarInfo:
    info = tarfile.TarInfo("dev")
    info.type = tarfile.CHRTYPE
    return info


BAD_ARCHIVES = {
    "parent": (_archive(["../evil.py"]), "not a plain file inside the job"),
    "absolute": (_archive(["/etc/evil.py"]), "not a plain file inside the job"),
    "link": (_archive([_link()]), "not a plain file inside the job"),
    "device": (_archive([_device()]), "not a plain file inside the job"),
    "no_job": (_archive(["helpers.py"], job=False), "holds no job.py"),
    "many": (_archive([f"f{i}.py" for i in range(MAX_MEMBERS + 1)]), "over 10000 files"),
    "not_gzip": (b"just some bytes, not an archive", "not a readable .tar.gz"),
    "truncated": (_archive(["a.py"])[:40], "not a readable .tar.gz"),
}


@pytest.mark.parametrize("case", list(BAD_ARCHIVES))
def test_an_archive_that_is_not_a_jobs_code_is_refused_at_upload_and_at_fetch(
    tmp_path: Path, case: str
) -> None:
    packed, message = BAD_ARCHIVES[case]
    store = LocalFolder(tmp_path / "store")
    with pytest.raises(CodeError, match=message):
        store_code(store, packed)
    ref = code_ref(packed)  # put there some other way (an older version, by hand)
    store.sub(CODE_FOLDER).write_bytes(ref.removeprefix("sha256:") + ".tar.gz", packed)
    with pytest.raises(CodeError, match=message):
        fetch_code(store, ref, tmp_path / "cache")
    assert not (tmp_path / "evil.py").exists() and not Path("/etc/evil.py").exists()
    assert list((tmp_path / "cache").iterdir()) == []  # nothing half-made is left


def test_only_requirements_the_environment_does_not_meet_are_installed() -> None:
    lines = [
        "# comment", "", "torch==2.13.0", "numpy>=1", "numpy<1  # too old", "no-such-pkg-xyz",
        "pytest; python_version < '3'", "./local-wheel",
    ]  # fmt: skip
    assert unmet_requirements(lines) == ["numpy<1", "no-such-pkg-xyz", "./local-wheel"]


def test_requirements_that_cannot_install_fail_with_pips_reason(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    (job / "job.py").write_text("x = 1\n")
    (job / "requirements.txt").write_text("./no-such-folder\n")  # fails fast, no network
    store = LocalFolder(tmp_path / "store")
    ref = store_code(store, pack_code(job))
    with pytest.raises(CodeError, match="installing the job's requirements"):
        fetch_code(store, ref, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_data_under_an_s3_prefix_is_copied_once_and_named_to_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from orchestrator.artifacts.data import DATA_ENV, fetch_data, use_data

    monkeypatch.setenv("ORCHESTRATOR_CODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(DATA_ENV, raising=False)
    with mock_aws():
        s3_client().create_bucket(Bucket="data")
        prefix = S3Folder("data", "sets/digits")
        prefix.write_bytes("train.csv", b"1,2\n")
        prefix.sub("images").write_bytes("0.png", b"png")
        with pytest.raises(CodeError, match="holds no files"):
            fetch_data("s3://data/sets/none")
        with pytest.raises(CodeError, match="copying s3://nobucket/x failed"):
            fetch_data("s3://nobucket/x")
        use_data("s3://data/sets/digits")
        local = Path(os.environ[DATA_ENV])
        assert (local / "train.csv").read_bytes() == b"1,2\n"
        assert (local / "images" / "0.png").read_bytes() == b"png"
        prefix.remove()  # copied once: the cache answers from now on
        assert fetch_data("s3://data/sets/digits") == local
    assert fetch_data(str(tmp_path)) == tmp_path  # a folder on the node is used as it is
    with pytest.raises(CodeError, match="not a folder"):
        fetch_data(str(tmp_path / "missing"))
