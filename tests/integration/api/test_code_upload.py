"""A job's code goes in through the API: `orchestrator submit` (the installed console script, as a
user runs it) checks, packs and uploads the training section's code, and the submitted spec names
it by digest; the API stores only code whose digest matches, and refuses a job naming code it
does not have."""

from __future__ import annotations

import shutil
import subprocess
import warnings
from pathlib import Path

import yaml
from pydantic import SecretStr

from orchestrator.api.app import create_app
from orchestrator.artifacts import LocalFolder
from orchestrator.artifacts.code import code_ref, fetch_code, pack_code
from orchestrator.settings import ApiSettings, Settings, TrainingSettings
from orchestrator.store import MemoryStore

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*httpx2", category=UserWarning)
    from fastapi.testclient import TestClient

JOBS = Path(__file__).parents[2] / "support" / "jobs"
AUTH = {"Authorization": "Bearer t0ken"}


def _settings(root: Path) -> Settings:
    return Settings(
        api=ApiSettings(token=SecretStr("t0ken")), training=TrainingSettings(artifacts_dir=root)
    )


def test_the_api_stores_code_under_its_digest_and_checks_submissions(tmp_path: Path) -> None:
    client = TestClient(create_app(MemoryStore(), _settings(tmp_path / "store")))
    packed = pack_code(JOBS / "digits_sgd.py")
    ref = code_ref(packed)
    assert client.put(f"/v1/code/{ref}", content=packed).status_code == 401
    wrong = client.put("/v1/code/sha256:" + "0" * 64, content=packed, headers=AUTH)
    assert wrong.status_code == 400 and "not sha256:" in wrong.json()["error"]["message"]
    assert client.put("/v1/code/latest", content=packed, headers=AUTH).status_code == 400
    job = {"name": "c", "budget_usd": 5, "work_gpu_hours": 1, "training": {"code": ref}}
    refused = client.post("/v1/jobs", json=job, headers=AUTH)
    assert refused.status_code == 422 and "was not uploaded" in refused.json()["error"]["message"]

    junk = b"any bytes at all"  # named by their own digest: still not code
    refused = client.put(f"/v1/code/{code_ref(junk)}", content=junk, headers=AUTH)
    assert refused.status_code == 400 and "not a readable .tar.gz" in refused.text
    stored = client.put(f"/v1/code/{ref}", content=packed, headers=AUTH)
    assert stored.status_code == 201 and stored.json() == {"code": ref, "bytes": len(packed)}
    assert client.post("/v1/jobs", json=job, headers=AUTH).status_code == 201
    home = fetch_code(LocalFolder(tmp_path / "store"), ref, tmp_path / "cache")
    assert (home / "job.py").read_bytes() == (JOBS / "digits_sgd.py").read_bytes()


def test_submit_uploads_the_code_its_job_file_names(tmp_path: Path) -> None:
    from orchestrator.api.serve import BackgroundServer

    store = MemoryStore()
    project = tmp_path / "project"
    shutil.copytree(JOBS / "bn_rmsprop", project / "model")
    spec = {
        "name": "bn", "budget_usd": 5, "work_gpu_hours": 1,
        "training": {"code": "model", "global_batch": 32, "iterations": 10},
    }  # fmt: skip
    (project / "job.yaml").write_text(yaml.safe_dump(spec))
    script = shutil.which("orchestrator")
    assert script is not None, "the console script is installed with the package"

    with BackgroundServer(create_app(store, _settings(tmp_path / "store"))) as server:
        cmd = [script, "submit", str(project / "job.yaml"), "--api", server.url, "--token",
               "t0ken"]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert run.returncode == 0, run.stderr
        assert "checked:" in run.stderr and "uploaded" in run.stderr
        job = store.get_job(run.stdout.strip())
        assert job.spec["training"]["code"] == code_ref(pack_code(project / "model"))

        (project / "job.yaml").write_text(yaml.safe_dump({**spec, "training": {"code": "nope"}}))
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert run.returncode == 2 and "training.code: nope does not exist" in run.stderr
        assert "Traceback" not in run.stderr


def test_with_an_s3_store_the_api_takes_code_and_hands_back_weights(tmp_path: Path) -> None:
    from moto import mock_aws

    from orchestrator.artifacts import JobArtifacts, S3Folder
    from orchestrator.artifacts.folders import s3_client
    from orchestrator.store import JobRecord

    with mock_aws():
        s3_client().create_bucket(Bucket="store")
        root = S3Folder("store", "artifacts")
        settings = Settings(
            api=ApiSettings(token=SecretStr("t0ken")),
            training=TrainingSettings(store=root.location),
        )
        store = MemoryStore()
        store.create_job(JobRecord.submit("job-s3", {"name": "s", "budget_usd": 1,
                                                     "work_gpu_hours": 1}, 1.0, 0.0))  # fmt: skip
        client = TestClient(create_app(store, settings))
        packed = pack_code(JOBS / "digits_sgd.py")
        ref = code_ref(packed)
        assert client.put(f"/v1/code/{ref}", content=packed, headers=AUTH).status_code == 201
        assert fetch_code(root, ref, tmp_path / "cache").is_dir()
        assert client.get("/v1/jobs/job-s3/weights", headers=AUTH).status_code == 404
        artifacts = JobArtifacts(root, "job-s3")
        artifacts.final.write_bytes("model.safetensors", b"weights from s3")
        got = client.get("/v1/jobs/job-s3/weights", headers=AUTH)
        assert got.status_code == 200 and got.content == b"weights from s3"
        ckpt = artifacts.checkpoints.sub("ckpt-00000004")
        ckpt.write_bytes("part-0000.safetensors", b"p")
        assert client.get("/v1/jobs/job-s3/checkpoint", headers=AUTH).status_code == 404
        ckpt.write_bytes("checkpoint.json", b"{}")
        tar = client.get("/v1/jobs/job-s3/checkpoint", headers=AUTH)
        assert tar.status_code == 200 and b"part-0000.safetensors" in tar.content


def test_submitting_a_pipeline_job_sizes_it_for_bidbrain_from_the_planner(tmp_path: Path) -> None:
    """`parallelism: pipeline` without `gpu_work_rates`: submit profiles the job's layers here
    and sets each GPU model's rate to the catalog's times the planner's parallel efficiency on
    max_gpus GPUs, so BidBrain buys for the pipeline's throughput, not for perfect scaling."""
    from orchestrator.api.serve import BackgroundServer
    from orchestrator.market.catalog import Catalog

    store = MemoryStore()
    shutil.copy(JOBS / "digits_pipeline.py", tmp_path / "job.py")
    spec = {
        "name": "pipe", "budget_usd": 5, "work_gpu_hours": 1, "max_gpus": 4,
        "training": {"code": "job.py", "global_batch": 64, "iterations": 10,
                     "parallelism": "pipeline"},
    }  # fmt: skip
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    script = shutil.which("orchestrator")
    assert script is not None
    with BackgroundServer(create_app(store, _settings(tmp_path / "store"))) as server:
        cmd = [script, "submit", str(tmp_path / "job.yaml"), "--api", server.url, "--token",
               "t0ken"]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert run.returncode == 0, run.stderr
        assert "parallel efficiency on 4 GPUs" in run.stderr
        rates = store.get_job(run.stdout.strip()).spec["gpu_work_rates"]
        catalog = Catalog.load().gpu_work_rates
        assert set(rates) == set(catalog)
        ratios = {rates[m] / catalog[m] for m in catalog}
        assert len({round(r, 9) for r in ratios}) == 1  # one efficiency for every model
        assert 0 < ratios.pop() <= 1
        given = {**spec, "gpu_work_rates": {"V100": 0.5}}  # the user's own rates win
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(given))
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert run.returncode == 0 and "parallel efficiency" not in run.stderr, run.stderr
        assert store.get_job(run.stdout.strip()).spec["gpu_work_rates"] == {"V100": 0.5}
        # 4 stage workers an instance: sized on whole instances of 4 (9 GPUs at most: 2)
        four = {**spec, "max_gpus": 9,
                "training": {**spec["training"], "devices_per_node": 4}}  # fmt: skip
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(four))
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert run.returncode == 0, run.stderr
        assert "parallel efficiency on 8 GPUs (2 instances of 4)" in run.stderr
