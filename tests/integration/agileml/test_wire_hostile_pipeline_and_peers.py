"""The wire fuzz of issue #33 against the two listeners `test_wire_hostile_json` does not reach:
a hosted pipeline's node server (`NodePool`, the supervisor's ROUTER) and a worker's FlexRR
inboxes (`PeerLink`, read by its `Reassigner`). Hostile headers unsigned, forged and signed;
then valid signed headers over hostile bodies, from a registered node and from roster peers.
After every case the listener is alive, nothing is registered or delivered that should not be,
and a legitimate message is answered or delivered. Seeded, bounded."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.agileml import wire
from orchestrator.agileml.errors import AgileMLError
from orchestrator.agileml.peers import PeerInboxes, PeerLink
from orchestrator.agileml.pipeline.remote import NodePool
from orchestrator.agileml.reassign import Reassigner
from orchestrator.agileml.roster import Roster
from orchestrator.agileml.wire import MessageKind
from orchestrator.straggler.protocol import Begun
from orchestrator.straggler.spec import StragglerSpec
from tests.support.hostile_json import (
    FIELDS,
    FUZZ,
    HOW,
    Target,
    deep,
    hostile_frames,
    hostile_json,
    hostile_objects,
    signed_body_frames,
)

JOB, TOKEN = "job-hostile-pipe", secrets.token_bytes(32)
KNOWN = ("pipe", "peer", "register", "heartbeat", "exited", "reply", JOB, "b", "i-fuzz")
JSON = hostile_json(FIELDS, *KNOWN)
HEADERS = hostile_objects(FIELDS, *KNOWN)
PIPE_FIELDS = ["host", "tier", "name", "code", "stdout", "log", "rid", "profile", "error"]
PIPE_BODIES = hostile_objects(PIPE_FIELDS, "transient", "reliable", "stage0.0-a", "x")
PIPE_DETAILS = ["register", "hello", "heartbeat", "exited", "profiled", "reply", "?"]
PEER_FIELDS = ["type", "clock", "timer", "assignment", "roster_version", "start", "end", "rows",
               "listens", "assignments", "done_end", "loss_sum"]  # fmt: skip
PEER_BODIES = hostile_objects(
    PEER_FIELDS, "progress", "listening", "do_this", "begun", "cancel", "completed"
)


# -- a hosted pipeline's node server ------------------------------------------------------


def _pipe(sock: zmq.Socket[Any], sender: str, detail: str, body: dict[str, Any]) -> str:
    """Send a legitimate `pipe` message and return the detail of the answer."""
    fields = {"kind": MessageKind.PIPE, "job_id": JOB, "sender": sender, "seq": 1, "clock": 0,
              "detail": detail}  # fmt: skip
    sock.send_multipart(wire.encode(fields, wire.json_body(body), TOKEN))
    assert sock.poll(10_000), f"the node server did not answer a {detail}"
    header, _ = wire.decode(sock.recv_multipart(), TOKEN)
    return str(header.detail)


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NodePool, Target]]:
    """A live node server with one registered node, `i-fuzz`, whose socket the fuzz sends on."""
    pool = NodePool(job_id=JOB, token=TOKEN, host="127.0.0.1", port=0,
                    out_dir=Path(tmp_path_factory.mktemp("pool")), welcome={"code": "x"},
                    failure_timeout_s=3600.0)  # fmt: skip
    pool.start()
    target = Target(f"tcp://127.0.0.1:{pool.port}")
    try:
        assert _pipe(target.sock, "i-fuzz", "register", {"host": "h", "tier": "transient"}) == (
            "welcome"
        )
        yield pool, target
    finally:
        target.close()
        pool.stop()


def _pool_answers(pool: NodePool, *, registered_again: bool = False) -> None:
    """A legitimate hello is answered, the server has not crashed, and only `i-fuzz` is
    registered, as it registered (`registered_again`: with a tier and host that are ones)."""
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{pool.port}")
    try:
        assert _pipe(sock, "i-legit", "hello", {}) == "welcome"
    finally:
        sock.close()
        ctx.term()
    assert pool.crashed is None and pool.nodes() == ["i-fuzz"]
    if registered_again:
        assert pool.tiers()["i-fuzz"] in ("reliable", "transient")
        assert all(len(pool._nodes[n].host) <= 253 for n in pool.nodes())
    else:
        assert pool.tiers() == {"i-fuzz": "transient"}
        assert pool._nodes["i-fuzz"].host == "h"
    pool.profiles.clear()  # a signed node may say anything there; the supervisor validates it


@pytest.mark.parametrize("how", HOW)
@FUZZ
@given(header=HEADERS, body=JSON)
def test_the_pipeline_node_server_outlives_hostile_json(
    pool: tuple[NodePool, Target], header: str, body: str, how: str
) -> None:
    served, to_it = pool
    to_it.counts[how] += 1
    to_it.send(hostile_frames(header, body, how, TOKEN))
    _pool_answers(served)


@FUZZ
@given(detail=st.sampled_from(PIPE_DETAILS), body=PIPE_BODIES)
def test_a_registered_node_with_a_hostile_body_neither_kills_nor_bends_the_node_server(
    pool: tuple[NodePool, Target], detail: str, body: str
) -> None:
    """A valid, signed `pipe` header from the registered node over a hostile body: nothing
    registers with a tier that is not one, and the server goes on answering."""
    served, to_it = pool
    to_it.counts[f"signed {detail}"] += 1
    fields = {"kind": "pipe", "job_id": JOB, "sender": "i-fuzz", "seq": 2, "clock": 0,
              "detail": detail}  # fmt: skip
    to_it.send(signed_body_frames(fields, body.encode(), TOKEN))
    if detail == "register":  # a valid one registers it again: then put it back as it was
        _pool_answers(served, registered_again=True)
        assert _pipe(to_it.sock, "i-fuzz", "register", {"host": "h", "tier": "transient"}) == (
            "welcome"
        )
    _pool_answers(served)


def test_a_register_with_a_tier_or_host_that_is_none_is_refused(
    pool: tuple[NodePool, Target],
) -> None:
    served, to_it = pool
    fields = {"kind": "pipe", "job_id": JOB, "sender": "i-fuzz", "seq": 3, "clock": 0,
              "detail": "register"}  # fmt: skip
    for body in (b'{"tier":5}', b'{"tier":"spot"}', b'{"host":["h"]}',
                 b'{"host":"' + b"h" * 300 + b'"}'):  # fmt: skip
        to_it.send(signed_body_frames(fields, body, TOKEN))
        _pool_answers(served)


def test_the_node_server_answers_after_the_fuzz_and_counts_what_it_dropped(
    pool: tuple[NodePool, Target],
) -> None:
    """Runs after the fuzz above (pytest keeps the file's order): the counts go to the note."""
    served, to_it = pool
    for raw in (deep(100_000), b'{"seq":' + b"9" * 5000 + b"}", b'{"seq":true}'):
        to_it.send([raw])
        to_it.send([raw, raw])
    _pool_answers(served)
    print(f"wire fuzz: pipeline node server {dict(to_it.counts)}, dropped {served._drops.count}")
    assert served._drops.count > 0


# -- a worker's FlexRR inboxes -------------------------------------------------------------


@dataclass
class _Layout:
    num_partitions: int = 2

    def size(self, p: int) -> int:
        return 4


class _Worker:
    """What a `Reassigner` asks of its worker while it handles messages: its layout, and its
    share of a clock (refused here, so no offer is computed)."""

    layout = _Layout()

    def share_rows(self, helpee: str, clock: int) -> int:
        raise AgileMLError("no share here")


@dataclass
class Peers:
    link: PeerLink  # worker a's
    reassigner: Reassigner
    sender: PeerLink  # worker b's
    ctx: zmq.Context[Any]
    raw: dict[str, zmq.Socket[Any]]  # PUSH to a's work and progress inboxes


@pytest.fixture(scope="module")
def peers() -> Iterator[Peers]:
    link = PeerLink("a", job_id=JOB, token=TOKEN)
    sender = PeerLink("b", job_id=JOB, token=TOKEN)
    nowhere = PeerInboxes(work="tcp://127.0.0.1:9", progress="tcp://127.0.0.1:9")
    inboxes = {"a": link.endpoints, "b": sender.endpoints, "c": nowhere}
    reassigner = Reassigner(StragglerSpec(), worker_id="a", link=link)
    reassigner.update_view(epoch=0, roster=Roster.starting(list(inboxes)), peers=inboxes)
    ctx: zmq.Context[Any] = zmq.Context()
    raw = {}
    for name, endpoint in (("work", link.endpoints.work), ("progress", link.endpoints.progress)):
        raw[name] = ctx.socket(zmq.PUSH)
        raw[name].setsockopt(zmq.LINGER, 0)
        raw[name].connect(endpoint)
    yield Peers(link, reassigner, sender, ctx, raw)
    for sock in raw.values():
        sock.close()
    ctx.term()
    sender.close()
    link.close()


def _send_raw(peers: Peers, frames: list[bytes]) -> None:
    for sock in peers.raw.values():
        sock.send_multipart(frames)


def _handled(peers: Peers, *, refused: int | None = None) -> None:
    """The reassigner reads both inboxes (it must not raise; with `refused`, until both
    copies of the case are refused: nothing of it delivered), then a peer's message arrives
    (with `refused`: first, nothing else was)."""
    deadline = time.monotonic() + 10.0
    for _ in range(3):  # PUSH delivers asynchronously: give the case time to land
        peers.reassigner.check(_Worker(), timeout_ms=5)  # type: ignore[arg-type]
    while refused is not None and peers.link.refused_in < refused + 2:
        assert time.monotonic() < deadline, "a hostile frame was not refused"
        peers.reassigner.check(_Worker(), timeout_ms=20)  # type: ignore[arg-type]
    begun = Begun(clock=5, assignment=9)
    assert peers.sender.send(peers.link.endpoints.work, begun, epoch=0)
    got = peers.link.receive(10_000)
    while refused is None and got is not None and got[2] != begun:
        got = peers.link.receive(10_000)  # a signed case that was valid, read after the check
    assert got is not None and got[:3] == ("b", 0, begun), f"not delivered as sent: {got}"


@pytest.mark.parametrize("how", HOW)
@FUZZ
@given(header=HEADERS, body=JSON)
def test_a_workers_peer_inboxes_outlive_hostile_json(
    peers: Peers, header: str, body: str, how: str
) -> None:
    refused = peers.link.refused_in
    _send_raw(peers, hostile_frames(header, body, how, TOKEN))
    _handled(peers, refused=None if how == "signed" else refused)  # the others: refused


@FUZZ
@given(sender=st.sampled_from(["b", "c", "z"]), body=PEER_BODIES)
def test_a_peer_with_a_hostile_body_never_breaks_the_reassigner(
    peers: Peers, sender: str, body: str
) -> None:
    """A valid, signed `peer` header from a roster member (or a stranger) over a hostile body:
    refused unless it is a valid FlexRR message, and handling one never raises."""
    fields = {"kind": "peer", "job_id": JOB, "sender": sender, "seq": 1, "clock": 0, "epoch": 0}
    _send_raw(peers, signed_body_frames(fields, body.encode(), TOKEN))
    _handled(peers)


def test_hostile_peer_fields_are_refused_not_delivered(peers: Peers) -> None:
    """Bools for integers, non-finite timers and negative rows are no FlexRR message."""
    fields = {"kind": "peer", "job_id": JOB, "sender": "b", "seq": 1, "clock": 0, "epoch": 0}
    for body in (b'{"type":"begun","clock":true,"assignment":1}',
                 b'{"type":"progress","clock":1,"timer":NaN}',
                 b'{"type":"cancel","clock":1,"timer":Infinity,"assignments":[1]}',
                 b'{"type":"do_this","clock":1,"assignment":1,"start":-1,"end":2,"rows":3,'
                 b'"timer":0}',
                 b'{"type":"begun","clock":' + b"9" * 30 + b',"assignment":1}'):  # fmt: skip
        refused = peers.link.refused_in
        peers.raw["work"].send_multipart(signed_body_frames(fields, body, TOKEN))
        assert peers.link.receive(10_000) is None
        assert peers.link.refused_in == refused + 1, body


def test_the_peer_inboxes_deliver_after_the_fuzz(peers: Peers) -> None:
    """After the peer fuzz above (where it ran in this worker: pytest-xdist may run it in
    another) and a forged frame here, the inboxes still deliver; the counts go to the note."""
    refused = peers.link.refused_in
    _send_raw(peers, hostile_frames('{"kind": "peer"}', "{}", "forged", TOKEN))
    _handled(peers, refused=refused)
    stats = peers.reassigner.stats
    print(f"wire fuzz: peer inboxes refused {peers.link.refused_in}, "
          f"reassigner dropped {stats.dropped_messages}")  # fmt: skip
    assert peers.link.refused_in > 0
