"""Fuzzing the runtime's wire (issue #19, item 2, a first slice): seeded streams of random,
truncated, bit-flipped, forged (wrong token, wrong job), padded and replayed multipart messages
against a live parameter server and a live pipeline supervisor's node pool. Afterwards each is
alive and its state is what the legitimate messages alone made it: the one real push applied
exactly once, no node registered."""

from __future__ import annotations

import random
import secrets
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from orchestrator.agileml import wire
from orchestrator.agileml.control import TrainingSpec
from orchestrator.agileml.hosting import host_training
from orchestrator.agileml.pipeline.hosted import HostedPipeline
from orchestrator.agileml.server import ParamServer
from orchestrator.agileml.wire import MessageKind

JOB, TOKEN = "job-fuzz", b"fuzz-test-token"
CASES = 5000  # per target: 10,000 in all
INITIAL = torch.tensor([1.0, 2.0, 3.0, 4.0])
PIPELINE_JOB = Path(__file__).parents[2] / "support" / "jobs" / "digits_pipeline.py"

Frames = list[bytes]


def _frames(fields: dict[str, Any], tensors: dict[str, torch.Tensor], token: bytes) -> Frames:
    return [bytes(f) for f in wire.encode(fields, tensors, token)]


def _mutations(
    rng: random.Random, valid: Frames, forge: Callable[[str], Frames]
) -> Iterator[tuple[str, Frames]]:
    """(kind, frames): every case a corruption of `valid` or a forgery, never `valid` itself
    but for `replay`."""
    kinds = ["random", "truncate_frames", "cut_bytes", "flip", "forged", "pad", "replay"]
    while True:
        kind = rng.choice(kinds)
        frames = [bytearray(f) for f in valid]
        if kind == "random":
            out = [rng.randbytes(rng.randint(0, 300)) for _ in range(rng.randint(1, 4))]
        elif kind == "truncate_frames":
            out = [bytes(f) for f in frames[: rng.randint(0, len(frames) - 1)]] or [b""]
        elif kind == "cut_bytes":
            i = rng.randrange(len(frames))
            frames[i] = frames[i][: rng.randrange(max(1, len(frames[i])))]
            out = [bytes(f) for f in frames]
        elif kind == "flip":
            i = rng.randrange(len(frames))
            if frames[i]:
                frames[i][rng.randrange(len(frames[i]))] ^= 1 << rng.randrange(8)
            out = [bytes(f) for f in frames]
        elif kind == "forged":
            out = forge(rng.choice(["token", "job"]))
        elif kind == "pad":
            out = [bytes(f) for f in frames] + [rng.randbytes(rng.randint(0, 64))]
        else:
            out = list(valid)
        yield kind, out


def _drain(sock: zmq.Socket[Any], counts: Counter[str]) -> None:
    while sock.poll(0):
        frames = sock.recv_multipart()
        try:
            header, _ = wire.decode(frames, TOKEN)
            counts[f"reply_{header.kind}"] += 1
        except Exception:  # noqa: BLE001 - an answer we cannot read counts as one
            counts["reply_unreadable"] += 1


@pytest.fixture
def server() -> Iterator[ParamServer]:
    ps = ParamServer("ps-0", job_id=JOB, token=TOKEN)
    ps.add_partition(0, INITIAL)
    ps.register_workers(["w0", "w1"])
    with ps:
        yield ps


def test_a_parameter_server_survives_a_stream_of_bad_messages_with_its_state_untouched(
    server: ParamServer,
) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    delta = torch.tensor([0.5, 0.0, -1.0, 2.0])
    push = {"kind": MessageKind.PUSH, "job_id": JOB, "sender": "w0", "seq": 1, "partition": 0,
            "clock": 0}  # fmt: skip
    valid = _frames(push, {"delta": delta}, TOKEN)

    def forge(how: str) -> Frames:
        if how == "token":
            return _frames(push, {"delta": torch.ones(4) * 100}, b"not-the-token")
        return _frames({**push, "job_id": "other-job"}, {"delta": torch.ones(4) * 100}, TOKEN)

    counts: Counter[str] = Counter()
    try:
        sock.send_multipart(valid)  # the one legitimate push
        assert sock.poll(5000)
        header, _ = wire.decode(sock.recv_multipart(), TOKEN)
        assert header.kind is MessageKind.PUSH_ACK and header.detail == "applied"
        cases = _mutations(random.Random(19), valid, forge)
        for _ in range(CASES):
            kind, frames = next(cases)
            counts[kind] += 1
            sock.send_multipart(frames)
            _drain(sock, counts)
        other = {**push, "sender": "w1", "seq": 1}
        sock2 = ctx.socket(zmq.DEALER)
        sock2.setsockopt(zmq.LINGER, 0)
        sock2.connect(server.endpoint)
        sock2.send_multipart(_frames(other, {"delta": torch.ones(4)}, TOKEN))
        assert sock2.poll(10_000), f"the server stopped answering after {counts}"
        header, _ = wire.decode(sock2.recv_multipart(), TOKEN)
        assert header.detail == "applied"
        sock2.close()
        _drain(sock, counts)
    finally:
        sock.close()
        ctx.term()
    assert torch.equal(server.state(0), INITIAL + delta + torch.ones(4))  # each applied once
    assert sum(counts[k] for k in ("random", "flip", "forged", "replay")) > CASES // 2
    print(f"parameter server fuzz: {CASES} cases {dict(counts)}")


def test_a_pipeline_supervisor_survives_a_stream_of_bad_messages_and_registers_no_one() -> None:
    token = secrets.token_bytes(32)
    spec = TrainingSpec(job_id="pipe-fuzz", code=str(PIPELINE_JOB), parallelism="pipeline",
                        iterations=4, global_batch=64)  # fmt: skip
    hosted = host_training(spec, token=token, host="127.0.0.1", port=0)
    assert isinstance(hosted, HostedPipeline)
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(hosted.endpoint)
    fields = {"kind": MessageKind.PIPE, "job_id": "pipe-fuzz", "sender": "n1", "seq": 1,
              "clock": 0, "detail": "register"}  # fmt: skip
    valid = _frames(fields, wire.json_body({"host": "h", "tier": "reliable"}), token)

    def forge(how: str) -> Frames:
        if how == "token":
            return _frames(fields, wire.json_body({"host": "h"}), b"x" * 32)
        return _frames({**fields, "job_id": "other"}, wire.json_body({"host": "h"}), token)

    counts: Counter[str] = Counter()
    try:
        cases = _mutations(random.Random(20), valid, forge)
        sent = 0
        while sent < CASES:
            kind, frames = next(cases)
            if kind == "replay":
                continue  # a replayed registration is a registration: not a bad message here
            counts[kind] += 1
            sent += 1
            sock.send_multipart(frames)
            while sock.poll(0):
                sock.recv_multipart()
                counts["answered"] += 1
        assert hosted.pool.nodes() == [], "a corrupted or forged registration was taken"
        assert counts["answered"] == 0, counts
        sock.send_multipart(valid)
        assert sock.poll(10_000), f"the supervisor stopped answering after {counts}"
        header, _ = wire.decode(sock.recv_multipart(), token)
        assert header.detail == "welcome" and hosted.pool.nodes() == ["n1"]
    finally:
        sock.close()
        ctx.term()
        hosted.stop()
    print(f"pipeline supervisor fuzz: {CASES} cases {dict(counts)}")
