"""Pipeline schedules (pure) and the stage runtime on real processes: Flush and GPipe equal
plain SGD on one process, 1F1B with weight stashing trains, 2BW keeps at most two versions."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from orchestrator.agileml.errors import AgileMLError
from orchestrator.agileml.pipeline.local import chain_layout, run_pipeline
from orchestrator.agileml.pipeline.schedule import Op, Schedule, stage_ops, stuck_worker
from orchestrator.agileml.pipeline.source import ChainModelSpec, build_chain, build_chain_data
from orchestrator.agileml.roster import global_batch_indices

SPEC = ChainModelSpec(features=16, hidden=32, classes=4, depth=4, samples=1024)
BOUNDS = chain_layout([(0, 1), (2, 3), (4, 6)])  # 7 modules (4 Linear + 3 ReLU) on 3 stages
RECOVERY_BOUND_S = 30.0


def _in_flight_max(ops: list[Op]) -> int:
    live, most = 0, 0
    for op in ops:
        live += 1 if op.kind == "F" else -1 if op.kind == "B" else 0
        most = max(most, live)
    return most


@pytest.mark.parametrize("schedule", list(Schedule))
@pytest.mark.parametrize("stage", [0, 1, 3])
def test_every_schedule_runs_each_minibatch_forward_then_backward_once(
    schedule: Schedule, stage: int
) -> None:
    ops = stage_ops(schedule, stages=4, stage=stage, minibatches=8, microbatches=4)
    forwards = [op.minibatch for op in ops if op.kind == "F"]
    backwards = [op.minibatch for op in ops if op.kind == "B"]
    assert sorted(forwards) == sorted(backwards) == list(range(8))
    for m in range(8):
        assert ops.index(Op("F", m)) < ops.index(Op("B", m))


def test_one_f_one_b_keeps_stages_minus_stage_in_flight() -> None:
    for stage in range(4):
        ops = stage_ops(Schedule.ONE_F_ONE_B, stages=4, stage=stage, minibatches=16, microbatches=1)
        assert _in_flight_max(ops) == 4 - stage  # the input stage admits NOAM = 4
        assert sum(op.kind == "U" for op in ops) == 16  # an update after every backward


def test_gpipe_keeps_a_whole_step_in_flight_and_flush_does_not() -> None:
    gpipe = stage_ops(Schedule.GPIPE, stages=4, stage=0, minibatches=8, microbatches=8)
    flush = stage_ops(Schedule.FLUSH, stages=4, stage=0, minibatches=8, microbatches=8)
    assert _in_flight_max(gpipe) == 8
    assert _in_flight_max(flush) == 4
    assert [op for op in gpipe if op.kind == "U"] == [Op("U", -1)]
    two_bw = stage_ops(Schedule.TWO_BW, stages=4, stage=0, minibatches=8, microbatches=4)
    assert sum(op.kind == "U" for op in two_bw) == 2


def test_bad_schedule_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple"):
        stage_ops(Schedule.FLUSH, stages=2, stage=0, minibatches=5, microbatches=2)
    with pytest.raises(ValueError, match="stage 2"):
        stage_ops(Schedule.GPIPE, stages=2, stage=2, minibatches=4, microbatches=2)


def _sgd_reference(steps: int, microbatches: int, size: int, lr: float) -> torch.Tensor:
    model = build_chain(SPEC, 0)
    x, y = build_chain_data(SPEC)
    for k in range(steps):
        rows = global_batch_indices(0, k, len(x), microbatches * size)
        model.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[rows]), y[rows], reduction="sum")
        (loss / (microbatches * size)).backward()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-lr)  # type: ignore[arg-type]
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("schedule", [Schedule.FLUSH, Schedule.GPIPE])
def test_flush_schedules_equal_plain_sgd_on_one_process(schedule: Schedule) -> None:
    result = run_pipeline(
        model=SPEC,
        layout=BOUNDS,
        schedule=schedule,
        minibatches=12,
        microbatches=4,
        microbatch_size=8,
        lr=0.1,
        timeout_s=120,
    )
    expected = _sgd_reference(steps=3, microbatches=4, size=8, lr=0.1)
    assert torch.allclose(result.weights, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("schedule", "vertical_sync"),
    [(Schedule.ONE_F_ONE_B, False), (Schedule.ONE_F_ONE_B, True), (Schedule.TWO_BW, False)],
)
def test_asynchronous_schedules_train(schedule: Schedule, vertical_sync: bool) -> None:
    result = run_pipeline(
        model=SPEC,
        layout=BOUNDS,
        schedule=schedule,
        minibatches=60,
        microbatches=3,
        microbatch_size=16,
        lr=0.6
        if schedule is Schedule.TWO_BW
        else 0.2,  # 2BW steps once per 3 microbatches (their mean)
        vertical_sync=vertical_sync,
        timeout_s=120,
    )
    losses = result.losses
    assert len(losses) == 60
    assert sum(losses[-10:]) / 10 < 0.8 * sum(losses[:10]) / 10
    if schedule is Schedule.TWO_BW:
        assert all(s["versions_kept_max"] <= 2 for s in result.stages), result.stages


def test_boundaries_that_skip_layers_are_refused() -> None:
    with pytest.raises(AgileMLError, match="cover"):
        run_pipeline(model=SPEC, layout=chain_layout([(0, 2), (4, 6)]), schedule=Schedule.GPIPE,
                     minibatches=2, microbatches=2)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("replan", "how", "mode", "notice"),
    [
        (None, "stage", "stage", False),
        (None, "restart", "restart", False),
        (lambda nodes: chain_layout([(0, 3), (4, 6)]), "stage", "restart", False),
        (None, "stage", "stage", True),
        (lambda nodes: chain_layout([(0, 3), (4, 6)]), "stage", "restart", True),
    ],
    ids=[
        "stage_only_on_a_replacement",
        "whole_restart_on_a_replacement",
        "replanned",
        "notice_stage_only",
        "notice_replanned",
    ],
)
def test_stage_evicted_mid_run_is_recreated_from_its_backup_and_ends_exact(  # type: ignore[no-untyped-def]
    replan, how: str, mode: str, notice: bool
) -> None:
    """Stage 1 is SIGKILLed after step 2: the job resumes from the last step every stage backed
    up, replays the interrupted step, and ends where plain SGD does, whether the lost stage
    alone is replaced (the others rewind in place) or every stage restarts."""
    result = run_pipeline(
        recovery=how,  # type: ignore[arg-type]
        notice=notice,
        model=SPEC,
        layout=BOUNDS,
        schedule=Schedule.FLUSH,
        minibatches=24,
        microbatches=4,
        microbatch_size=8,
        lr=0.1,
        backup=True,
        evict=(1, 8),
        replan=replan,
        timeout_s=120,
    )
    assert len(result.recoveries) == 1
    recovery = result.recoveries[0]
    assert (recovery.mode, recovery.notice) == (mode, notice)
    if notice:  # it left after backing up its next update: nothing it computed is redone
        assert recovery.stage == 1 and recovery.resumed_minibatch >= 8
    else:  # the killed stage may not have sent its copy of step 2 yet
        assert recovery.stage == 1 and recovery.resumed_minibatch in (4, 8)
    # bounded, not timed: a replacement process starts (Python and torch imported), seconds
    # on a busy machine; benchmarks/pipeline_elastic.py measures it
    assert recovery.seconds is not None and recovery.seconds < RECOVERY_BOUND_S
    if replan is not None:
        assert recovery.layout == chain_layout([(0, 3), (4, 6)])
    assert len(result.losses) == 24
    expected = _sgd_reference(steps=6, microbatches=4, size=8, lr=0.1)
    assert torch.allclose(result.weights, expected, atol=1e-6, rtol=0)


def test_eviction_needs_backups() -> None:
    with pytest.raises(AgileMLError, match="backup"):
        run_pipeline(model=SPEC, layout=BOUNDS, schedule=Schedule.FLUSH, minibatches=4,
                     microbatches=2, evict=(0, 1))  # fmt: skip


def test_reliable_copy_keeps_the_last_step_every_stage_backed_up_in_layer_order() -> None:
    """After a re-plan the layout changes; the copy is one flat vector in layer order, so a
    step completed under the old layout still counts for the next recovery."""
    from orchestrator.agileml.pipeline.launch import Backups

    backups = Backups()
    backups.add(1, 0, 2, np.array([1.0], dtype=np.float32))
    assert backups.done == 0 and backups.weights is None  # stage 1 has not backed up step 1
    backups.add(1, 1, 2, np.array([2.0, 3.0], dtype=np.float32))
    assert backups.done == 1 and backups.weights.tolist() == [1.0, 2.0, 3.0]
    backups.add(2, 0, 2, np.array([9.0], dtype=np.float32))
    backups.forget_partial()  # a stage died before step 2 was complete
    backups.add(2, 0, 3, np.array([4.0], dtype=np.float32))  # re-planned onto 3 stages
    assert backups.done == 1  # step 2 is not complete under the new layout yet


def test_two_bw_with_fewer_microbatches_than_stages_is_refused() -> None:
    with pytest.raises(AgileMLError, match="2bw"):
        run_pipeline(model=SPEC, layout=BOUNDS, schedule=Schedule.TWO_BW, minibatches=4,
                     microbatches=2)  # fmt: skip


# --- replicated stages (1F1B-RR) ---


@pytest.mark.parametrize("schedule", list(Schedule))
@pytest.mark.parametrize("replicas", [(2, 1), (1, 3), (3, 1, 2), (2, 2), (4,), (1, 2, 1, 3)])
def test_replicated_layouts_never_deadlock(schedule: Schedule, replicas: tuple[int, ...]) -> None:
    assert stuck_worker(schedule, replicas=replicas, minibatches=48, microbatches=4) is None


def test_a_deadlocking_order_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator.agileml.pipeline import schedule as module

    def backward_first(*args: object, **kwargs: object) -> list[Op]:
        return [Op("B", 0), Op("F", 0)]  # a backward before its forward

    monkeypatch.setattr(module, "stage_ops", backward_first)
    assert stuck_worker(Schedule.ONE_F_ONE_B, replicas=(1, 1), minibatches=1, microbatches=1) == (
        0, 0, Op("B", 0)
    )  # fmt: skip


def test_replicas_split_minibatches_round_robin_and_the_input_stage_admits_one_per_worker() -> None:
    replicas = (2, 1, 1)  # 4 workers; NOAM = ceil(4 / 2) = 2 per input replica
    for r in range(2):
        ops = stage_ops(Schedule.ONE_F_ONE_B, stages=3, stage=0, minibatches=16, microbatches=1,
                        replicas=replicas, replica=r)  # fmt: skip
        assert {op.minibatch for op in ops if op.kind != "U"} == set(range(r, 16, 2))
        assert _in_flight_max(ops) == 2
        assert sum(op.kind == "U" for op in ops) == 8  # one update per own minibatch
    with pytest.raises(ValueError, match="multiple of 2"):
        stage_ops(Schedule.ONE_F_ONE_B, stages=3, stage=0, minibatches=15, microbatches=1,
                  replicas=replicas, replica=0)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("schedule", "replicas"),
    [(Schedule.FLUSH, [2, 1, 1]), (Schedule.GPIPE, [1, 1, 3])],
)
def test_replicated_flush_equals_plain_sgd_and_replicas_agree(
    schedule: Schedule, replicas: list[int]
) -> None:
    result = run_pipeline(
        model=SPEC,
        layout=chain_layout([(0, 1), (2, 3), (4, 6)], replicas),
        schedule=schedule,
        minibatches=12,
        microbatches=4,
        microbatch_size=8,
        lr=0.1,
        timeout_s=120,
    )
    assert len(result.stages) == sum(replicas)
    expected = _sgd_reference(steps=3, microbatches=4, size=8, lr=0.1)
    assert torch.allclose(result.weights, expected, atol=1e-6, rtol=0)
    for stage in range(3):
        digests = {r["weights_sha256"] for r in result.stages if r["stage"] == stage}
        assert len(digests) == 1  # the replicas of a stage hold the same bits
    outputs = [r for r in result.stages if r["stage"] == 2]
    for r in outputs:  # round-robin: each output replica computed the loss of its own share
        assert all(m % len(outputs) == r["replica"] for m in r["loss_minibatches"])
    assert len(result.losses) == 12


def test_replicated_one_f_one_b_trains_with_replicas_in_step() -> None:
    result = run_pipeline(
        model=SPEC,
        layout=chain_layout([(0, 3), (4, 6)], [2, 1]),
        schedule=Schedule.ONE_F_ONE_B,
        minibatches=60,
        microbatch_size=16,
        lr=0.2,
        timeout_s=120,
    )
    assert len(result.losses) == 60
    assert sum(result.losses[-10:]) / 10 < 0.8 * sum(result.losses[:10]) / 10
    inputs = [r for r in result.stages if r["stage"] == 0]
    assert len(inputs) == 2 and inputs[0]["weights_sha256"] == inputs[1]["weights_sha256"]


@pytest.mark.slow
def test_eviction_of_a_replicated_stage_replans_with_the_planner() -> None:
    """4 workers as stages of 2+1+1 replicas; one of stage 0's workers is killed and the
    planner lays the job out on the 3 left; the result still equals plain SGD."""
    from orchestrator.agileml.pipeline.planner import plan
    from orchestrator.agileml.pipeline.profiler import LayerProfile, ModelProfile

    profile = ModelProfile(
        layers=[
            LayerProfile(
                name=f"l{i}",
                forward_ms=1.0,
                backward_ms=2.0,
                activation_bytes=1000,
                parameter_bytes=1000,
            )
            for i in range(7)
        ]
    )

    def replan(nodes: int):  # type: ignore[no-untyped-def]
        return plan(profile, nodes, 1e9, stages=3).stages

    result = run_pipeline(
        model=SPEC,
        layout=chain_layout([(0, 1), (2, 3), (4, 6)], [2, 1, 1]),
        schedule=Schedule.FLUSH,
        minibatches=24,
        microbatches=4,
        microbatch_size=8,
        lr=0.1,
        backup=True,
        evict=(0, 8),
        replan=replan,
        timeout_s=120,
    )
    (recovery,) = result.recoveries
    assert recovery.stage == 0
    assert [st.replicas for st in recovery.layout] == [1, 1, 1]
    assert len(result.stages) == 3
    expected = _sgd_reference(steps=6, microbatches=4, size=8, lr=0.1)
    assert torch.allclose(result.weights, expected, atol=1e-6, rtol=0)


def test_a_kill_takes_every_worker_of_the_node_and_the_job_replans_without_it() -> None:
    """Nodes of 2 devices running the same 2-stage sub-pipeline side by side (slots (0, 2)
    and (1, 3): node 0 holds replica 0 of both stages). The kill at stage 0 takes node 0 and
    with it a worker of stage 1 too: the job re-plans for the 1 node left, and flush ends as
    plain SGD does."""
    from orchestrator.agileml.pipeline.planner import PlannedStage

    asked: list[int] = []

    def replan(nodes: int):  # type: ignore[no-untyped-def]
        asked.append(nodes)
        return chain_layout([(0, 3), (4, 6)])  # one node: a worker of each stage

    side_by_side = (
        PlannedStage(first_layer=0, last_layer=3, replicas=2, slots=(0, 2)),
        PlannedStage(first_layer=4, last_layer=6, replicas=2, slots=(1, 3)),
    )
    result = run_pipeline(
        model=SPEC, layout=side_by_side, schedule=Schedule.FLUSH, minibatches=24,
        microbatches=4, microbatch_size=8, lr=0.1, backup=True, evict=(0, 8),
        replan=replan, timeout_s=120, devices_per_node=2,
    )  # fmt: skip
    assert asked == [1]  # two of its workers gone, one node lost
    (recovery,) = result.recoveries
    assert [st.replicas for st in recovery.layout] == [1, 1]
    expected = _sgd_reference(steps=6, microbatches=4, size=8, lr=0.1)
    assert torch.allclose(result.weights, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize(("slots", "per_node"), [(((0, 1), (1, 2)), 2), (((0, 1), (2, 3)), 3)])
def test_a_placement_that_misses_a_slot_or_splits_a_node_is_refused(
    slots: tuple[tuple[int, ...], ...], per_node: int
) -> None:
    from orchestrator.agileml.pipeline.planner import PlannedStage

    layout = tuple(PlannedStage(first_layer=a, last_layer=b, replicas=2, slots=s)
                   for (a, b), s in zip([(0, 3), (4, 6)], slots, strict=True))  # fmt: skip
    with pytest.raises(AgileMLError, match="do not place their 4 workers on nodes of"):
        run_pipeline(model=SPEC, layout=layout, schedule=Schedule.FLUSH, minibatches=4,
                     devices_per_node=per_node)  # fmt: skip


def test_vertical_sync_with_replicated_stages_is_refused() -> None:
    with pytest.raises(AgileMLError, match="vertical_sync"):
        run_pipeline(model=SPEC, layout=chain_layout([(0, 3), (4, 6)], [2, 1]),
                     schedule=Schedule.ONE_F_ONE_B, minibatches=4, vertical_sync=True)  # fmt: skip
    with pytest.raises(AgileMLError, match="multiple of 2"):
        run_pipeline(model=SPEC, layout=chain_layout([(0, 3), (4, 6)], [2, 1]),
                     schedule=Schedule.ONE_F_ONE_B, minibatches=5)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("schedule", "layout", "cut"),
    [
        (Schedule.ONE_F_ONE_B, BOUNDS, 1),
        (Schedule.TWO_BW, BOUNDS, 3),  # every stage updates on 3 microbatches
        (Schedule.ONE_F_ONE_B, chain_layout([(0, 3), (4, 6)], [2, 1]), 2),  # 2 replicas: pairs
    ],
    ids=["1f1b", "2bw", "1f1b_rr"],
)
def test_asynchronous_schedules_recover_from_an_eviction_close_to_the_run_without(
    schedule: Schedule, layout: tuple, cut: int
) -> None:
    """1F1B and 2BW resume every stage from the last minibatch count all stages backed up and
    refill the pipeline: every minibatch is trained, and the loss ends within noise of the
    run without the eviction."""
    common = dict(
        model=SPEC,
        layout=layout,
        schedule=schedule,
        minibatches=60,
        microbatches=3,
        microbatch_size=16,
        lr=0.6 if schedule is Schedule.TWO_BW else 0.2,
        backup=True,
        timeout_s=120,
    )
    plain = run_pipeline(**common)  # type: ignore[arg-type]
    evicted = run_pipeline(**common, evict=(len(layout) - 1, 24))  # type: ignore[arg-type]
    (recovery,) = evicted.recoveries
    # a cut every stage backed up (the input stage may back up a few more before the kill
    # lands): a common multiple of the stages' update groups
    assert 0 < recovery.resumed_minibatch <= 30 and recovery.resumed_minibatch % cut == 0
    assert recovery.seconds is not None and recovery.seconds < RECOVERY_BOUND_S
    assert len(evicted.losses) == 60
    tail_plain, tail_evicted = sum(plain.losses[-10:]) / 10, sum(evicted.losses[-10:]) / 10
    assert tail_evicted < 0.8 * sum(evicted.losses[:10]) / 10  # it kept learning
    assert abs(tail_evicted - tail_plain) < 0.15 * tail_plain
    assert float((plain.weights - evicted.weights).abs().max()) < 0.5


@pytest.mark.parametrize("schedule", [Schedule.ONE_F_ONE_B, Schedule.TWO_BW])  # flush: as train
def test_a_stage_tells_the_jobs_scheduler_the_updates_it_makes(schedule: Schedule) -> None:
    """Issue #36, item 1: a `scheduler(optimizer, total_iterations)` (a OneCycleLR, which
    raises one step past its total) is told the updates its stage makes in the run, whatever
    the schedule groups into one update (1f1b: a minibatch per replica; 2bw: M per replica)."""
    job = Path(__file__).parents[2] / "support" / "jobs" / "cancer_onecycle.py"
    result = run_pipeline(code=str(job), layout=chain_layout([(0, 0), (1, 2)], [2, 1]),
                          schedule=schedule, minibatches=40, microbatches=4,
                          microbatch_size=8)  # fmt: skip
    assert len(result.losses) == 40 and all(math.isfinite(v) for v in result.losses)
