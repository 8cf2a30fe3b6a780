"""A training job's artifacts through the controller: checkpoints in the job's folder, the job
resumed from the newest one when the controller restarts (real node processes, the user's job
file), the final weights written while the nodes still serve, and both handed back by the API
(`orchestrator job ID --download`)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from pydantic import SecretStr
from safetensors.torch import load
from support.redis_server import free_port

from orchestrator.agileml.jobcode import load_job_code
from orchestrator.agileml.reference import relative_error, train_reference
from orchestrator.agileml.token import AGILEML_TOKEN_ENV
from orchestrator.api.app import WEIGHTS_HEADER, create_app
from orchestrator.artifacts import Folder, JobArtifacts, S3Folder, folder_name
from orchestrator.artifacts.code import CACHE_ENV, pack_code, store_code
from orchestrator.artifacts.folders import s3_client
from orchestrator.cloud.local.moto_server import MotoEC2Server
from orchestrator.controller.training import TrainingHost
from orchestrator.jobspec import JobSubmission
from orchestrator.settings import ApiSettings, Settings, TrainingSettings
from orchestrator.store import JobRecord, JobState, MemoryStore

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*httpx2", category=UserWarning)
    from fastapi.testclient import TestClient

JOBS = Path(__file__).parents[2] / "support" / "jobs"
JOB_FILE = JOBS / "digits_adamw.py"
JOB_ID = "job-resume"
ITERATIONS = 100
GLOBAL_BATCH = 64
TOKEN = bytes(range(32))
TRAINING = {
    "code": str(JOB_FILE), "global_batch": GLOBAL_BATCH, "iterations": ITERATIONS,
    "num_partitions": 4, "min_nodes": 2, "heartbeat_s": 0.1, "failure_timeout_s": 2.0,
    "checkpoint_every": 10,
}  # fmt: skip


@pytest.fixture(autouse=True)
def _code_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The training host fetches uploaded code too: into the test's folder, not ~/.cache."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "code-cache"))


def _host(store: MemoryStore, root: Folder, port: int) -> TrainingHost:
    return TrainingHost(
        store, token=TOKEN, advertise_host="127.0.0.1", bind_host="127.0.0.1", base_port=port,
        artifacts_root=root,
    )  # fmt: skip


def _nodes(endpoint: str, logs: Path) -> list[subprocess.Popen[bytes]]:
    """A reliable and a transient node, as the instance agents start them."""
    env = {**os.environ, AGILEML_TOKEN_ENV: TOKEN.hex(), "ORCHESTRATOR_TEST_JOB_PAUSE_S": "0.05",
           CACHE_ENV: str(logs / "code-cache")}  # fmt: skip
    procs = []
    for node_id, tier in (("r0", "reliable"), ("t0", "transient")):
        cmd = [sys.executable, "-m", "orchestrator.agileml.node", "--node-id", node_id,
               "--job-id", JOB_ID, "--tier", tier, "--controller", endpoint]  # fmt: skip
        with (logs / f"{node_id}.log").open("ab") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log))
    return procs


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait(10)


def _step_until(
    host: TrainingHost, done: object, timeout_s: float = 120.0, logs: Path | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():  # type: ignore[operator]
        if time.monotonic() >= deadline:
            try:
                print(_state_of(host, logs), file=sys.stderr)  # pytest cuts a long message
            except Exception as exc:  # noqa: BLE001 - the timeout is what the test reports
                print(f"(the hosted job's state could not be read: {exc!r})", file=sys.stderr)
            raise AssertionError("no progress (the hosted job's state is on stderr)")
        host.step(time.time())
        time.sleep(0.1)


def _state_of(host: TrainingHost, logs: Path | None) -> str:
    """What a test that timed out needs to say why: the hosted job's progress, its reports,
    evaluations and checkpoints, and the ends of its nodes' logs."""
    hosted = host.hosted(JOB_ID)
    lines = [f"hosted: {hosted is not None}"]
    if hosted is not None:
        lines += [
            f"done: {hosted.done}",
            f"error: {hosted.error}",
            f"progress: {hosted.progress()}",
            f"evaluations: {hosted.evaluations()}",
        ]
    lines += [f"reports: {[r.model_dump() for r in host.store.training(JOB_ID)[-3:]]}"]
    artifacts = host.artifacts(JOB_ID)
    if artifacts is not None:
        lines += [f"checkpoints: {sorted(artifacts.checkpoints.names())}"]
    for log in sorted(logs.glob("*.log")) if logs is not None else []:
        lines += [f"--- {log.name}", *log.read_text(errors="replace").splitlines()[-40:]]
    return "\n".join(lines)


@pytest.fixture
def artifact_store() -> Iterator[Folder]:
    """A bucket on a moto server (S3 as on AWS; the nodes reach it too). The local folder's
    path is the demo's and `train`'s (their tests)."""
    with MotoEC2Server() as server:
        s3_client(server.endpoint_url).create_bucket(Bucket="artifacts")
        yield S3Folder("artifacts", "orchestrator", endpoint=server.endpoint_url)


@pytest.mark.slow
def test_a_restarted_controller_resumes_the_job_from_its_checkpoint(
    tmp_path: Path, artifact_store: Folder
) -> None:
    """The job's code uploaded to the store, fetched by its nodes; its checkpoints there."""
    store = MemoryStore()
    code = store_code(artifact_store, pack_code(JOB_FILE))
    training = {**TRAINING, "code": code}
    job = JobSubmission(name="resume", budget_usd=10.0, work_gpu_hours=2.0, training=training)
    store.create_job(JobRecord.submit(JOB_ID, job.model_dump(mode="json"), 10.0, 0.0))
    root, port = artifact_store, free_port()
    artifacts = JobArtifacts(root, JOB_ID)
    first = _host(store, root, port)
    first.tags_for(JOB_ID)  # hosted at the job's first launch
    procs = _nodes(str(first.endpoint(JOB_ID)), tmp_path)
    try:
        _step_until(
            first,
            lambda: store.training(JOB_ID)[-1:] and store.training(JOB_ID)[-1].iteration >= 35,
            logs=tmp_path,
        )
        work_before = store.get_job(JOB_ID).work_done_gpu_hours
        assert work_before > 0
        # each node's speed, for BidBrain's learned rates: its rows in the job's work units
        measured = store.instance_work(JOB_ID)
        assert set(measured) == {"r0", "t0"}
        assert all(m.hours > 0 and m.work_gpu_hours > 0 for m in measured.values())
        total = sum(m.work_gpu_hours for m in measured.values())
        assert 0.5 * work_before <= total <= 1.5 * work_before
    finally:  # the controller goes, and with it the job's nodes (their agents restart them)
        first.close()
        _stop(procs)
    latest = artifacts.latest_checkpoint()
    assert latest is not None
    resumed = int(folder_name(latest).removeprefix("ckpt-"))
    reports_before = len(store.training(JOB_ID))

    second = _host(store, root, port)
    second.step(time.time())  # hosts the job again where its workers' tags point
    assert second.endpoint(JOB_ID) == f"tcp://127.0.0.1:{port}"
    procs = _nodes(str(second.endpoint(JOB_ID)), tmp_path)
    try:
        _step_until(second, artifacts.has_final, logs=tmp_path)
    finally:
        second.close()
        _stop(procs)
    assert resumed < ITERATIONS - 20  # the controller went mid-training
    after = [r.iteration for r in store.training(JOB_ID)[reports_before:] if r.iteration > 0]
    assert after and min(after) >= resumed  # nothing before the checkpoint trained again
    assert store.get_job(JOB_ID).work_done_gpu_hours >= work_before  # kept as recorded
    # the job ends with the weights of a run that never stopped
    code = load_job_code(JOB_FILE)
    model = code.model()
    model.load_state_dict(load(artifacts.final.read_bytes("model.safetensors")))
    expected, _ = train_reference(code, iterations=ITERATIONS, global_batch=GLOBAL_BATCH)
    assert relative_error(model, expected) <= 1e-5


@pytest.mark.slow
def test_a_job_reads_its_data_from_an_s3_prefix_the_controller_never_fetches(
    tmp_path: Path,
) -> None:
    """`training.data` on S3: each node copies it and its dataset() reads it; the controller
    assembles the final weights from the model alone."""
    from sklearn.datasets import load_digits

    from orchestrator.artifacts.data import DATA_ENV

    x, y = load_digits(return_X_y=True)
    blob = io.BytesIO()
    np.savez(blob, x=x[:1000], y=y[:1000])
    with MotoEC2Server() as server:
        s3_client(server.endpoint_url).create_bucket(Bucket="artifacts")
        root = S3Folder("artifacts", "orchestrator", endpoint=server.endpoint_url)
        root.sub("data").sub("sets").write_bytes("digits.npz", blob.getvalue())
        store = MemoryStore()
        training = {
            **TRAINING, "code": store_code(root, pack_code(JOBS / "digits_from_data")),
            "data": root.sub("data").location, "iterations": 30,
        }  # fmt: skip
        job = JobSubmission(name="data", budget_usd=10.0, work_gpu_hours=2.0, training=training)
        store.create_job(JobRecord.submit(JOB_ID, job.model_dump(mode="json"), 10.0, 0.0))
        host = _host(store, root, free_port())
        host.tags_for(JOB_ID)
        procs = _nodes(str(host.endpoint(JOB_ID)), tmp_path)
        artifacts = JobArtifacts(root, JOB_ID)
        try:
            _step_until(host, lambda: host.hosted(JOB_ID).done, logs=tmp_path)  # type: ignore[union-attr]
            host.save_final(JOB_ID)
        finally:
            host.close()
            _stop(procs)
        assert artifacts.has_final() and DATA_ENV not in os.environ
        weights = load(artifacts.final.read_bytes("model.safetensors"))
    assert sorted(weights) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert list((tmp_path / "code-cache" / "data").iterdir())  # the nodes' copy


def test_the_api_hands_back_the_weights_and_the_newest_checkpoint(tmp_path: Path) -> None:
    store = MemoryStore()
    job = JobSubmission(name="w", budget_usd=10.0, work_gpu_hours=2.0)
    store.create_job(JobRecord.submit(JOB_ID, job.model_dump(mode="json"), 10.0, 0.0))
    settings = Settings(
        api=ApiSettings(token=SecretStr("t0ken")), training=TrainingSettings(artifacts_dir=tmp_path)
    )
    client = TestClient(create_app(store, settings))
    auth = {"Authorization": "Bearer t0ken"}
    assert client.get(f"/v1/jobs/{JOB_ID}/weights").status_code == 401
    missing = client.get(f"/v1/jobs/{JOB_ID}/weights", headers=auth)
    assert missing.status_code == 404 and "no weights yet" in missing.json()["error"]["message"]
    assert client.get("/v1/jobs/job-nope/weights", headers=auth).status_code == 404

    artifacts = JobArtifacts(tmp_path, JOB_ID)
    ckpt = artifacts.checkpoints.path / "ckpt-00000009"
    ckpt.mkdir(parents=True)
    (ckpt / "part-0000.safetensors").write_bytes(b"part")
    (ckpt / "model.safetensors").write_bytes(b"checkpoint weights")
    assert client.get(f"/v1/jobs/{JOB_ID}/weights", headers=auth).status_code == 404  # torn
    (ckpt / "checkpoint.json").write_text('{"clock": 9}')
    got = client.get(f"/v1/jobs/{JOB_ID}/weights", headers=auth)
    assert got.content == b"checkpoint weights" and got.headers[WEIGHTS_HEADER] == ckpt.name
    artifacts.final.path.mkdir(parents=True)
    (artifacts.final.path / "model.safetensors").write_bytes(b"final weights")
    got = client.get(f"/v1/jobs/{JOB_ID}/weights", headers=auth)
    assert got.content == b"final weights" and got.headers[WEIGHTS_HEADER] == "final"

    tar = client.get(f"/v1/jobs/{JOB_ID}/checkpoint", headers=auth)
    assert tar.status_code == 200
    with tarfile.open(fileobj=io.BytesIO(tar.content)) as archive:
        assert sorted(archive.getnames()) == [
            "ckpt-00000009", "ckpt-00000009/checkpoint.json", "ckpt-00000009/model.safetensors",
            "ckpt-00000009/part-0000.safetensors",
        ]  # fmt: skip


def test_job_download_writes_the_weights_and_unpacks_the_checkpoint(tmp_path: Path) -> None:
    """`orchestrator job ID --download DIR` as a user runs it, against a served API."""
    from orchestrator.api.serve import BackgroundServer

    store = MemoryStore()
    job = JobSubmission(name="w", budget_usd=10.0, work_gpu_hours=2.0)
    store.create_job(JobRecord.submit(JOB_ID, job.model_dump(mode="json"), 10.0, 0.0))
    root = tmp_path / "artifacts"
    settings = Settings(
        api=ApiSettings(token=SecretStr("t0ken")), training=TrainingSettings(artifacts_dir=root)
    )
    artifacts = JobArtifacts(root, JOB_ID)
    ckpt = artifacts.checkpoints.path / "ckpt-00000019"
    ckpt.mkdir(parents=True)
    for name, data in (("part-0000.safetensors", b"p"), ("model.safetensors", b"w19")):
        (ckpt / name).write_bytes(data)
    (ckpt / "checkpoint.json").write_text('{"clock": 19}')
    out = tmp_path / "got"

    def download() -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "orchestrator", "job", JOB_ID, "--download", str(out),
               "--api", server.url, "--token", "t0ken"]  # fmt: skip
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)

    with BackgroundServer(create_app(store, settings)) as server:
        run = download()
        assert run.returncode == 0, run.stderr
        assert (out / "model.safetensors").read_bytes() == b"w19"
        assert (out / "checkpoint" / "ckpt-00000019" / "checkpoint.json").is_file()
        assert "ckpt-00000019 weights" in run.stderr and "--resume" in run.stderr
        artifacts.final.path.mkdir(parents=True)
        (artifacts.final.path / "model.safetensors").write_bytes(b"final")
        run = download()
        assert run.returncode == 0 and (out / "model.safetensors").read_bytes() == b"final"
        (ckpt / "checkpoint.json").unlink()
        (artifacts.final.path / "model.safetensors").unlink()
        run = download()
        assert run.returncode == 2 and "no weights yet" in run.stderr
        assert "Traceback" not in run.stderr


@pytest.mark.slow
def test_evaluations_during_training_reach_the_reports_and_tensorboard(tmp_path: Path) -> None:
    """`eval_every` through the controller: the training host evaluates the checkpoints its
    nodes write (at least 20 iterations apart; a fast run may checkpoint less often, at the
    backup servers' next common clock) on a thread of its own, and the model at the end once
    more; each report carries the newest evaluation, of the weights after an exact iteration
    count, and the job's TensorBoard file in its artifacts holds the loss and every evaluation.
    (Without the end's evaluation, a run whose only checkpoint came at 45 had one result.)"""
    from orchestrator.agileml.event_files import read_scalars
    from orchestrator.artifacts import LocalFolder

    store = MemoryStore()
    root = LocalFolder(tmp_path / "artifacts")
    job_file = Path(__file__).parents[3] / "orchestrator" / "jobs" / "digits_cnn.py"
    training = {**TRAINING, "code": store_code(root, pack_code(job_file)), "iterations": 60,
                "global_batch": 32, "checkpoint_every": 0, "eval_every": 20}  # fmt: skip
    job = JobSubmission(name="evals", budget_usd=10.0, work_gpu_hours=2.0, training=training)
    store.create_job(JobRecord.submit(JOB_ID, job.model_dump(mode="json"), 10.0, 0.0))
    host = _host(store, root, free_port())
    host.tags_for(JOB_ID)
    procs = _nodes(str(host.endpoint(JOB_ID)), tmp_path)
    hosted = host.hosted(JOB_ID)
    assert hosted is not None
    try:
        _step_until(host, lambda: hosted.done, logs=tmp_path)
        # as the controller ends a finished job: the final weights, then the job ends; its
        # host keeps it until the end's evaluation is in, reports it, and only then stops it
        host.save_final(JOB_ID)
        for state in (JobState.RUNNING, JobState.SUCCEEDED):
            store.transition(JOB_ID, state, expected_version=store.get_job(JOB_ID).version,
                             now_s=time.time())  # fmt: skip
        _step_until(host, lambda: host.hosted(JOB_ID) is None, logs=tmp_path)
    finally:
        host.close()
        _stop(procs)
    found = hosted.evaluations()
    iterations = [e["iteration"] for e in found]
    # during the run, on checkpoints at least 20 iterations apart; and the model at the end
    assert len(found) >= 2 and iterations[-1] == 60, found
    during = iterations[:-1]
    assert all(b - a >= 20 for a, b in zip(during, during[1:], strict=False))
    assert all(0 <= e["held_out_accuracy"] <= 1 for e in found)
    reported = [r.evaluation for r in store.training(JOB_ID) if r.evaluation is not None]
    assert reported and reported[-1].iteration == iterations[-1]
    # the weights after that many iterations evaluate the same on one process
    code = load_job_code(job_file)
    first = found[0]
    early, _ = train_reference(code, iterations=first["iteration"], global_batch=32)
    assert code.evaluate is not None
    assert code.evaluate(early)["held_out_accuracy"] == first["held_out_accuracy"]
    [events] = (tmp_path / "artifacts" / JOB_ID / "tensorboard").glob("events.out.tfevents.*")
    scalars = read_scalars(events)
    evals = [(step, v) for tag, step, v in scalars if tag == "eval/held_out_accuracy"]
    assert [step for step, _ in evals] == iterations
    assert any(tag == "train/loss" for tag, _, _ in scalars)
