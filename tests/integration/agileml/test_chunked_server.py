"""A parameter server's chunked pushes and pull replies (`chunks`) over real sockets: replies
keep the values of their state, refusals come once, connections interleave freely."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import zmq
from support.wire_client import WireClient, WireClients

from orchestrator.agileml import chunks, wire
from orchestrator.agileml.server import ParamServer
from orchestrator.agileml.wire import Header, MessageKind

JOB, TOKEN = "job-chunks", b"chunked-server-test-token"
SIZE = 1000  # floats: 4,000 bytes, in chunks of 1,024
WORKERS = [f"w{i}" for i in range(24)]


@pytest.fixture
def server() -> Iterator[ParamServer]:
    ps = ParamServer("ps-0", job_id=JOB, token=TOKEN, chunk_bytes=1024)
    ps.add_partition(0, torch.zeros(SIZE))
    ps.register_workers(WORKERS)
    with ps:
        yield ps


@pytest.fixture
def ctx() -> Iterator[WireClients]:
    clients = WireClients(job_id=JOB, token=TOKEN)
    yield clients
    clients.close()


def _chunked_push(client: WireClient, clock: int, delta: torch.Tensor, partition: int = 0) -> list:
    client.seq += 1
    fields = {"kind": MessageKind.PUSH, "job_id": JOB, "sender": client.sender,
              "seq": client.seq, "partition": partition, "clock": clock}  # fmt: skip
    return list(chunks.ChunkedMessage(fields, "delta", delta, TOKEN, chunk_bytes=1024))


def _messages(client: WireClient) -> list[Header]:
    """Every message waiting for `client` (until 300 ms pass without one)."""
    out = []
    while client.sock.poll(300):
        header, _ = wire.decode(client.sock.recv_multipart(), TOKEN)
        out.append(header)
    return out


def test_pushes_of_many_connections_in_interleaved_chunks_are_all_applied(
    server: ParamServer, ctx: WireClients
) -> None:
    clients = [ctx(server.endpoint, w) for w in WORKERS]
    pushes = [_chunked_push(c, 0, torch.full((SIZE,), 1.0)) for c in clients]
    for i in range(len(pushes[0])):  # every connection's first chunk, then every second ...
        for client, frames in zip(clients, pushes, strict=True):
            client.sock.send_multipart(frames[i], copy=False)
    acks = [client.recv()[0] for client in clients]
    assert {(a.kind, a.detail) for a in acks} == {(MessageKind.PUSH_ACK, "applied")}
    assert torch.equal(server.state(0), torch.full((SIZE,), float(len(WORKERS))))


def test_a_chunked_push_to_a_partition_not_served_is_refused_once(
    server: ParamServer, ctx: WireClients
) -> None:
    w0 = ctx(server.endpoint, "w0")
    for frames in _chunked_push(w0, 0, torch.ones(SIZE), partition=9):
        w0.sock.send_multipart(frames, copy=False)
    replies = _messages(w0)
    assert [(h.kind, h.detail) for h in replies] == [(MessageKind.ERROR, "not_owner")]
    for frames in _chunked_push(w0, 0, torch.ones(SIZE)):  # the same connection goes on
        w0.sock.send_multipart(frames, copy=False)
    assert [(h.kind, h.detail) for h in _messages(w0)] == [(MessageKind.PUSH_ACK, "applied")]


def test_a_chunked_push_of_the_wrong_size_is_refused_once_to_its_seq(
    server: ParamServer, ctx: WireClients
) -> None:
    w0 = ctx(server.endpoint, "w0")
    for frames in _chunked_push(w0, 0, torch.ones(SIZE + 1)):
        w0.sock.send_multipart(frames, copy=False)
    replies = _messages(w0)
    assert [(h.seq, h.kind) for h in replies] == [(w0.seq, MessageKind.ERROR)]
    assert (replies[0].detail or "").startswith("bad_delta")


def test_a_bad_chunk_mid_message_is_answered_once_and_the_rest_dropped(
    server: ParamServer, ctx: WireClients
) -> None:
    w0 = ctx(server.endpoint, "w0")
    frames = _chunked_push(w0, 0, torch.ones(SIZE))
    fields = {"kind": MessageKind.PUSH, "job_id": JOB, "sender": "w0", "seq": w0.seq,
              "partition": 0, "clock": 0, "chunk": [900, SIZE]}  # fmt: skip
    overrun = wire.encode(fields, {"delta": torch.ones(256)}, TOKEN)  # past the whole's end
    for message in (frames[0], overrun, *frames[1:]):
        w0.sock.send_multipart(message, copy=False)
    replies = _messages(w0)
    assert [(h.seq, h.kind, h.detail) for h in replies] == [(w0.seq, MessageKind.ERROR, "schema")]
    assert torch.equal(server.state(0), torch.zeros(SIZE))


def test_a_pull_asking_for_a_whole_reply_gets_one_message(
    server: ParamServer, ctx: WireClients
) -> None:
    w0 = ctx(server.endpoint, "w0")
    w0.send(MessageKind.PULL, partition=0, clock=-1)
    chunked = _messages(w0)
    w0.send(MessageKind.PULL, partition=0, clock=-1, whole_reply=True)
    whole = _messages(w0)
    assert len(chunked) == 4 and all(h.chunk is not None for h in chunked)
    assert len(whole) == 1 and whole[0].chunk is None


@pytest.mark.parametrize(
    ("size", "chunk_bytes"),
    [(SIZE, 1024), (100_000, 128 * 1024)],  # pyzmq copies a frame under 64 KiB when made
)
def test_a_reply_built_before_a_newer_state_keeps_its_own_values(
    size: int, chunk_bytes: int
) -> None:
    """Requests parked while the partition was handed off, all answered at once when it
    resumes: a pull of the old state, the pushes that complete clock 0, a pull of the new
    state. The first reply's chunks must frame the old values, though the second reply's copy
    is made before either is sent (the server's handler driven without its thread, as its
    loop drives it)."""
    ps = ParamServer("ps-0", job_id=JOB, token=TOKEN, chunk_bytes=chunk_bytes)
    ps.add_partition(0, torch.zeros(size))
    ps.register_workers(["w0", "w1"])

    def message(kind: MessageKind, seq: int, sender: str, **fields: object) -> list[zmq.Frame]:
        header = {"kind": kind, "job_id": JOB, "sender": sender, "seq": seq, "partition": 0}
        tensors = {"delta": torch.ones(size)} if kind is MessageKind.PUSH else {}
        frames = wire.encode({**header, **fields}, tensors, TOKEN)
        return [zmq.Frame(sender.encode()), *(zmq.Frame(f) for f in frames)]

    ps._moving.add(0)  # a hand-off in flight: requests are parked
    for m in (message(MessageKind.PULL, 1, "w1", clock=-1),
              message(MessageKind.PUSH, 2, "w0", clock=0),
              message(MessageKind.PUSH, 3, "w1", clock=0),
              message(MessageKind.PULL, 4, "w0", clock=0)):  # fmt: skip
        assert ps._handle(m) == []
    with ps._lock:  # as a resume does
        ps._moving.discard(0)
        replies = ps._unpark(0)
    pulled = {}
    for _, reply in replies:
        if not isinstance(reply, chunks.ChunkedMessage):
            continue  # a push's ack
        assembler = chunks.Assembler()
        for frames in reply:  # sent only now, as the loop sends them
            raw = [bytes(f.buffer) if isinstance(f, zmq.Frame) else bytes(f) for f in frames]
            got = assembler.add(0, *wire.decode(raw, TOKEN))  # type: ignore[arg-type]
        assert got is not None
        pulled[got[0].seq] = got[1]["values"]
    assert sorted(pulled) == [1, 4]
    assert torch.equal(pulled[1], torch.zeros(size))
    assert torch.equal(pulled[4], ps.state(0)) and not torch.equal(pulled[4], pulled[1])
