"""Large pushes and pull replies as several messages (`wire.Header.chunk`).

One message of 64 MB moved at ~1.8 GB/s over loopback here, and its MAC, once on each side,
ran in series with the transfer: ~55 ms in all. As 4 MB chunks, each signed just before it
is sent and checked as it arrives, the sender's MAC of one chunk runs while ZMQ's I/O thread
transfers the one before, the receiver checks one while the next arrives, and no 64 MB
receive buffer is paged in per message: ~25 ms (`benchmarks.wire_throughput`).

A chunk is an ordinary authenticated message: its header is the whole message's (the same
kind, seq, partition, clock ...) with `chunk` = (offset, total) in elements, and its one
tensor is that slice of the 1-D whole. `ChunkedMessage` sends; `Assembler` receives, in order
(ZMQ keeps a connection's messages in order), into a buffer kept for the next message of the
same key and size, so nothing is allocated per message.
"""

from __future__ import annotations

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

#: Tensors over this many bytes travel in chunks of this many (see the module docstring; 1, 2
#: and 4 MB measured within noise of each other for 64 MB, 16 MB slower).
CHUNK_BYTES = 4 * 1024 * 1024
#: Assemblies a receiver keeps open at once (a DoS guard: the oldest is dropped).
MAX_OPEN = 256

Frame = bytes | memoryview | zmq.Frame


def chunked(tensors: Mapping[str, torch.Tensor], chunk_bytes: int | None = None) -> bool:
    """Whether a message of these tensors goes in chunks: one tensor over `chunk_bytes`
    (default `CHUNK_BYTES`)."""
    if len(tensors) != 1:
        return False
    (tensor,) = tensors.values()
    return tensor.numel() * tensor.element_size() > (chunk_bytes or CHUNK_BYTES)


class ChunkedMessage:
    """A message of one large tensor as messages of at most `chunk_bytes` of it each, each
    signed only when taken: send each before taking the next, so that ZMQ transfers one chunk
    while the next is signed. The tensor is framed in place (as `wire.encode`'s `zero_copy`):
    do not change it until every chunk is sent.

    `chunk_bytes` defaults to `CHUNK_BYTES`. `frame` wraps each chunk's buffer frame before
    it is sent (a tracked `zmq.Frame`).
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
    ) -> None:
        self._fields = dict(header_fields)
        self._name = name
        self._flat = tensor.detach().cpu().contiguous().reshape(-1)
        self._token = token
        self._step = max(1, (chunk_bytes or CHUNK_BYTES) // self._flat.element_size())
        self._frame = frame

    def __len__(self) -> int:
        return -(-self._flat.numel() // self._step)

    def __iter__(self) -> Iterator[list[Frame]]:
        total = self._flat.numel()
        for offset in range(0, total, self._step):
            piece = self._flat[offset : offset + self._step]
            fields = {**self._fields, "chunk": [offset, total]}
            frames: list[Frame] = list(
                wire.encode(fields, {self._name: piece}, self._token, zero_copy=True)
            )
            last = frames[-1]
            if self._frame is not None and isinstance(last, memoryview):
                frames[-1] = self._frame(last)
            yield frames


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
    filled: int = 0


def _same_message(a: Header, b: Header) -> bool:
    return a.model_copy(update={"chunk": None, "tensors": ()}) == b.model_copy(
        update={"chunk": None, "tensors": ()}
    )


class Assembler:
    """Puts chunked tensors back together as their messages arrive (decoded: authenticated
    and checked by `wire.decode`). Not thread-safe.

    `add(key, header, tensors)` takes every message a receiver decoded: one that is not a
    chunk comes back as it is; a chunk is copied into its whole, and the whole comes back with
    its last chunk's header (`chunk` None) once complete. `key` tells apart assemblies that
    may be open together (a worker's request seq; a server's sender and partition). A whole
    is a buffer reused for the next whole of the same `key`'s `buffer_key` and size: it stays
    valid until then.
    """

    def __init__(self, max_open: int = MAX_OPEN) -> None:
        self._open: OrderedDict[Hashable, _Open] = OrderedDict()
        self._buffers: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self._max_open = max_open

    def add(
        self,
        key: Hashable,
        header: Header,
        tensors: dict[str, torch.Tensor],
        buffer_key: Hashable | None = None,
    ) -> tuple[Header, dict[str, torch.Tensor]] | None:
        """The message, whole; None while chunks of it are still to come.

        Raises:
            WireError: SCHEMA, a chunk out of order or of another message than the chunks
                before it under `key` (that assembly is dropped).
        """
        if header.chunk is None:
            return header, tensors
        offset, total = header.chunk
        ((name, piece),) = tensors.items()
        if offset == 0:
            whole = self._buffer(key if buffer_key is None else buffer_key, piece.dtype, total)
            self._open.pop(key, None)
            self._open[key] = _Open(header, whole)
            while len(self._open) > self._max_open:
                self._open.popitem(last=False)
        assembly = self._open.get(key)
        if (
            assembly is None
            or assembly.filled != offset
            or assembly.whole.numel() != total
            or assembly.whole.dtype != piece.dtype
            or not _same_message(assembly.header, header)
        ):
            self._open.pop(key, None)
            raise WireError(WireReason.SCHEMA, f"chunk {header.chunk} out of order")
        assembly.whole[offset : offset + piece.numel()].copy_(piece)
        assembly.filled += piece.numel()
        if assembly.filled < total:
            return None
        del self._open[key]
        return header.model_copy(update={"chunk": None}), {name: assembly.whole}

    def _buffer(self, key: Hashable, dtype: torch.dtype, total: int) -> torch.Tensor:
        kept = self._buffers.get(key)
        if kept is None or kept.dtype != dtype or kept.numel() != total:
            # a new whole is paged in as it is first written: kept for the next one
            kept = torch.empty(total, dtype=dtype)
            self._buffers[key] = kept
        self._buffers.move_to_end(key)
        while len(self._buffers) > self._max_open:
            self._buffers.popitem(last=False)
        return kept

    def clear(self) -> None:
        """Drop every open assembly and kept buffer."""
        self._open.clear()
        self._buffers.clear()


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
