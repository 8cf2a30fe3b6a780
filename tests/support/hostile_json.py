"""Hostile JSON for the wire fuzzers (issue #33): the classes that once killed the runtime's
serving threads, as raw JSON text (Python's own `json.dumps` cannot write most of them): bools
where integers go, integers far past 64 bits (5,000 digits once raised a ValueError), nesting
100,000 deep (once a RecursionError), NaN and Infinity, lone surrogates, wrong types, missing
and extra fields; and the frames of a case, unsigned, forged or signed with the job's token."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import zmq
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from orchestrator.agileml import wire

EXAMPLES = 100  # per target and way of signing
HOW = ["unsigned", "forged", "signed"]
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])  # fmt: skip
FIELDS = ["v", "kind", "job_id", "sender", "seq", "partition", "clock", "tensors", "detail",
          "workers", "epoch", "roster_version", "chunk", "whole_reply", "op", "tier",
          "endpoint"]  # fmt: skip


def leaves(*strings: str) -> st.SearchStrategy[str]:
    """Hostile JSON leaves, and `strings` (JSON strings a target knows) among them."""
    return st.one_of(
        st.sampled_from(["null", "true", "false", "NaN", "Infinity", "-Infinity", "1e999", "-0"]),
        st.integers(min_value=-(2**70), max_value=2**70).map(str),
        st.integers(min_value=1, max_value=6000).map(lambda n: "9" * n),
        st.integers(min_value=1, max_value=100_000).map(lambda n: "[" * n + "]" * n),
        st.sampled_from(['"\\ud800"', *(json.dumps(s) for s in strings)]),
        st.text(max_size=8).map(json.dumps),
    )


def json_object(pairs: list[tuple[str, str]]) -> str:
    """A JSON object of raw JSON values (keys may repeat)."""
    return "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in pairs) + "}"


def hostile_json(fields: list[str], *strings: str) -> st.SearchStrategy[str]:
    """Recursive hostile JSON whose objects mostly use `fields` as keys."""
    return st.recursive(
        leaves(*strings),
        lambda inner: (
            st.lists(inner, max_size=4).map(lambda xs: "[" + ",".join(xs) + "]")
            | st.lists(
                st.tuples(st.sampled_from(fields) | st.text(max_size=4), inner), max_size=6
            ).map(json_object)
        ),
        max_leaves=12,
    )


def hostile_objects(fields: list[str], *strings: str) -> st.SearchStrategy[str]:
    """JSON objects over `fields` whose values are hostile JSON."""
    value = hostile_json(fields, *strings)
    return st.lists(st.tuples(st.sampled_from(fields), value), max_size=10).map(json_object)


def deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def hostile_frames(header: str, body: str, how: str, token: bytes) -> list[bytes]:
    """The frames of one case: `how` says whether it is signed with `token`."""
    raw_header, raw_body = header.encode(), body.encode()
    if how == "unsigned":
        return [raw_header, raw_body]
    if how == "forged":
        return [b"\0" * wire.AUTH_BYTES, raw_header, raw_body]
    return [wire.sign([raw_header, raw_body], token), raw_header, raw_body]


def signed_body_frames(fields: dict[str, object], body: bytes, token: bytes) -> list[bytes]:
    """A valid, signed header (`fields`, with a `body` tensor) over the raw `body`: a sender
    with the token, but a bug."""
    header = wire.canonical_json({"v": wire.PROTOCOL_VERSION, "partition": None, "clock": None,
                                  "detail": None, **fields,
                                  "tensors": [{"name": "body", "dtype": "uint8",
                                               "shape": [len(body)]}]})  # fmt: skip
    return [wire.sign([header, body], token), header, body]


class Target:
    """A live server, a raw socket to it, and a legitimate request it must answer."""

    def __init__(self, endpoint: str) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.counts: Counter[str] = Counter()

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)
        while self.sock.poll(0):
            self.sock.recv_multipart()
            self.counts["replies"] += 1

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()
