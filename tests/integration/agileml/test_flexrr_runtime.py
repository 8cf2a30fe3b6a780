"""FlexRR in the AgileML runtime: real nodes (threads, real sockets) training the additive probe
under injected stragglers, whose exact final parameters show any row whose update was lost or
added twice while work moved between workers.

Skewed work (`UnevenWorkload`: the first half of the ranks own rows that cost 3x) makes the
heavy workers fall behind every iteration, so reassignment happens on every run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Literal

import pytest
import torch
import zmq
from pydantic import ValidationError
from support.agileml_jobs import TOKEN, WAIT_S, Job

from orchestrator.agileml import wire
from orchestrator.agileml.control import ModelSpec, TrainingSpec
from orchestrator.agileml.elasticity import NodeTier
from orchestrator.agileml.node import AgileMLNode, NodeResult
from orchestrator.agileml.reassign import Reassigner
from orchestrator.agileml.wire import MessageKind
from orchestrator.straggler.patterns import InjectedWork, UnevenWorkload
from orchestrator.straggler.protocol import DoThis
from orchestrator.straggler.spec import StragglerSpec

NODES = ("n0", "n1", "n2", "n3")


def _spec(
    job_id: str,
    *,
    flexrr: bool = True,
    iterations: int = 10,
    slack: int = 1,
    preload: Literal["all", "tail"] = "tail",
) -> TrainingSpec:
    return TrainingSpec(
        job_id=job_id,
        model=ModelSpec(kind="additive", features=8),
        samples=512,
        global_batch=64,  # 16 rows per worker; a power of two keeps float32 sums exact
        lr=1.0,
        slack=slack,
        iterations=iterations,
        num_partitions=4,
        min_nodes=len(NODES),
        heartbeat_s=0.1,
        # generous: the nodes are threads of this process, and a loaded machine (CI) can hold
        # a heartbeat back long enough to take the reliable node for dead
        failure_timeout_s=2.0,
        straggler=StragglerSpec(
            flexrr=flexrr,
            helper_group_size=3,
            initial_assignment=0.125,  # 2 rows of 16
            follow_up_assignment=0.25,  # 4 rows
            checks_per_iteration=16,  # one check per row
            max_chunk_overhead=10.0,  # rows stay 1-row chunks even on a loaded machine
            preload=preload,
            injected=InjectedWork(pattern=UnevenWorkload(heavy_share=0.75), row_ms=4.0),
        ),
    )


def _run(job: Job) -> None:
    """One reliable and three transient nodes: stage 2, so a transient node may fail."""
    for node in NODES:
        job.launch(node, NodeTier.RELIABLE if node == "n0" else NodeTier.TRANSIENT)


def _reassigner(node: AgileMLNode) -> Reassigner:
    deadline = time.monotonic() + WAIT_S
    while node._reassigner is None:  # built once the node has its spec
        assert time.monotonic() < deadline, "the node never loaded"
        time.sleep(0.005)
    return node._reassigner


def _stats(job: Job) -> dict[str, dict[str, float]]:
    """Every node's FlexRR counters, once the job is shut down (nodes owning partitions wait
    for the shutdown after the last clock)."""
    job.coord.stop()
    job.wait_for("every node to exit", lambda: len(job.outcomes) == len(job.nodes))
    out = {}
    for node_id, outcome in job.outcomes.items():
        assert isinstance(outcome, NodeResult), f"{node_id} crashed: {outcome!r}"
        out[node_id] = outcome.straggler
    return out


def _total(stats: dict[str, dict[str, float]], key: str) -> float:
    return sum(s.get(key, 0.0) for s in stats.values())


@pytest.mark.parametrize(
    ("slack", "preload"), [(0, "tail"), (1, "all")], ids=["bsp_rr", "flexrr_preload_all"]
)
def test_slow_workers_get_help_and_every_row_is_applied_once(
    jobs: Callable[[TrainingSpec], Job], slack: int, preload: Literal["all", "tail"]
) -> None:
    job = jobs(_spec(f"help-{slack}", slack=slack, preload=preload))
    _run(job)
    params = job.finish()
    assert torch.equal(params, job.expected())
    stats = _stats(job)
    helped = _total(stats, "rows_helped_by_others")
    assert helped > 0, stats
    # helpers computed at least what was accepted (more if a cancel crossed a `begun`)
    assert _total(stats, "rows_helped_for_others") >= helped
    heavy = stats["n0"]["rows_helped_by_others"] + stats["n1"]["rows_helped_by_others"]
    light = stats["n2"]["rows_helped_by_others"] + stats["n3"]["rows_helped_by_others"]
    assert heavy > light, stats  # help flows to the workers that own the costly rows
    assert _total(stats, "preload_hits") > 0


def test_flexrr_off_never_moves_work(jobs: Callable[[TrainingSpec], Job]) -> None:
    job = jobs(_spec("off", flexrr=False, iterations=4))
    _run(job)
    assert torch.equal(job.finish(), job.expected())
    stats = _stats(job)
    assert _total(stats, "rows_helped_by_others") == 0
    assert _total(stats, "offers") == 0
    assert all(job.nodes[n].view.peers == {} for n in NODES)  # no inbox advertised


def test_helper_evicted_mid_help_returns_its_unfinished_rows(
    jobs: Callable[[TrainingSpec], Job],
) -> None:
    """n3 (light rows) gets its eviction notice while computing a helpee's rows: it sends back
    what it did and returns the rest, which the helpee does itself; then n3 leaves."""
    # iterations past the roster change's horizon even when a busy machine delays it (12
    # once ended "done": the change came after the last clock)
    job = jobs(_spec("evict-helper", iterations=30))
    _run(job)
    node = job.nodes["n3"]
    reassigner = _reassigner(node)
    original = reassigner._work
    noticed = threading.Event()

    def work(w, identity, clock, span, own_fraction):  # type: ignore[no-untyped-def]
        if identity != "n3" and clock >= 2 and not noticed.is_set():
            noticed.set()
            node.leave()  # the notice arrives in the middle of a help
        return original(w, identity, clock, span, own_fraction)

    reassigner._work = work  # type: ignore[method-assign]
    assert torch.equal(job.finish(), job.expected())
    assert noticed.is_set()
    stats = _stats(job)
    assert stats["n3"]["returned"] >= 1, stats
    assert job.ended("n3") == "left"
    assert "evicted" in {e.kind for e in job.coord.events()}


class HelperDied(RuntimeError):
    """Raised inside a help: the helper's node dies right there."""


def test_helper_that_dies_mid_help_loses_no_rows(jobs: Callable[[TrainingSpec], Job]) -> None:
    """n3 dies while computing a helpee's rows: the helpee takes them back (deadline or the
    roll-back that follows the failure), and the job still ends exact."""
    job = jobs(_spec("die-helper", iterations=12))
    _run(job)
    reassigner = _reassigner(job.nodes["n3"])
    original = reassigner._work
    died = threading.Event()

    def work(w, identity, clock, span, own_fraction):  # type: ignore[no-untyped-def]
        if identity != "n3" and clock >= 2:
            died.set()
            raise HelperDied("killed mid-help")
        return original(w, identity, clock, span, own_fraction)

    reassigner._work = work  # type: ignore[method-assign]
    assert torch.equal(job.finish(), job.expected())
    assert died.is_set()
    assert isinstance(job.outcomes["n3"], HelperDied)
    # "rolled_back" when n3 owned partitions (an ActivePS), "failed" when it was a worker only
    assert {"failed", "rolled_back"} & {e.kind for e in job.coord.events()}


def test_forged_and_foreign_peer_messages_are_dropped(jobs: Callable[[TrainingSpec], Job]) -> None:
    """A `do_this` with a wrong MAC, and a validly signed one from a non-member, change
    nothing: the job ends exact and the forged one is counted as refused."""
    job = jobs(_spec("forged", iterations=6))
    _run(job)
    target = _reassigner(job.nodes["n0"])
    assert target.link is not None
    offer = DoThis(clock=1, assignment=0, start=0, end=4, rows=16, timer=time.time())
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(target.link.endpoints.work)
    fields = {"kind": MessageKind.PEER, "job_id": "forged", "seq": 1, "clock": 1, "epoch": 1}
    body = wire.json_body(offer.model_dump(mode="json"))
    sock.send_multipart(wire.encode({**fields, "sender": "n1"}, body, b"wrong-token" * 3))
    sock.send_multipart(wire.encode({**fields, "sender": "intruder"}, body, TOKEN))
    try:
        assert torch.equal(job.finish(), job.expected())
    finally:
        sock.close()
        ctx.term()
    stats = _stats(job)["n0"]
    assert stats["refused_messages"] >= 1
    assert stats["dropped_messages"] >= 1


def test_training_spec_turns_flexrr_off_from_json() -> None:
    on = TrainingSpec.model_validate({"job_id": "j"})
    assert on.straggler.flexrr and on.straggler.helper_group_size == 4  # Table 3.1 defaults
    off = TrainingSpec.model_validate_json('{"job_id": "j", "straggler": {"flexrr": false}}')
    assert not off.straggler.flexrr


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"initial_assignment": 0}, "initial_assignment"),
        ({"initial_assignment": 0.1, "follow_up_assignment": 0.05}, "follow_up_assignment"),
        ({"checks_per_iteration": 0}, "checks_per_iteration"),
        ({"injected": {"pattern": {"kind": "power_law", "alpha": 1.5}}}, "alpha"),
        ({"flexr": False}, "flexr"),
    ],
)
def test_bad_straggler_settings_are_refused_naming_the_field(
    settings: dict[str, object], field: str
) -> None:
    with pytest.raises(ValidationError, match=field):
        TrainingSpec.model_validate({"job_id": "j", "straggler": settings})


def test_flexrr_nodes_push_partitions_during_backward(
    jobs: Callable[[TrainingSpec], Job],
) -> None:
    """FlexRR on, nobody straggling: each share is one chunk, so its partitions leave from the
    gradient hooks (the overlap path). Exactness through it: the user-job tests (processes,
    8 partitions, FlexRR on) and `test_agileml_training` (bit for bit, overlap on and off);
    here the nodes are threads of one process, whose built-in models draw their initial
    weights from the shared global generator, so two runs do not start alike."""
    counts = {}
    for overlap in (True, False):
        spec = TrainingSpec(
            job_id=f"early-{overlap}",
            model=ModelSpec(kind="mlp", features=12, hidden=24, classes=3),
            samples=256,
            global_batch=32,
            iterations=12,
            num_partitions=4,
            min_nodes=2,
            heartbeat_s=0.1,
            failure_timeout_s=2.0,
            overlap=overlap,
        )
        job = jobs(spec)
        job.launch("r0", NodeTier.RELIABLE)
        job.launch("t0")
        assert torch.isfinite(job.finish()).all()
        counts[overlap] = [n._worker.early_pushes for n in job.nodes.values() if n._worker]
        job.close()
    assert len(counts[True]) == 2 and all(count > 0 for count in counts[True]), counts
    assert not any(counts[False]), counts
