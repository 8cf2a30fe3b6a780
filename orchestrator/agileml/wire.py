"""The AgileML wire format: a JSON header plus raw tensor buffers, authenticated (Poly1305).

A message is a ZMQ multipart message `[auth, header, buffer_0, ..., buffer_k]`:

* `auth` is 32 bytes: a random 128-bit nonce, then a Poly1305 tag over the header frame's raw
  bytes and each buffer, each piece prefixed with its 8-byte big-endian length (so bytes cannot
  be shifted between frames). The tag's one-time key is HMAC-SHA256(job token, label + nonce),
  so every message has its own key, as Poly1305 requires. Poly1305 runs at ~10 GB/s where
  HMAC-SHA256 runs at ~1.5 GB/s, which matters when every iteration moves the whole model.
  The token itself never travels.
* `header` is canonical JSON (sorted keys, no spaces, ASCII) of a `Header`; its `tensors` list
  names, in order, the dtype and shape of each buffer.
* `buffer_i` holds the raw little-endian bytes of tensor i (C order), exactly
  `itemsize(dtype) * prod(shape)` bytes.

The tag is checked over the raw frames before anything is parsed: a frame from a sender
without the job's token is dropped unread, whatever its JSON holds (deep nesting, huge
integers). Nothing is ever unpickled: tensors are rebuilt with `torch.frombuffer`, in place over
a received ZMQ frame's own memory (no copy), or over a private copy of any other bytes.
`decode` checks, in this order: frame count and sizes, MAC, JSON (its nesting and integers
bounded), version, kind, schema (strict types: a bool is not an integer; integers within 64
bits), dtypes, buffer count, buffer sizes, a chunk's place; the first failure raises
`WireError` with its reason, and the caller must drop the message without acting on it.

A large push or pull reply is sent as several such messages, each with a chunk of its one
tensor (`Header.chunk`); `chunks` sends and reassembles them.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import math
import secrets
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Annotated, Any

import torch
import zmq
from cryptography.hazmat.primitives.poly1305 import Poly1305
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orchestrator.agileml.errors import WireError, WireReason
from orchestrator.units import INT64_MAX

PROTOCOL_VERSION = 5  # 5: large pushes and pull replies in chunks (`Header.chunk`, `chunks`)
# 256 MiB: a generous bound for one partition of a large model; a DoS guard, not a quota.
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
#: The header frame's bound (a handoff's worker names are the largest header).
MAX_HEADER_BYTES = 1024 * 1024
NONCE_BYTES = 16  # 128 random bits per message
TAG_BYTES = 16  # Poly1305
AUTH_BYTES = NONCE_BYTES + TAG_BYTES
_KEY_LABEL = b"agileml/poly1305-key/"
ZERO_COPY_MIN_BYTES = 4096  # smaller buffers are copied (ZMQ may store them unaligned)
MAX_WORKERS = 4096  # bound on the `workers` list of a handoff header (a DoS guard)
PULL_BF16 = "bf16"  # a pull's `detail`: the values in bfloat16 (`wire_precision`)

DTYPES: Mapping[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,  # pushes and pulls with `wire_precision` bf16
    "float64": torch.float64,
    "int64": torch.int64,
    "uint8": torch.uint8,  # JSON bodies of control messages (`json_body`)
}
_DTYPE_NAMES: Mapping[torch.dtype, str] = {dt: name for name, dt in DTYPES.items()}


class MessageKind(StrEnum):
    """What a message asks or answers. Requests come from workers, replies from servers.

    pull -> pull_reply | error; push -> push_ack | error; clock -> clock_ack | error;
    hello -> hello | error. `error` carries the cause in `detail`.
    handoff -> handoff_ack | error, between servers: a partition's snapshot (tensors `values`
    float32, `applied` int64 (k, 2) of (worker_index, clock) pairs indexing the header's
    `workers`, `version` int64 (1,), `consistent` int64 (1,), and the updates not yet streamed
    to the BackupPS: `pending` float32 (m, size), `pending_clocks` int64 (m,), `pending_pairs`
    int64 (q, 2), and the clipping coefficients `coef_clocks` int64 (n,), `coefs` float64 (n,));
    the ack carries the receiver's new `version`.
    restore -> restore_ack: a handoff-shaped snapshot from a BackupPS that replaces the owner's
    copy outright (roll-back after a failure); its header's `epoch` is the new epoch.
    replicate -> replicate_ack, ActivePS to BackupPS: the coalesced update of one partition for
    one clock (tensor `delta`; `workers` names whose pushes it sums; with clipping, `coef`
    float64 (1,), the clock's coefficient).
    norm -> norm_reply | error, worker to server (gradient clipping, see `clipping`): for a
    clock, once complete, its coefficient (`coef` float64 (1,)) or the squared norm of its
    summed gradient (`sq_norm` float64 (1,)); neither: applied without one.
    clip -> clip_ack | error: the clock's coefficient (`coef` float64 (1,)).
    control -> control_reply, elasticity controller to nodes and back: a JSON body (`json_body`).
    peer: one-way, worker to worker (FlexRR's RapidReassignment): a JSON `body` (a
    `straggler.protocol` message) and, for `completed`, the helped rows' gradient partitions
    `g0`..`g{N-1}` float32.
    pipe: one-way, between pipeline stages and their launcher: `detail` says what (act, grad,
    hello, peers, done), `clock` the minibatch, `epoch` an activation's weight version.
    """

    PULL = "pull"
    PULL_REPLY = "pull_reply"
    PUSH = "push"
    PUSH_ACK = "push_ack"
    CLOCK = "clock"
    CLOCK_ACK = "clock_ack"
    HELLO = "hello"
    ERROR = "error"
    HANDOFF = "handoff"
    HANDOFF_ACK = "handoff_ack"
    RESTORE = "restore"
    RESTORE_ACK = "restore_ack"
    REPLICATE = "replicate"
    REPLICATE_ACK = "replicate_ack"
    CONTROL = "control"
    CONTROL_REPLY = "control_reply"
    PEER = "peer"
    NORM = "norm"
    NORM_REPLY = "norm_reply"
    CLIP = "clip"
    CLIP_ACK = "clip_ack"
    PIPE = "pipe"


#: The only messages whose tensors may be bfloat16 (`wire_precision`): a worker's gradient
#: and the values a server answers it with. Anywhere else it is refused as a bad dtype.
BFLOAT16_KINDS = frozenset({MessageKind.PUSH, MessageKind.PULL_REPLY})
#: The only messages that may carry a chunk of a larger tensor (`Header.chunk`, `chunks`).
CHUNKED_KINDS = frozenset({MessageKind.PUSH, MessageKind.PULL_REPLY})
#: What a push's delta and a pull reply's values may be (bfloat16: `wire_precision`).
VALUE_DTYPES = (torch.float32, torch.bfloat16)

Name = Annotated[str, Field(min_length=1, max_length=128)]
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]


_KINDS = frozenset(k.value for k in MessageKind)


class TensorSpec(BaseModel):
    """The name, dtype and shape of one buffer frame."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: Name
    dtype: str  # checked against DTYPES after validation, to report WireReason.DTYPE
    shape: Annotated[tuple[Count, ...], Field(max_length=16)]


class Header(BaseModel):
    """The header frame of a message.

    `partition` and `clock` are set by the operations that need them: a pull carries the
    minimum clock it must see, a push the clock of its update. `detail` explains an `error`.
    `workers` names the workers a `handoff` snapshot's `applied` pairs refer to (by index);
    `epoch` is the epoch a request was made in, `roster_version` the roster a push was computed
    with (see `server.ParamServer`), `chunk` where a chunk of a large tensor goes (`chunks`),
    `whole_reply` that a pull's reply must not be chunked. These are left out of messages that
    do not set them.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    v: int
    kind: MessageKind
    job_id: Name
    sender: Name
    seq: Count
    partition: Count | None = None
    clock: Annotated[int, Field(ge=-INT64_MAX, le=INT64_MAX)] | None = None
    tensors: Annotated[tuple[TensorSpec, ...], Field(max_length=4096)] = ()
    detail: Annotated[str, Field(max_length=512)] | None = None
    workers: Annotated[tuple[Name, ...], Field(max_length=MAX_WORKERS)] | None = None
    epoch: Count | None = None
    roster_version: Count | None = None
    # (offset, total): the message's one tensor is elements [offset, offset + its size) of a
    # 1-D tensor of `total` elements sent in several messages (`chunks`); pushes and pull
    # replies only
    chunk: tuple[Count, Count] | None = None
    # a pull whose reply must come whole, in one message: its worker shares the server's
    # process and takes the values by reference (no transfer for chunks to overlap)
    whole_reply: bool | None = None


def canonical_json(obj: Mapping[str, Any]) -> bytes:
    """The byte form that is both sent and authenticated: sorted keys, no spaces, ASCII."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def compute_tag(nonce: bytes, pieces: Sequence[bytes | memoryview], token: bytes) -> bytes:
    """The Poly1305 tag of `pieces` (the header frame, then each buffer), length-prefixed,
    under the one-time key HMAC-SHA256(token, label + nonce)."""
    derive = _keyed_hmac(token).copy()
    derive.update(_KEY_LABEL + nonce)
    mac = Poly1305(derive.digest())
    for piece in pieces:
        mac.update(len(piece).to_bytes(8, "big"))
        mac.update(piece)
    return mac.finalize()


@functools.lru_cache(maxsize=16)
def _keyed_hmac(token: bytes) -> hmac.HMAC:
    """HMAC-SHA256 keyed with `token`, before any message: the key schedule is done once per
    token, not per message. Shared: only ever `.copy()` it, never update it."""
    return hmac.new(token, digestmod=hashlib.sha256)


def _tensor_bytes(
    name: str, tensor: torch.Tensor, zero_copy: bool
) -> tuple[dict[str, Any], bytes | memoryview]:
    dtype_name = _DTYPE_NAMES.get(tensor.dtype)
    if dtype_name is None:
        raise WireError(WireReason.DTYPE, f"tensor {name!r} has dtype {tensor.dtype}")
    t = tensor.detach().cpu().contiguous()
    spec = {"name": name, "dtype": dtype_name, "shape": list(t.shape)}
    view = byte_view(t)
    return spec, view if zero_copy and len(view) else view.tobytes()


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, in place (no copy)."""
    # numpy has no bfloat16: its bytes, through a byte view of the same memory
    flat = tensor.reshape(-1)
    array = (flat.view(torch.uint8) if flat.dtype == torch.bfloat16 else flat).numpy()
    return array.data.cast("B")


def encode(
    header_fields: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    token: bytes,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    zero_copy: bool = False,
) -> list[bytes | memoryview]:
    """Build the frames of a message.

    Args:
        header_fields: `kind`, `job_id`, `sender`, `seq` and optionally `partition`, `clock`,
            `detail`, `workers` (a list of names), `epoch`, `roster_version`, `chunk`,
            `whole_reply` (omitted when not given); `v` defaults to `PROTOCOL_VERSION` (set it
            only to test peers).
        tensors: the buffers to send, in order; CPU copies are taken, inputs are not changed.
            With `zero_copy`, contiguous CPU tensors are framed in place instead: send with
            `copy=False` and do not change them until the message is sent.
        token: the job token (the MAC key).

    Raises:
        WireError: `DTYPE` for a tensor outside the allowlist, `SCHEMA` for invalid fields,
            `TOO_LARGE` if the message would exceed `max_message_bytes`.
    """
    header, buffers = unsigned(
        header_fields, tensors, max_message_bytes=max_message_bytes, zero_copy=zero_copy
    )
    return [sign_frames(header, buffers, token), header, *buffers]


def unsigned(
    header_fields: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    zero_copy: bool = False,
) -> tuple[bytes, list[bytes | memoryview]]:
    """The header frame and buffer frames of a message, not signed yet (`encode`, with the
    same arguments but the token; sign with `sign_frames`)."""
    specs: list[dict[str, Any]] = []
    buffers: list[bytes | memoryview] = []
    for name, tensor in tensors.items():
        spec, data = _tensor_bytes(name, tensor, zero_copy)
        specs.append(spec)
        buffers.append(data)
    fields = dict(header_fields)
    if "tensors" in fields:
        raise WireError(WireReason.SCHEMA, "`tensors` are computed by encode")
    fields.setdefault("v", PROTOCOL_VERSION)
    if isinstance(fields.get("kind"), MessageKind):
        fields["kind"] = str(fields["kind"])
    body = {"partition": None, "clock": None, "detail": None, **fields, "tensors": specs}
    header = canonical_json(body)
    try:
        Header.model_validate_json(header)
    except ValidationError as exc:
        raise WireError(WireReason.SCHEMA, _first_error(exc)) from None
    if len(header) > MAX_HEADER_BYTES or (
        AUTH_BYTES + len(header) + sum(len(b) for b in buffers) > max_message_bytes
    ):
        raise WireError(WireReason.TOO_LARGE, f"message over {max_message_bytes} bytes")
    return header, buffers


def sign_frames(
    header: bytes, buffers: Sequence[bytes | memoryview | zmq.Frame], token: bytes
) -> bytes:
    """The `auth` frame of a message of this header and these buffer frames, over the bytes
    each frame will send (a `zmq.Frame` may hold a copy of what it was made from)."""
    return sign([header, *(b.buffer if isinstance(b, zmq.Frame) else b for b in buffers)], token)


def sign(pieces: Sequence[bytes | memoryview], token: bytes) -> bytes:
    """The `auth` frame of a message of these header and buffer frames: a fresh nonce and its
    tag (for peers and tests that build frames by hand; `encode` calls it)."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    return nonce + compute_tag(nonce, pieces, token)


def decode(
    frames: Sequence[bytes | memoryview],
    token: bytes,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> tuple[Header, dict[str, torch.Tensor]]:
    """Authenticate and parse a message into its header and tensors: over a received ZMQ
    frame's memory, which over `inproc://` is the sender's own buffer, so treat them as
    read-only (copy before changing them).

    Raises:
        WireError: with the reason of the first check that failed (see the module docstring).
            The message must then be dropped; nothing about it can be trusted.
    """
    if not frames:
        raise WireError(WireReason.NO_FRAMES, "empty message")
    total = sum(len(f) for f in frames)
    if total > max_message_bytes:
        raise WireError(WireReason.TOO_LARGE, f"{total} bytes > limit {max_message_bytes}")
    if len(frames) < 2 or len(frames[0]) != AUTH_BYTES:
        raise WireError(WireReason.BAD_MAC, "no authentication frame (an older or foreign peer)")
    if len(frames[1]) > MAX_HEADER_BYTES:
        raise WireError(WireReason.TOO_LARGE, f"header over {MAX_HEADER_BYTES} bytes")
    auth, raw = bytes(frames[0]), bytes(frames[1])
    buffers = [memoryview(f) for f in frames[2:]]
    tag = compute_tag(auth[:NONCE_BYTES], [raw, *buffers], token)
    if not hmac.compare_digest(auth[NONCE_BYTES:], tag):
        raise WireError(WireReason.BAD_MAC, "wrong MAC (wrong token or tampered)")
    obj = parse_json(raw)
    if not isinstance(obj, dict):
        raise WireError(WireReason.BAD_JSON, "header is not a JSON object")
    if obj.get("v") != PROTOCOL_VERSION:
        raise WireError(WireReason.VERSION, f"version {obj.get('v')!r} != {PROTOCOL_VERSION}")
    if obj.get("kind") not in _KINDS:
        raise WireError(WireReason.UNKNOWN_KIND, f"kind {obj.get('kind')!r}")
    try:
        header = Header.model_validate_json(raw)
    except ValidationError as exc:
        raise WireError(WireReason.SCHEMA, _first_error(exc)) from None
    tensors = _tensors(header, buffers)
    if header.chunk is not None:
        _check_chunk(header, tensors, max_message_bytes)
    return header, tensors


def _check_chunk(header: Header, tensors: dict[str, torch.Tensor], max_bytes: int) -> None:
    """A chunk is one 1-D tensor within its whole, of a kind that may be chunked, and the
    whole within the bound of one message (what a receiver allocates for it)."""
    assert header.chunk is not None
    offset, total = header.chunk
    if header.kind not in CHUNKED_KINDS or len(tensors) != 1:
        raise WireError(WireReason.SCHEMA, f"a chunk of one tensor in a {header.kind}")
    (piece,) = tensors.values()
    if piece.dim() != 1 or not piece.numel() or offset + piece.numel() > total:
        raise WireError(WireReason.SCHEMA, f"chunk {header.chunk} of {tuple(piece.shape)}")
    if total * piece.dtype.itemsize > max_bytes:  # authenticated: SCHEMA is answered to its seq
        raise WireError(WireReason.SCHEMA, f"a chunked tensor over {max_bytes} bytes")


def _tensors(header: Header, buffers: list[memoryview]) -> dict[str, torch.Tensor]:
    names = [spec.name for spec in header.tensors]
    if len(set(names)) != len(names):
        raise WireError(WireReason.SCHEMA, "duplicate tensor names")
    for spec in header.tensors:
        if spec.dtype not in DTYPES or (
            spec.dtype == "bfloat16" and header.kind not in BFLOAT16_KINDS
        ):
            raise WireError(WireReason.DTYPE, f"tensor {spec.name!r}: dtype {spec.dtype!r}")
    if len(buffers) != len(header.tensors):
        raise WireError(
            WireReason.BUFFER_COUNT, f"{len(buffers)} buffers for {len(header.tensors)} specs"
        )
    out: dict[str, torch.Tensor] = {}
    for spec, buf in zip(header.tensors, buffers, strict=True):
        dtype = DTYPES[spec.dtype]
        if math.prod(d for d in spec.shape if d) > INT64_MAX // 8:  # even an empty one:
            # torch cannot lay out a shape whose strides overflow 64 bits
            raise WireError(WireReason.SCHEMA, f"tensor {spec.name!r}: shape {spec.shape}")
        expected = math.prod(spec.shape) * dtype.itemsize
        if len(buf) != expected:
            raise WireError(
                WireReason.BUFFER_SIZE, f"tensor {spec.name!r}: {len(buf)} bytes, want {expected}"
            )
        if expected == 0:
            out[spec.name] = torch.empty(spec.shape, dtype=dtype)
        else:
            # a received ZMQ frame's memory is used in place (over inproc:// it is the
            # sender's buffer: receivers only read it); anything else (bytes) is copied
            own = not buf.readonly and expected >= ZERO_COPY_MIN_BYTES
            data = buf if own else bytearray(buf)
            out[spec.name] = torch.frombuffer(data, dtype=dtype).reshape(spec.shape)
    return out


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "header"
    return f"{where}: {err['msg']}"


def json_body(obj: Any) -> dict[str, torch.Tensor]:
    """The tensors of a control message carrying `obj` as JSON (a uint8 buffer named `body`)."""
    raw = canonical_json(obj) if isinstance(obj, Mapping) else json.dumps(obj).encode()
    return {"body": torch.frombuffer(bytearray(raw), dtype=torch.uint8)}


def parse_json_body(tensors: Mapping[str, torch.Tensor]) -> Any:
    """The JSON value of a control message. Raises WireError(SCHEMA) if there is none, and
    WireError(BAD_JSON) if it is not bounded JSON (see `parse_json`)."""
    body = tensors.get("body")
    if body is None or body.dtype != torch.uint8 or body.dim() != 1:
        raise WireError(WireReason.SCHEMA, "control message without a uint8 `body`")
    # a body may carry a diverged loss (NaN, Infinity): its model decides what it accepts
    return parse_json(body.numpy().tobytes(), what="body", non_finite=True)


#: Nesting deeper than this is refused before it is parsed.
MAX_JSON_DEPTH = 64


def parse_json(raw: bytes, *, what: str = "header", non_finite: bool = False) -> Any:
    """Strict, bounded JSON: UTF-8, nested at most `MAX_JSON_DEPTH` deep, integers within 64
    bits, and no NaN, Infinity or number that overflows to one unless `non_finite`.

    Raises:
        WireError: BAD_JSON, saying why.
    """
    brackets = raw.count(b"[") + raw.count(b"{")  # at C speed: most messages stop here
    if brackets > MAX_JSON_DEPTH and _depth(raw) > MAX_JSON_DEPTH:
        raise WireError(WireReason.BAD_JSON, f"{what}: nested over {MAX_JSON_DEPTH} deep")
    try:
        if non_finite:
            return json.loads(raw.decode("utf-8"), parse_int=_bounded_int)
        return json.loads(
            raw.decode("utf-8"),
            parse_int=_bounded_int,
            parse_float=_finite_float,
            parse_constant=_no_constant,
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError too
        raise WireError(WireReason.BAD_JSON, f"{what}: {str(exc)[:200]}") from None


def _depth(raw: bytes) -> int:
    """The deepest nesting of brackets outside strings (an upper bound of the JSON's)."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > 19:  # 2**63 has 19 digits: no longer one is an int64
        raise ValueError(f"integer of {len(text)} digits")
    value = int(text)
    if not -INT64_MAX - 1 <= value <= INT64_MAX:
        raise ValueError("integer outside 64 bits")
    return value


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:20]} overflows to {value}")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def process_context() -> zmq.Context[Any]:
    """The process's one shared ZMQ context, never terminated: `inproc://` endpoints connect only
    within one context, so a server and the worker of the same node both use this one."""
    return zmq.Context.instance()
