"""The parameter server over real sockets: exactly-once pushes, BSP/SSP pulls, rejections."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq
from support.wire_client import WireClients

from orchestrator.agileml.errors import ServerError
from orchestrator.agileml.server import ParamServer
from orchestrator.agileml.wire import PULL_BF16, MessageKind

JOB, TOKEN = "job-1", b"server-test-token"
INITIAL = torch.tensor([1.0, 2.0, 3.0, 4.0])


@pytest.fixture
def server() -> Iterator[ParamServer]:
    threads_before = threading.active_count()
    ps = ParamServer("ps-0", job_id=JOB, token=TOKEN)
    ps.add_partition(0, INITIAL)
    ps.register_workers(["w0", "w1"])
    with ps:
        yield ps
    assert threading.active_count() == threads_before


@pytest.fixture
def ctx() -> Iterator[WireClients]:
    clients = WireClients(job_id=JOB, token=TOKEN)
    yield clients
    clients.close()


def test_duplicated_push_is_applied_exactly_once(server: ParamServer, ctx: WireClients) -> None:
    w0, w1 = ctx(server.endpoint, "w0"), ctx(server.endpoint, "w1")
    d0, d1 = torch.tensor([0.5, 0.0, -1.0, 2.0]), torch.tensor([0.25, 1.0, 1.0, 1.0])
    first = w0.push(0, d0)
    again = w0.push(0, d0)  # a resend after a lost ack
    other = w1.push(0, d1)
    assert (first.kind, first.detail) == (MessageKind.PUSH_ACK, "applied")
    assert (again.kind, again.detail) == (MessageKind.PUSH_ACK, "duplicate")
    assert other.detail == "applied"
    assert torch.equal(server.state(0), INITIAL + d0 + d1)
    stats = server.stats()
    assert (stats.pushes_applied, stats.pushes_duplicate) == (2, 1)


def test_bsp_pull_waits_for_the_slowest_worker(server: ParamServer, ctx: WireClients) -> None:
    w0, w1 = ctx(server.endpoint, "w0"), ctx(server.endpoint, "w1")
    d = torch.ones(4)
    w0.push(0, d)
    seq = w0.send(MessageKind.PULL, partition=0, clock=0)  # w0 at clock 1 under BSP: min 0
    assert w0.silent(), "pull answered before w1 pushed clock 0"
    assert server.stats().pulls_held == 1
    w1.push(0, 2 * d)  # makes the held pull answerable
    header, tensors = w0.recv()
    assert (header.kind, header.seq, header.clock) == (MessageKind.PULL_REPLY, seq, 0)
    assert torch.equal(tensors["values"], INITIAL + 3 * d)
    assert server.stats().pulls_held == 0


def test_bf16_on_the_wire_is_summed_and_kept_in_float32(
    server: ParamServer, ctx: WireClients
) -> None:
    """`wire_precision` bf16: a push may carry bfloat16, summed into the float32 values; a
    pull that asks for bf16 gets them rounded to it, any other pull (the final weights are
    read so) gets float32."""
    w0, w1 = ctx(server.endpoint, "w0"), ctx(server.endpoint, "w1")
    d0 = torch.tensor([0.5, 1 / 3, -1.0, 2.0]).to(torch.bfloat16)
    d1 = torch.tensor([0.25, 1 / 3, 1.0, 1.0])  # a float32 worker in the same job
    assert w0.push(0, d0).detail == "applied"
    assert w1.push(0, d1).detail == "applied"
    want = INITIAL + (d0.float() + d1)  # the clock's sum, then applied
    assert server.state(0).dtype == torch.float32 and torch.equal(server.state(0), want)
    _, half = w0.request(MessageKind.PULL, partition=0, clock=0, detail=PULL_BF16)
    assert half["values"].dtype == torch.bfloat16
    assert torch.equal(half["values"], want.to(torch.bfloat16))
    _, full = w1.request(MessageKind.PULL, partition=0, clock=0)
    assert full["values"].dtype == torch.float32 and torch.equal(full["values"], want)
    again = w0.push(0, d0)  # a resend: still once
    assert again.detail == "duplicate" and torch.equal(server.state(0), want)


def test_ssp_pull_is_answered_within_the_slack(server: ParamServer, ctx: WireClients) -> None:
    slack = 1
    w0, w1 = ctx(server.endpoint, "w0"), ctx(server.endpoint, "w1")
    w0.push(0, torch.ones(4))  # w0 finishes clock 0 while w1 has pushed nothing
    w0.send(MessageKind.PULL, partition=0, clock=1 - slack - 1)  # w0 at clock 1
    header, tensors = w0.recv()
    assert header.kind is MessageKind.PULL_REPLY
    # not waiting; complete clocks only: w0's own update waits for w1 (no read-my-writes)
    assert torch.equal(tensors["values"], INITIAL)
    w0.push(1, torch.ones(4))
    w0.send(MessageKind.PULL, partition=0, clock=2 - slack - 1)  # clock 2: needs w1's clock 0
    assert w0.silent()
    w1.push(0, torch.ones(4))
    header, tensors = w0.recv()
    assert header.kind is MessageKind.PULL_REPLY
    assert torch.equal(tensors["values"], INITIAL + 2)  # clock 0, both pushes, applied once


def test_unauthenticated_push_changes_nothing(server: ParamServer, ctx: WireClients) -> None:
    w0 = ctx(server.endpoint, "w0")
    reply = w0.push(0, torch.full((4,), 100.0), token=b"not-the-job-token")
    assert (reply.kind, reply.detail) == (MessageKind.ERROR, "bad_mac")
    assert torch.equal(server.state(0), INITIAL)
    assert server.stats().rejected == 1 and server.stats().pushes_applied == 0


@pytest.mark.parametrize(
    ("sender", "fields", "detail"),
    [
        ("intruder", {"clock": 0}, "unknown_worker"),
        ("w0", {"clock": 0, "job_id": "other-job"}, "wrong_job"),
        ("w0", {"clock": -1}, "bad_clock"),
        ("w0", {}, "bad_clock"),
        ("w0", {"clock": 0, "partition": 9}, "not_owner"),
        ("w0", {"clock": 0, "delta": torch.ones(3)}, "bad_delta"),
        ("w0", {"clock": 0, "delta": torch.ones(4, dtype=torch.float64)}, "bad_delta"),
    ],
)
def test_refused_push_gets_an_error_and_changes_nothing(
    server: ParamServer, ctx: WireClients, sender: str, fields: dict[str, Any], detail: str
) -> None:
    client = ctx(server.endpoint, sender)
    delta = fields.pop("delta", torch.ones(4))
    fields.setdefault("partition", 0)
    client.send(MessageKind.PUSH, tensors={"delta": delta}, **fields)
    header, _ = client.recv()
    assert (header.kind, header.detail, header.seq) == (MessageKind.ERROR, detail, client.seq)
    assert torch.equal(server.state(0), INITIAL)
    assert server.stats().rejected == 1


@pytest.mark.parametrize(
    "frames",
    [
        [b"\x80not json", b"junk"],
        [b"\0" * 32, b"[" * 100_000 + b"]" * 100_000],  # RecursionError, once
        [b"\0" * 32, b'{"seq":' + b"9" * 5000 + b"}"],  # ValueError, once
        [b"\0" * 32, b'{"seq":true}'],
    ],
    ids=["not-json", "deep", "huge-int", "bool-seq"],
)
def test_an_unauthenticated_message_is_refused_unread_and_the_server_serves_on(
    server: ParamServer, ctx: WireClients, frames: list[bytes]
) -> None:
    client = ctx(server.endpoint, "w0")
    client.sock.send_multipart(frames)
    header, _ = client.recv()
    assert (header.kind, header.seq, header.detail) == (MessageKind.ERROR, 0, "bad_mac")
    client.send(MessageKind.HELLO)  # the server is still serving
    assert client.recv()[0].kind is MessageKind.HELLO
    assert server.stats().rejected == 1 and torch.equal(server.state(0), INITIAL)


def test_a_message_whose_handling_raises_is_dropped_and_the_server_serves_on(
    server: ParamServer, ctx: WireClients, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = ctx(server.endpoint, "w0")
    real = server._dispatch

    def broken(identity, header, tensors):  # a bug in one request's handling
        if header.kind is MessageKind.PULL:
            raise IndexError("a bug")
        return real(identity, header, tensors)

    monkeypatch.setattr(server, "_dispatch", broken)
    client.send(MessageKind.PULL, partition=0, clock=0)
    assert client.silent()
    assert client.push(0, torch.ones(4)).detail == "applied"  # still serving
    assert server.stats().dropped == 1 and server.crashed is None


def test_a_serving_thread_that_dies_says_so(
    server: ParamServer, ctx: WireClients, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The socket itself failing ends the loop: `crashed` says why (the node fails on it)."""

    def socket_gone(*_: object) -> None:
        raise zmq.ZMQError(zmq.ETERM)

    monkeypatch.setattr(server, "_handle", socket_gone)
    monkeypatch.setattr(server, "_drop", socket_gone)
    ctx(server.endpoint, "w0").send(MessageKind.HELLO)
    deadline = time.monotonic() + 5.0
    while server.crashed is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.crashed is not None and "stopped serving" in server.crashed


def test_stop_is_bounded_and_idempotent() -> None:
    ps = ParamServer("ps-x", job_id=JOB, token=TOKEN).start()
    assert ps.endpoint.startswith("tcp://127.0.0.1:")
    port = int(ps.endpoint.rsplit(":", 1)[1])
    with pytest.raises(ServerError):
        ParamServer("ps-y", job_id=JOB, token=TOKEN, port=port).start()  # port in use
    ps.stop(timeout_s=2.0)
    ps.stop()


def _coef(value: float) -> dict[str, torch.Tensor]:
    return {"coef": torch.tensor([value], dtype=torch.float64)}


def test_clipping_a_norm_waits_for_every_push_and_a_clock_for_its_coefficient(
    server: ParamServer, ctx: WireClients
) -> None:
    """The clipping round over the wire: `norm` is held until the clock is complete, then
    answered with the sum's squared norm; the clock is applied only with its coefficient,
    scaled by it; a later `norm` is answered with the coefficient."""
    server.set_clipping(True)
    w0, w1 = ctx(server.endpoint, "w0"), ctx(server.endpoint, "w1")
    w0.push(0, torch.ones(4))
    w0.send(MessageKind.NORM, partition=0, clock=0)
    assert w0.silent(), "norm answered before w1 pushed clock 0"
    w1.push(0, torch.ones(4))
    header, tensors = w0.recv()
    assert header.kind is MessageKind.NORM_REPLY
    assert float(tensors["sq_norm"].item()) == pytest.approx(16.0)  # the sum: 2 x 4 elements
    assert torch.equal(server.state(0), INITIAL)  # complete, not applied
    w0.send(MessageKind.PULL, partition=0, clock=0)
    assert w0.silent(), "pull answered before the clock had its coefficient"
    ack, _ = w1.request(MessageKind.CLIP, partition=0, clock=0, tensors=_coef(0.25))
    assert ack.kind is MessageKind.CLIP_ACK
    header, tensors = w0.recv()  # the held pull, now the clock is applied
    assert header.kind is MessageKind.PULL_REPLY
    assert torch.equal(tensors["values"], INITIAL + 0.5)
    header, tensors = w1.request(MessageKind.NORM, partition=0, clock=0)
    assert float(tensors["coef"].item()) == 0.25


@pytest.mark.parametrize(
    ("kind", "fields", "detail"),
    [
        (MessageKind.CLIP, {"clock": 0, "tensors": _coef(1.5)}, "bad_delta"),
        (MessageKind.CLIP, {"clock": 0, "tensors": _coef(float("nan"))}, "bad_delta"),
        (MessageKind.CLIP, {"clock": 0, "tensors": {"coef": torch.ones(1)}}, "bad_delta"),
        (MessageKind.CLIP, {"tensors": _coef(0.5)}, "bad_delta"),
        (MessageKind.NORM, {"clock": -1}, "bad_clock"),
        (MessageKind.NORM, {}, "bad_clock"),
        (MessageKind.NORM, {"clock": 0, "partition": 9}, "not_owner"),
        (MessageKind.CLIP, {"clock": 1, "tensors": _coef(0.5)}, "bad_clock"),  # incomplete
    ],
    ids=[
        "coef-above-1",
        "coef-nan",
        "coef-float32",
        "clip-no-clock",
        "norm-negative-clock",
        "norm-no-clock",
        "norm-not-owner",
        "clip-incomplete-clock",
    ],  # fmt: skip
)
def test_a_hostile_clipping_request_is_refused_and_changes_nothing(
    server: ParamServer, ctx: WireClients, kind: MessageKind, fields: dict[str, Any], detail: str
) -> None:
    server.set_clipping(True)
    w0, w1 = ctx(server.endpoint, "w0"), ctx(server.endpoint, "w1")
    w0.push(0, torch.ones(4))
    w1.push(0, torch.ones(4))
    fields.setdefault("partition", 0)
    header, _ = w0.request(kind, **fields)
    assert (header.kind, header.detail) == (MessageKind.ERROR, detail)
    assert torch.equal(server.state(0), INITIAL)  # still waiting for a coefficient
    ack, _ = w0.request(MessageKind.CLIP, partition=0, clock=0, tensors=_coef(1.0))
    assert ack.kind is MessageKind.CLIP_ACK
    assert torch.equal(server.state(0), INITIAL + 2)


def test_clipping_requests_are_refused_by_a_job_that_does_not_clip_and_from_strangers(
    server: ParamServer, ctx: WireClients
) -> None:
    """Without clipping a `clip` could scale an update: refused, as is one from a worker the
    roster does not know."""
    w0, w1 = ctx(server.endpoint, "w0"), ctx(server.endpoint, "w1")
    w0.push(0, torch.ones(4))
    w1.push(0, torch.ones(4))
    header, _ = w0.request(MessageKind.CLIP, partition=0, clock=0, tensors=_coef(1e-6))
    assert (header.kind, header.detail) == (MessageKind.ERROR, "unexpected_kind")
    assert torch.equal(server.state(0), INITIAL + 2)  # applied as pushed
    server.set_clipping(True)
    w0.push(1, torch.ones(4))
    w1.push(1, torch.ones(4))
    stranger = ctx(server.endpoint, "intruder")
    header, _ = stranger.request(MessageKind.CLIP, partition=0, clock=1, tensors=_coef(0.5))
    assert (header.kind, header.detail) == (MessageKind.ERROR, "unknown_worker")
    assert torch.equal(server.state(0), INITIAL + 2)  # clock 1 still waits
