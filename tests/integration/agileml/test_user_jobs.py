"""The test of record for users' own jobs: real node processes train a job file through an
eviction with notice, a join and a SIGKILL, and end with the weights of a single-process
PyTorch loop over the same global batches; `orchestrator train` as a user runs it."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from orchestrator.agileml import checkpoints
from orchestrator.agileml.control import TrainingSpec
from orchestrator.agileml.elasticity import NodeTier
from orchestrator.agileml.event_files import read_scalars
from orchestrator.agileml.jobcode import load_job_code
from orchestrator.agileml.local import LocalJob
from orchestrator.agileml.parts import training_parts
from orchestrator.agileml.reference import relative_error, train_reference
from orchestrator.agileml.trainrun import TrainPlan, parse_injections, train_locally, train_spec
from orchestrator.straggler.spec import StragglerSpec

JOBS = Path(__file__).parents[2] / "support" / "jobs"
ITERATIONS = 120
GLOBAL_BATCH = 64
FAULTS = "evict@10,join@20,kill@50"  # the kill waits until the joiner is in the roster
PAUSE_S = "0.05"  # per loss call: gives the joining node time to load and enter the roster


@pytest.mark.slow
@pytest.mark.parametrize(
    ("job", "accumulate", "clip"),
    # accumulation and clipping in one run (CI time): 3 micro-batches of uneven shares
    [("digits_sgd.py", 1, None), ("digits_adamw.py", 3, 0.5)],
    ids=["digits_sgd.py", "digits_adamw.py-accumulate3-clip"],
)
def test_weights_through_evict_join_and_kill_equal_a_single_process_loop(
    job: str, accumulate: int, clip: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `accumulate`, each worker computes its rows of an iteration in micro-batches
    (FlexRR's chunks no larger than one) and the loop does the same with the global batch;
    with `clip`, every iteration's gradient is clipped to that global norm, as the loop's
    `clip_grad_norm_` does (the roll-back after the kill restores the coefficients too)."""
    path = JOBS / job
    monkeypatch.setenv("ORCHESTRATOR_TEST_JOB_PAUSE_S", PAUSE_S)
    plan = TrainPlan(
        code=str(path),
        nodes=3,
        reliable=1,
        iterations=ITERATIONS,
        global_batch=GLOBAL_BATCH,
        partitions=8,  # spread over the ActivePSs: the kill of one is a roll-back
        injections=tuple(parse_injections(FAULTS)),
        accumulate=accumulate,
        clip_grad_norm=clip,
    )
    result = train_locally(plan)
    monkeypatch.delenv("ORCHESTRATOR_TEST_JOB_PAUSE_S")
    kinds = [e["kind"] for e in result.events]
    assert [k for k in kinds if k.startswith(("injected_", "skipped_"))] == [
        "injected_evict",
        "injected_join",
        "injected_kill",
    ], result.events
    # the victims are the oldest transient nodes: ActivePSs, so the kill is a roll-back
    assert {"evicted", "joined", "rolled_back"} <= set(kinds), result.events
    expected, losses = train_reference(
        load_job_code(path), iterations=ITERATIONS, global_batch=GLOBAL_BATCH,
        accumulate=accumulate, clip_grad_norm=clip,
    )  # fmt: skip
    assert relative_error(result.model, expected) <= 1e-5
    assert result.final_loss is not None and result.final_loss < losses[0] / 2


def test_clipping_by_the_global_norm_equals_the_single_process_loop() -> None:
    """`clip_grad_norm`: the partitions' servers apply each iteration scaled by the coefficient
    of the whole gradient's norm; the weights are the loop's that calls `clip_grad_norm_`, and
    far from the unclipped loop's (the clipping did act)."""
    path = JOBS / "digits_adamw.py"
    plan = TrainPlan(code=str(path), nodes=2, reliable=1, iterations=25, global_batch=48,
                     partitions=5, clip_grad_norm=0.5)  # fmt: skip
    result = train_locally(plan)
    code = load_job_code(path)
    clipped, _ = train_reference(code, iterations=25, global_batch=48, clip_grad_norm=0.5)
    unclipped, _ = train_reference(code, iterations=25, global_batch=48)
    assert relative_error(result.model, clipped) <= 1e-5
    assert relative_error(result.model, unclipped) > 1e-3


BATCHNORM_1D_JOB = """
import torch
from torch import nn


def model():
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def dataset():
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(96, 6, generator=g),
                                          torch.randint(0, 3, (96,), generator=g))


def loss(output, target):
    return nn.functional.cross_entropy(output, target)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.05)
"""


def _start_three_nodes(job: LocalJob) -> None:
    """The reliable r0 and the transient t0 and t1."""
    job.add_node("r0", NodeTier.RELIABLE)
    job.add_node("t0", NodeTier.TRANSIENT)
    job.add_node("t1", NodeTier.TRANSIENT)


def test_a_batchnorm_job_with_the_controllers_default_spec_trains(tmp_path: Path) -> None:
    """A job spec's training section leaves FlexRR on (the default); a node turns it off for a
    model with BatchNorm, as `train` does. FlexRR's chunks of one row made BatchNorm1d raise
    ("Expected more than 1 value per channel"): a user's job through the controller failed."""
    path = tmp_path / "bn_job.py"
    path.write_text(BATCHNORM_1D_JOB)
    spec = TrainingSpec(job_id="bn", code=str(path), global_batch=48, iterations=15,
                        num_partitions=2, min_nodes=3)  # fmt: skip
    assert spec.straggler.flexrr  # what a job spec gives
    with LocalJob(spec) as job:
        _start_three_nodes(job)
        _, outcomes = job.finish(timeout_s=120)
    assert job.coordinator.error is None
    assert all(len(o.ends) == 15 for o in outcomes.values()), outcomes


def test_accumulation_without_flexrr_equals_the_single_process_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FlexRR off (as for a BatchNorm job): a worker's share in 4 micro-batches, gradients
    summed; the weights are the loop's, and the job's loss saw the micro-batches (a per-row
    loss gives the same weights whole, so the rows it saw are what tell)."""
    rows_log = tmp_path / "rows.txt"
    monkeypatch.setenv("ORCHESTRATOR_TEST_ROWS_LOG", str(rows_log))
    path = JOBS / "digits_sgd.py"
    plan = TrainPlan(code=str(path), nodes=2, reliable=1, iterations=20, global_batch=48)
    spec = train_spec(plan).model_copy(
        update={"accumulate": 4, "straggler": StragglerSpec(flexrr=False)}
    )
    with LocalJob(spec) as job:
        _start_three_nodes(job)
        params, _ = job.finish(timeout_s=120)
    seen = [line.split() for line in rows_log.read_text().splitlines()]
    trained = [int(rows) for pid, rows, _ in seen if int(pid) != os.getpid()]  # the nodes'
    # 3 workers, 16 rows each per iteration: 4 micro-batches of 4 rows (a node's warm-up
    # before its first clock takes 8 rows, within a micro-batch of the global batch: 12)
    assert trained.count(4) >= 20 * 3 * 4 and max(trained) <= 12, sorted(set(trained))
    model = training_parts(spec).model_with(params)
    code = load_job_code(path)
    expected, _ = train_reference(code, iterations=20, global_batch=48, accumulate=4)
    assert relative_error(model, expected) <= 1e-5


def test_evaluations_during_training_are_of_the_weights_after_the_iterations_they_name() -> None:
    """`--eval-every 15`: the job's evaluate() runs on checkpoints while training goes on, at
    least 15 iterations apart (a checkpoint is due 15 after the last; the backup servers take
    it at their next common clock, which may come later); each result names the iteration its
    weights are after, exactly: the single-process loop's weights after that many iterations
    evaluate the same."""
    path = Path(__file__).parents[3] / "orchestrator" / "jobs" / "digits_cnn.py"
    plan = TrainPlan(code=str(path), nodes=2, reliable=1, iterations=90, global_batch=48,
                     eval_every=15)  # fmt: skip
    result = train_locally(plan)
    found = result.evaluations
    iterations = [e["iteration"] for e in found]
    assert len(found) >= 2 and iterations[-1] == 90, found  # one during the run, and the end
    during = iterations[:-1]
    assert all(b - a >= 15 for a, b in zip(during, during[1:], strict=False)), found
    assert all(set(e) == {"iteration", *result.evaluation} for e in found)
    assert found[-1] == {"iteration": 90, **result.evaluation}
    code = load_job_code(path)
    first = found[0]
    assert 15 <= first["iteration"] < 90
    early, _ = train_reference(code, iterations=first["iteration"], global_batch=48)
    early.eval()
    with torch.no_grad():
        assert code.evaluate is not None
        metrics = code.evaluate(early)
    assert metrics["held_out_accuracy"] == first["held_out_accuracy"]
    assert metrics["held_out_loss"] == pytest.approx(first["held_out_loss"], rel=1e-4)


@pytest.mark.slow
def test_bf16_computes_in_bfloat16_and_classifies_as_well_as_fp32(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`precision: bf16` (with `wire_precision: bf16`: pushes and pulls in bfloat16 too): the
    job's forward and loss ran in bfloat16 on the nodes (its loss saw bfloat16 outputs), the
    parameter servers' fp32 weights came back, and they classify the held-out digits within
    1.5 points of an fp32 run of the same job."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    held_x, held_y = torch.tensor(x[1500:] / 16.0, dtype=torch.float32), torch.tensor(y[1500:])
    accuracy, dtypes = {}, {}
    for precision in ("fp32", "bf16"):
        rows_log = tmp_path / f"{precision}.txt"
        monkeypatch.setenv("ORCHESTRATOR_TEST_ROWS_LOG", str(rows_log))
        plan = TrainPlan(code=str(JOBS / "digits_sgd.py"), nodes=2, reliable=1, iterations=60,
                         global_batch=GLOBAL_BATCH, precision=precision,
                         wire_precision=precision)  # fmt: skip
        result = train_locally(plan)
        assert result.precision == precision and result.wire["precision"] == precision
        assert all(p.dtype == torch.float32 for p in result.model.parameters())
        with torch.no_grad():
            guess = result.model(held_x).argmax(1)
        accuracy[precision] = float((guess == held_y).float().mean())
        seen = [line.split() for line in rows_log.read_text().splitlines()]
        dtypes[precision] = {dtype for pid, _, dtype in seen if int(pid) != os.getpid()}
    assert dtypes == {"fp32": {"torch.float32"}, "bf16": {"torch.bfloat16"}}
    assert accuracy["fp32"] > 0.8
    assert abs(accuracy["bf16"] - accuracy["fp32"]) <= 0.015, accuracy


@pytest.mark.slow
def test_a_job_stopped_whole_resumes_from_its_checkpoint_with_the_same_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every process of the job goes (as when the controller node restarts); a new run from
    the newest checkpoint ends with the weights of the run that never stopped."""
    path = JOBS / "digits_adamw.py"
    monkeypatch.setenv("ORCHESTRATOR_TEST_JOB_PAUSE_S", "0.02")
    base = TrainPlan(code=str(path), nodes=2, reliable=1, iterations=60, global_batch=GLOBAL_BATCH)
    spec = train_spec(
        base.model_copy(update={"checkpoint_dir": str(tmp_path), "checkpoint_every": 10})
    )
    with LocalJob(spec, log_dir=tmp_path) as job:
        _start_three_nodes(job)
        job.wait_clock(35, timeout_s=120)
    # leaving the block stopped the controller and every node
    newest = checkpoints.latest(tmp_path)
    assert newest is not None
    done = checkpoints.read_manifest(newest).iterations_done
    assert 10 <= done <= 50  # mid-run (the nodes may pass clock 35 before they stop)
    result = train_locally(base.model_copy(update={"resume": str(tmp_path)}))
    monkeypatch.delenv("ORCHESTRATOR_TEST_JOB_PAUSE_S")
    assert result.losses[0][0] == done  # nothing before the checkpoint was trained again
    expected, _ = train_reference(load_job_code(path), iterations=60, global_batch=GLOBAL_BATCH)
    assert relative_error(result.model, expected) <= 1e-5


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "orchestrator", "train", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_train_cli_writes_weights_that_load_into_the_users_model(tmp_path: Path) -> None:
    """A job directory with a helper module, BatchNorm, RMSprop + OneCycleLR, an evaluate hook;
    pushes and pulls in bfloat16 (`--wire-precision bf16`; BatchNorm's buffers in their own
    partition, which travels in fp32: its counters stay exact)."""
    out = tmp_path / "out"
    run = _cli(
        str(JOBS / "bn_rmsprop"),
        "--nodes", "3", "--iterations", "100", "--global-batch", "64",
        "--inject", "evict@30", "--wire-precision", "bf16", "--partitions", "2",
        "--out", str(out),
        cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "evict t0 at iteration" in run.stdout  # the oldest transient node
    assert "bf16 on the wire: " in run.stdout and "less than fp32" in run.stdout
    summary = json.loads((out / "summary.json").read_text())
    wire = summary["wire"]
    assert wire["precision"] == "bf16" and wire["saved_bytes_per_worker_iteration"] > 0
    assert summary["iterations"] == 100 and summary["seconds_per_iteration"] > 0
    assert summary["mean_seconds_per_iteration"] > 0
    assert set(summary["phase_seconds"]) == {"wait", "pull", "compute", "push"}
    # the last iterations, not the last alone: BatchNorm normalises over each worker's share,
    # and some shares of a batch give a high loss in train mode (the last batch here, in 4
    # shares of 16: 6.2 and 11.6 on two of them, 0.0 whole on one process), as under DDP
    assert statistics.median(loss for _, loss in summary["losses"][-10:]) < 0.5
    assert summary["evaluation"]["held_out_accuracy"] >= 0.9
    # start-up (nodes joined, loaded, configured) reported apart from the training
    assert 0 < summary["startup_seconds"] < summary["wall_seconds"]
    assert re.search(r"in [\d.]+ s \(start-up [\d.]+ s, training [\d.]+ s\)", run.stdout)
    # the output says where the nodes' logs are; a node that ended well says so in its log
    assert f"the nodes' logs: {out / 'logs'}" in run.stdout
    reliable = (out / "logs" / "r0.log").read_text()
    for milestone in ("joined node=r0 tier=reliable", "loaded and ready", "ended node=r0 how=done"):
        assert milestone in reliable, reliable
    assert "how=left" in (out / "logs" / "t0.log").read_text()  # the evicted one
    # TensorBoard's files: the loss at every iteration, the evaluation at the last
    [events] = (out / "tensorboard").glob("events.out.tfevents.*")
    scalars = read_scalars(events)
    assert [step for tag, step, _ in scalars if tag == "train/loss"] == list(range(1, 101))
    accuracy = summary["evaluation"]["held_out_accuracy"]
    assert ("eval/held_out_accuracy", 100, pytest.approx(accuracy)) in scalars
    assert f"tensorboard --logdir {out / 'tensorboard'}" in run.stdout
    sys.path.insert(0, str(JOBS / "bn_rmsprop"))
    try:
        job = load_job_code(JOBS / "bn_rmsprop")
        model = job.model()
        weights = load_file(str(out / "model.safetensors"))
        assert sorted(weights) == sorted(model.state_dict())
        model.load_state_dict(weights)
        assert int(weights["1.num_batches_tracked"]) == 100  # buffers came back too
        assert not torch.equal(weights["1.running_mean"], torch.zeros(32))
    finally:
        sys.path.remove(str(JOBS / "bn_rmsprop"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nosuch.py"], "job file nosuch.py does not exist"),
        ([str(JOBS / "digits_sgd.py"), "--global-batch", "3"], "--global-batch 3 is smaller"),
        ([str(JOBS / "digits_sgd.py"), "--inject", "evict@"], "--inject: 'evict@' is not"),
    ],
)
def test_train_cli_refuses_bad_input_with_one_line_and_exit_2(
    tmp_path: Path, args: list[str], message: str
) -> None:
    run = _cli(*args, cwd=tmp_path)
    assert run.returncode == 2
    assert message in run.stderr and "Traceback" not in run.stderr
    assert os.listdir(tmp_path) == []  # nothing written


@pytest.mark.slow
def test_the_options_users_train_with_together_through_the_cli(tmp_path: Path) -> None:
    """Issue #36's check: a job with `scheduler(opt, total_iterations)` returning OneCycleLR
    (which raises one step past its total_steps: told the run's length, it runs to the end),
    trained with `--accumulate 2 --clip-grad-norm 1.0 --eval-every 50` through an eviction,
    has an evaluation every 50 iterations and TensorBoard's files, and classifies held-out
    data as well as the single-process loop without those options; its weights are the
    loop's with them."""
    out, path = tmp_path / "out", JOBS / "cancer_onecycle.py"
    run = _cli(
        str(path), "--nodes", "2", "--iterations", "150", "--global-batch", "32",
        "--accumulate", "2", "--clip-grad-norm", "1.0", "--eval-every", "50",
        "--inject", "evict@20", "--out", str(out), cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "runtime: evicted t0" in run.stdout, run.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["clip_grad_norm"] == 1.0 and summary["iterations"] == 150
    found = [e["iteration"] for e in summary["evaluations"]]
    during = found[:-1]  # and the end's, at 150
    assert found[-1] == 150 and len(during) >= 1, found
    assert all(b - a >= 50 for a, b in zip(during, during[1:], strict=False)), found
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    code = load_job_code(path)
    plain, _ = train_reference(code, iterations=150, global_batch=32)
    assert code.evaluate is not None
    baseline = code.evaluate(plain)["held_out_accuracy"]
    assert summary["evaluation"]["held_out_accuracy"] >= baseline - 0.02
    model = code.model()
    model.load_state_dict(load_file(str(out / "model.safetensors")))
    same, _ = train_reference(code, iterations=150, global_batch=32, accumulate=2,
                              clip_grad_norm=1.0)  # fmt: skip
    assert relative_error(model, same) <= 1e-5


@pytest.mark.slow
def test_rows_read_ahead_by_a_dataloader_are_the_rows_of_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dataset read item by item: each node's DataLoader processes (`loader_workers`, from a
    fork server: their parent is not the node) read most items, ahead of the computation,
    through an eviction (a roster change: a guess dropped); the weights are the single-process
    loop's, and no loader process outlives the run."""
    items = tmp_path / "items.txt"
    monkeypatch.setenv("ORCHESTRATOR_TEST_ITEMS_LOG", str(items))
    monkeypatch.setenv("ORCHESTRATOR_TEST_ITEM_S", "0.002")  # 24 ms a share: a decode
    path = JOBS / "digits_items.py"
    plan = TrainPlan(code=str(path), nodes=2, reliable=1, iterations=160, global_batch=36,
                     injections=tuple(parse_injections("evict@120")), loader_workers=2)  # fmt: skip
    result = train_locally(plan)
    me = str(os.getpid())
    reads = [line.split() for line in items.read_text().splitlines()]
    loaders = {pid for pid, parent in reads if pid != me and parent != me}
    by_loaders = sum(1 for pid, _ in reads if pid in loaders)
    # 2 per node, of the 3 nodes; each is up (torch and the job imported, one item read as it
    # starts) before its node is ready, however busy the machine: most of the job's rows are
    # read ahead (the nodes read the rest, and FlexRR helpers their helpees' rows)
    assert len(loaders) >= 2 * 2, loaders
    assert by_loaders - len(loaders) >= 0.75 * 160 * 36, by_loaders
    expected, _ = train_reference(load_job_code(path), iterations=160, global_batch=36)
    assert relative_error(result.model, expected) <= 1e-5
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in loaders):
        assert time.monotonic() < deadline, "a loader process outlived its node"
        time.sleep(0.2)
