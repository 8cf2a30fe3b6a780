"""The per-layer profiler: one entry per layer with measured times and exact byte counts, a
PROFILE.json round trip into the planner, and its input errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from orchestrator.agileml.pipeline import ModelProfile, ProfileError, plan, profile_sequential

FLOAT_BYTES = 4


def small_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_profiles_each_layer_with_times_and_exact_sizes() -> None:
    profile = profile_sequential(small_model(), torch.randn(32, 8), repeats=3, warmup=1)
    assert [layer.name for layer in profile.layers] == ["0:Linear", "1:ReLU", "2:Linear"]
    assert all(layer.forward_ms > 0 and layer.backward_ms > 0 for layer in profile.layers)
    assert [layer.activation_bytes for layer in profile.layers] == [
        32 * 16 * FLOAT_BYTES,
        32 * 16 * FLOAT_BYTES,
        32 * 4 * FLOAT_BYTES,
    ]
    assert [layer.parameter_bytes for layer in profile.layers] == [
        (8 * 16 + 16) * FLOAT_BYTES,
        0,
        (16 * 4 + 4) * FLOAT_BYTES,
    ]


def test_profile_leaves_no_gradients_behind() -> None:
    model = small_model()
    with torch.no_grad():  # the profiler turns gradients on for itself
        profile_sequential(model, torch.randn(4, 8), repeats=1, warmup=0)
    assert all(p.grad is None for p in model.parameters())


def test_profile_round_trips_through_json_into_the_planner(tmp_path: Path) -> None:
    profile = profile_sequential(small_model(), torch.randn(32, 8), repeats=2, warmup=1)
    path = tmp_path / "PROFILE.json"
    profile.to_json(path)
    loaded = ModelProfile.from_json(path)
    assert loaded == profile
    result = plan(loaded, 2, 1e9)
    assert result.stages[0].first_layer == 0 and result.stages[-1].last_layer == 2
    assert sum(stage.replicas for stage in result.stages) == 2
    assert result.throughput_per_s() > 0


def test_integer_inputs_and_a_list_of_layers() -> None:
    layers = [nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 2)]
    profile = profile_sequential(layers, torch.randint(0, 10, (5, 3)), repeats=1, warmup=0)
    assert [layer.name for layer in profile.layers] == ["0:Embedding", "1:Flatten", "2:Linear"]
    assert profile.layers[0].parameter_bytes == 10 * 4 * FLOAT_BYTES
    assert profile.layers[2].activation_bytes == 5 * 2 * FLOAT_BYTES


class TwoOutputs(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x


@pytest.mark.parametrize(
    ("model", "kwargs", "field"),
    [
        (nn.Sequential(nn.ReLU()), {"repeats": 0}, "repeats"),
        (nn.Sequential(nn.ReLU()), {"warmup": -1}, "warmup"),
        (nn.Sequential(), {}, "model"),
        (nn.Sequential(TwoOutputs()), {}, "model"),
    ],
)
def test_profiler_input_errors(model: nn.Module, kwargs: dict, field: str) -> None:
    with pytest.raises(ProfileError) as caught:
        profile_sequential(model, torch.randn(2, 3), **kwargs)
    assert caught.value.field == field
    assert caught.value.fix
