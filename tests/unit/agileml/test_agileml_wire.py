"""The AgileML wire format: round trips, every malformed message refused with its reason, and
nothing parsed before the MAC checks out (a hostile frame is dropped unread)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from orchestrator.agileml import wire
from orchestrator.agileml.errors import WireError, WireReason

TOKEN = b"job-token-0123456789abcdef"


def _header(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "v": wire.PROTOCOL_VERSION,
        "kind": "push",
        "job_id": "job-1",
        "sender": "w-0",
        "seq": 7,
        "partition": 2,
        "clock": 3,
        "detail": None,
        "tensors": [{"name": "delta", "dtype": "float32", "shape": [2]}],
    }
    base.update(overrides)
    return base


def _frames(header: dict[str, Any], buffers: list[bytes], token: bytes = TOKEN) -> list[bytes]:
    """Hand-built frames, correctly signed, so that the check under test is the one that fails."""
    return _signed([wire.canonical_json(header), *buffers], token)


def _signed(pieces: list[bytes], token: bytes = TOKEN) -> list[bytes]:
    """`pieces` (a header frame of any bytes, then buffers) with a valid auth frame."""
    return [wire.sign(pieces, token), *pieces]


def _reason(frames: list[bytes], **kwargs: Any) -> WireReason:
    with pytest.raises(WireError) as info:
        wire.decode(frames, TOKEN, **kwargs)
    return info.value.reason


FLOAT_BYTES = torch.tensor([1.0, 2.0]).numpy().tobytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64])
def test_round_trip_preserves_values_dtype_and_shape(dtype: torch.dtype) -> None:
    tensors = {
        "matrix": torch.arange(12).reshape(3, 4).to(dtype),
        "scalar": torch.tensor(5).to(dtype),
        "empty": torch.empty(0, 3, dtype=dtype),
    }
    fields = {"kind": "pull_reply", "job_id": "j", "sender": "ps-0", "seq": 1, "partition": 0}
    header, out = wire.decode(wire.encode(fields, tensors, TOKEN), TOKEN)
    assert header.kind is wire.MessageKind.PULL_REPLY and header.partition == 0
    assert [s.name for s in header.tensors] == list(tensors)
    for name, t in tensors.items():
        assert out[name].dtype == dtype and out[name].shape == t.shape
        assert torch.equal(out[name], t)


def test_a_bfloat16_tensor_framed_in_place_round_trips() -> None:
    """Pushes frame their gradient in place (`zero_copy`); numpy has no bfloat16."""
    delta = torch.linspace(-1, 1, 5000).to(torch.bfloat16)
    fields = {"kind": "push", "job_id": "j", "sender": "w", "seq": 0, "partition": 0}
    frames = wire.encode(fields, {"delta": delta}, TOKEN, zero_copy=True)
    _, out = wire.decode([bytes(f) for f in frames], TOKEN)
    assert out["delta"].dtype == torch.bfloat16 and torch.equal(out["delta"], delta)


@pytest.mark.parametrize("kind", ["pipe", "handoff", "replicate", "pull"])
def test_bfloat16_is_refused_outside_pushes_and_pull_replies(kind: str) -> None:
    """Only the data path carries bfloat16 (`wire_precision`): the pipeline's files, hand-offs
    and backups are float32 or bytes, and code reading them need not know another dtype."""
    fields = {"kind": kind, "job_id": "j", "sender": "w", "seq": 0, "partition": 0}
    frames = wire.encode(fields, {"w": torch.ones(4, dtype=torch.bfloat16)}, TOKEN)
    with pytest.raises(WireError) as info:
        wire.decode(frames, TOKEN)
    assert info.value.reason is WireReason.DTYPE


def test_decoded_tensor_is_a_private_writable_copy() -> None:
    frames = wire.encode(
        {"kind": "push", "job_id": "j", "sender": "w", "seq": 0}, {"d": torch.ones(3)}, TOKEN
    )
    _, out = wire.decode(frames, TOKEN)
    out["d"] += 1  # would fail or warn on a read-only buffer
    assert torch.equal(wire.decode(frames, TOKEN)[1]["d"], torch.ones(3))


def test_token_never_travels() -> None:
    frames = wire.encode(
        {"kind": "hello", "job_id": "j", "sender": "w", "seq": 0}, {"d": torch.ones(3)}, TOKEN
    )
    assert all(TOKEN not in f for f in frames)


def test_hand_built_valid_message_decodes() -> None:
    header, out = wire.decode(_frames(_header(), [FLOAT_BYTES]), TOKEN)
    assert header.seq == 7 and torch.equal(out["delta"], torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([], WireReason.NO_FRAMES),
        (_signed([b"{not json"]), WireReason.BAD_JSON),
        (_signed([b"\xff\xfe"]), WireReason.BAD_JSON),
        (_signed([b"[1, 2]"]), WireReason.BAD_JSON),
        (_signed([b"[" * 65 + b"]" * 65]), WireReason.BAD_JSON),  # nested too deep
        (_signed([b'{"seq":' + b"9" * 20 + b"}"]), WireReason.BAD_JSON),  # past 64 bits
        (_signed([b'{"seq":NaN}']), WireReason.BAD_JSON),
        (_frames(_header(seq=True), [FLOAT_BYTES]), WireReason.SCHEMA),  # a bool: no int
        (_frames(_header(seq=2**63), [FLOAT_BYTES]), WireReason.BAD_JSON),
        (_frames(_header(clock=2**63 - 1), [FLOAT_BYTES]), None),  # the largest int64: fine
        (_frames(_header(v=wire.PROTOCOL_VERSION + 1), [FLOAT_BYTES]), WireReason.VERSION),
        (_frames(_header(kind="gossip"), [FLOAT_BYTES]), WireReason.UNKNOWN_KIND),
        (_frames(_header(seq=-1), [FLOAT_BYTES]), WireReason.SCHEMA),
        (_frames(_header(seq="7"), [FLOAT_BYTES]), WireReason.SCHEMA),
        (_frames(_header(sender=""), [FLOAT_BYTES]), WireReason.SCHEMA),
        (_frames(_header(extra_field=1), [FLOAT_BYTES]), WireReason.SCHEMA),
        (
            _frames({k: v for k, v in _header().items() if k != "job_id"}, [FLOAT_BYTES]),
            WireReason.SCHEMA,
        ),
        (
            _frames(
                _header(tensors=[{"name": "d", "dtype": "float32", "shape": [-2]}]), [FLOAT_BYTES]
            ),
            WireReason.SCHEMA,
        ),
        (
            _frames(
                _header(tensors=[{"name": "d", "dtype": "float32", "shape": [1]}] * 2),
                [FLOAT_BYTES[:4]] * 2,
            ),
            WireReason.SCHEMA,
        ),
        (
            _frames(
                _header(tensors=[{"name": "d", "dtype": "float16", "shape": [4]}]), [FLOAT_BYTES]
            ),
            WireReason.DTYPE,
        ),
        (
            _frames(_header(tensors=[{"name": "d", "dtype": "object", "shape": [1]}]), [b"x"]),
            WireReason.DTYPE,
        ),
        (_frames(_header(), []), WireReason.BUFFER_COUNT),
        (_frames(_header(), [FLOAT_BYTES, FLOAT_BYTES]), WireReason.BUFFER_COUNT),
        (_frames(_header(), [FLOAT_BYTES[:7]]), WireReason.BUFFER_SIZE),
        (_frames(_header(), [FLOAT_BYTES + b"\0" * 4]), WireReason.BUFFER_SIZE),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_malformed_message_is_rejected_with_its_reason(
    frames: list[bytes], reason: WireReason | None
) -> None:
    if reason is None:
        wire.decode(frames, TOKEN)
        return
    assert _reason(frames) is reason


HOSTILE = [
    b"[" * 100_000 + b"]" * 100_000,  # RecursionError once
    b'{"seq":' + b"9" * 5000 + b"}",  # ValueError (int digits) once
    b'{"seq":true}',  # a bool where the sequence number goes
    b"\xff" * 64,
    b'{"v":3,"kind":"hello","job_id":"j","sender":"s","seq":1,"tensors":[]}',
]


@pytest.mark.parametrize("header", HOSTILE, ids=["deep", "huge_int", "bool_seq", "binary", "ok"])
@pytest.mark.parametrize("auth", [b"", b"\0" * wire.AUTH_BYTES, b"\0" * 7])
def test_an_unauthenticated_frame_is_refused_before_its_json_is_read(
    header: bytes, auth: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_parse(*_: Any, **__: Any) -> Any:
        raise AssertionError("parsed before the MAC was checked")

    monkeypatch.setattr(wire.json, "loads", no_parse)
    frames = [auth, header] if auth else [header]
    assert _reason(frames) is WireReason.BAD_MAC


def test_message_over_the_size_limit_is_rejected_before_parsing() -> None:
    frames = _frames(
        _header(tensors=[{"name": "d", "dtype": "float32", "shape": [64]}]), [b"\0" * 256]
    )
    assert _reason(frames, max_message_bytes=200) is WireReason.TOO_LARGE
    with pytest.raises(WireError) as info:
        wire.encode(
            {"kind": "push", "job_id": "j", "sender": "w", "seq": 0},
            {"d": torch.zeros(64)},
            TOKEN,
            max_message_bytes=200,
        )
    assert info.value.reason is WireReason.TOO_LARGE


def test_wrong_token_is_rejected_as_bad_mac() -> None:
    frames = wire.encode({"kind": "pull", "job_id": "j", "sender": "w", "seq": 0}, {}, b"other")
    assert _reason(frames) is WireReason.BAD_MAC


@pytest.mark.parametrize("tamper", ["header", "buffer", "shift", "missing_auth", "nonce"])
def test_tampered_message_is_rejected_as_bad_mac(tamper: str) -> None:
    specs = [{"name": n, "dtype": "float32", "shape": [1]} for n in ("a", "b")]
    header = _header(tensors=specs)
    frames = _frames(header, [FLOAT_BYTES[:4], FLOAT_BYTES[4:]])
    if tamper == "header":
        frames[1] = frames[1].replace(b'"clock":3', b'"clock":4')
    elif tamper == "buffer":
        frames[2] = FLOAT_BYTES[4:]
    elif tamper == "shift":  # same concatenated bytes, split differently
        frames = [frames[0], frames[1], FLOAT_BYTES[:2], FLOAT_BYTES[2:]]
    elif tamper == "missing_auth":
        frames = frames[1:]
    else:  # the same tag under another nonce
        frames[0] = bytes([frames[0][0] ^ 1]) + frames[0][1:]
    assert _reason(frames) is WireReason.BAD_MAC


@pytest.mark.parametrize("dtype", [torch.int32, torch.float16, torch.bool])
def test_encode_refuses_dtype_outside_the_allowlist(dtype: torch.dtype) -> None:
    with pytest.raises(WireError) as info:
        wire.encode(
            {"kind": "push", "job_id": "j", "sender": "w", "seq": 0},
            {"d": torch.zeros(2, dtype=dtype)},
            TOKEN,
        )
    assert info.value.reason is WireReason.DTYPE


def test_encode_refuses_invalid_header_fields() -> None:
    with pytest.raises(WireError) as info:
        wire.encode({"kind": "push", "job_id": "j", "sender": "w", "seq": -3}, {}, TOKEN)
    assert info.value.reason is WireReason.SCHEMA


def test_the_mac_is_poly1305_under_a_key_derived_per_nonce() -> None:
    """A known answer, computed here from the primitives: HMAC-SHA256(token, label + nonce) as
    the one-time Poly1305 key over the length-prefixed raw header frame and buffers."""
    import hashlib
    import hmac

    from cryptography.hazmat.primitives.poly1305 import Poly1305

    token, nonce = b"t" * 32, b"\xab" * wire.NONCE_BYTES
    pieces = [b'{"kind":"push","seq":3}', b"\x00\x01\x02", b""]
    for _ in range(2):  # the second time from the cached key schedule
        key = hmac.new(token, b"agileml/poly1305-key/" + nonce, hashlib.sha256).digest()
        mac = Poly1305(key)
        for piece in pieces:
            mac.update(len(piece).to_bytes(8, "big") + piece)
        assert wire.compute_tag(nonce, pieces, token) == mac.finalize()
    other = wire.compute_tag(nonce, pieces, b"u" * 32)
    assert other != wire.compute_tag(nonce, pieces, token)  # the cache is per token
