"""A job's instances' logs (#36): an instance agent ships its log (its node's milestones and
errors, tracebacks too) to the job's artifact store, and the API and `orchestrator logs` read
it with the read token, also once the instance is gone."""

from __future__ import annotations

import logging
import shutil
import subprocess
import warnings
from pathlib import Path

from pydantic import SecretStr

from orchestrator.agent.logship import SHIP_INTERVAL_S, LogShipper
from orchestrator.api.app import create_app
from orchestrator.artifacts.jobs import MAX_LOG_BYTES, JobArtifacts
from orchestrator.jobspec import JobSubmission
from orchestrator.settings import ApiSettings, Settings, TrainingSettings
from orchestrator.store import JobRecord, MemoryStore

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*httpx2", category=UserWarning)
    from fastapi.testclient import TestClient

WRITE, READ = "t0ken", "r3ad"


def _settings(root: Path) -> Settings:
    return Settings(
        api=ApiSettings(token=SecretStr(WRITE), read_token=SecretStr(READ)),
        training=TrainingSettings(artifacts_dir=root),
    )


def _store_with_job(job_id: str) -> MemoryStore:
    store = MemoryStore()
    sub = JobSubmission(name="j", budget_usd=5.0, work_gpu_hours=1.0)
    store.create_job(JobRecord.submit(job_id, sub.model_dump(mode="json"), 5.0, 0.0))
    return store


def _ship(root: Path, job_id: str, instance: str, *lines: str) -> LogShipper:
    shipper = LogShipper(instance, job_id, "agent")
    logger = logging.getLogger(f"test.logship.{instance}")
    logger.addHandler(shipper)
    logger.setLevel(logging.INFO)
    try:
        for line in lines:
            logger.error(line)
    finally:
        logger.removeHandler(shipper)
    assert shipper.ship(str(root), force=True)
    return shipper


def test_the_shipper_writes_when_the_log_changed_and_keeps_its_end(tmp_path: Path) -> None:
    shipper = _ship(tmp_path, "job-1", "i-1", "joined", "the job's code failed:\nTraceback")
    log = JobArtifacts(tmp_path, "job-1").logs.read_bytes("i-1.log").decode()
    assert "ERROR agent joined" in log and "Traceback" in log
    assert not shipper.ship(str(tmp_path), force=True)  # nothing new: no write
    assert not shipper.ship(None, force=True)  # no store known yet: it waits in memory
    record = logging.makeLogRecord({"msg": "x" * 1000, "levelno": logging.INFO})
    for _ in range(MAX_LOG_BYTES // 1000 + 10):
        shipper.emit(record)
    assert len(shipper.text()) <= MAX_LOG_BYTES and shipper.text().endswith("x\n")
    assert not shipper.ship(str(tmp_path), now=0.0)  # within SHIP_INTERVAL_S of the last
    assert shipper.ship(str(tmp_path), now=1e9 + SHIP_INTERVAL_S)


def test_the_shipper_ships_from_its_own_thread_and_not_the_storage_librarys_records(
    tmp_path: Path,
) -> None:
    """botocore logs every client it makes: shipped, those records would change the log at
    every write, which would then be written again for ever."""
    shipper = LogShipper("i-2", "job-1", "agent")
    root = logging.getLogger()
    root.addHandler(shipper)
    try:
        logging.getLogger("botocore.credentials").warning("Found credentials in ...")
        logging.getLogger("orchestrator.agileml.node").warning("ended how=done")
        store = None

        def where() -> str | None:
            return store

        shipper.start(where)
        store = str(tmp_path)  # the node joined: the spec names the store
        shipper.stop()  # the last write, from its thread
    finally:
        root.removeHandler(shipper)
    log = JobArtifacts(tmp_path, "job-1").logs.read_bytes("i-2.log").decode()
    assert "ended how=done" in log and "Found credentials" not in log


def test_the_api_lists_and_serves_the_logs_with_the_read_token(tmp_path: Path) -> None:
    root = tmp_path / "store"
    _ship(root, "job-1", "i-0a1", "ready", "the job's code failed:\nTraceback (x)")
    _ship(root, "job-1", "i-0b2", "left")
    client = TestClient(create_app(_store_with_job("job-1"), _settings(root)))
    read = {"Authorization": f"Bearer {READ}"}
    assert client.get("/v1/jobs/job-1/logs").status_code == 401
    assert client.get("/v1/jobs/job-1/logs", headers=read).json() == {"nodes": ["i-0a1", "i-0b2"]}
    got = client.get("/v1/jobs/job-1/logs/i-0a1", headers=read)
    assert got.status_code == 200 and "Traceback (x)" in got.text
    assert int(got.headers["X-Log-Bytes"]) == len(got.content)
    tail = client.get("/v1/jobs/job-1/logs/i-0a1?tail_bytes=5", headers=read)
    assert tail.text == got.text[-5:]
    missing = client.get("/v1/jobs/job-1/logs/i-9", headers=read)
    assert missing.status_code == 404 and "i-0a1, i-0b2" in missing.json()["error"]["fix"]
    assert client.get("/v1/jobs/job-1/logs/..%2Fx", headers=read).status_code in (404, 422)
    assert client.get("/v1/jobs/job-2/logs", headers=read).status_code == 404  # no such job
    too_much = client.get(f"/v1/jobs/job-1/logs/i-0a1?tail_bytes={MAX_LOG_BYTES + 1}", headers=read)
    assert too_much.status_code == 422


def test_orchestrator_logs_prints_every_nodes_end_or_one(tmp_path: Path) -> None:
    from orchestrator.api.serve import BackgroundServer

    root = tmp_path / "store"
    _ship(root, "job-1", "i-0a1", "the job's code failed:\nTraceback (most recent call last)")
    _ship(root, "job-1", "i-0b2", "ended node=i-0b2 how=done")
    script = shutil.which("orchestrator")
    assert script is not None, "the console script is installed with the package"
    with BackgroundServer(create_app(_store_with_job("job-1"), _settings(root))) as server:

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            cmd = [script, "logs", "job-1", "--api", server.url, "--token", READ, *args]
            return subprocess.run(cmd, capture_output=True, text=True, timeout=60)

        every = cli()
        assert every.returncode == 0, every.stderr
        assert "i-0a1" in every.stdout and "Traceback (most recent call last)" in every.stdout
        assert "how=done" in every.stdout
        one = cli("--node", "i-0b2")
        assert one.returncode == 0 and "how=done" in one.stdout and "Traceback" not in one.stdout
        missing = cli("--node", "i-9")
        assert missing.returncode != 0 and "has no log of i-9" in missing.stderr


def test_follow_prints_only_what_came_after_what_it_printed() -> None:
    from orchestrator.cli.logs import _after

    assert _after("a\nb\nc\n", "b\n") == "c\n"
    assert _after("a\nb\n", "b\n") == ""
    assert _after("x\ny\n", "b\n") == "x\ny\n"  # its start dropped past what was printed
    assert _after("a\n", "") == "a\n"
