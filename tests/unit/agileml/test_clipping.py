"""Gradient clipping by the global norm over partitions (`clipping`): the partitions' squared
norms and the coefficient they give equal `clip_grad_norm_` on the whole model, a complete
clock waits for its coefficient, and the coefficient travels with the partition."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from orchestrator.agileml.clipping import (
    NormAnswer,
    answer_from_tensors,
    coefficient,
    squared_norm,
)
from orchestrator.agileml.partition_state import PartitionStore
from orchestrator.agileml.partitions import PartitionLayout
from orchestrator.agileml.rejections import RejectedError
from orchestrator.agileml.snapshots import snapshot_from_wire, snapshot_to_wire
from orchestrator.agileml.spec import TrainingSpec
from orchestrator.agileml.updates import OptimizerPlan, OptimizerRule
from orchestrator.agileml.wire import Header, MessageKind

MAX_NORM = 0.7
PARTS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Linear(7, 3))


def _optimizer(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)  # type: ignore[arg-type]


def _stores(model: nn.Module) -> tuple[PartitionLayout, list[PartitionStore]]:
    layout = PartitionLayout(model, PARTS)  # partitions cut through tensors and buffers
    plan = OptimizerPlan.from_model(model, _optimizer, None, layout.buffer_sizes)
    stores = []
    for p, values in enumerate(layout.gather(model)):
        store = PartitionStore(plan.rules(layout.bounds))
        store.add(p, values)
        store.register_workers(["w0", "w1"])
        store.set_clipping(True)
        stores.append(store)
    return layout, stores


def _push(
    layout: PartitionLayout, stores: list[PartitionStore], clock: int, g: torch.Tensor
) -> None:
    for p, store in enumerate(stores):
        half = g[layout.slice(p)] / 2
        store.apply_push(p, "w0", clock, half.clone())
        store.apply_push(p, "w1", clock, half.clone())


def _clip(stores: list[PartitionStore], clock: int) -> float:
    """What a worker does: the squared norms, the coefficient, sent to every partition."""
    answers = [s.norm_answer(p, clock) for p, s in enumerate(stores)]
    assert all(a is not None and a.sq_norm is not None for a in answers), answers
    coef = coefficient([a.sq_norm or 0.0 for a in answers if a is not None], MAX_NORM)
    for p, store in enumerate(stores):
        store.set_coefficient(p, clock, coef)
    return coef


def test_partitioned_clipping_equals_clip_grad_norm_on_the_whole_model() -> None:
    """Gradients of every size (clipped hard, a little, not at all); the buffers' changes are
    neither measured nor scaled; momentum carries the clipped gradients on."""
    model, expected = _model(), _model()
    layout, stores = _stores(model)
    opt = _optimizer(expected.parameters())
    params = sum(p.numel() for p in expected.parameters())
    coefs = []
    for clock, size in enumerate([5.0, 0.8, 0.01, 3.0]):
        g = torch.randn(layout.total, generator=torch.Generator().manual_seed(clock)) * size
        g[params:] = 1e6  # buffer changes: huge, and left out of the norm
        _push(layout, stores, clock, g)
        assert all(s.consistent_clock(p) == clock - 1 for p, s in enumerate(stores))
        coefs.append(_clip(stores, clock))
        assert all(s.consistent_clock(p) == clock for p, s in enumerate(stores))
        offset = 0
        for p in expected.parameters():
            p.grad = g[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        nn.utils.clip_grad_norm_(expected.parameters(), MAX_NORM)
        opt.step()
    assert coefs[0] < 0.5 and coefs[2] == 1.0, coefs
    got = torch.cat([s.values(p) for p, s in enumerate(stores)])
    want = torch.cat([p.detach().reshape(-1) for p in expected.parameters()])
    torch.testing.assert_close(got[:params], want, rtol=1e-6, atol=1e-7)


def test_a_norm_is_answered_once_the_clock_is_complete_then_with_its_coefficient() -> None:
    layout, stores = _stores(_model())
    store = stores[0]
    g = torch.ones(layout.total)
    store.apply_push(0, "w0", 0, g[layout.slice(0)].clone())
    assert store.norm_answer(0, 0) is None  # w1 has not pushed: held
    store.apply_push(0, "w1", 0, g[layout.slice(0)].clone())
    answer = store.norm_answer(0, 0)
    assert answer is not None and answer.sq_norm is not None and answer.coef is None
    store.set_coefficient(0, 0, 0.25)
    store.set_coefficient(0, 0, 0.5)  # a later one changes nothing
    assert store.norm_answer(0, 0) == NormAnswer(coef=0.25)
    assert store.consistent_clock(0) == 0


def test_the_coefficient_travels_in_a_snapshot_and_on_the_wire() -> None:
    layout, stores = _stores(_model())
    g = torch.ones(layout.total)
    _push(layout, stores, 0, g)
    stores[1].set_coefficient(1, 0, 0.5)
    _push(layout, stores, 1, g)
    stores[1].set_coefficient(1, 1, 0.25)
    moved = PartitionStore(stores[1]._rules)  # noqa: SLF001 (the same rules)
    moved.set_clipping(True)
    snapshot = stores[1].export_partition(1)
    assert snapshot.coefs == ((0, 0.5), (1, 0.25))
    workers, tensors = snapshot_to_wire(snapshot)
    header = Header(v=3, kind=MessageKind.HANDOFF, job_id="j", sender="s", seq=1, partition=1,
                    workers=tuple(workers))  # fmt: skip
    moved.import_partition(snapshot_from_wire(header, tensors))
    assert moved.norm_answer(1, 1) == NormAnswer(coef=0.25)
    assert torch.equal(moved.values(1), stores[1].values(1))
    tensors["coefs"] = torch.tensor([0.5, 3.0], dtype=torch.float64)  # not a coefficient
    with pytest.raises(RejectedError):
        snapshot_from_wire(header, tensors)


def test_squared_norms_and_hostile_replies() -> None:
    g = torch.arange(10, dtype=torch.float32)
    assert squared_norm(g, [slice(0, 3), slice(5, 7)]) == pytest.approx(0 + 1 + 4 + 25 + 36)
    assert coefficient([float("nan"), 1.0], 1.0) == 1.0  # fp16 then skips the step
    assert coefficient([0.0], 1.0) == 1.0
    assert answer_from_tensors({}) == NormAnswer()
    for bad in (
        {"coef": torch.tensor([2.0], dtype=torch.float64)},
        {"coef": torch.tensor([-0.5], dtype=torch.float64)},
        {"sq_norm": torch.tensor([-1.0], dtype=torch.float64)},
        {"sq_norm": torch.tensor([1.0], dtype=torch.float32)},
        {"other": torch.tensor([1.0], dtype=torch.float64)},
    ):
        with pytest.raises(ValueError):
            answer_from_tensors(bad)


def test_rules_measure_parameters_only() -> None:
    model = _model()
    layout = PartitionLayout(model, 1)
    plan = OptimizerPlan.from_model(model, _optimizer, None, layout.buffer_sizes)
    rule = OptimizerRule(plan, layout.bounds(0), layout.gather(model)[0])
    covered = sum(s.stop - s.start for s in rule.gradient_slices())
    assert covered == sum(p.numel() for p in model.parameters())


def test_the_option_is_bounded_bulk_synchronous_and_data_parallel_only() -> None:
    assert TrainingSpec(job_id="j", clip_grad_norm=1.0).clip_grad_norm == 1.0
    for bad in (0.0, -1.0, float("inf"), float("nan"), 1e10):
        with pytest.raises(ValidationError, match="clip_grad_norm"):
            TrainingSpec(job_id="j", clip_grad_norm=bad)
    with pytest.raises(ValidationError, match="slack 0"):
        TrainingSpec(job_id="j", clip_grad_norm=1.0, slack=1, horizon_clocks=8)
    with pytest.raises(ValidationError, match="data-parallel"):
        TrainingSpec(job_id="j", code="job.py", parallelism="pipeline", clip_grad_norm=1.0)


def test_a_paramservs_own_backup_copy_learns_a_waiting_clocks_coefficient_after_its_handoff() -> (
    None
):
    """A ParamServ hands a partition to a new ActivePS while a complete clock waits for its
    coefficient, and keeps the state as its backup copy: the new owner streams that clock
    (with its coefficient) once applied, and the copy applies it too (else it would hold
    every later clock back for good)."""
    layout, (old, *_) = _stores(_model())
    g = torch.ones(layout.total)[layout.slice(0)]
    old.apply_push(0, "w0", 0, g.clone())
    old.apply_push(0, "w1", 0, g.clone())  # complete; no coefficient yet
    snapshot = old.export_partition(0)
    handed = replace(snapshot, pending=old.complete_unapplied(0))
    new, copy = PartitionStore(old._rules), PartitionStore(old._rules, spare_sums=0)  # noqa: SLF001
    for store in (new, copy):
        store.set_clipping(True)
    new.import_partition(handed)
    copy.import_partition(snapshot, restore=True)
    assert new.set_coefficient(0, 0, 0.5)
    (chunk,) = new.take_streamable(0)
    assert (chunk.clock, chunk.coef) == (0, 0.5)
    assert copy.apply_chunk(0, 0, chunk.workers, chunk.delta, chunk.coef).value == "duplicate"
    assert copy.consistent_clock(0) == new.consistent_clock(0) == 0
    assert torch.equal(copy.values(0), new.values(0))


def test_a_coefficient_waits_for_a_complete_clock_and_may_be_zero() -> None:
    layout, (store, *_) = _stores(_model())
    g = torch.ones(layout.total)[layout.slice(0)]
    store.apply_push(0, "w0", 0, g.clone())
    assert not store.set_coefficient(0, 0, 0.5)  # w1 has not pushed: refused
    store.apply_push(0, "w1", 0, g.clone())
    assert store.complete_through(0) == -1  # complete, but not applicable yet
    assert store.set_coefficient(0, 0, 0.0)  # torch zeroes a gradient past float32's range
    assert coefficient([1e78], 1.0) == 0.0
    assert store.consistent_clock(0) == 0
