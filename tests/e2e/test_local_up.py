"""`orchestrator local up` -> `submit --wait` -> `job --download` -> `local down`, as a new user
runs them through the installed console script, with a job file the project never trained
(an MLP on scikit-learn's wine data, SGD with momentum): its weights come back and classify
held-out rows; a job whose scheduler raises on the parameter servers ends `failed` with the
user's error (exit 1), and `orchestrator logs` shows the failing node's traceback; nothing the
world started is left running."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file
from support.processes import alive, descendants

from orchestrator.agileml.jobcode import load_job_code

SUPPORT_JOBS = Path(__file__).parents[1] / "support" / "jobs"

WINE_JOB = """
import torch
from sklearn.datasets import load_wine
from torch import nn
from torch.utils.data import TensorDataset


def _data():
    x, y = load_wine(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32)
    x = (x - x.mean(0)) / x.std(0)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    return x[order], torch.tensor(y)[order]


def model():
    return nn.Sequential(nn.Linear(13, 32), nn.Tanh(), nn.Linear(32, 3))


def dataset():
    x, y = _data()
    return TensorDataset(x[:140], y[:140])


def loss(out, target):
    return nn.functional.cross_entropy(out, target)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def evaluate(m):
    x, y = _data()
    with torch.no_grad():
        out = m(x[140:])
    return {"held_out_accuracy": float((out.argmax(1) == y[140:]).float().mean())}
"""


def _spec(name: str, code: str, iterations: int) -> str:
    return (
        f"name: {name}\nbudget_usd: 30\nwork_gpu_hours: 4\nmax_gpus: 2\n"
        "instance_types: [p3.2xlarge]\n"
        f"training:\n  code: {code}\n  iterations: {iterations}\n  global_batch: 32\n"
        "  num_partitions: 2\n  min_nodes: 2\n"
    )


@pytest.mark.slow
@pytest.mark.ci
def test_a_users_job_goes_through_local_up_submit_download_and_down(tmp_path: Path) -> None:
    script = shutil.which("orchestrator")
    assert script is not None, "the console script is installed (pip install -e .)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATOR_API__")}
    env["ORCHESTRATOR_LOCAL_DIR"] = str(tmp_path / "state")
    env["ORCHESTRATOR_TEST_FAIL"] = "schedule"  # the failing job's scheduler raises at step 21

    def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run([script, *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=timeout)  # fmt: skip

    (tmp_path / "wine.py").write_text(WINE_JOB)
    (tmp_path / "wine.yaml").write_text(_spec("wine-mlp", "wine.py", 300))
    shutil.copy(SUPPORT_JOBS / "digits_failing.py", tmp_path / "failing.py")
    (tmp_path / "failing.yaml").write_text(_spec("failing", "failing.py", 200))

    up = cli("local", "up", "--json")
    assert up.returncode == 0, up.stderr
    world = json.loads(up.stdout)
    assert set(world) == {"api_url", "token", "read_token", "dashboard_url"}
    pid = json.loads((tmp_path / "state" / "world.json").read_text())["pid"]
    started: set[int] = set()
    try:
        status = cli("local", "status", "--json")
        assert status.returncode == 0 and json.loads(status.stdout) == world

        run = cli("submit", "wine.yaml", "--wait", timeout=420)
        assert run.returncode == 0, run.stdout + run.stderr
        job_id = run.stdout.split()[0]
        started = descendants(pid)  # the agents, Redis and moto among them
        job: dict[str, Any] = json.loads(cli("job", job_id, "--json").stdout)
        assert job["state"] == "succeeded", job
        assert "trained 300 iterations" in job["message"]
        assert job["work_done_gpu_hours"] == pytest.approx(4.0)

        got = cli("job", job_id, "--download", str(tmp_path / "out"))
        assert got.returncode == 0, got.stderr
        user_job = load_job_code(tmp_path / "wine.py")
        model = user_job.model()
        model.load_state_dict(load_file(tmp_path / "out" / "model.safetensors"))
        assert user_job.evaluate is not None
        assert user_job.evaluate(model)["held_out_accuracy"] >= 0.8

        failed = cli("submit", "failing.yaml", "--wait", timeout=420)
        assert failed.returncode == 1, failed.stdout + failed.stderr
        failed_job = json.loads(cli("job", failed.stdout.split()[0], "--json").stdout)
        assert failed_job["state"] == "failed"
        assert "Tried to step 21 times" in failed_job["message"]  # the user's scheduler
        assert "Tried to step 21 times" in failed.stderr  # on the console too
        # the nodes' logs through the API: the traceback of the node whose server failed
        logs = cli("logs", failed_job["job_id"])
        assert logs.returncode == 0, logs.stderr
        assert "the job's code failed" in logs.stdout and "Tried to step 21 times" in logs.stdout
        assert "Traceback (the job's frames" in logs.stdout, logs.stdout[-3000:]
    finally:
        down = cli("local", "down", timeout=120)
    assert down.returncode == 0, down.stderr
    deadline = time.monotonic() + 30  # init reaps what the world left
    while time.monotonic() < deadline and alive({pid, *started}):
        time.sleep(0.2)
    left = sorted(alive({pid, *started}))
    for p in left:  # never leave them to the next test
        os.kill(p, signal.SIGKILL)
    assert not left, f"processes left running after `local down`: {left}"
    assert cli("local", "status").returncode == 1
    assert not (tmp_path / "state" / "world.json").exists()
