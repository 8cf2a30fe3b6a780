"""Transient nodes lost one after another, or during a recovery, never abort a job whose
reliable node lives (the chaos soak's unexpected aborts). In one process: an elasticity
controller and node threads on the additive probe, whose exact final parameters show any lost
or doubled update. A node dies by `AgileMLNode.stop` (its server and heartbeats stop, as a
SIGKILL would stop them), injected at the moment each race needs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from support.agileml_jobs import WAIT_S, Gate, Hook, InjectedCrash, Job, additive_spec, chain

from orchestrator.agileml import coordinator as coordinator_module
from orchestrator.agileml.control import Left, TrainingSpec
from orchestrator.agileml.elasticity import AgileMLStage, NodeState, NodeTier, RolePlan
from orchestrator.agileml.errors import AgileMLError

TRANSIENT = ("t0", "t1", "t2")


@dataclass
class Crasher:
    """Phase hooks for the transient nodes; `target` dies once pulled for `clock`."""

    target: str = ""
    clock: int = -1
    fired: threading.Event = field(default_factory=threading.Event)

    def hook(self, node_id: str) -> Hook:
        def run(phase: str, clock: int) -> None:
            armed = (node_id, phase, clock) == (self.target, "pulled", self.clock)
            if armed and not self.fired.is_set():
                self.fired.set()
                raise InjectedCrash(f"{node_id} crashed at clock {clock}")

        return run


def _kill(job: Job, node_id: str) -> None:
    """The node dies: its worker, server and heartbeats stop."""
    job.nodes[node_id].stop()
    job.wait_for(f"{node_id} to be dead", lambda: node_id in job.outcomes)


def _start(
    job: Job, transient: tuple[str, ...], crasher: Crasher, *r0: Hook
) -> tuple[Gate, list[str]]:
    """Launch r0 (held at clock 3, then `r0` hooks) and the transient nodes; returns the
    gate and the ActivePSs of stage 2."""
    gate = job.gate(3)
    job.launch("r0", NodeTier.RELIABLE, hook=chain(gate, *r0))
    for t in transient:
        job.launch(t, hook=crasher.hook(t))
    view = job.wait_started()
    assert view.stage == 2
    gate.wait_reached()
    return gate, sorted(set(view.owners.values()))


def _finish_exact(job: Job) -> None:
    for gate in job.gates:
        gate.released.set()
    assert job.coord.wait_done(2 * WAIT_S), f"not done: {job.coord.events()}"
    assert job.coord.error is None, job.coord.error
    assert torch.equal(job.finish(), job.expected())
    job.close()
    assert job.ended("r0") == "done"


def test_the_active_ps_dying_while_the_job_drops_to_stage1_is_rolled_back_not_lost(
    jobs: Callable[[TrainingSpec], Job],
) -> None:
    """1 reliable + 2 transient nodes (stage 2: one ActivePS). The worker-only node dies, so
    the job drops to stage 1, whose ParamServs are on r0; the ActivePS dies too, before it has
    handed anything to r0. Its partitions must still have their BackupPS: the controller keeps
    the stage-2 backups until the hand-offs to r0 are done (it dropped them at once, and the
    roll-back found "partitions lost: no BackupPS" while r0 held every clock of them)."""
    job = jobs(additive_spec("drop-race", min_nodes=3))
    crasher = Crasher()
    gate, (active,) = _start(job, TRANSIENT[:2], crasher)
    original = job.coord._rebalance
    raced = threading.Event()

    def rebalance(client: Any, plan: RolePlan) -> None:
        if plan.stage is AgileMLStage.PARAMSERV_ONLY and not raced.is_set():
            raced.set()
            _kill(job, active)  # before its partitions are handed to r0
        original(client, plan)

    job.coord._rebalance = rebalance  # type: ignore[method-assign]
    crasher.target, crasher.clock = ({"t0", "t1"} - {active}).pop(), 8
    gate.released.set()

    job.wait_for("the race", raced.is_set)
    _finish_exact(job)
    assert job.event_nodes("failed") == {crasher.target}
    assert job.event_nodes("rolled_back") == {active}
    view = job.coord.view()
    assert view.stage == 1 and view.backups == {}  # dropped once all was on r0


def test_a_node_dying_while_the_controller_recovers_from_another_is_recovered_too(
    jobs: Callable[[TrainingSpec], Job], monkeypatch: pytest.MonkeyPatch
) -> None:
    """1 reliable + 3 transient nodes (stage 2: two ActivePSs). The worker-only node dies;
    while the controller asks the owners which of its clocks are unfinished, an ActivePS dies
    too. The recovery goes on from both losses (a roll-back); it aborted the job."""
    job = jobs(additive_spec("second-death", min_nodes=4))
    crasher = Crasher()
    gate, active = _start(job, TRANSIENT, crasher)
    assert len(active) == 2
    original = coordinator_module.unfinished_clocks
    raced = threading.Event()

    def unfinished_clocks(call: Any, failed: str, table: Any) -> tuple[int, int]:
        if not raced.is_set():
            raced.set()
            _kill(job, active[0])  # an owner the controller is about to ask
        return original(call, failed, table)

    monkeypatch.setattr(coordinator_module, "unfinished_clocks", unfinished_clocks)
    crasher.target, crasher.clock = (set(TRANSIENT) - set(active)).pop(), 8
    gate.released.set()

    job.wait_for("the race", raced.is_set)
    _finish_exact(job)
    assert job.event_nodes("rolled_back") == {crasher.target, active[0]}, job.coord.events()


def test_a_push_that_arrives_after_the_controller_asked_moves_the_failed_nodes_end_later(
    jobs: Callable[[TrainingSpec], Job], monkeypatch: pytest.MonkeyPatch
) -> None:
    """1 reliable + 3 transient nodes. A worker-only node dies at clock 8; the survivors'
    pushes of clock 8 reach a server after the controller asked which clocks were unfinished
    (injected: its answer misses them). A server then refuses the roster that drops the node
    from clock 8: the controller must ask again and drop it later, with its shares adopted up
    to there. It logged the refusal and went on, and the servers disagreed on the roster: the
    chaos soak's job ended with parameters off the exact ones (no update lost or doubled in
    all: rows of one clock computed twice, others never)."""
    job = jobs(additive_spec("late-push", min_nodes=4))
    crasher = Crasher()
    gate, active = _start(job, TRANSIENT, crasher)
    original = coordinator_module.unfinished_clocks
    asked: list[tuple[int, int]] = []

    def unfinished_clocks(call: Any, failed: str, table: Any) -> tuple[int, int]:
        first, end = original(call, failed, table)
        asked.append((first, end))
        return (first, first) if len(asked) == 1 else (first, end)  # the first misses clock 8

    monkeypatch.setattr(coordinator_module, "unfinished_clocks", unfinished_clocks)
    crasher.target, crasher.clock = (set(TRANSIENT) - set(active)).pop(), 8
    gate.released.set()

    job.wait_for("its failure", lambda: crasher.target in job.event_nodes("failed"))
    _finish_exact(job)
    assert len(asked) >= 2 and asked[0] == (8, 9), asked
    adoption = job.coord.view().adoptions[crasher.target]
    assert (adoption.from_clock, adoption.to_clock) == (8, 9), adoption


def test_an_evicted_node_that_dies_after_leaving_the_roster_leaves_no_shares_to_adopt(
    jobs: Callable[[TrainingSpec], Job],
) -> None:
    """1 reliable + 3 transient nodes. A worker-only node gets its notice, leaves the roster
    and dies before its `left` arrives, while r0 is held at a later clock that the others have
    pushed. The node computes none of the clocks the controller finds unfinished: no survivor
    may be given its share of them (r0, given one, crashed on it and the job aborted)."""
    job = jobs(additive_spec("evicted-death", min_nodes=4))
    later = job.gate()  # armed once the eviction's clock is known
    gate, active = _start(job, TRANSIENT, Crasher(), later)
    leaver = (set(TRANSIENT) - set(active)).pop()
    node = job.nodes[leaver]
    send = node._send

    def lose_left(client: Any, message: Any) -> Any:
        if isinstance(message, Left):  # it dies before its `left` arrives
            later.reached.wait(WAIT_S)
            time.sleep(0.3)  # the others push r0's held clock meanwhile
            return None
        return send(client, message)

    node._send = lose_left  # type: ignore[method-assign]
    node.leave()
    job.wait_for("the eviction", lambda: bool(job.event_nodes("evicted")))
    (evicted,) = [e for e in job.coord.events() if e.kind == "evicted"]
    later.clock = int(evicted.detail.rsplit(" ", 1)[1]) + 2  # "out from clock N"
    gate.released.set()

    job.wait_for("its failure", lambda: leaver in job.event_nodes("failed"))
    assert leaver not in job.coord.view().adoptions, job.coord.events()
    _finish_exact(job)
    assert job.ended(leaver) == "left"


def test_a_joiner_whose_scale_up_failed_joins_at_the_next_step(
    jobs: Callable[[TrainingSpec], Job],
) -> None:
    """The roster change that adds a ready node fails once (here injected; in the soak a
    server refused every clock tried). The node joins at the next step: it stayed `ready`
    for good, a worker in the roster of later joins yet outside the plan of a failure."""
    job = jobs(additive_spec("join-retry", min_nodes=2))
    gate = job.gate(3)
    job.launch("r0", NodeTier.RELIABLE, hook=gate)
    job.launch("t0")
    job.wait_started()
    gate.wait_reached()
    original = job.coord._schedule
    refused = threading.Event()

    def schedule(client: Any, plan: RolePlan, change: Any) -> Any:
        if not refused.is_set():
            refused.set()
            raise AgileMLError("could not schedule a roster change: injected")
        return original(client, plan, change)

    job.coord._schedule = schedule  # type: ignore[method-assign]
    job.launch("t1")
    job.wait_for("the refused join", refused.is_set)
    job.wait_for("t1 to join", lambda: "t1" in job.event_nodes("joined"))
    assert job.coord.node_state("t1") is NodeState.ACTIVE
    _finish_exact(job)
    assert job.ended("t1") == "done"
