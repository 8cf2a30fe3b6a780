"""Partition hand-off between parameter servers: state, dedup set and ownership move intact."""

from __future__ import annotations

import secrets
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq
from support.wire_client import HELD_CHECK_MS, REPLY_TIMEOUT_MS, WireClient
from torch import nn

from orchestrator.agileml import wire
from orchestrator.agileml.elasticity import AgileMLStage, RolePlan
from orchestrator.agileml.errors import HandoffError, OwnershipConflictError, PartitionError
from orchestrator.agileml.examples import gaussian_mixture, initial_model, mlr_factory, shard
from orchestrator.agileml.node import hand_off
from orchestrator.agileml.partition_state import PartitionStore, PushOutcome
from orchestrator.agileml.partitions import Ownership, PartitionLayout, PartitionTable
from orchestrator.agileml.rejections import parse_moved
from orchestrator.agileml.server import ParamServer
from orchestrator.agileml.server_calls import rebalance, settle
from orchestrator.agileml.snapshots import snapshot_to_wire
from orchestrator.agileml.updates import sgd_rules
from orchestrator.agileml.wire import MessageKind
from orchestrator.agileml.worker import Worker, WorkerSpec

JOB, TOKEN = "job-h", b"handoff-test-token"
INITIAL = torch.tensor([1.0, 2.0, 3.0, 4.0])


def free_port() -> int:
    """A TCP port nobody listens on (for a receiver that does not answer, or not yet)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def pair() -> Iterator[tuple[ParamServer, ParamServer]]:
    threads_before = threading.active_count()
    old = ParamServer("ps-a", job_id=JOB, token=TOKEN)
    new = ParamServer("ps-b", job_id=JOB, token=TOKEN)
    old.add_partition(0, INITIAL)
    for ps in (old, new):
        ps.register_workers(["w0", "w1"])
    with old, new:
        yield old, new
    assert threading.active_count() == threads_before


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_store_snapshot_round_trip_keeps_values_applied_set_and_dedup() -> None:
    old, new = PartitionStore(), PartitionStore()
    old.add(3, INITIAL, version=4)
    old.register_workers(["w0", "w1"])
    d = torch.ones(4)
    assert old.apply_push(3, "w0", 0, d) is PushOutcome.APPLIED
    assert old.apply_push(3, "w0", 1, d) is PushOutcome.APPLIED
    snap = old.export_partition(3)
    assert (snap.version, snap.applied, snap.workers) == (4, {("w0", 0), ("w0", 1)}, ("w0", "w1"))
    assert [c for c, _ in snap.accum] == [0, 1]  # summed, not applied: w1 is missing
    assert new.import_partition(snap) == 5
    assert torch.equal(new.values(3), INITIAL)
    assert new.apply_push(3, "w0", 1, d) is PushOutcome.DUPLICATE  # replay after the hand-off
    assert new.consistent_clock(3) == -1  # w1 has pushed nothing yet
    assert new.apply_push(3, "w1", 0, d) is PushOutcome.APPLIED
    assert new.consistent_clock(3) == 0
    assert torch.equal(new.values(3), INITIAL + 2)  # clock 0 applied once: w0's and w1's
    assert new.apply_push(3, "w1", 1, 3 * d) is PushOutcome.APPLIED
    assert torch.equal(new.values(3), INITIAL + 6)


def test_store_refuses_an_older_snapshot() -> None:
    a, b = PartitionStore(), PartitionStore()
    a.add(0, INITIAL, version=2)
    stale = a.export_partition(0)
    assert b.import_partition(stale) == 3
    back = b.export_partition(0)
    with pytest.raises(OwnershipConflictError) as info:
        b.import_partition(stale)  # b holds version 3; 2 is older
    assert (info.value.expected_version, info.value.actual_version) == (2, 3)
    a.drop_partition(0, new_version=3)
    with pytest.raises(OwnershipConflictError):
        a.import_partition(stale)  # a gave it away at 3: its own old snapshot is stale too
    assert a.import_partition(back) == 4  # the current owner may hand it back


def test_handoff_moves_state_and_applied_set_over_the_wire(
    pair: tuple[ParamServer, ParamServer], ctx: zmq.Context[Any]
) -> None:
    old, new = pair
    w0 = WireClient(ctx, old.endpoint, "w0", job_id=JOB, token=TOKEN)
    d = torch.tensor([0.5, -1.0, 0.0, 2.0])
    assert w0.push(0, d).detail == "applied"
    result = old.handoff_to(0, new.endpoint)
    assert (result.partition, result.new_owner, result.version) == (0, "ps-b", 1)
    assert old.owned() == [] and new.owned() == [0]
    assert torch.equal(new.state(0), INITIAL)  # clock 0 waits for w1: summed, not applied
    snap = new.snapshot(0)
    assert (snap.applied, snap.version) == ({("w0", 0)}, 1)
    assert [(c, a.tolist()) for c, a in snap.accum] == [(0, d.tolist())]
    assert (old.stats().handoffs_sent, new.stats().handoffs_received) == (1, 1)

    # The push applied before the hand-off, replayed to the new owner, is a duplicate.
    w0_new = WireClient(ctx, new.endpoint, "w0", job_id=JOB, token=TOKEN)
    assert w0_new.push(0, d).detail == "duplicate"
    w1_new = WireClient(ctx, new.endpoint, "w1", job_id=JOB, token=TOKEN)
    assert w1_new.push(0, d).detail == "applied"
    assert torch.equal(new.state(0), INITIAL + 2 * d)  # clock 0 complete: applied once
    assert w0_new.push(1, d).detail == "applied"

    # The old owner refuses pushes and pulls for the partition and names the new owner.
    refused = w0.push(2, d)
    assert refused.kind is MessageKind.ERROR
    assert parse_moved(refused.detail) == ("ps-b", 1)
    pulled, _ = w0.request(MessageKind.PULL, partition=0, clock=-1)
    assert parse_moved(pulled.detail) == ("ps-b", 1)
    assert torch.equal(new.state(0), INITIAL + 2 * d)  # clock 1 still lacks w1


def test_held_pull_gets_moved_error_when_its_partition_is_handed_off(
    pair: tuple[ParamServer, ParamServer], ctx: zmq.Context[Any]
) -> None:
    old, new = pair
    w0 = WireClient(ctx, old.endpoint, "w0", job_id=JOB, token=TOKEN)
    w0.push(0, torch.ones(4))
    w0.seq += 1
    w0.sock.send_multipart(
        wire.encode(
            {
                "kind": MessageKind.PULL,
                "job_id": JOB,
                "sender": "w0",
                "seq": w0.seq,
                "partition": 0,
                "clock": 0,
            },
            {},
            TOKEN,
        )
    )  # waits for w1's clock 0
    assert not w0.sock.poll(200)
    old.handoff_to(0, new.endpoint)
    assert w0.sock.poll(REPLY_TIMEOUT_MS)
    header, _ = wire.decode(w0.sock.recv_multipart(), TOKEN)
    assert (header.kind, header.seq) == (MessageKind.ERROR, w0.seq)
    assert parse_moved(header.detail) == ("ps-b", 1)


class _SlowReceiver:
    """A receiver that takes a hand-off and answers only when told: the partition stays in
    flight at its sender meanwhile."""

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"

    def take(self) -> tuple[bytes, wire.Header]:
        assert self.sock.poll(REPLY_TIMEOUT_MS), "no hand-off came"
        identity, *frames = self.sock.recv_multipart()
        header, _ = wire.decode(frames, TOKEN)
        assert header.kind is MessageKind.HANDOFF
        return identity, header

    def answer(self, identity: bytes, header: wire.Header, **fields: Any) -> None:
        reply = {"kind": MessageKind.HANDOFF_ACK, "job_id": JOB, "sender": "ps-b",
                 "seq": header.seq, "partition": header.partition, **fields}  # fmt: skip
        self.sock.send_multipart([identity, *wire.encode(reply, {}, TOKEN)])


def _hand_off_in_background(
    old: ParamServer, endpoint: str, timeout_s: float = 10.0
) -> tuple[threading.Thread, list[Any]]:
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(old.handoff_to(0, endpoint, timeout_s=timeout_s))
        except HandoffError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def test_requests_during_a_handoff_wait_for_it_and_then_go_to_the_new_owner(
    ctx: zmq.Context[Any],
) -> None:
    """Parked, not refused: a worker asking again every few ms would re-send (and MAC) its
    whole push over and over, taking the cores the hand-off needs. Once the ack comes, the
    push and the pull parked meanwhile get `moved`, at once."""
    receiver = _SlowReceiver(ctx)
    with ParamServer("ps-a", job_id=JOB, token=TOKEN) as old:
        old.add_partition(0, INITIAL)
        old.register_workers(["w0", "w1"])
        thread, outcome = _hand_off_in_background(old, receiver.endpoint)
        identity, handoff = receiver.take()
        w0 = WireClient(ctx, old.endpoint, "w0", job_id=JOB, token=TOKEN)
        w1 = WireClient(ctx, old.endpoint, "w1", job_id=JOB, token=TOKEN)
        pushed = w0.send(MessageKind.PUSH, {"delta": torch.ones(4)}, partition=0, clock=0)
        pulled = w1.send(MessageKind.PULL, partition=0, clock=-1)
        assert w0.silent() and w1.silent()  # parked while the partition is in flight
        receiver.answer(identity, handoff, clock=1)
        thread.join(10)
        assert outcome[0].new_owner == "ps-b"
        for client, seq in ((w0, pushed), (w1, pulled)):
            header, _ = client.recv(REPLY_TIMEOUT_MS)
            assert (header.seq, parse_moved(header.detail)) == (seq, ("ps-b", 1))
        assert old.owned() == []  # the push was never applied here
    receiver.sock.close(linger=0)


def test_a_refused_handoff_serves_what_was_parked_and_an_unknown_one_has_it_ask_again(
    ctx: zmq.Context[Any],
) -> None:
    receiver = _SlowReceiver(ctx)
    with ParamServer("ps-a", job_id=JOB, token=TOKEN) as old:
        old.add_partition(0, INITIAL)
        old.register_workers(["w0"])
        w0 = WireClient(ctx, old.endpoint, "w0", job_id=JOB, token=TOKEN)
        # refused by the receiver: the sender serves the partition again, the push included
        thread, outcome = _hand_off_in_background(old, receiver.endpoint)
        identity, handoff = receiver.take()
        seq = w0.send(MessageKind.PUSH, {"delta": torch.ones(4)}, partition=0, clock=0)
        assert w0.silent()
        receiver.answer(identity, handoff, kind=MessageKind.ERROR, detail="stale_version")
        thread.join(10)
        assert isinstance(outcome[0], HandoffError) and not outcome[0].outcome_unknown
        header, _ = w0.recv()
        assert (header.seq, header.kind, header.detail) == (seq, MessageKind.PUSH_ACK, "applied")
        assert torch.equal(old.state(0), INITIAL + 1)
        # no answer at all: the outcome is unknown, and what was parked is told `moving`
        thread, outcome = _hand_off_in_background(old, receiver.endpoint, timeout_s=1.0)
        receiver.take()
        seq = w0.send(MessageKind.PUSH, {"delta": torch.ones(4)}, partition=0, clock=1)
        thread.join(10)
        assert isinstance(outcome[0], HandoffError) and outcome[0].outcome_unknown
        header, _ = w0.recv()
        assert (header.seq, header.detail) == (seq, "moving")
    receiver.sock.close(linger=0)


def test_a_parked_push_from_the_nodes_own_worker_is_kept_as_it_was_sent(
    ctx: zmq.Context[Any],
) -> None:
    """The own node's worker pushes over inproc without a copy (its buffer is the frame):
    what is parked is a copy, so a worker that fills its buffer again meanwhile does not
    change the push that a refused hand-off then applies."""
    receiver = _SlowReceiver(ctx)
    size = 1 << 16  # 256 KiB: above the size ZMQ copies anyway
    with ParamServer("ps-a", job_id=JOB, token=TOKEN) as old:
        old.add_partition(0, torch.zeros(size))
        old.register_workers(["w0"])
        thread, outcome = _hand_off_in_background(old, receiver.endpoint)
        identity, handoff = receiver.take()
        own = wire.process_context().socket(zmq.DEALER)
        own.setsockopt(zmq.LINGER, 0)
        own.connect(old.inproc_endpoint)
        gradient = torch.ones(size)
        push = {"kind": MessageKind.PUSH, "job_id": JOB, "sender": "w0", "seq": 1,
                "partition": 0, "clock": 0}  # fmt: skip
        own.send_multipart(wire.encode(push, {"delta": gradient}, TOKEN, zero_copy=True),
                           copy=False)  # fmt: skip
        assert not own.poll(HELD_CHECK_MS)  # parked
        gradient.fill_(1000.0)  # the worker's next use of its buffer
        receiver.answer(identity, handoff, kind=MessageKind.ERROR, detail="stale_version")
        thread.join(10)
        assert isinstance(outcome[0], HandoffError)
        assert own.poll(REPLY_TIMEOUT_MS)
        header, _ = wire.decode(own.recv_multipart(), TOKEN)
        assert (header.kind, header.detail) == (MessageKind.PUSH_ACK, "applied")
        assert torch.equal(old.state(0), torch.ones(size))
        own.close(linger=0)
    receiver.sock.close(linger=0)


def test_a_resent_handoff_is_taken_once_and_acknowledged_again(
    pair: tuple[ParamServer, ParamServer], ctx: zmq.Context[Any]
) -> None:
    old, new = pair
    sent = old.snapshot(0)
    old.handoff_to(0, new.endpoint)
    w1 = WireClient(ctx, new.endpoint, "w1", job_id=JOB, token=TOKEN)
    assert w1.push(0, torch.ones(4)).detail == "applied"
    workers, tensors = snapshot_to_wire(sent)
    # the same hand-off again (its ack was lost): acknowledged, not imported over the push
    resend = WireClient(ctx, new.endpoint, "ps-a", job_id=JOB, token=TOKEN)
    header, _ = resend.request(MessageKind.HANDOFF, tensors, partition=0, workers=workers)
    assert (header.kind, header.clock) == (MessageKind.HANDOFF_ACK, 1)
    assert new.snapshot(0).applied == {("w1", 0)} and new.stats().handoffs_received == 1


def test_older_snapshot_over_the_wire_is_refused(
    pair: tuple[ParamServer, ParamServer], ctx: zmq.Context[Any]
) -> None:
    old, new = pair
    stale = old.snapshot(0)
    old.handoff_to(0, new.endpoint)
    workers, tensors = snapshot_to_wire(stale)
    # the same snapshot from another sender is not a resend: refused as stale
    replay = WireClient(ctx, new.endpoint, "ps-z", job_id=JOB, token=TOKEN)
    header, _ = replay.request(MessageKind.HANDOFF, tensors, partition=0, workers=workers)
    assert (header.kind, header.detail) == (MessageKind.ERROR, "stale_version")
    assert new.snapshot(0).version == 1 and torch.equal(new.state(0), INITIAL)


def test_refused_handoff_leaves_the_sender_serving(ctx: zmq.Context[Any]) -> None:
    with (
        ParamServer("ps-a", job_id=JOB, token=TOKEN) as old,
        ParamServer("ps-c", job_id=JOB, token=TOKEN) as newer,
    ):
        old.add_partition(0, INITIAL, version=1)
        old.register_workers(["w0"])
        newer.add_partition(0, torch.zeros(4), version=5)  # already holds a newer version
        with pytest.raises(HandoffError) as info:
            old.handoff_to(0, newer.endpoint, timeout_s=2.0)
        assert (info.value.reason, info.value.outcome_unknown) == ("stale_version", False)
        assert old.owned() == [0] and old.stats().handoffs_sent == 0
        assert (
            WireClient(ctx, old.endpoint, "w0", job_id=JOB, token=TOKEN)
            .push(0, torch.ones(4))
            .detail
            == "applied"
        )


def test_unauthenticated_ack_keeps_the_partition_frozen_until_resumed(
    ctx: zmq.Context[Any],
) -> None:
    with (
        ParamServer("ps-a", job_id=JOB, token=TOKEN) as old,
        ParamServer("ps-x", job_id=JOB, token=b"another-job-token") as stranger,
    ):
        old.add_partition(0, INITIAL)
        old.register_workers(["w0"])
        with pytest.raises(HandoffError) as info:
            old.handoff_to(0, stranger.endpoint, timeout_s=2.0)
        assert (info.value.reason, info.value.outcome_unknown) == ("bad_mac", True)
        w0 = WireClient(ctx, old.endpoint, "w0", job_id=JOB, token=TOKEN)
        assert w0.push(0, torch.ones(4)).detail == "moving"  # frozen: outcome unknown
        old.resume_partition(0)  # the operator checked: the stranger did not take it
        assert w0.push(0, torch.ones(4)).detail == "applied"
        assert torch.equal(old.state(0), INITIAL + 1)


def test_a_handoff_without_an_ack_can_be_sent_again_to_the_same_receiver_only() -> None:
    port = free_port()
    receiver = f"tcp://127.0.0.1:{port}"
    with ParamServer("ps-a", job_id=JOB, token=TOKEN) as old:
        old.add_partition(0, INITIAL)
        old.register_workers(["w0"])
        with pytest.raises(HandoffError) as info:
            old.handoff_to(0, receiver, timeout_s=0.3)  # nobody listens there yet
        assert (info.value.reason, info.value.outcome_unknown) == ("timeout", True)
        assert old.unsettled() == {0: receiver}
        with pytest.raises(PartitionError, match="unknown outcome"):
            old.handoff_to(0, "tcp://127.0.0.1:1", timeout_s=0.3)
        with ParamServer("ps-b", job_id=JOB, token=TOKEN, port=port) as new:
            assert old.handoff_to(0, receiver, timeout_s=5.0).new_owner == "ps-b"
            assert old.unsettled() == {} and new.owned() == [0]
            assert torch.equal(new.state(0), INITIAL)


def test_rebalance_settles_a_dead_receivers_handoffs_and_keeps_the_live_ones() -> None:
    """`rebalance` with the node's `handoff` op on real servers: the move to a live node
    lands, the one to a node that never answers is left unsettled, and `settle` has the
    old owner serve it again."""
    dead = f"tcp://127.0.0.1:{free_port()}"
    with (
        ParamServer("a", job_id=JOB, token=TOKEN) as a,
        ParamServer("b", job_id=JOB, token=TOKEN) as b,
    ):
        table = PartitionTable(4)
        for p in range(4):
            a.add_partition(p, INITIAL + p, version=table.move(p, "a"))
        servers = {"a": a, "b": b}
        ops: list[str] = []

        def call(node: str, body: dict[str, Any]) -> dict[str, Any]:
            ops.append(f"{body['op']} {node}")
            moves = {int(p): str(e) for p, e in body.get("moves", {}).items()}
            if body["op"] == "handoff":
                return hand_off(servers[node], moves, timeout_s=0.3)
            for p in body["partitions"]:
                servers[node].resume_partition(int(p))
            return {}

        nodes = ("a", "b", "c")
        plan = RolePlan(AgileMLStage.PARAMSERV_ONLY, nodes, (), (), nodes)
        done = rebalance(
            call,
            plan=plan,
            table=table,
            endpoints={"a": a.endpoint, "b": b.endpoint, "c": dead},
            alive=lambda node: node != "c",
        )
        moved_to_c = sorted(done.unsettled["a"])
        assert done.moved and done.unsettled == {"a": dict.fromkeys(moved_to_c, "c")}
        assert ops == ["handoff a"]  # a dead receiver's hand-off is not sent again
        assert sorted(b.owned()) == [p for p in range(4) if table.owner(p) == "b"] != []
        assert all(table.owner(p) == "a" for p in moved_to_c)
        assert a.unsettled() == dict.fromkeys(moved_to_c, dead)
        settle(call, done.unsettled)
        assert a.unsettled() == {} and sorted(a.owned()) == sorted(
            p for p in range(4) if table.owner(p) == "a"
        )
        a.register_workers(["w0"])
        with zmq.Context() as ctx:  # served again: a push to a resumed partition is applied
            w0 = WireClient(ctx, a.endpoint, "w0", job_id=JOB, token=TOKEN)
            assert w0.push(moved_to_c[0], torch.ones(4)).detail == "applied"
            w0.sock.close(linger=0)


FEATURES, CLASSES = 8, 3
DATA = gaussian_mixture(1200, FEATURES, CLASSES, seed=5)


def _full_loss(model: nn.Module) -> float:
    with torch.no_grad():
        return float(nn.functional.cross_entropy(model(DATA[0]), DATA[1]))


def test_two_worker_mlr_keeps_learning_across_a_mid_run_handoff() -> None:
    threads_before = threading.active_count()
    token, factory, n_parts = secrets.token_bytes(16), mlr_factory(FEATURES, CLASSES), 4
    model = initial_model(factory, seed=2)
    layout, table = PartitionLayout(model, n_parts), PartitionTable(n_parts)
    table.assign_round_robin(["ps-0", "ps-1"])
    servers = {sid: ParamServer(sid, job_id=JOB, token=token) for sid in ("ps-0", "ps-1")}
    parts = layout.gather(model)
    for sid, server in servers.items():
        server.set_update_rules(sgd_rules(0.5))
        for p in table.owned_by(sid):
            server.add_partition(p, parts[p], version=table.get(p).version)
        server.register_workers(["w-0", "w-1"])

    def current_model() -> nn.Module:
        out = initial_model(factory, seed=2)
        layout.scatter(out, [servers[table.owner(p)].state(p) for p in range(n_parts)])
        return out

    def run_all(workers: list[Worker], iterations: int) -> list[BaseException]:
        errors: list[BaseException] = []

        def body(w: Worker) -> None:
            try:
                w.run(iterations)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=body, args=(w,)) for w in workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return errors

    try:
        for server in servers.values():
            server.start()
        endpoints = {sid: s.endpoint for sid, s in servers.items()}
        workers = [
            Worker(
                WorkerSpec(f"w-{i}", JOB, batch_size=32, seed=2, request_timeout_s=5.0),
                token=token,
                layout=layout,
                table=table,
                endpoints=endpoints,
                model_factory=factory,
                data=shard(DATA, 2, i),
                loss_fn=nn.functional.cross_entropy,
            )
            for i in range(2)
        ]
        start = _full_loss(current_model())
        assert run_all(workers, 10) == []
        mid = _full_loss(current_model())
        assert mid < start

        moved = servers["ps-0"].handoff_to(0, endpoints["ps-1"])  # ps-0 is being evicted
        # the table is stale: the old owner names the new one, and the workers follow it
        assert run_all(workers, 5) == []
        assert table.get(0) == Ownership("ps-1", moved.version)
        assert [w.clock for w in workers] == [15, 15]
        assert run_all(workers, 5) == []
        assert [w.clock for w in workers] == [20, 20]
        assert _full_loss(current_model()) < mid
        stats = servers["ps-1"].stats()
        assert stats.pushes_duplicate == 0 and stats.handoffs_received == 1
    finally:
        for server in servers.values():
            server.stop()
    assert threading.active_count() == threads_before
