"""`controller.wiring`: the controller the CLI, the demo and the tests build from `Settings`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_controller import T0, submit

from orchestrator.controller.wiring import build_controller, controller_clock
from orchestrator.errors import UserError
from orchestrator.market.trace_source import TracePriceSource
from orchestrator.settings import Settings
from orchestrator.store.redis_store import RedisStore


def first_decision(settings: Settings, store: RedisStore, ec2: Any, prices: Any) -> list[str]:
    """What the first tick acquires for a job with a $5 budget: `count x type (max price)`."""
    store._client.flushdb()  # noqa: SLF001 - each controller starts from an empty store
    submit(store, budget=5.0)
    controller = build_controller(settings, store=store, client=ec2, prices=prices)
    decision = controller.tick(T0).decisions["job-1"]
    return [f"{r.count}x{r.instance_type} ({r.max_price_usd_per_hour})" for r in decision.acquire]


def test_a_bidbrain_setting_in_the_config_file_changes_the_decisions(
    store: RedisStore, ec2: Any, prices: TracePriceSource, tmp_path: Path, monkeypatch
) -> None:
    """A budget must carry what the footprint commits until the next decision: decide every
    hour instead of every 2 minutes and the $5 job cannot take a whole p3.16xlarge."""
    monkeypatch.delenv("ORCHESTRATOR_CONFIG_FILE", raising=False)
    default = first_decision(Settings.load(), store, ec2, prices)
    assert "1xp3.16xlarge (24.48)" in default
    config = tmp_path / "controller.yaml"
    config.write_text("bidbrain:\n  decision_interval_s: 3600\n")
    hourly = first_decision(Settings.load(config), store, ec2, prices)
    assert hourly != default and not any("p3.16xlarge" in a for a in hourly)


def test_settings_from_the_environment_reach_the_controller_and_win_over_the_file(
    store: RedisStore, ec2: Any, prices: TracePriceSource, tmp_path: Path, monkeypatch
) -> None:
    config = tmp_path / "controller.yaml"
    config.write_text("bidbrain:\n  decision_interval_s: 3600\n  max_adds_per_decision: 5\n")
    monkeypatch.setenv("ORCHESTRATOR_CONFIG_FILE", str(config))
    monkeypatch.setenv("ORCHESTRATOR_BIDBRAIN__DECISION_INTERVAL_S", "7200")
    monkeypatch.setenv("ORCHESTRATOR_CONTROLLER__BILLING", "hourly-refund")
    settings = Settings.load()
    controller = build_controller(settings, store=store, client=ec2, prices=prices)
    assert controller.settings.decision_interval_s == 7200.0  # the environment wins
    assert controller.settings.max_adds_per_decision == 5  # the file fills the rest
    assert controller.billing.name == "hourly-refund"
    acquired = [a.split(" ")[0] for a in first_decision(settings, store, ec2, prices)]
    assert acquired == ["1xm5.xlarge", "2xp3.2xlarge"]  # as decided every two hours


def test_a_replay_needs_its_start_time_and_runs_faster_than_real_time() -> None:
    replay = Settings(controller={"prices": ("trace",), "speed": 600.0})
    with pytest.raises(UserError, match="start at"):
        controller_clock(replay)
    clock, speed = controller_clock(
        replay.model_copy(
            update={"controller": replay.controller.model_copy(
                update={"replay_start": "2020-02-03T00:00:00Z"})}
        )
    )  # fmt: skip
    assert speed == 600.0 and clock() >= T0
