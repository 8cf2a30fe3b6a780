"""Fixed partitions of model state and the partition-owner table."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from orchestrator.agileml.errors import OwnershipConflictError, PartitionError
from orchestrator.agileml.examples import initial_model, mlp_factory
from orchestrator.agileml.partitions import PartitionLayout, PartitionTable


def _mlp() -> nn.Module:
    return initial_model(mlp_factory(5, 3, 2), seed=1)  # 5*3+3 + 3*2+2 = 26 parameters


def test_layout_splits_into_contiguous_nearly_equal_partitions() -> None:
    layout = PartitionLayout(_mlp(), 4)
    assert layout.total == 26
    assert [layout.bounds(p) for p in range(4)] == [(0, 7), (7, 14), (14, 20), (20, 26)]
    assert sum(layout.size(p) for p in range(4)) == 26
    with pytest.raises(PartitionError):
        layout.bounds(4)


@pytest.mark.parametrize("n", [0, 27])
def test_layout_refuses_impossible_partition_counts(n: int) -> None:
    with pytest.raises(PartitionError):
        PartitionLayout(_mlp(), n)


@pytest.mark.parametrize("n", [1, 3, 26])
def test_gather_then_scatter_round_trips_the_parameters(n: int) -> None:
    source, target = _mlp(), initial_model(mlp_factory(5, 3, 2), seed=2)
    layout = PartitionLayout(source, n)
    parts = layout.gather(source)
    assert len(parts) == n and all(t.dtype == torch.float32 for t in parts)
    layout.scatter(target, parts)
    for (name, a), (_, b) in zip(source.named_parameters(), target.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    flat = torch.cat([p.detach().reshape(-1) for p in source.parameters()])
    assert torch.equal(torch.cat(parts), flat)
    assert torch.equal(parts[n - 1], flat[layout.slice(n - 1)])


def _bn_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    model.train()
    model(torch.randn(8, 4))  # moves the running statistics off their defaults
    return model


@pytest.mark.parametrize("n", [1, 2, 5, 7, 36])
def test_scatter_loads_parameters_and_buffers_across_partition_edges(n: int) -> None:
    """Partition edges inside a parameter, and between the parameters and the buffers."""
    source, target = _bn_model(1), _bn_model(2)
    layout = PartitionLayout(source, n)
    assert layout.total == 36  # 15 + 6 + 8 parameters, 3 + 3 statistics and a batch count
    layout.scatter(target, layout.gather(source))
    want, got = source.state_dict(), target.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want), n


def test_scatter_loads_a_non_contiguous_parameter() -> None:
    source, target = _bn_model(1), _bn_model(2)
    first = target[0]
    first.weight.data = first.weight.data.t().contiguous().t()  # same shape, other strides
    assert not first.weight.is_contiguous()
    layout = PartitionLayout(source, 4)
    layout.scatter(target, layout.gather(source))
    assert torch.equal(target[0].weight, source[0].weight)


def test_scatter_refuses_wrong_sizes_and_foreign_models() -> None:
    model = _mlp()
    layout = PartitionLayout(model, 2)
    parts = layout.gather(model)
    with pytest.raises(PartitionError):
        layout.scatter(model, parts[:1])
    with pytest.raises(PartitionError):
        layout.scatter(model, [parts[0], parts[1][:-1]])
    with pytest.raises(PartitionError):
        layout.scatter(nn.Linear(5, 2), parts)


def test_gather_grads_treats_missing_grads_as_zero() -> None:
    model = _mlp()
    layout = PartitionLayout(model, 2)
    assert all(torch.count_nonzero(g) == 0 for g in layout.gather_grads(model))


def test_round_robin_gives_alternating_partitions_and_moves_bump_versions() -> None:
    table = PartitionTable(5)
    with pytest.raises(PartitionError):
        table.owner(0)  # not assigned yet
    table.assign_round_robin(["ps-a", "ps-b"])
    assert table.owned_by("ps-a") == [0, 2, 4] and table.owned_by("ps-b") == [1, 3]
    assert table.get(1).version == 1
    assert table.move(1, "ps-c") == 2
    assert table.owner(1) == "ps-c" and table.owned_by("ps-b") == [3]
    assert table.move(1, "ps-c") == 2  # no-op: same owner, same version


def test_illegal_moves_are_refused_and_change_nothing() -> None:
    table = PartitionTable(2)
    table.assign_round_robin(["ps-a"])
    for bad in (-1, 2):
        with pytest.raises(PartitionError):
            table.move(bad, "ps-b")
    with pytest.raises(PartitionError):
        table.move(0, "")
    with pytest.raises(OwnershipConflictError) as info:
        table.move(0, "ps-b", expected_version=0)
    assert info.value.actual_version == 1
    assert table.owner(0) == "ps-a" and table.get(0).version == 1
    with pytest.raises(PartitionError):
        table.assign_round_robin([])
