"""The scale benchmark (`python -m benchmarks.scale`) on a tiny world, so that it cannot rot:
2 and 3 jobs of 4 instances through the same code path (real redis-server, moto EC2 server,
uvicorn), and its JSON has every figure, with sane values."""

from __future__ import annotations

import json
import os
from pathlib import Path

from benchmarks.scale import DECISION_MS_P95_TARGET, ENDPOINTS, SCALED, run, table


def _children_named(name: str) -> list[int]:
    """Pids of this process's children running `name` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()  # "pid (comm) state ppid ..."
        except OSError:
            continue  # gone meanwhile
        comm, _, rest = text.partition("(")[2].rpartition(")")
        if comm == name and rest.split()[1] == str(os.getpid()):
            found.append(int(stat.parent.name))
    return found


def test_the_scale_benchmark_reports_every_figure_at_each_size(tmp_path: Path) -> None:
    result = run([2, 3], instances_per_job=4, ticks=2, requests=3, profile_dir=tmp_path)
    json.dumps(result)  # JSON as printed
    assert [s["jobs"] for s in result["sizes"]] == [2, 3]
    for size in result["sizes"]:
        assert size["instances_target"] == 4 * size["jobs"]
        assert size["instances_alive"] >= size["instances_target"]  # doomed ones may linger
        assert size["fill"]["ticks"] >= 1 and size["fill"]["ec2_calls"] > 0
        assert size["tick_s"]["n"] == 2 and 0 < size["tick_s"]["p50"] <= size["tick_s"]["max"]
        assert size["ec2_calls_per_tick"] >= 1  # the reconciliation's DescribeInstances
        assert size["redis_commands_per_tick"] > 0
        decisions = size["decision_ms"]
        assert decisions["n"] == 2 * size["jobs"] and 0 < decisions["p95"] < DECISION_MS_P95_TARGET
        assert size["markets_per_decision"] > 0
        assert size["job_step_ms"]["n"] == 2 * size["jobs"]
        assert set(size["api_ms"]) == set(ENDPOINTS)
        for endpoint in size["api_ms"].values():
            assert endpoint["n"] == 3 and 0 < endpoint["p50"] <= endpoint["max"]
            assert endpoint["bytes"] > 0
        assert size["redis_used_memory_bytes"] > 0 and size["redis_keys"] > 0
        assert size["events_per_job"] > 0
    assert set(result["scaling"]) == set(SCALED)
    text = table(result)
    assert "decision p95 target" in text and "GET /metrics" in text
    # the profiles of the largest size, and nothing left running
    assert {p.name for p in tmp_path.iterdir()} >= {"tick-3jobs.prof", "api-metrics-3jobs.txt"}
    assert _children_named("redis-server") == []
