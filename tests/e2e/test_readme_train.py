"""The README's own `orchestrator train` commands, as a new user runs them: its example job
file written out, each command run through the installed console script, and the weights and
summary they promise read back (a crash while printing once lost both)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from orchestrator.agileml.jobcode import load_job_code

README = Path(__file__).parents[2] / "README.md"


def _example_job() -> str:
    """The README's complete example job (the python block after "A complete example")."""
    text = README.read_text()
    start = text.index("A complete example")
    block = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert block is not None
    return block.group(1)


def _train_commands() -> list[list[str]]:
    """Every `orchestrator train digits.py ... --inject ...` command in the README's bash blocks
    (a line ending in `\\` continues)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            if line.startswith("orchestrator train digits.py") and "--inject" in line:
                commands.append(shlex.split(line))
    return commands


def test_the_readme_names_the_commands_this_test_runs() -> None:
    commands = _train_commands()
    assert len(commands) == 2, commands  # the data-parallel one and the pipeline one
    assert any("--pipeline" in c for c in commands)
    assert "def evaluate(m)" in _example_job()


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.parametrize("index", [0, 1], ids=["data-parallel", "pipeline"])
def test_the_readmes_train_command_writes_the_weights_it_promises(
    index: int, tmp_path: Path
) -> None:
    script = shutil.which("orchestrator")
    assert script is not None, "the console script is installed (pip install -e .)"
    (tmp_path / "digits.py").write_text(_example_job())
    command = _train_commands()[index]
    run = subprocess.run(
        [script, *command[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=400
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"] == 300
    assert summary["evaluation"]["held_out_accuracy"] >= 0.8
    kinds = [e["kind"] for e in summary["events"]]
    # the faults happened: injected (data-parallel), or recovered from (a pipeline)
    assert any(k.startswith("injected_") or k == "recovered" for k in kinds), kinds
    assert not [k for k in kinds if k.startswith("skipped_")], kinds  # all of them happened
    assert f"wrote {Path('out') / 'model.safetensors'}" in run.stdout
    if "--pipeline" in command:  # its stages, and the stage its kill took, said so
        assert "pipeline: stages" in run.stdout and "lost stage" in run.stdout, run.stdout
    job = load_job_code(tmp_path / "digits.py")
    model = job.model()
    model.load_state_dict(load_file(str(out / "model.safetensors")))
    x = torch.zeros(1, 1, 8, 8)
    assert model(x).shape == (1, 10)
