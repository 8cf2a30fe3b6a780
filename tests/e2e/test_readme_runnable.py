"""The README's shell blocks marked `<!-- runnable -->` run as written, from the repository's
root after `./setup.sh` (the console script on PATH), each bounded; a block that starts a local
world is always followed by `local down` here, whatever happened."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
MARK = "<!-- runnable -->"
BLOCK_TIMEOUT_S = 900


def runnable_blocks() -> list[str]:
    """The bash blocks directly after a runnable mark, in order."""
    text = (ROOT / "README.md").read_text()
    return re.findall(re.escape(MARK) + r"\n```bash\n(.*?)```", text, re.S)


def test_the_readme_marks_blocks_that_run_and_only_bash_ones() -> None:
    text = (ROOT / "README.md").read_text()
    blocks = runnable_blocks()
    assert len(blocks) == text.count(MARK) >= 3, "every mark is followed by a ```bash block"
    assert any("orchestrator train" in b for b in blocks)
    assert any("orchestrator local up" in b and "orchestrator local down" in b for b in blocks)


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.parametrize("index", range(3))
def test_the_readmes_runnable_block_runs_as_written(index: int, tmp_path: Path) -> None:
    script = shutil.which("orchestrator")
    assert script is not None, "the console script is installed (./setup.sh)"
    block = runnable_blocks()[index]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATOR_API__")}
    env["ORCHESTRATOR_LOCAL_DIR"] = str(tmp_path / "local")  # not the user's own world
    try:
        run = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", block], cwd=ROOT, env=env,
            capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S,
        )  # fmt: skip
    finally:
        if (tmp_path / "local" / "world.json").exists():
            subprocess.run([script, "local", "down"], env=env, capture_output=True, timeout=120)
    assert run.returncode == 0, f"{block}\n--- stdout\n{run.stdout}\n--- stderr\n{run.stderr}"
    # `train --inject`: every fault the block asks for happens (a short run once ended before
    # its joiner computed, and the kill waiting on it was skipped: "kill@50 not done")
    assert " not done: " not in run.stdout, run.stdout
    assert not (tmp_path / "local" / "world.json").exists(), "the block left its world up"
