"""Control calls and the elasticity controller's reconfiguration thread under failures found
by the chaos soak: a call to a node that stopped heartbeating is not waited out, and the
reconfiguration thread never dies silently (the job would stall with nobody to notice)."""

from __future__ import annotations

import secrets
import time

import pytest
import zmq

from orchestrator.agileml.control import ControlClient, ControlError, ModelSpec, TrainingSpec
from orchestrator.agileml.coordinator import Coordinator

TOKEN = secrets.token_bytes(32)


@pytest.fixture
def silent_peer():
    """An endpoint that takes requests and never answers (a node that died mid-call)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield f"tcp://127.0.0.1:{port}"
    sock.close()
    ctx.term()


def test_a_call_gives_up_once_the_node_is_gone_not_at_its_timeout(silent_peer) -> None:
    client = ControlClient(job_id="j", sender="controller", token=TOKEN)
    try:
        started = time.monotonic()
        deadline = started + 0.5  # the node stops heartbeating half a second in
        with pytest.raises(ControlError, match="stopped heartbeating"):
            client.call(
                silent_peer, {"op": "handoff"}, 30.0, gone=lambda: time.monotonic() > deadline
            )
        assert time.monotonic() - started < 3.0
        with pytest.raises(ControlError, match="timeout"):  # without `gone`: the timeout
            client.call(silent_peer, {"op": "configure"}, 0.3)
    finally:
        client.close()


def test_an_unexpected_error_in_reconfiguration_aborts_the_job_with_its_reason(monkeypatch) -> None:
    spec = TrainingSpec(job_id="crashy", model=ModelSpec(kind="additive", features=8),
                        global_batch=8, iterations=10, num_partitions=1, min_nodes=1)  # fmt: skip
    coordinator = Coordinator(spec, token=TOKEN)

    def broken(client, batch) -> None:
        raise KeyError("t9")

    monkeypatch.setattr(coordinator, "_step", broken)
    coordinator.start()
    try:
        assert coordinator.wait_done(10.0), "the job stalled instead of aborting"
        assert coordinator.error is not None and "KeyError" in coordinator.error
        assert any(e.kind == "aborted" for e in coordinator.events())
    finally:
        coordinator.stop()
