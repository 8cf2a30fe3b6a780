"""The frozen copies that pull replies send in place: one per state, never changed while ZMQ
holds a message framing it, reused (not reallocated) once it is released."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq

from orchestrator.agileml.reply_copies import ReplyCopies

SIZE = 1 << 16  # 256 KB: over pyzmq's copy threshold (a smaller frame is copied when sent)


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://copies")
    b.connect("inproc://copies")
    yield a, b
    a.close(linger=0)
    b.close(linger=0)
    ctx.term()


def _send(sock: zmq.Socket[Any], copies: ReplyCopies, p: int, copy: torch.Tensor) -> Any:
    """Send `copy` as a reply's last frame; returns that frame's tracker."""
    frames = copies.track(p, [b"header", memoryview(copy.numpy()).cast("B")])
    sock.send_multipart(frames, copy=False)
    return frames[-1].tracker  # type: ignore[union-attr]


def test_every_pull_of_one_state_sends_one_copy_of_it() -> None:
    copies, live = ReplyCopies(), torch.arange(8, dtype=torch.float32)
    first = copies.copy_of(0, live, generation=1)
    assert copies.copy_of(0, live, generation=1) is first
    assert torch.equal(first, live) and first.data_ptr() != live.data_ptr()
    live += 1  # the next clock is applied in place
    assert torch.equal(copies.copy_of(0, live, generation=2), live)


def test_a_copy_in_flight_is_never_overwritten_and_is_reused_once_released(
    pair: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    sender, receiver = pair
    assert SIZE * 4 > zmq.COPY_THRESHOLD
    copies, live = ReplyCopies(), torch.zeros(SIZE)
    first = copies.copy_of(0, live, generation=1)
    tracker = _send(sender, copies, 0, first)  # not received yet: ZMQ holds it
    for generation in range(2, 6):
        live += 1
        copy = copies.copy_of(0, live, generation)
        assert copy.data_ptr() != first.data_ptr()
        assert torch.equal(first, torch.zeros(SIZE)), "a copy in flight changed"
    frames = receiver.recv_multipart(copy=False)
    assert torch.equal(torch.frombuffer(frames[1].buffer, dtype=torch.float32), torch.zeros(SIZE))
    del frames  # the receiver lets go: the message is released (ZMQ says so in a while)
    tracker.wait(10)
    live += 1
    reused = copies.copy_of(0, live, generation=6)
    assert reused.data_ptr() == first.data_ptr(), "a released copy was not reused"
    assert torch.equal(reused, live)


def test_a_partition_whose_shape_changed_gets_a_copy_of_its_own_shape() -> None:
    copies = ReplyCopies()
    copies.copy_of(0, torch.zeros(4), generation=1)
    copies.copy_of(0, torch.ones(4), generation=2)
    bigger = torch.full((6,), 2.0)
    assert torch.equal(copies.copy_of(0, bigger, generation=0), bigger)
    copies.forget(0)
    assert torch.equal(copies.copy_of(0, bigger, generation=0), bigger)


def test_bfloat16_copies_hold_the_values_rounded_and_are_reused_as_bfloat16() -> None:
    """`wire_precision` bf16: the copies a server sends the workers that ask for it."""
    copies, live = ReplyCopies(torch.bfloat16), torch.linspace(0, 1, 8)
    first = copies.copy_of(0, live, generation=1)
    assert first.dtype == torch.bfloat16 and torch.equal(first, live.to(torch.bfloat16))
    live += 1 / 3
    spare_copies = [copies.copy_of(0, live, generation=g) for g in (2, 3)]  # nothing in flight
    assert all(c.dtype == torch.bfloat16 for c in spare_copies)
    assert torch.equal(spare_copies[-1], live.to(torch.bfloat16))
