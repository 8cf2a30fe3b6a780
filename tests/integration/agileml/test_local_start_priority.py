"""LocalJob starts a job's first nodes at normal priority and joiners at the lowest; a held
joiner loads before its release and trains after it, and one never released ends with the
job."""

from __future__ import annotations

import time

from orchestrator.agileml.control import ModelSpec, TrainingSpec
from orchestrator.agileml.elasticity import NodeState, NodeTier
from orchestrator.agileml.local import LocalJob


def _entry(job: LocalJob, node_id: str) -> str:
    args = list(job._procs[node_id].args)  # noqa: SLF001 - the command the node runs
    return args[args.index("-m") + 1]


def test_the_first_nodes_start_at_normal_priority_and_a_joiner_at_the_lowest() -> None:
    """On a busy machine nice-19 start-ups of a job's first nodes could starve for minutes
    (nothing of the job computes yet, so nothing is slowed by starting them normally)."""
    spec = TrainingSpec(job_id="prio", model=ModelSpec(kind="additive", features=64), lr=1.0,
                        global_batch=8, iterations=400, num_partitions=2, min_nodes=2)  # fmt: skip
    with LocalJob(spec) as job:
        job.add_node("r0", NodeTier.RELIABLE)
        job.add_node("t0", NodeTier.TRANSIENT)
        assert _entry(job, "r0") == _entry(job, "t0") == "orchestrator.agileml.node"
        job.wait_clock(2, timeout_s=120)
        job.add_node("t1", NodeTier.TRANSIENT)
        assert _entry(job, "t1") == "orchestrator.agileml.node_process"  # imports at nice 19
        job.wait_clock(job.max_clock() + 2, timeout_s=120)


def test_a_held_node_never_released_ends_with_the_job_at_once() -> None:
    """A held joiner (`join@N` past the end) waits on its stdin; at the job's end it reads EOF
    or is stopped, and is reported as never released, without the 10 s stop grace."""
    spec = TrainingSpec(job_id="held", model=ModelSpec(kind="additive", features=16), lr=1.0,
                        global_batch=8, iterations=30, num_partitions=2, min_nodes=2)  # fmt: skip
    with LocalJob(spec) as job:
        job.add_node("r0", NodeTier.RELIABLE)
        job.add_node("t0", NodeTier.TRANSIENT)
        job.add_node("h1", NodeTier.TRANSIENT, held=True)
        _, outcomes = job.finish(timeout_s=120)
        started = time.monotonic()
        job.close()
    assert outcomes["h1"].ended == "never released"
    assert outcomes["r0"].ended == "done" and len(outcomes["r0"].ends) == 30
    assert time.monotonic() - started < 5.0


#: A job that outlasts any test: it is left running, and closed by `LocalJob`'s exit.
LONG = TrainingSpec(job_id="held", model=ModelSpec(kind="additive", features=16), lr=1.0,
                    global_batch=8, iterations=100_000, num_partitions=2,
                    min_nodes=2)  # fmt: skip


def _start_with_held_node(job: LocalJob) -> float:
    """r0, t0 and a held h1, until h1 has loaded; returns the tests' deadline."""
    job.add_node("r0", NodeTier.RELIABLE)
    job.add_node("t0", NodeTier.TRANSIENT)
    job.add_node("h1", NodeTier.TRANSIENT, held=True)
    log = job.log_dir / "h1.log"
    deadline = time.monotonic() + 120
    while "loaded; held until released" not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.05)
    return deadline


def test_a_held_node_loads_before_its_release_and_trains_after_it() -> None:
    """A held joiner (`train --inject join@N`) joins and loads with the job's start, then
    waits, loaded, for its release: the join is a `ready`, not a load. Its load once came
    after the release and outlasted short runs: the README's `join@35` in 80 iterations
    never computed, and the `kill@50` after it was skipped."""
    with LocalJob(LONG) as job:
        deadline = _start_with_held_node(job)
        job.wait_clock(job.max_clock() + 5, timeout_s=120)
        assert job.coordinator.node_state("h1") is NodeState.JOINING  # loaded, not ready
        assert "h1" not in job.coordinator.view().roster.members(job.max_clock())
        job.release("h1")
        while job.coordinator.node_work().get("h1", (0, 0.0))[0] == 0:  # rows it computed
            assert time.monotonic() < deadline, (job.log_dir / "h1.log").read_text()[-2000:]
            time.sleep(0.05)


def test_a_held_node_ends_at_sigterm() -> None:
    """SIGTERM ends a held node at once (its wait for the release polls whether it was
    stopped; a blocking read of stdin outlived SIGTERM, and the launcher's stop waited out its
    10 s grace)."""
    with LocalJob(LONG) as job:
        _start_with_held_node(job)
        node = job._procs["h1"]  # noqa: SLF001 - the held node's process
        node.terminate()
        assert node.wait(5) == 0  # ended as a node that was never released
