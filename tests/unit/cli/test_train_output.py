"""What `orchestrator train` prints of a run's events: every shape of event the two runtimes
write (a data-parallel join once crashed the printing after a full run, losing the weights)."""

from __future__ import annotations

from orchestrator.agileml.local import NodeOutcome
from orchestrator.agileml.trainrun import TrainPlan, _joins_that_computed_nothing, parse_injections
from orchestrator.cli.train import _event_line


def test_a_data_parallel_join_prints_without_a_pipeline_field() -> None:
    line = _event_line({"at_s": 3.2, "kind": "joined", "nodes": ["j1"], "detail": "from clock 160"})
    assert line == "  runtime: joined j1 (from clock 160)"


def test_a_pipeline_join_prints_where_it_resumed() -> None:
    line = _event_line({"kind": "joined", "resumed_iteration": 150, "stages": [[0, 3, 2]]})
    assert line == "  a node joined: resumed at iteration 150 on stages [[0, 3, 2]]"


def test_events_of_other_shapes_print_less_rather_than_fail() -> None:
    assert _event_line({"kind": "recovered"}) is not None
    assert _event_line({"kind": "planned", "stages": None}) is not None
    assert _event_line({"kind": "started", "nodes": ["r0"]}) is None
    assert _event_line({}) is None
    assert _event_line({"kind": "skipped_kill", "iteration": 200, "reason": "why"}) == (
        "warning: kill@200 not done: why"
    )


def test_a_pipeline_on_nodes_of_several_devices_prints_where_each_stage_runs() -> None:
    event = {"kind": "planned", "stages": [[0, 2, 2], [3, 6, 2]], "microbatches": 4,
             "placement": [[0, 1], [0, 1]]}  # fmt: skip
    assert _event_line(event) == (
        "pipeline: stages [[0, 2, 2], [3, 6, 2]] ([first, last layer, replicas]), "
        "4 microbatches per iteration\n  on nodes [[0, 1], [0, 1]] (each stage's replicas)"
    )


def test_a_join_whose_node_computed_nothing_is_reported_not_done() -> None:
    """`injected_join` says a node was let go; if it computed no iteration before the end
    (a short run), the run says so rather than leave the join looking done."""
    plan = TrainPlan(code="job.py", nodes=2, iterations=80,
                     injections=tuple(parse_injections("join@35,join@60")))  # fmt: skip
    injected = [
        {"iteration": 37, "kind": "injected_join", "node": "j1"},
        {"iteration": 61, "kind": "injected_join", "node": "j2"},
    ]
    outcomes = {
        "j1": NodeOutcome("j1", "killed", [], [], {}, {}),
        "j2": NodeOutcome("j2", "still joining at the end", [], [], {}, {}),
    }
    computed = {"t0", "j1"}  # j1 from its result, or from its heartbeats if it was killed
    (skipped,) = _joins_that_computed_nothing(plan, injected, computed, outcomes)
    assert _event_line(skipped) == (
        "warning: join@60 not done: j2 computed no iteration before the job ended "
        "(still joining at the end)"
    )
