"""Large pushes and pull replies as several messages (`wire.Header.chunk`).

One message of 64 MB moved at ~1.8 GB/s over loopback here, and its MAC, once on each side,
ran in series with the transfer: ~55 ms in all. As 4 MB chunks, each signed just before it
is sent and checked as it arrives, the sender's MAC of one chunk runs while ZMQ's I/O thread
transfers the one before, the receiver checks one while the next arrives, and no 64 MB
receive buffer is paged in per message: ~35 ms, as fast as raw ZMQ's one message
(`benchmarks.wire_throughput`). Smaller tensors go whole (`CHUNK_ABOVE_BYTES`).

A chunk is an ordinary authenticated message: its header is the whole message's (the same
kind, seq, partition, clock ...) with `chunk` = (offset, total) in elements, and its one
tensor is that slice of the 1-D whole. `ChunkedMessage` sends; `Assembler` receives, in order
(ZMQ keeps a connection's messages in order), into a buffer lent from a pool per (key, dtype,
size) until the receiver gives it back, so nothing is allocated per message.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from orchestrator.agileml import wire
from orchestrator.agileml.errors import WireError, WireReason
from orchestrator.agileml.wire import Header

#: Chunks are of this many bytes (see the module docstring; 1, 2 and 4 MB measured within
#: noise of each other for 64 MB, 16 MB slower).
CHUNK_BYTES = 4 * 1024 * 1024
#: Tensors over this many bytes go in chunks. Below it one message reuses the heap's memory
#: (ZMQ's receive buffer is not paged in anew), and on a busy machine the chunks' extra copies
#: cost more than their overlap gains: the 5M-parameter MLR's 5 MB partitions in 2 chunks
#: measured 0.167 and 0.175 s per iteration against 0.152 whole (`agileml_elasticity`).
CHUNK_ABOVE_BYTES = 32 * 1024 * 1024
#: Assemblies a receiver keeps open at once, messages it remembers as refused and shapes it
#: keeps free buffers for (DoS guards: the oldest is dropped). A server keeps one assembly per
#: connected worker, a worker one per partition it pulls.
MAX_OPEN = 1024
#: Free buffers kept per (pool key, dtype, size) for the next whole of that shape.
FREE_PER_SHAPE = 4

Frame = bytes | memoryview | zmq.Frame


def chunked(tensors: Mapping[str, torch.Tensor], chunk_bytes: int | None = None) -> bool:
    """Whether a message of these tensors goes in chunks: one tensor over `chunk_bytes` when
    given (a benchmark's or a test's size), else over `CHUNK_ABOVE_BYTES`."""
    if len(tensors) != 1:
        return False
    (tensor,) = tensors.values()
    return tensor.numel() * tensor.element_size() > (chunk_bytes or CHUNK_ABOVE_BYTES)


class ChunkedMessage:
    """A message of one large tensor as messages of at most `chunk_bytes` of it each, each
    signed only when taken: send each before taking the next, so that ZMQ transfers one chunk
    while the next is signed. The tensor is framed in place (as `wire.encode`'s `zero_copy`):
    do not change it until every chunk is sent.

    `chunk_bytes` defaults to `CHUNK_BYTES`. `frame` wraps each chunk's buffer in the frame it
    is sent as (a tracked `zmq.Frame`): all are made here, when the message is built, so
    whatever tracks them counts the memory in use from then on, not from when it is sent.

    Raises:
        WireError: TOO_LARGE, the tensor is over `max_message_bytes` (the receiver's bound).
    """

    def __init__(
        self,
        header_fields: Mapping[str, Any],
        name: str,
        tensor: torch.Tensor,
        token: bytes,
        *,
        chunk_bytes: int | None = None,
        frame: Callable[[memoryview], Frame] | None = None,
        max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        if flat.numel() * flat.element_size() > max_message_bytes:
            raise WireError(WireReason.TOO_LARGE, f"tensor {name!r} over {max_message_bytes} bytes")
        self._fields = dict(header_fields)
        self._name = name
        self._token = token
        step = max(1, (chunk_bytes or CHUNK_BYTES) // flat.element_size())
        self._total = flat.numel()
        self._pieces = [flat[offset : offset + step] for offset in range(0, self._total, step)]
        self._frames: list[Frame | None] = [
            frame(wire.byte_view(piece)) if frame is not None else None for piece in self._pieces
        ]

    def __len__(self) -> int:
        return len(self._pieces)

    def __iter__(self) -> Iterator[list[Frame]]:
        offset = 0
        for piece, framed in zip(self._pieces, self._frames, strict=True):
            fields = {**self._fields, "chunk": [offset, self._total]}
            header, buffers = wire.unsigned(fields, {self._name: piece}, zero_copy=True)
            # signed over the frame's own bytes: pyzmq copies a small one when it is made
            body: list[Frame] = [*buffers] if framed is None else [framed]
            offset += piece.numel()
            yield [wire.sign_frames(header, body, self._token), header, *body]


def message(
    header_fields: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    token: bytes,
    *,
    chunk_bytes: int | None = None,
    whole: bool = False,
    max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES,
) -> list[Frame] | ChunkedMessage:
    """A message of `tensors` framed in place: in chunks if `chunked` says so (and not
    `whole`), else one message (`wire.encode` with `zero_copy`). Send it with `send`."""
    if not whole and chunked(tensors, chunk_bytes):
        ((name, tensor),) = tensors.items()
        return ChunkedMessage(header_fields, name, tensor, token, chunk_bytes=chunk_bytes,
                              max_message_bytes=max_message_bytes)  # fmt: skip
    return list(wire.encode(header_fields, tensors, token, zero_copy=True,
                            max_message_bytes=max_message_bytes))  # fmt: skip


def send(
    sock: zmq.Socket[Any], prefix: list[bytes], message: Sequence[Frame] | ChunkedMessage
) -> None:
    """Send a message (its frames, or each chunk of a `ChunkedMessage` in turn) after `prefix`
    (a ROUTER's identity frame, or nothing)."""
    parts: Iterable[Sequence[Frame]] = message if isinstance(message, ChunkedMessage) else [message]
    for frames in parts:
        sock.send_multipart([*prefix, *frames], copy=False)


@dataclass
class _Open:
    header: Header
    whole: torch.Tensor
    shape_key: ShapeKey
    filled: int = 0


#: A pool of buffers: (the receiver's pool key, dtype, elements).
ShapeKey = tuple[Hashable, torch.dtype, int]


def _same_message(a: Header, b: Header) -> bool:
    return a.model_copy(update={"chunk": None, "tensors": ()}) == b.model_copy(
        update={"chunk": None, "tensors": ()}
    )


class Assembler:
    """Puts chunked tensors back together as their messages arrive (decoded: authenticated
    and checked by `wire.decode`). Not thread-safe.

    `add(key, header, tensors, pool_key)` takes every message a receiver decoded: one that is
    not a chunk comes back as it is; a chunk is copied into its whole, and the whole comes
    back with its last chunk's header (`chunk` None) once complete. `key` tells apart
    assemblies that may be open together (a worker's request seq; a server's connection: one
    connection's messages come in order, so a new message's first chunk ends any other open
    under its key). A whole is lent from a pool of buffers per (`pool_key`, dtype, size): give
    it back with `release` or `reset` once it is no longer read, and the next whole of that
    shape reuses it (a new buffer is paged in as it is first written).

    A chunk out of order raises `WireError` once; the rest of that message is then dropped
    without a word, as are those of a message `refuse`d. Thread-safe (a server's serving
    thread assembles while its control thread `forget`s a partition handed off).
    """

    def __init__(self, max_open: int = MAX_OPEN) -> None:
        self._lock = threading.Lock()
        self._forgotten: set[Hashable] = set()  # pool keys whose buffers are freed, not kept
        self._open: OrderedDict[Hashable, _Open] = OrderedDict()
        self._refused: dict[Hashable, int] = {}  # key -> the seq whose chunks are dropped
        self._free: OrderedDict[ShapeKey, list[torch.Tensor]] = OrderedDict()
        self._lent: dict[int, tuple[ShapeKey, torch.Tensor]] = {}  # id(whole) -> (shape, it)
        self._max_open = max_open

    def add(
        self,
        key: Hashable,
        header: Header,
        tensors: dict[str, torch.Tensor],
        pool_key: Hashable = None,
    ) -> tuple[Header, dict[str, torch.Tensor]] | None:
        """The message, whole; None while chunks of it are still to come (or it is dropped).

        Raises:
            WireError: SCHEMA, a chunk out of order or of another message than the chunks
                before it under `key` (that message is dropped).
        """
        if header.chunk is None:
            return header, tensors
        with self._lock:
            return self._add(key, header, tensors, pool_key)

    def _add(
        self,
        key: Hashable,
        header: Header,
        tensors: dict[str, torch.Tensor],
        pool_key: Hashable,
    ) -> tuple[Header, dict[str, torch.Tensor]] | None:
        assert header.chunk is not None
        offset, total = header.chunk
        ((name, piece),) = tensors.items()
        if offset == 0:
            self._refused.pop(key, None)
            self._close(key)
            self._forgotten.discard(pool_key)  # served here again
            shape_key = (pool_key, piece.dtype, total)
            self._open[key] = _Open(header, self._take(shape_key), shape_key)
            while len(self._open) > self._max_open:
                self._close(next(iter(self._open)))
        elif self._refused.get(key) == header.seq:
            return None
        assembly = self._open.get(key)
        if (
            assembly is None
            or assembly.filled != offset
            or assembly.whole.numel() != total
            or assembly.whole.dtype != piece.dtype
            or not _same_message(assembly.header, header)
        ):
            self._refuse(key, header.seq)
            raise WireError(WireReason.SCHEMA, f"chunk {header.chunk} out of order")
        assembly.whole[offset : offset + piece.numel()].copy_(piece)
        assembly.filled += piece.numel()
        if assembly.filled < total:
            return None
        del self._open[key]
        self._lent[id(assembly.whole)] = (assembly.shape_key, assembly.whole)
        return header.model_copy(update={"chunk": None}), {name: assembly.whole}

    def refuse(self, key: Hashable, seq: int) -> None:
        """Drop message `seq` under `key`: its chunks so far, and those still to come."""
        with self._lock:
            self._refuse(key, seq)

    def _refuse(self, key: Hashable, seq: int) -> None:
        self._close(key)
        self._refused[key] = seq
        while len(self._refused) > self._max_open:
            del self._refused[next(iter(self._refused))]

    def release(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Give back the whole among `tensors`, if one was lent (`add`): it is not read after."""
        with self._lock:
            for tensor in tensors.values():
                lent = self._lent.pop(id(tensor), None)
                if lent is not None and lent[1] is tensor:
                    self._give_back(*lent)

    def reset(self) -> None:
        """Give back every whole lent and drop every message still open."""
        with self._lock:
            for shape_key, whole in self._lent.values():
                self._give_back(shape_key, whole)
            self._lent.clear()
            for key in list(self._open):
                self._close(key)
            self._refused.clear()

    def forget(self, pool_key: Hashable) -> None:
        """Free the buffers kept for `pool_key` (a partition no longer served here), and those
        given back for it later, until a message for it comes again."""
        with self._lock:
            self._forgotten.add(pool_key)
            while len(self._forgotten) > self._max_open:
                self._forgotten.pop()
            for shape_key in [k for k in self._free if k[0] == pool_key]:
                del self._free[shape_key]

    def clear(self) -> None:
        """Drop everything: open messages, lent wholes and kept buffers."""
        with self._lock:
            self._open.clear()
            self._refused.clear()
            self._lent.clear()
            self._free.clear()
            self._forgotten.clear()

    def _close(self, key: Hashable) -> None:
        assembly = self._open.pop(key, None)
        if assembly is not None:
            self._give_back(assembly.shape_key, assembly.whole)

    def _take(self, shape_key: ShapeKey) -> torch.Tensor:
        free = self._free.get(shape_key)
        if free:
            return free.pop()
        _, dtype, total = shape_key
        return torch.empty(total, dtype=dtype)

    def _give_back(self, shape_key: ShapeKey, whole: torch.Tensor) -> None:
        if shape_key[0] in self._forgotten:
            return  # freed with the last reference
        free = self._free.setdefault(shape_key, [])
        self._free.move_to_end(shape_key)
        if len(free) < FREE_PER_SHAPE:
            free.append(whole)
        while len(self._free) > self._max_open:
            del self._free[next(iter(self._free))]


def await_reply(
    sock: Any, seq: int, token: bytes, timeout_s: float
) -> tuple[Header, dict[str, torch.Tensor]] | None:
    """Wait on a DEALER socket for the authenticated reply to request `seq`, whole (its chunks
    put together into a new tensor); replies to other (earlier, abandoned) requests are
    skipped. None after `timeout_s`.

    Raises:
        WireError: a reply that fails `decode` (it cannot be trusted), or chunks out of order.
    """
    deadline = time.monotonic() + timeout_s
    assembler = Assembler(max_open=1)
    while (remaining_ms := int((deadline - time.monotonic()) * 1000)) > 0:
        if not sock.poll(remaining_ms):
            return None
        header, tensors = wire.decode(sock.recv_multipart(), token)
        if header.seq == seq and (whole := assembler.add(seq, header, tensors)) is not None:
            return whole
    return None
