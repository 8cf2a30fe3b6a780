"""A user's job trained as a pipeline (`orchestrator train --pipeline`): real stage processes
run the job's own nn.Sequential, loss, optimizer and scheduler; under the synchronous `flush`
schedule the weights equal a single-process loop over the same global batches, through a
SIGKILLed stage too; the weights load into the job's model; bad input is one line, exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from orchestrator.agileml.errors import AgileMLError
from orchestrator.agileml.jobcode import JobCodeError, load_job_code, seeded_model
from orchestrator.agileml.pipeline.source import job_layers, job_source, layer_sizes, load_layers
from orchestrator.agileml.pipeline.trainrun import (
    check_pipeline_plan,
    microbatches_for,
    train_pipeline_locally,
)
from orchestrator.agileml.reference import relative_error, train_reference
from orchestrator.agileml.trainrun import TrainPlan, parse_injections
from orchestrator.errors import UserError

JOBS = Path(__file__).parents[2] / "support" / "jobs"
JOB = JOBS / "digits_pipeline.py"
ITERATIONS, GLOBAL_BATCH = 24, 64


def _plan(**changes: object) -> TrainPlan:
    base = {
        "code": str(JOB),
        "nodes": 2,
        "iterations": ITERATIONS,
        "global_batch": GLOBAL_BATCH,
        "pipeline": True,
        "stages": 2,
    }
    return TrainPlan.model_validate({**base, **changes})


def test_flush_pipeline_of_a_users_job_equals_a_single_process_loop() -> None:
    """AdamW with a cosine schedule, stepped by each stage on its own layers."""
    result = train_pipeline_locally(_plan())
    planned = result.events[0]
    assert planned["kind"] == "planned" and len(planned["stages"]) == 2
    expected, losses = train_reference(
        load_job_code(JOB), iterations=ITERATIONS, global_batch=GLOBAL_BATCH
    )
    assert relative_error(result.model, expected) <= 1e-5
    assert [k for k, _ in result.losses] == list(range(ITERATIONS))
    assert result.losses[0][1] == pytest.approx(losses[0], rel=1e-5)
    assert result.evaluation["accuracy"] > 0.5


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_groups", "sgd"])
def test_a_killed_stage_is_rebuilt_from_the_reliable_copy_and_the_weights_stay_exact(
    optimizer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run re-plans on the node left and ends where a single process does: AdamW's
    moments and step counts come back from the backups, the cosine schedule's position from
    the iterations done."""
    monkeypatch.setenv("ORCHESTRATOR_TEST_OPTIMIZER", optimizer)
    result = train_pipeline_locally(_plan(injections=tuple(parse_injections("kill@12"))))
    recovered = [e for e in result.events if e["kind"] == "recovered"]
    assert len(recovered) == 1 and recovered[0]["resumed_iteration"] <= 12
    assert sum(r for _, _, r in recovered[0]["stages"]) == 1  # one node left
    expected, _ = train_reference(
        load_job_code(JOB), iterations=ITERATIONS, global_batch=GLOBAL_BATCH
    )
    assert relative_error(result.model, expected) <= 1e-5


def test_nodes_of_two_devices_hold_two_workers_each_and_a_lost_device_loses_its_node() -> None:
    """3 nodes of 2 devices: 6 stage workers, 2 on each node (the planner's slots). `kill`
    takes a node's two workers, `kill-device` one worker, whose node is lost with it: the job
    re-plans for 2 nodes, then 1, and ends where one process does."""
    injections = tuple(parse_injections("kill@8,kill-device@16"))
    result = train_pipeline_locally(_plan(nodes=3, devices_per_node=2, injections=injections))
    placements = [e["placement"] for e in result.events]
    nodes = [sorted(n for stage in p for n in stage) for p in placements]
    assert nodes == [[0, 0, 1, 1, 2, 2], [0, 0, 1, 1], [0, 0]], result.events
    assert [len(e["stages"]) for e in result.events] == [2, 2, 2]  # --stages 2 throughout
    assert result.devices == {"n0": 2}  # the last attempt's workers, by node
    expected, _ = train_reference(
        load_job_code(JOB), iterations=ITERATIONS, global_batch=GLOBAL_BATCH
    )
    assert relative_error(result.model, expected) <= 1e-5


def test_a_stage_whose_code_raises_fails_the_run_with_its_log_not_a_recovery(
    tmp_path: Path,
) -> None:
    job = tmp_path / "flaky.py"
    job.write_text(
        JOB.read_text().replace(
            "def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:\n",
            "CALLS = []\n\n\n"
            "def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:\n"
            "    CALLS.append(1)\n"
            "    if len(CALLS) > 3:\n"
            "        raise RuntimeError('the loss broke at call 4')\n",
        )
    )
    with pytest.raises(AgileMLError, match="(?s)crashed; the end of its log:.*the loss broke"):
        train_pipeline_locally(_plan(code=str(job)))


def test_a_notice_a_join_and_a_kill_in_one_run_end_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """The node leaving on notice hands over through the reliable copy, the joiner makes the
    job re-plan for one more node, the kill is recovered from the cut: flush still ends where
    one process does (AdamW's state and the cosine schedule follow every re-plan)."""
    result = train_pipeline_locally(
        _plan(nodes=2, injections=tuple(parse_injections("evict@6,join@12,kill@18")))
    )
    changes = [(e["kind"], sum(r for _, _, r in e["stages"])) for e in result.events[1:]]
    assert changes == [("recovered", 1), ("joined", 2), ("recovered", 1)], result.events
    assert [e.get("notice") for e in result.events[1:]] == [True, None, False]
    expected, _ = train_reference(
        load_job_code(JOB), iterations=ITERATIONS, global_batch=GLOBAL_BATCH
    )
    assert relative_error(result.model, expected) <= 1e-5


def test_frozen_layers_stay_as_they_were_and_the_rest_train_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ORCHESTRATOR_TEST_FROZEN", "1")
    result = train_pipeline_locally(_plan(injections=tuple(parse_injections("kill@12"))))
    code = load_job_code(JOB)
    expected, _ = train_reference(code, iterations=ITERATIONS, global_batch=GLOBAL_BATCH)
    assert relative_error(result.model, expected) <= 1e-5
    assert torch.equal(result.model[0].weight, seeded_model(code, 0)[0].weight)  # untrained


def test_an_eviction_after_the_last_update_ends_from_the_reliable_copy() -> None:
    result = train_pipeline_locally(
        _plan(injections=tuple(parse_injections(f"evict@{ITERATIONS - 1}")))
    )
    expected, _ = train_reference(
        load_job_code(JOB), iterations=ITERATIONS, global_batch=GLOBAL_BATCH
    )
    assert relative_error(result.model, expected) <= 1e-5


def test_weights_tied_across_layers_are_refused(tmp_path: Path) -> None:
    job = tmp_path / "tied.py"
    job.write_text(
        JOB.read_text() + "\n\ndef stages(m):\n"
        "    head = nn.Linear(96, 96)\n"
        "    head.weight = m[2].weight\n"
        "    return [*m, head]\n"
    )
    with pytest.raises(JobCodeError, match="share the weight `weight`"):
        check_pipeline_plan(_plan(code=str(job)))


def test_layers_state_round_trips_with_buffers() -> None:
    """BatchNorm's running statistics and its integer batch count travel too."""
    code = load_job_code(JOBS / "bn_rmsprop")
    model = code.model()
    assert isinstance(model, nn.Sequential)
    layers = job_layers(code, model)
    flat = torch.cat(
        [t.detach().reshape(-1).float() for m in layers for t in [*m.parameters(), *m.buffers()]]
    )
    assert flat.numel() == sum(layer_sizes(layers))
    other = job_layers(code, code.model())
    load_layers(other, flat + 1)
    for a, b in zip(layers, other, strict=True):
        for key, value in a.state_dict().items():
            assert torch.equal(b.state_dict()[key], (value.float() + 1).to(value.dtype))


def test_a_model_that_is_not_sequential_is_refused_with_the_fix(tmp_path: Path) -> None:
    job = tmp_path / "job.py"
    job.write_text(
        JOB.read_text().replace(
            "def _layers() -> nn.Sequential:\n    return nn.Sequential(",
            "def _layers() -> nn.Module:\n    return Wrapped(",
        )
        + "\n\nclass Wrapped(nn.Module):\n"
        "    def __init__(self, *layers):\n"
        "        super().__init__()\n"
        "        self.body = nn.Sequential(*layers)\n\n"
        "    def forward(self, x):\n"
        "        return self.body(x)\n"
    )
    with pytest.raises(JobCodeError, match="not an nn.Sequential.*stages\\(model\\)"):
        job_source(str(job), 0).layers()
    hooked = tmp_path / "hooked.py"  # a module is imported once per path
    hooked.write_text(job.read_text() + "\n\ndef stages(m):\n    return list(m.body)\n")
    assert len(job_source(str(hooked), 0).layers()) == 7


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"injections": tuple(parse_injections("kill@5,kill@6"))}, "takes away 2 nodes of 2"),
        ({"injections": tuple(parse_injections("kill@30"))}, "want an iteration in 1..23"),
        ({"stages": 9, "nodes": 4}, "--stages 9: the job has 7 layers and 4 stage workers"),
        (
            {"stages": 5, "nodes": 2, "devices_per_node": 2},
            "--stages 5: the job has 7 layers and 4 stage workers .* at most 4 stages",
        ),
        ({"injections": tuple(parse_injections("kill-device@5"))}, "each node has one device"),
    ],
)
def test_pipeline_plans_that_cannot_run_are_refused(
    changes: dict[str, object], message: str
) -> None:
    with pytest.raises(UserError, match=message):
        check_pipeline_plan(_plan(**changes))


def test_microbatches_divide_the_global_batch() -> None:
    assert microbatches_for(256, 4) == 8
    assert microbatches_for(256, 1) == 4
    assert microbatches_for(60, 4) == 6
    assert microbatches_for(7, 3) == 1


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The installed console script, as a user runs it."""
    exe = Path(sys.executable).parent / "orchestrator"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "orchestrator"]
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [*cmd, *args], cwd=cwd, capture_output=True, text=True, timeout=600, env=env
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--schedule", "2bw"], "--schedule and --stages need --pipeline"),
        (["--pipeline", "--schedule", "zigzag"], "--schedule"),
        (["--pipeline", "--nodes", "2", "--inject", "kill@3,evict@4"], "takes away 2 nodes of 2"),
    ],
)
def test_train_cli_refuses_bad_pipeline_input_with_one_line_and_exit_2(
    tmp_path: Path, args: list[str], message: str
) -> None:
    run = _cli("train", str(JOB), *args, cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert message in run.stderr and "Traceback" not in run.stderr
    assert os.listdir(tmp_path) == []


def test_plan_profiles_a_jobs_layers_here_and_saves_the_profile(tmp_path: Path) -> None:
    saved = tmp_path / "profile.json"
    run = _cli(
        "plan", "--job", str(JOB), "--workers", "3", "--bandwidth", "1e9", "--stages", "3",
        "--global-batch", "64", "--save-profile", str(saved), "--json", cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    body = json.loads(run.stdout)
    assert [s["replicas"] for s in body["stages"]] == [1, 1, 1]
    assert body["stages"][-1]["last_layer"] == 6
    layers = json.loads(saved.read_text())["layers"]
    assert [layer["name"] for layer in layers][:2] == ["0:Linear", "1:ReLU"]
    assert layers[0]["parameter_bytes"] == (64 * 96 + 96) * 4


def test_plan_wants_one_of_profile_and_job(tmp_path: Path) -> None:
    run = _cli("plan", "--workers", "2", "--bandwidth", "1e9", cwd=tmp_path)
    assert run.returncode == 2 and "give one of --profile" in run.stderr
