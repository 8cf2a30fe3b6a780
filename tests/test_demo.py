"""The README's main command, end to end: `orchestrator demo --json-summary PATH`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_the_offline_demo_finishes_the_job_within_budget_and_leaves_nothing_running(tmp_path):
    summary_path = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "demo", "--json-summary", str(summary_path)],
        capture_output=True,
        text=True,
        timeout=290,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads(summary_path.read_text())
    assert summary["job_state"] == "succeeded"
    assert summary["spent_usd"] <= summary["budget_usd"]
    assert summary["evictions"] >= 1
    assert summary["orphans_after"] == 0
    assert summary["work_done_fraction"] == 1.0
    assert summary["wall_seconds"] < 300
    # the agents trained a real model with AgileML through the evictions
    assert summary["training_iterations"] > 0
    assert summary["final_loss"] < summary["loss_at_start"]
    assert any(event.startswith("evicted") for event in summary["training_events"])
    assert "Summary: job succeeded" in proc.stdout


def test_demo_refuses_a_non_positive_budget():
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "demo", "--budget", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--budget" in proc.stderr and "Traceback" not in proc.stderr
