"""Large pushes and pull replies in chunks: each chunk an authenticated message, put back
together in order into a buffer reused for the next message (`chunks`)."""

from __future__ import annotations

import threading
import time

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


def _whole(
    assembler: chunks.Assembler, message: chunks.ChunkedMessage, key: object
) -> torch.Tensor:
    got = None
    for h, t in _decoded(message):
        got = assembler.add(key, h, t, pool_key=h.partition)
    assert got is not None
    return got[1]["values"]


def _message(seq: int, fill: float, n: int = 300) -> chunks.ChunkedMessage:
    return chunks.ChunkedMessage(
        {**FIELDS, "seq": seq}, "values", torch.full((n,), fill), TOKEN, chunk_bytes=400
    )


def test_a_whole_given_back_is_reused_for_the_next_of_its_shape_and_not_before() -> None:
    assembler = chunks.Assembler()
    first = _whole(assembler, _message(1, 1.0), 1)
    second = _whole(assembler, _message(2, 2.0), 2)
    assert second is not first  # the first is still lent: never written under its reader
    assert torch.equal(first, torch.full((300,), 1.0))
    assembler.reset()  # both given back
    third = _whole(assembler, _message(3, 3.0), 3)
    assert third is first or third is second  # nothing allocated
    assert torch.equal(third, torch.full((300,), 3.0))
    assembler.release({"values": third})
    assert _whole(assembler, _message(4, 4.0), 4) is third


def test_free_buffers_are_bounded_per_shape() -> None:
    assembler = chunks.Assembler()
    wholes = [_whole(assembler, _message(seq, 0.0), seq) for seq in range(10)]
    assembler.reset()
    again = [_whole(assembler, _message(seq, 0.0), seq) for seq in range(10, 20)]
    reused = {id(w) for w in wholes} & {id(w) for w in again}
    assert len(reused) == chunks.FREE_PER_SHAPE


def test_a_new_message_under_a_key_ends_the_one_open_there() -> None:
    """A server keys by connection: a connection's messages come in order, so a first chunk
    ends whatever that connection left unfinished."""
    assembler = chunks.Assembler()
    stale = _decoded(_message(1, 1.0))
    assembler.add("conn", *stale[0])
    assert torch.equal(_whole(assembler, _message(2, 2.0), "conn"), torch.full((300,), 2.0))
    with pytest.raises(WireError):
        assembler.add("conn", *stale[1])


def test_a_refused_message_s_other_chunks_are_dropped_without_a_word() -> None:
    assembler = chunks.Assembler()
    parts = _decoded(_message(5, 1.0, n=500))
    assembler.refuse("conn", 5)
    assert all(assembler.add("conn", *part) is None for part in parts[1:])
    with pytest.raises(WireError):  # out of order: refused once ...
        assembler.add("c2", *parts[1])
    assert assembler.add("c2", *parts[2]) is None  # ... and the rest dropped


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
    assert assembler.add(7, *parts[1]) is None  # refused once: the rest dropped quietly
    other = _decoded(
        chunks.ChunkedMessage({**FIELDS, "clock": 12}, "values", values, TOKEN, chunk_bytes=100)
    )
    assembler.add(7, *parts[0])
    with pytest.raises(WireError):  # the next chunk of another clock's values
        assembler.add(7, *other[1])


def test_open_assemblies_are_bounded() -> None:
    assembler = chunks.Assembler(max_open=2)
    firsts = [_decoded(_message(seq, 0.0, n=150)) for seq in (1, 2, 3)]
    for seq, parts in zip((1, 2, 3), firsts, strict=True):
        assembler.add(seq, *parts[0])
    with pytest.raises(WireError):  # the oldest was dropped
        assembler.add(1, *firsts[0][1])
    assert assembler.add(3, *firsts[2][1]) is not None  # the newest completes


def test_a_tensor_over_the_message_bound_is_refused_before_sending() -> None:
    with pytest.raises(WireError) as err:
        chunks.ChunkedMessage(FIELDS, "values", torch.zeros(300), TOKEN, max_message_bytes=1000)
    assert err.value.reason is WireReason.TOO_LARGE


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
        ({**FIELDS, "chunk": [0, 2**40]}, {"values": torch.ones(5)}, "schema"),  # to its seq
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


def test_a_partition_forgotten_keeps_no_buffer_given_back_later() -> None:
    assembler = chunks.Assembler()
    parts = _decoded(_message(1, 1.0))
    assembler.add("conn", *parts[0], pool_key=3)
    whole = _whole(assembler, _message(2, 2.0), "other")
    assembler.forget(3)  # handed off while a push of it was open and another lent
    assembler.release({"values": whole})
    assembler.reset()
    again = _whole(assembler, _message(3, 3.0), "third")  # served here again: a new buffer
    assert again is not whole


def test_a_partition_forgotten_from_another_thread_while_chunks_arrive() -> None:
    """A server's control thread forgets a partition handed off while its serving thread
    assembles and gives buffers back."""
    assembler = chunks.Assembler(max_open=8)
    messages = [_decoded(_message(seq, 0.0, n=100)) for seq in range(16)]
    errors: list[BaseException] = []
    stop = time.monotonic() + 0.5

    def forget() -> None:
        try:
            while time.monotonic() < stop:
                assembler.forget(3)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=forget)
    thread.start()
    while time.monotonic() < stop:
        for seq, parts in enumerate(messages):
            for part in parts:
                got = assembler.add(seq % 8, *part, pool_key=3)
            assert got is not None
            assembler.release(got[1])
    thread.join()
    assert errors == []
