"""`orchestrator simulate --json` as the simulator benchmarks run it: a 20 h job on a region's
bundled 2020 prices and the p3 capacity trace, in a subprocess (as a user runs it)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from orchestrator.market.trace_source import bundled_prices_dir


def simulate_json(
    region: str, *, strategies: str, starts: int, seed: int, options: list[str]
) -> dict[str, Any]:
    """One run's report (`options`: the case's own, e.g. `--nodes 16`).

    Raises:
        SystemExit: the run failed (the end of its stderr).
    """
    args = [
        sys.executable, "-m", "orchestrator", "simulate", "--prices",
        str(bundled_prices_dir(region)), "--strategy", strategies, "--job-hours", "20",
        "--starts", str(starts), "--seed", str(seed), *options, "--json",
    ]  # fmt: skip
    proc = subprocess.run(args, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"simulate failed for {region}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)
