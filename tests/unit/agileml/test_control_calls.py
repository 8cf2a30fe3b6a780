"""Control calls and the elasticity controller's reconfiguration thread under failures found
by the chaos soak: a call to a node that stopped heartbeating is not waited out, and the
reconfiguration thread never dies silently (the job would stall with nobody to notice), nor
does its serving thread on a hostile frame."""

from __future__ import annotations

import secrets
import threading
import time

import pytest
import zmq

from orchestrator.agileml import wire
from orchestrator.agileml.control import ControlClient, ControlError, ModelSpec, TrainingSpec
from orchestrator.agileml.coordinator import MAX_UNHEARD_S, Coordinator
from orchestrator.agileml.elasticity import NodeState

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


HOSTILE_BODIES = [
    b"[" * 100_000 + b"]" * 100_000,  # RecursionError once
    b'{"op":"heartbeat","clock":' + b"9" * 5000 + b"}",  # ValueError (int digits) once
    b'{"op":"heartbeat","clock":true}',
    b'{"op":"heartbeat","clock":NaN}',
]


def test_hostile_frames_never_silence_the_elasticity_controller() -> None:
    """Unauthenticated frames of the classes that once killed its serving thread, and the
    same bodies authenticated (a node with the token but a bug): each is refused, and a
    legitimate node is still answered."""
    spec = TrainingSpec(job_id="hostile", model=ModelSpec(kind="additive", features=8),
                        global_batch=8, iterations=10, num_partitions=1, min_nodes=1)  # fmt: skip
    coordinator = Coordinator(spec, token=TOKEN).start()
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(coordinator.endpoint)
    client = ControlClient(job_id="hostile", sender="n0", token=TOKEN)
    try:
        for body in HOSTILE_BODIES:
            raw.send_multipart([body])  # no authentication frame at all
            raw.send_multipart([b"\0" * wire.AUTH_BYTES, body])  # a forged one
            fields = {"kind": "control", "job_id": "hostile", "sender": "n0", "seq": 1}
            header = wire.canonical_json({**fields, "v": wire.PROTOCOL_VERSION, "tensors": [
                {"name": "body", "dtype": "uint8", "shape": [len(body)]}]})  # fmt: skip
            raw.send_multipart([wire.sign([header, body], TOKEN), header, body])
        reply = client.call(coordinator.endpoint, {"op": "heartbeat", "clock": 0}, 10.0)
        assert "ok" in reply  # answered (an unknown node's heartbeat is refused, politely)
        assert coordinator.error is None
    finally:
        client.close()
        raw.close()
        ctx.term()
        coordinator.stop()


def test_a_joiner_is_told_the_lowest_fp16_loss_scale_the_live_nodes_reported() -> None:
    """fp16: a node joining late starts at the running workers' loss scale, not at 2 ** 16
    (each overflow of a joiner's would skip a step for every worker)."""
    # the nodes stay live however slow this machine is (the hint counts live nodes only)
    spec = TrainingSpec(job_id="scale", model=ModelSpec(kind="additive", features=8),
                        global_batch=8, iterations=10, num_partitions=1, min_nodes=3,
                        failure_timeout_s=60.0)  # fmt: skip
    coordinator = Coordinator(spec, token=TOKEN).start()
    clients = {n: ControlClient(job_id="scale", sender=n, token=TOKEN) for n in ("a", "b", "c")}
    try:

        def call(node: str, body: dict[str, object]) -> dict[str, object]:
            return clients[node].call(coordinator.endpoint, body, 10.0)

        join = {"op": "join", "tier": "transient", "endpoint": "tcp://127.0.0.1:9"}
        assert call("a", join)["loss_scale_exponent"] is None  # nobody reported one yet
        call("b", join)
        for node, exponent in (("a", 12), ("b", 9)):
            call(node, {"op": "ready"})
            call(node, {"op": "heartbeat", "clock": 0, "loss_scale_exponent": exponent})
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and coordinator.members() != {"a", "b"}:
            time.sleep(0.05)
        reply = call("c", join)
        assert reply["ok"] and reply["loss_scale_exponent"] == 9
    finally:
        for client in clients.values():
            client.close()
        coordinator.stop()


def test_silence_counts_only_up_to_when_the_message_loop_last_caught_up(monkeypatch) -> None:
    """Slow is not dead: while the controller's own message loop cannot run (its process
    starved on a busy machine), the heartbeats waiting for it are not silence; once it has
    read everything, a node that really sent nothing is failed."""
    spec = TrainingSpec(job_id="slow", model=ModelSpec(kind="additive", features=8),
                        global_batch=8, iterations=10, num_partitions=1, min_nodes=2)  # fmt: skip
    clock = [1000.0]
    coordinator = Coordinator(spec, token=TOKEN, now=lambda: clock[0]).start()
    client = ControlClient(job_id="slow", sender="a", token=TOKEN)
    answer, stalled, resume = coordinator._answer, threading.Event(), threading.Event()
    held = threading.Event()

    def stalling(frames):
        if stalled.is_set():
            held.set()
            resume.wait(30.0)  # the loop cannot run: what else was sent waits in its queue
        return answer(frames)

    monkeypatch.setattr(coordinator, "_answer", stalling)
    replies: list[dict[str, object]] = []
    try:
        join = {"op": "join", "tier": "reliable", "endpoint": "tcp://127.0.0.1:9"}
        assert client.call(coordinator.endpoint, join, 30.0)["ok"]
        assert client.call(coordinator.endpoint, {"op": "ready"}, 30.0)["ok"]
        _wait_until(lambda: coordinator.node_state("a") is NodeState.READY, "never ready")
        stalled.set()
        beat = threading.Thread(
            target=lambda: replies.append(
                client.call(coordinator.endpoint, {"op": "heartbeat", "clock": 0}, 30.0)
            )
        )
        beat.start()
        assert held.wait(30.0)
        clock[0] += 10 * spec.failure_timeout_s  # the loop stalls; the node's beat waits
        assert coordinator._detect_failures() == []
        stalled.clear()
        resume.set()
        beat.join(30.0)
        assert not beat.is_alive() and replies and replies[0]["ok"]
        assert coordinator._detect_failures() == []  # heard: alive
        clock[0] += 2 * spec.failure_timeout_s  # now truly silent
        _wait_until(lambda: coordinator._detect_failures() == ["a"], "a silent node not failed")
        # a loop that never catches up (a flood) hides a silent node no longer than a bound
        assert client.call(coordinator.endpoint, {"op": "heartbeat", "clock": 0}, 30.0)["ok"]
        resume.clear()
        stalled.set()
        held.clear()
        threading.Thread(target=_call_quietly, args=(coordinator.endpoint,), daemon=True).start()
        assert held.wait(30.0)
        clock[0] += MAX_UNHEARD_S + 5 * spec.failure_timeout_s
        assert coordinator._detect_failures() == ["a"] or (
            coordinator.node_state("a") is NodeState.FAILED  # dropped as silent meanwhile
        )
    finally:
        resume.set()
        client.close()
        coordinator.stop()


def _call_quietly(endpoint: str) -> None:
    """A message from another node that the (stalled) loop takes and holds."""
    other = ControlClient(job_id="slow", sender="b", token=TOKEN)
    try:
        other.call(endpoint, {"op": "heartbeat", "clock": 0}, 5.0)
    except ControlError:
        pass
    finally:
        other.close()


def _wait_until(done, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)
