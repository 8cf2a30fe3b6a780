"""A test harness for AgileML jobs in one process: an elasticity controller and node threads.

`jobs` (a pytest fixture) makes `Job`s and, at the end, stops them and checks that no thread
outlives the test. `Gate` is a phase hook that holds a worker at a clock until released.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import torch

from orchestrator.agileml.control import ModelSpec, TrainingSpec, View
from orchestrator.agileml.coordinator import Coordinator
from orchestrator.agileml.elasticity import NodeState, NodeTier
from orchestrator.agileml.examples import additive_expected
from orchestrator.agileml.node import AgileMLNode, NodeResult

TOKEN = secrets.token_bytes(32)
WAIT_S = 60.0  # bound on any one wait; only reached when something is broken (or a busy machine)
GATE_S = 30.0  # a held worker is let go after this long whatever happens

Hook = Callable[[str, int], None]


def additive_spec(
    job_id: str, *, min_nodes: int, iterations: int = 40, wire_precision: str = "fp32"
) -> TrainingSpec:
    """A job on the additive probe whose every update is exact (small-integer data: every
    float32 sum is exact, and every worker's gradient is exact in bfloat16 too: multiples of
    1/16 under 2), with fast heartbeats and a short failure timeout."""
    return TrainingSpec(
        wire_precision=wire_precision,  # type: ignore[arg-type]
        job_id=job_id,
        model=ModelSpec(kind="additive", features=24),
        samples=512,
        global_batch=16,
        lr=1.0,
        iterations=iterations,
        num_partitions=4,
        min_nodes=min_nodes,
        heartbeat_s=0.05,
        failure_timeout_s=0.5,
    )


class InjectedCrash(RuntimeError):
    """Raised from a phase hook: the node dies right there."""


class Gate:
    """A phase hook that holds a worker at the start of `clock` (once pulled) until released.

    `clock` may be set later (None: not armed yet), as long as the worker has not passed it.
    """

    def __init__(self, clock: int | None = None) -> None:
        self.clock = clock
        self.reached = threading.Event()
        self.released = threading.Event()

    def __call__(self, phase: str, clock: int) -> None:
        if phase == "pulled" and clock == self.clock and not self.released.is_set():
            self.reached.set()
            self.released.wait(GATE_S)

    def wait_reached(self) -> None:
        assert self.reached.wait(WAIT_S), f"no worker reached clock {self.clock}"


def chain(*hooks: Hook) -> Hook:
    def run(phase: str, clock: int) -> None:
        for hook in hooks:
            hook(phase, clock)

    return run


@dataclass
class Job:
    """A coordinator and the node threads of one job; `close` stops and joins everything."""

    spec: TrainingSpec
    coord: Coordinator
    nodes: dict[str, AgileMLNode] = field(default_factory=dict)
    outcomes: dict[str, NodeResult | BaseException] = field(default_factory=dict)
    threads: list[threading.Thread] = field(default_factory=list)
    gates: list[Gate] = field(default_factory=list)

    def launch(
        self, node_id: str, tier: NodeTier = NodeTier.TRANSIENT, hook: Hook | None = None
    ) -> AgileMLNode:
        node = AgileMLNode(
            node_id,
            tier,
            job_id=self.spec.job_id,
            controller=self.coord.endpoint,
            token=TOKEN,
            phase_hook=hook,
        )

        def run() -> None:
            try:
                self.outcomes[node_id] = node.run()
            except BaseException as exc:  # a crash injected by the test, or a real failure
                self.outcomes[node_id] = exc

        thread = threading.Thread(target=run, name=f"test-node-{node_id}", daemon=True)
        self.nodes[node_id] = node
        self.threads.append(thread)
        thread.start()
        return node

    def gate(self, clock: int | None = None) -> Gate:
        gate = Gate(clock)
        self.gates.append(gate)
        return gate

    def wait_for(self, what: str, predicate: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out waiting for {what}; view: {self.coord.view()}; "
                    f"events: {self.coord.events()}"
                )
            time.sleep(0.01)

    def event_nodes(self, kind: str) -> set[str]:
        return {n for e in self.coord.events() if e.kind == kind for n in e.nodes}

    def gone(self, nodes: set[str]) -> bool:
        """Whether these nodes' runs have ended and the controller counts them out of the job
        (by their `left`, or, should that message be lost, by their missing heartbeats)."""
        return all(n in self.outcomes and self.coord.node_state(n) is NodeState.GONE for n in nodes)

    def wait_started(self) -> View:
        self.wait_for("the job to start", lambda: self.coord.view().epoch > 0)
        return self.coord.view()

    def finish(self) -> torch.Tensor:
        """Let every held worker go, wait for the job, return the final parameters."""
        for gate in self.gates:
            gate.released.set()
        assert self.coord.wait_done(WAIT_S * 2), f"job not done; events: {self.coord.events()}"
        return torch.cat(self.coord.fetch_parameters())

    def expected(self) -> torch.Tensor:
        return additive_expected(self.spec, self.spec.iterations)

    def close(self) -> None:
        for gate in self.gates:
            gate.released.set()
        try:
            self.coord.stop()  # the view says shutdown: every node exits
        finally:
            for node in self.nodes.values():
                node.stop()
            for thread in self.threads:
                thread.join(WAIT_S)
        stuck = [t.name for t in self.threads if t.is_alive()]
        assert not stuck, f"node threads did not exit: {stuck}"

    def ended(self, node_id: str) -> str:
        outcome = self.outcomes[node_id]
        return outcome.ended if isinstance(outcome, NodeResult) else type(outcome).__name__


@pytest.fixture
def jobs() -> Iterator[Callable[[TrainingSpec], Job]]:
    """Makes jobs; at the end closes them and checks that no thread outlives the test."""
    before = set(threading.enumerate())
    made: list[Job] = []

    def make(spec: TrainingSpec) -> Job:
        made.append(Job(spec, Coordinator(spec, token=TOKEN).start()))
        return made[-1]

    yield make
    for job in made:
        job.close()
    deadline = time.monotonic() + 5.0
    while (left := set(threading.enumerate()) - before) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not left, f"threads left running: {sorted(t.name for t in left)}"
