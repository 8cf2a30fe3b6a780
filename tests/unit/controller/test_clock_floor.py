"""Time never runs back: a controller whose clock reads behind a tick already made refuses to
tick (nothing decided, launched or billed), and ticks again once its clock is past it; a
replay restarted with an earlier start continues from where the store's controller left off."""

from __future__ import annotations

import logging

import pytest

from orchestrator.cloud.memory import InMemoryCloud
from orchestrator.controller.clock import ClockRewoundError
from orchestrator.controller.wiring import build_controller, controller_clock
from orchestrator.jobspec import JobSubmission
from orchestrator.market.prices import to_epoch_seconds
from orchestrator.settings import ControllerSettings, Settings
from orchestrator.store import JobRecord

T0 = to_epoch_seconds("2020-02-03T00:00:00Z")  # as conftest's


def test_a_tick_behind_the_mark_changes_nothing_and_a_later_one_runs(store, ec2, prices) -> None:
    cloud = InMemoryCloud("us-east-1", "ctl", ec2=ec2)
    sub = JobSubmission(name="t", budget_usd=200.0, work_gpu_hours=40.0, max_gpus=8.0,
                        instance_types=("p3.2xlarge",))  # fmt: skip
    store.create_job(JobRecord.submit("job-1", sub.model_dump(mode="json"), 200.0, T0))
    first = build_controller(Settings(), store=store, cloud=cloud, prices=prices)
    first.tick(T0)
    first.tick(T0 + 17 * 3600.0)  # the job runs 17 hours in
    alive = store.list_instances("job-1", alive_only=True)
    assert alive and store.clock_high_water() == T0 + 17 * 3600.0
    events, ledger = len(store.events("job-1")), store.ledger("job-1")
    job = store.get_job("job-1")
    store.transition("job-1", "cancelling", expected_version=job.version, now_s=T0 + 17 * 3600.0)
    # a controller restarted on a rewound clock: it would bill 17 h of instances as minutes
    rewound = build_controller(Settings(), store=store, cloud=cloud, prices=prices)
    with pytest.raises(ClockRewoundError, match="behind 2020-02-03 17:00:00 UTC"):
        rewound.tick(T0 + 1800.0)
    assert store.list_instances("job-1", alive_only=True) == alive  # nothing billed or ended
    assert len(store.events("job-1")) == events and store.ledger("job-1") == ledger
    rewound.tick(T0 + 17 * 3600.0 + 60.0)  # past the mark: it ticks (and bills the full run)
    assert store.list_instances("job-1", alive_only=True) == []
    billed: dict[str, float] = {}
    for e in store.ledger("job-1"):  # a spot run is billed in pieces, one per price
        billed[e.instance_id] = billed.get(e.instance_id, 0.0) + e.end_s - e.start_s
    for rec in alive:  # each billed for its whole run, to the tick that ended it
        assert billed[rec.instance_id] >= T0 + 17 * 3600.0 + 60.0 - rec.launched_at - 1e-6


def test_a_restarted_replay_continues_from_the_mark(caplog) -> None:
    replay = Settings(controller=ControllerSettings(
        prices=("trace",), replay_start="2020-02-03T00:00:00Z", speed=60.0))  # fmt: skip
    clock, _ = controller_clock(replay, floor_s=None)
    assert T0 <= clock() < T0 + 600.0
    with caplog.at_level(logging.WARNING):
        clock, _ = controller_clock(replay, floor_s=T0 + 17 * 3600.0)
    assert T0 + 17 * 3600.0 <= clock() < T0 + 17 * 3600.0 + 600.0
    assert "continues from 2020-02-03 17:00:00 UTC" in caplog.text
    clock, _ = controller_clock(replay, floor_s=T0 - 3600.0)  # a mark before the start
    assert T0 <= clock() < T0 + 600.0
