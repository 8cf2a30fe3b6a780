"""A pipeline node counts as its job's from its `hello`: it fetches the job's code and data
(sending no heartbeat) before it registers, and its instance must not be taken for idle while
it does (`HostedPipeline.members`)."""

from __future__ import annotations

import time
from typing import Any

import zmq

from orchestrator.agileml import wire
from orchestrator.agileml.pipeline.remote import NodePool
from orchestrator.agileml.wire import MessageKind

TOKEN = bytes(range(32))


def _send(sock: zmq.Socket[Any], detail: str, seq: int) -> None:
    fields = {"kind": MessageKind.PIPE, "job_id": "job-1", "sender": "i-a", "seq": seq,
              "clock": 0, "detail": detail}  # fmt: skip
    body = {"host": "127.0.0.1", "tier": "transient"}
    sock.send_multipart(wire.encode(fields, wire.json_body(body), TOKEN))
    assert sock.poll(5000), f"no welcome for {detail}"
    sock.recv_multipart()


def test_a_node_is_fetching_from_its_hello_until_it_registers(tmp_path) -> None:
    pool = NodePool(job_id="job-1", token=TOKEN, host="127.0.0.1", port=0, out_dir=tmp_path,
                    welcome={"code": "x"}, failure_timeout_s=30.0)  # fmt: skip
    pool.start()
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{pool.port}")
        assert pool.fetching(600.0) == set() and pool.nodes() == []
        _send(sock, "hello", 1)
        assert pool.fetching(600.0) == {"i-a"} and pool.nodes() == []
        time.sleep(0.05)
        assert pool.fetching(0.01) == set()  # said hello too long ago to count
        _send(sock, "register", 2)
        assert pool.fetching(600.0) == set() and pool.nodes() == ["i-a"]
    finally:
        sock.close()
        ctx.term()
        pool.stop()
