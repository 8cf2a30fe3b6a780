"""Large pushes and pull replies in chunks: each chunk an authenticated message, put back
together in order into a buffer reused for the next message (`chunks`)."""

from __future__ import annotations

import threading

import pytest
import torch
import zmq

from orchestrator.agileml import chunks, wire
from orchestrator.agileml.errors import WireError, WireReason
from orchestrator.agileml.wire import MessageKind

TOKEN = b"chunk-test-token"
FIELDS = {"kind": MessageKind.PULL_REPLY, "job_id": "j", "sender": "ps-0", "seq": 7,
          "partition": 3, "clock": 11}  # fmt: skip


def _decoded(message: chunks.ChunkedMessage) -> list[tuple[wire.Header, dict[str, torch.Tensor]]]:
    return [wire.decode([bytes(f) for f in frames], TOKEN) for frames in message]  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tensor_sent_in_chunks_comes_back_whole_and_equal(dtype: torch.dtype) -> None:
    values = torch.randn(1000).to(dtype)
    message = chunks.ChunkedMessage(FIELDS, "values", values, TOKEN, chunk_bytes=600)
    parts = _decoded(message)
    step = 600 // values.element_size()
    assert len(parts) == len(message) == -(-1000 // step)
    assert [h.chunk for h, _ in parts] == [(o, 1000) for o in range(0, 1000, step)]
    assembler = chunks.Assembler()
    results = [assembler.add(h.seq, h, t) for h, t in parts]
    assert all(r is None for r in results[:-1])
    assert results[-1] is not None
    header, tensors = results[-1]
    assert header.chunk is None and (header.seq, header.partition, header.clock) == (7, 3, 11)
    assert torch.equal(tensors["values"], values)


def test_the_whole_is_a_buffer_reused_for_the_next_message_of_its_key() -> None:
    assembler = chunks.Assembler()
    wholes = []
    for seq, fill in ((1, 1.0), (2, 2.0)):
        message = chunks.ChunkedMessage(
            {**FIELDS, "seq": seq}, "values", torch.full((300,), fill), TOKEN, chunk_bytes=400
        )
        for h, t in _decoded(message):
            got = assembler.add(h.seq, h, t, buffer_key=h.partition)
        assert got is not None
        wholes.append(got[1]["values"])
    assert wholes[0] is wholes[1]  # nothing allocated per message
    assert torch.equal(wholes[1], torch.full((300,), 2.0))


def test_a_message_that_is_not_a_chunk_passes_through() -> None:
    frames = wire.encode(FIELDS, {"values": torch.ones(3)}, TOKEN)
    header, tensors = wire.decode(frames, TOKEN)
    assert chunks.Assembler().add(7, header, tensors) == (header, tensors)


def test_chunks_out_of_order_or_of_another_message_are_refused() -> None:
    values = torch.arange(100, dtype=torch.float32)
    parts = _decoded(chunks.ChunkedMessage(FIELDS, "values", values, TOKEN, chunk_bytes=100))
    assembler = chunks.Assembler()
    with pytest.raises(WireError) as err:  # the second chunk without the first
        assembler.add(7, *parts[1])
    assert err.value.reason is WireReason.SCHEMA
    assembler.add(7, *parts[0])
    with pytest.raises(WireError):  # a chunk skipped: the assembly is dropped
        assembler.add(7, *parts[2])
    with pytest.raises(WireError):
        assembler.add(7, *parts[1])
    other = _decoded(
        chunks.ChunkedMessage({**FIELDS, "clock": 12}, "values", values, TOKEN, chunk_bytes=100)
    )
    assembler.add(7, *parts[0])
    with pytest.raises(WireError):  # the next chunk of another clock's values
        assembler.add(7, *other[1])


def test_open_assemblies_are_bounded() -> None:
    assembler = chunks.Assembler(max_open=2)
    values = torch.zeros(50)
    firsts = []
    for seq in (1, 2, 3):
        parts = _decoded(
            chunks.ChunkedMessage({**FIELDS, "seq": seq}, "values", values, TOKEN, chunk_bytes=100)
        )
        assembler.add(seq, *parts[0])
        firsts.append(parts)
    with pytest.raises(WireError):  # the oldest was dropped
        assembler.add(1, *firsts[0][1])
    assert assembler.add(3, *firsts[2][1]) is not None  # the newest completes


def _chunk_frames(fields: dict[str, object], tensors: dict[str, torch.Tensor]) -> list[bytes]:
    return [bytes(f) for f in wire.encode(fields, tensors, TOKEN)]


@pytest.mark.parametrize(
    ("fields", "tensors", "reason"),
    [
        ({**FIELDS, "kind": "pull", "chunk": [0, 10]}, {"values": torch.ones(5)}, "schema"),
        ({**FIELDS, "chunk": [8, 10]}, {"values": torch.ones(5)}, "schema"),
        ({**FIELDS, "chunk": [0, 10]}, {"values": torch.ones(5, 1)}, "schema"),
        ({**FIELDS, "chunk": [0, 10]}, {"values": torch.ones(0)}, "schema"),
        ({**FIELDS, "chunk": [0, 10]}, {"a": torch.ones(2), "b": torch.ones(2)}, "schema"),
        ({**FIELDS, "chunk": [0, 2**40]}, {"values": torch.ones(5)}, "too_large"),
        ({**FIELDS, "chunk": [0, -1]}, {"values": torch.ones(5)}, "schema"),
    ],
)
def test_decode_refuses_a_chunk_that_cannot_be_one(
    fields: dict[str, object], tensors: dict[str, torch.Tensor], reason: str
) -> None:
    with pytest.raises(WireError) as err:
        frames = _chunk_frames(fields, tensors)
        wire.decode(frames, TOKEN)  # type: ignore[arg-type]
    assert err.value.reason == reason


def test_await_reply_puts_a_chunked_reply_together_and_skips_other_seqs() -> None:
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(b"hi")
        identity, _ = router.recv_multipart()
        values = torch.randn(777)

        def answer() -> None:
            stale = chunks.ChunkedMessage({**FIELDS, "seq": 6}, "values", values * 2, TOKEN,
                                          chunk_bytes=256)  # fmt: skip
            router.send_multipart([identity, *next(iter(stale))])  # an abandoned request's
            for message in (
                chunks.ChunkedMessage(FIELDS, "values", values, TOKEN, chunk_bytes=256),
            ):
                chunks.send(router, [identity], message)

        sender = threading.Thread(target=answer)
        sender.start()
        got = chunks.await_reply(dealer, 7, TOKEN, timeout_s=10)
        sender.join()
        assert got is not None
        assert torch.equal(got[1]["values"], values)
    finally:
        router.close(0)
        dealer.close(0)
        ctx.term()
