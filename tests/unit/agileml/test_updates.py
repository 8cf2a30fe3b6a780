"""The parameter servers' update rules: the user's optimizer run per partition must equal the
same optimizer run on the whole model, and its state must survive a trip through bytes."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from orchestrator.agileml.errors import AgileMLError, PartitionError
from orchestrator.agileml.partition_state import SPARE_SUMS, PartitionStore
from orchestrator.agileml.partitions import PartitionLayout
from orchestrator.agileml.updates import OptimizerPlan, OptimizerRule

STEPS = 12


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _two_groups(params: Any) -> list[dict[str, Any]]:
    params = list(params)
    return [
        {"params": [p for p in params if p.dim() > 1], "weight_decay": 0.01},
        {"params": [p for p in params if p.dim() == 1], "weight_decay": 0.0, "lr": 0.05},
    ]


OPTIMIZERS: dict[str, tuple[Callable[[Any], torch.optim.Optimizer], Any]] = {
    "sgd-nesterov-groups": (
        lambda ps: torch.optim.SGD(_two_groups(ps), lr=0.1, momentum=0.9, nesterov=True),
        None,
    ),
    "adamw-cosine": (
        lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
        lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS),
    ),
    "adam-amsgrad-onecycle": (
        lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True),
        lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS),
    ),
    "rmsprop-momentum": (lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5), None),
    "adagrad": (lambda ps: torch.optim.Adagrad(ps, lr=0.1), None),
}


def _grads(layout: PartitionLayout, step: int) -> torch.Tensor:
    return torch.randn(layout.total, generator=torch.Generator().manual_seed(step))


def _reference(optimizer: Any, scheduler: Any, steps: int) -> nn.Module:
    model = _model()
    layout = PartitionLayout(model, 1)
    opt = optimizer(model.parameters())
    sched = scheduler(opt) if scheduler is not None else None
    for step in range(steps):
        flat = _grads(layout, step)
        offset = 0
        for p in model.parameters():
            p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        opt.step()
        if sched is not None:
            sched.step()
    return model


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_partitioned_optimizer_equals_the_whole_model_optimizer(name: str) -> None:
    optimizer, scheduler = OPTIMIZERS[name]
    model = _model()
    layout = PartitionLayout(model, 4)  # partitions cut through the parameter tensors
    plan = OptimizerPlan.from_model(model, optimizer, scheduler)
    parts = layout.gather(model)
    rules = [OptimizerRule(plan, layout.bounds(p), parts[p]) for p in range(4)]
    for step in range(STEPS):
        grad = _grads(layout, step)
        for p, rule in enumerate(rules):
            rule.apply(grad[layout.slice(p)].clone())
    layout.scatter(model, parts)
    expected = _reference(optimizer, scheduler, STEPS)
    for got, want in zip(model.parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["adamw-cosine", "sgd-nesterov-groups"])
def test_optimizer_state_travels_as_bytes_and_the_run_continues_exactly(name: str) -> None:
    optimizer, scheduler = OPTIMIZERS[name]
    model = _model()
    layout = PartitionLayout(model, 2)
    plan = OptimizerPlan.from_model(model, optimizer, scheduler)
    bounds = layout.bounds(1)
    steady, moved = layout.gather(model)[1], layout.gather(model)[1]
    a = OptimizerRule(plan, bounds, steady)
    b = OptimizerRule(plan, bounds, moved)
    for step in range(STEPS):
        grad = _grads(layout, step)[layout.slice(1)]
        a.apply(grad.clone())
        b.apply(grad.clone())
        if step == 5:  # hand partition 1 over: values and state to a fresh rule
            values = moved.clone()
            b = OptimizerRule(plan, bounds, values)
            b.load_state(a.state())
            moved = values
    assert torch.equal(steady, moved)


def test_store_applies_a_clock_once_with_its_optimizer_after_a_mid_clock_handoff() -> None:
    optimizer, scheduler = OPTIMIZERS["adamw-cosine"]
    model = _model()
    layout = PartitionLayout(model, 1)
    plan = OptimizerPlan.from_model(model, optimizer, scheduler)
    rules = plan.rules(layout.bounds)
    initial = layout.gather(model)[0]
    still, first = PartitionStore(rules), PartitionStore(rules)
    for store in (still, first):
        store.add(0, initial)
        store.register_workers(["w0", "w1"])
    half = _grads(layout, 0) / 2
    for store in (still, first):
        store.apply_push(0, "w0", 0, half.clone())
        store.apply_push(0, "w1", 0, half.clone())
        store.apply_push(0, "w0", 1, half.clone())  # clock 1: w1 missing
    second = PartitionStore(rules)
    second.import_partition(first.export_partition(0))
    for store in (still, second):
        store.apply_push(0, "w1", 1, half.clone())
        assert store.apply_push(0, "w0", 1, half.clone()).value == "duplicate"
    assert still.consistent_clock(0) == second.consistent_clock(0) == 1
    assert torch.equal(still.values(0), second.values(0))
    expected = _reference(optimizer, scheduler, 0)  # the same two clocks on the whole model
    opt = optimizer(expected.parameters())
    sched = scheduler(opt)
    for _ in range(2):
        offset = 0
        for p in expected.parameters():
            p.grad = (2 * half)[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        opt.step()
        sched.step()
    torch.testing.assert_close(second.values(0), layout.gather(expected)[0], rtol=1e-6, atol=1e-7)


def test_buffers_move_by_the_summed_pushes_and_the_optimizer_leaves_them_alone() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    layout = PartitionLayout(model, 2)
    assert layout.buffer_sizes == (4, 4, 1)  # running_mean, running_var, num_batches_tracked
    plan = OptimizerPlan.from_model(
        model, lambda ps: torch.optim.SGD(ps, lr=1.0), None, layout.buffer_sizes
    )
    flat = torch.cat(layout.gather(model))
    parts = layout.gather(model)
    rules = [OptimizerRule(plan, layout.bounds(p), parts[p]) for p in range(2)]
    push = torch.ones(layout.total)
    for p, rule in enumerate(rules):
        rule.apply(push[layout.slice(p)].clone())
    after = torch.cat(parts)
    torch.testing.assert_close(
        after - flat, torch.cat([-push[: layout.param_total], push[layout.param_total :]])
    )
    layout.scatter(model, parts)
    assert int(model[1].num_batches_tracked) == 1


def test_an_optimizer_that_is_not_elementwise_is_refused() -> None:
    with pytest.raises(AgileMLError, match="LBFGS is not supported"):
        OptimizerPlan.from_model(_model(), lambda ps: torch.optim.LBFGS(ps), None)


def test_a_state_that_does_not_fit_is_refused() -> None:
    model = _model()
    layout = PartitionLayout(model, 2)
    plan = OptimizerPlan.from_model(model, lambda ps: torch.optim.Adam(ps), None)
    rule = OptimizerRule(plan, layout.bounds(0), layout.gather(model)[0])
    with pytest.raises(AgileMLError, match="does not fit"):
        rule.load_state(b"not a torch archive")


def test_a_backup_holds_clocks_back_and_rewinds_to_a_common_clock_with_its_optimizer() -> None:
    """A BackupPS under a ceiling sums the clocks past it without applying them, so a
    roll-back can restore it at any complete clock: the state of a run stopped there."""
    optimizer, scheduler = OPTIMIZERS["adamw-cosine"]
    model = _model()
    layout = PartitionLayout(model, 1)
    rules = OptimizerPlan.from_model(model, optimizer, scheduler).rules(layout.bounds)
    initial = layout.gather(model)[0]
    backup, plain = PartitionStore(rules), PartitionStore(rules)
    for store in (backup, plain):
        store.add(0, initial)
        store.register_workers(["w0"])
    backup.set_ceiling(1)
    for clock in range(5):
        backup.apply_chunk(0, clock, ["w0"], _grads(layout, clock))
    assert (backup.consistent_clock(0), backup.complete_through(0)) == (1, 4)
    backup.rewind_to(0, 3)
    for clock in range(4):
        plain.apply_push(0, "w0", clock, _grads(layout, clock))
    assert backup.consistent_clock(0) == 3
    assert torch.equal(backup.values(0), plain.values(0))
    assert backup.export_partition(0).rule_state == plain.export_partition(0).rule_state
    assert not backup.is_applied(0, "w0", 4)  # clock 4 will be pushed again after the roll-back
    with pytest.raises(PartitionError, match="cannot rewind to clock 2"):
        backup.rewind_to(0, 2)  # clock 3 is applied already
    with pytest.raises(PartitionError, match="cannot rewind to clock 5"):
        backup.rewind_to(0, 5)  # clock 4 and 5 are missing


def test_without_a_common_clock_a_backup_restores_at_its_own_complete_clock() -> None:
    """The roll-back's fallback: the snapshot holds exactly the clocks it says it holds, so
    the clock the owner reports is the one it is at (no held-back clock applied on import)."""
    model = _model()
    layout = PartitionLayout(model, 1)
    backup = PartitionStore()
    backup.add(0, layout.gather(model)[0])
    backup.register_workers(["w0", "w1"])
    backup.set_ceiling(1)
    for clock in range(4):
        backup.apply_chunk(0, clock, ["w0", "w1"], torch.ones(layout.total))
    backup.apply_chunk(0, 4, ["w0"], torch.ones(layout.total))  # clock 4: w1 missing
    backup.rewind_to(0, backup.complete_through(0))
    snapshot = backup.export_partition(0)
    owner = PartitionStore()
    owner.import_partition(snapshot, restore=True)
    assert snapshot.consistent == owner.consistent_clock(0) == 3
    assert not owner.is_applied(0, "w0", 4)  # pushed again after the roll-back


def test_a_clocks_sum_goes_into_an_applied_clocks_buffer_and_never_aliases_a_push() -> None:
    """A clock's pushes are summed into the buffer of a clock applied before (no fresh
    tensor per clock), yet a push is copied in: a sender reusing its buffer changes nothing."""
    store = PartitionStore()
    store.add(0, torch.zeros(6))
    store.register_workers(["w0", "w1"])
    buffer, want = torch.empty(6), torch.zeros(6)
    reused = []
    for clock in range(5):
        for worker in ("w0", "w1"):
            buffer.fill_(clock + 1)  # the sender's one buffer, refilled for each push
            store.apply_push(0, worker, clock, buffer)
            want += clock + 1
            buffer.fill_(-100.0)
        sums = store._parts[0].spare  # noqa: SLF001 - what the store reuses
        assert len(sums) <= SPARE_SUMS
        reused.append({t.data_ptr() for t in sums})
    assert torch.equal(store.values(0), want)
    assert len(set.union(*reused)) <= SPARE_SUMS, "a fresh tensor for every clock"


def test_a_server_runs_adam_with_the_fused_cpu_step_equal_to_rounding() -> None:
    """`fused_step`: torch's fused CPU kernel for Adam unless the job asked for its own
    implementation (foreach, fused=False); the values agree with the job's own loop to
    rounding (SGD to the bit)."""
    from orchestrator.agileml.updates import OptimizerPlan

    torch.manual_seed(0)
    model = torch.nn.Linear(50, 40)
    grads = [torch.randn(50 * 40 + 40) for _ in range(20)]

    def run(optimizer: Any) -> tuple[torch.Tensor, torch.optim.Optimizer | None]:
        plan = OptimizerPlan.from_model(model, optimizer, None)
        values = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
        rule = plan.rules(lambda p: (0, values.numel()))(0, values)
        for g in grads:
            rule.apply(g.clone())
        return values, rule._optimizer

    fused, opt = run(lambda p: torch.optim.Adam(p, lr=1e-2))
    assert opt is not None and opt.defaults["fused"] is True
    own, opt = run(lambda p: torch.optim.Adam(p, lr=1e-2, foreach=False, fused=False))
    assert opt is not None and not opt.defaults["fused"]
    assert torch.allclose(fused, own, rtol=1e-6, atol=1e-7) and not torch.equal(fused, own)
    _, opt = run(lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True))  # the job's choice
    assert opt is not None and not opt.defaults["fused"]
    sgd, opt = run(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True))
    assert opt is not None and opt.defaults["fused"] is True
    plain, _ = run(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, fused=False))
    assert torch.equal(sgd, plain)
    _, opt = run(lambda p: torch.optim.RMSprop(p, lr=1e-3))  # no fused step: as written
    assert opt is not None and not opt.defaults.get("fused")


def test_a_state_saved_by_an_unfused_optimizer_keeps_the_fused_step() -> None:
    """A hand-off or checkpoint from a server whose optimizer was not fused (an older
    version) loads into a fused one and it stays fused (load_state_dict replaces the groups)."""
    from orchestrator.agileml.updates import OptimizerPlan

    model = torch.nn.Linear(4, 3)
    values = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()

    def rule(optimizer: Any) -> Any:
        plan = OptimizerPlan.from_model(model, optimizer, None)
        return plan.rules(lambda p: (0, values.numel()))(0, values.clone())

    params = [torch.nn.Parameter(torch.zeros(12)), torch.nn.Parameter(torch.zeros(3))]
    older = torch.optim.Adam(params, lr=1e-2)  # as a server before the fused step saved it
    for p in params:
        p.grad = torch.ones_like(p)
    older.step()
    assert older.param_groups[0]["fused"] is None
    blob = io.BytesIO()
    torch.save({"optimizer": older.state_dict(), "scheduler": None}, blob)
    fused = rule(lambda p: torch.optim.Adam(p, lr=1e-2))
    fused.load_state(blob.getvalue())
    assert all(g["fused"] for g in fused._optimizer.param_groups)
    fused.apply(torch.ones_like(values))  # steps from the loaded state
