"""Fuzzing the classes of hostile input that once killed the runtime's serving threads (issue
#33): JSON headers and control bodies from a recursive strategy with bools where integers go,
integers past 64 bits, deep nesting, NaN and Infinity, lone surrogates, wrong types, missing
and extra fields, sent unauthenticated and authenticated (a node with the token but a bug),
to a live parameter server and a live elasticity controller. After every case the server is
alive, its state untouched, and a legitimate request is answered. Seeded, bounded."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq
from hypothesis import given

from orchestrator.agileml import wire
from orchestrator.agileml.control import ControlClient, ModelSpec, TrainingSpec
from orchestrator.agileml.coordinator import Coordinator
from orchestrator.agileml.server import ParamServer
from orchestrator.agileml.wire import MessageKind
from tests.support.hostile_json import (
    FIELDS,
    FUZZ,
    HOW,
    Target,
    deep,
    hostile_frames,
    hostile_json,
    hostile_objects,
    signed_body_frames,
)

JOB, TOKEN = "job-hostile", secrets.token_bytes(32)
INITIAL = torch.tensor([1.0, 2.0, 3.0, 4.0])
JSON = hostile_json(FIELDS, "push", "hello", "control", "float32", JOB)
HEADERS = hostile_objects(FIELDS, "push", "hello", "control", "float32", JOB)


def _hostile_frames(header: str, body: str, how: str) -> list[bytes]:
    return hostile_frames(header, body, how, TOKEN)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[ParamServer, Target]]:
    ps = ParamServer("ps-0", job_id=JOB, token=TOKEN)
    ps.add_partition(0, INITIAL)
    ps.register_workers(["w0"])
    with ps:
        target = Target(ps.endpoint)
        yield ps, target
        target.close()


@pytest.fixture(scope="module")
def controller() -> Iterator[tuple[Coordinator, Target]]:
    spec = TrainingSpec(job_id=JOB, model=ModelSpec(kind="additive", features=8),
                        global_batch=8, iterations=10, num_partitions=1, min_nodes=1)  # fmt: skip
    coordinator = Coordinator(spec, token=TOKEN).start()
    target = Target(coordinator.endpoint)
    yield coordinator, target
    target.close()
    coordinator.stop()


def _server_answers(ps: ParamServer) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(ps.endpoint)
    try:
        fields = {"kind": MessageKind.HELLO, "job_id": JOB, "sender": "w0", "seq": 7}
        sock.send_multipart(wire.encode(fields, {}, TOKEN))
        assert sock.poll(10_000), "the parameter server stopped answering"
        header, _ = wire.decode(sock.recv_multipart(), TOKEN)
        assert (header.kind, header.seq) == (MessageKind.HELLO, 7)
    finally:
        sock.close()
        ctx.term()
    assert ps.crashed is None and torch.equal(ps.state(0), INITIAL)


def _controller_answers(coordinator: Coordinator) -> None:
    client = ControlClient(job_id=JOB, sender="n0", token=TOKEN)
    try:
        reply = client.call(coordinator.endpoint, {"op": "heartbeat", "clock": 0}, 10.0)
        assert "ok" in reply
    finally:
        client.close()
    assert coordinator.error is None and coordinator.view().epoch == 0  # no one joined


@pytest.mark.parametrize("target", ["server", "controller"])
@pytest.mark.parametrize("how", HOW)
@FUZZ
@given(header=HEADERS, body=JSON)
def test_a_live_server_outlives_hostile_json(
    request: pytest.FixtureRequest, target: str, header: str, body: str, how: str
) -> None:
    """`server`: a parameter server; `controller`: an elasticity controller."""
    served, to_it = request.getfixturevalue(target)
    to_it.counts[how] += 1
    to_it.send(_hostile_frames(header, body, how))
    if target == "server":
        _server_answers(served)
    else:
        _controller_answers(served)


@pytest.mark.parametrize("how", HOW)
def test_deep_nesting_and_huge_integers_reach_neither_server_as_data(
    server: tuple[ParamServer, Target], controller: tuple[Coordinator, Target], how: str
) -> None:
    """The three single frames that once killed a live parameter server, and their control
    bodies, then a legitimate request to each."""
    ps, to_server = server
    coordinator, to_controller = controller
    for raw in (deep(100_000), b'{"seq":' + b"9" * 5000 + b"}", b'{"seq":true}'):
        for target in (to_server, to_controller):
            frames = _hostile_frames("{}", "{}", how)
            frames[-2:] = [raw, raw]  # header and body both
            if how == "signed":
                frames[0] = wire.sign([raw, raw], TOKEN)
            target.send(frames)
            target.send([raw])  # a single frame, as the first probe sent it
    _server_answers(ps)
    _controller_answers(coordinator)


def test_both_servers_answer_after_the_fuzz(
    server: tuple[ParamServer, Target], controller: tuple[Coordinator, Target]
) -> None:
    """Runs after the fuzz tests above (pytest keeps the file's order): both alive, their
    state untouched; the counts go to the note."""
    ps, to_server = server
    coordinator, to_controller = controller
    _server_answers(ps)
    _controller_answers(coordinator)
    print(f"wire fuzz: parameter server {dict(to_server.counts)}, stats {ps.stats()}; "
          f"elasticity controller {dict(to_controller.counts)}")  # fmt: skip


HOSTILE_BODIES = [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"op":"status","x":' + b"9" * 5000 + b"}",
    b'{"op":true}',
    b'{"op":"heartbeat","clock":NaN,"loss":Infinity}',
    b'"\\ud800"',
    b"\xff\xfe",
]


@pytest.mark.parametrize("body", HOSTILE_BODIES, ids=range(len(HOSTILE_BODIES)))
def test_a_signed_control_message_with_a_hostile_body_reaches_neither_server_as_data(
    server: tuple[ParamServer, Target], controller: tuple[Coordinator, Target], body: bytes
) -> None:
    """A valid, signed header (a node with the token, but a bug) over each hostile body."""
    ps, to_server = server
    coordinator, to_controller = controller
    fields = {"kind": "control", "job_id": JOB, "sender": "w0", "seq": 3}
    for target in (to_server, to_controller):
        target.send(signed_body_frames(fields, body, TOKEN))
    _server_answers(ps)
    _controller_answers(coordinator)
