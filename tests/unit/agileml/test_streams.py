"""Overlap of a worker's communication with its computation (`agileml.streams`), without a
network: pulled partitions load when an operation first reads them, and partitions are handed
to the sender while backward is still running, with exactly the gradients it ends with."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from orchestrator.agileml.errors import AgileMLError
from orchestrator.agileml.partitions import PartitionLayout
from orchestrator.agileml.streams import EarlyPushes, PullStream, streaming_safe


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)
    )


class _Tied(nn.Module):
    """Reads another module's weight without calling that module (a tied output layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 8, bias=False)
        self.mid = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.mid(self.embed(x)))
        return nn.functional.linear(h, self.embed.weight.t())


def _fresh(layout: PartitionLayout, factory: Callable[[], nn.Module]) -> list[torch.Tensor]:
    """The partitions of a differently initialised model (what the server would send)."""
    torch.manual_seed(42)
    return layout.gather(factory())


class _Server:
    """Hands the stream one partition per wait, in order, and records the waits."""

    def __init__(self, stream_ref: list[PullStream], parts: list[torch.Tensor]) -> None:
        self.stream_ref, self.parts, self.next = stream_ref, parts, 0
        self.waits = 0

    def wait(self, done: Callable[[], bool]) -> None:
        self.waits += 1
        while not done():
            self.stream_ref[0].arrived(self.next, self.parts[self.next])
            self.next += 1


def _stream(
    model: nn.Module, layout: PartitionLayout, parts: list[torch.Tensor]
) -> tuple[PullStream, _Server]:
    ref: list[PullStream] = []
    server = _Server(ref, parts)
    stream = PullStream(layout, model, server.wait)
    ref.append(stream)
    server.stream_ref[0].arrived(0, parts[0])
    server.next = 1
    return stream, server


def _reference(
    factory: Callable[[], nn.Module], parts: list[torch.Tensor], layout: PartitionLayout
) -> nn.Module:
    ref = factory()
    layout.scatter(ref, parts)
    return ref


def test_forward_reads_each_partition_only_after_it_arrived_and_matches_a_full_load() -> None:
    model = _mlp()
    layout = PartitionLayout(model, 4)
    parts = _fresh(layout, _mlp)
    stream, server = _stream(model, layout, parts)
    last = list(model.parameters())[-1]
    stale = last.detach().clone()
    x = torch.randn(7, 6)
    assert torch.equal(last, stale)  # nothing past the first partition is loaded yet
    with stream.guard():
        out = model(x)
    assert torch.equal(out, _reference(_mlp, parts, layout)(x))
    assert server.waits >= 2  # partitions were awaited one layer at a time, not all at once
    stream.finish()
    assert not stream.pending
    assert torch.equal(torch.cat(layout.gather(model)), torch.cat(parts))


def _streamed_and_reference(
    factory: Callable[[], nn.Module], x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A forward pass streamed over 3 partitions, and the same on a model loaded whole."""
    model = factory()
    layout = PartitionLayout(model, 3)
    parts = _fresh(layout, factory)
    stream, _ = _stream(model, layout, parts)
    with stream.guard():
        out = model(x)
    return out, _reference(factory, parts, layout)(x)


def test_a_weight_read_outside_its_module_is_loaded_before_the_read() -> None:
    out, reference = _streamed_and_reference(_Tied, torch.randn(4, 5))
    assert torch.equal(out, reference)


def test_buffers_load_with_the_partitions_that_hold_them() -> None:
    def factory() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))

    model = factory()
    layout = PartitionLayout(model, 3)
    parts = _fresh(layout, factory)
    parts[-1][-13:] = torch.arange(13, dtype=torch.float32)  # running stats and count
    stream, _ = _stream(model, layout, parts)
    stream.ensure_buffers()
    assert torch.equal(
        layout.gather_buffers(model), layout.gather_buffers(_reference(factory, parts, layout))
    )


def test_early_pushes_send_each_partition_during_backward_with_its_final_gradient() -> None:
    model = _mlp()
    layout = PartitionLayout(model, 4)
    params = layout.params(model)
    early = EarlyPushes(layout, model)
    sent: dict[int, torch.Tensor] = {}
    first_layer_done: list[bool] = []

    def send(p: int) -> None:
        sent[p] = layout.partition_grad(params, p).clone()
        first_layer_done.append(model[0].weight.grad is not None)

    assert early.arm(send)
    model(torch.randn(9, 6)).square().sum().backward()
    order = early.disarm()
    assert sorted(order) == [0, 1, 2, 3]
    assert order[-1] == 0  # the first layer's gradients come last
    assert first_layer_done[0] is False  # the first partition left before backward ended
    for p, grad in sent.items():
        assert torch.equal(grad, layout.partition_grad(params, p))
    # disarmed: another backward sends nothing
    model(torch.randn(2, 6)).sum().backward()
    assert early.sent == order


def test_frozen_parameters_and_buffers_keep_their_partitions_for_the_end() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    for p in model[0].parameters():
        p.requires_grad_(False)
    layout = PartitionLayout(model, 4)
    early = EarlyPushes(layout, model)
    sent: list[int] = []
    assert early.arm(sent.append)
    model(torch.randn(5, 4)).sum().backward()
    early.disarm()
    # partition 0 holds only frozen values (no gradient will come: it goes at the end), the
    # last one buffers; the ones in between hold the gradients that did come
    assert layout.partition_params(0) == (0,) and layout.buffer_partitions() == (3,)
    assert sorted(sent) == [1, 2]
    model[0].weight.requires_grad_(True)  # a change the hooks did not see: nothing is armed
    assert not early.arm(sent.append)


def test_partition_grad_is_a_view_inside_one_gradient_and_fills_missing_ones_with_zeros() -> None:
    model = nn.Linear(100, 10)
    layout = PartitionLayout(model, 4)
    model(torch.randn(3, 100)).sum().backward()
    params = layout.params(model)
    inside = layout.partition_grad(params, 0)
    assert inside.data_ptr() == model.weight.grad.data_ptr()  # type: ignore[union-attr]
    model.bias.grad = None
    last = layout.partition_grad(params, 3)
    assert torch.equal(last[-10:], torch.zeros(10))


class _KeptView(nn.Module):
    """Keeps a view of its weight from construction and reads only the view."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 6)
        self.w = nn.Parameter(torch.randn(3, 6))
        self.wt = self.w.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.first(x)) @ self.wt


def test_a_view_kept_of_a_parameter_is_loaded_before_it_is_read() -> None:
    out, reference = _streamed_and_reference(_KeptView, torch.randn(5, 4))
    assert torch.equal(out, reference)


def test_pulled_buffers_are_the_values_before_the_forward_changed_them() -> None:
    def factory() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))

    model = factory()
    layout = PartitionLayout(model, 3)
    parts = _fresh(layout, factory)
    stream, _ = _stream(model, layout, parts)
    with stream.guard():
        model(torch.randn(8, 4))  # BatchNorm updates its running statistics in place
    as_pulled = layout.gather_buffers(_reference(factory, parts, layout))
    assert torch.equal(stream.pulled_buffers(), as_pulled)
    assert not torch.equal(layout.gather_buffers(model), as_pulled)


def test_a_gradient_accumulated_twice_turns_early_pushes_off() -> None:
    model = _mlp()
    layout = PartitionLayout(model, 4)
    early = EarlyPushes(layout, model)
    x = torch.randn(3, 6)
    with early.probe():  # two backward calls through one graph: every gradient twice
        out = model(x).sum()
        out.backward(retain_graph=True)
        out.backward()
    assert early.disabled
    assert not early.arm(lambda p: None)


def test_a_second_accumulation_while_armed_fails_loudly() -> None:
    model = _mlp()
    layout = PartitionLayout(model, 4)
    early = EarlyPushes(layout, model)
    out = model(torch.randn(3, 6)).sum()
    assert early.arm(lambda p: None)
    out.backward(retain_graph=True)
    with pytest.raises(AgileMLError, match="accumulated twice"):
        out.backward()
    early.disarm()
    assert early.disabled


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit.script's own
def test_torchscript_and_compiled_modules_are_not_streamed() -> None:
    assert streaming_safe(_mlp())
    assert not streaming_safe(nn.Sequential(torch.jit.script(nn.Linear(2, 2))))
    assert not streaming_safe(nn.Sequential(torch.compile(nn.Linear(2, 2))))  # not compiled yet
