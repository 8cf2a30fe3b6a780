"""`benchmarks/gpu_check.py`, the check for a machine with GPUs: without CUDA it says it skipped;
its whole flow (AgileML, DDP, the single-process loop, the JSON) runs on the CPU with
`--cpu-smoke`, so the script is known to work before a GPU is at hand."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

CHECK = [sys.executable, "-m", "benchmarks.gpu_check"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA runs the real check")
def test_without_cuda_the_check_says_it_skipped() -> None:
    run = subprocess.run(CHECK, capture_output=True, text=True, timeout=120, check=True)
    assert "no CUDA device" in json.loads(run.stdout)["skipped"]


@pytest.mark.slow
def test_the_checks_flow_runs_on_the_cpu_and_both_runs_match_the_loop() -> None:
    run = subprocess.run(
        [*CHECK, "--cpu-smoke", "--iterations", "12", "--global-batch", "64"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert out["device"] == "cpu" and out["devices"] == 2
    [digits] = out["runs"]
    assert digits["job"] == "digits_cnn.py" and digits["gpus"] == 2
    assert digits["agileml_s_per_it"] > 0 and digits["ddp_s_per_it"] > 0 and digits["ratio"] > 0
    assert digits["agileml_distance_to_loop"] <= 1e-5
    assert digits["ddp_distance_to_loop"] <= 1e-5
