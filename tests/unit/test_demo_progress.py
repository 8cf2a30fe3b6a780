"""The offline demo's progress line says "-" for a loss not known yet, never "nan"."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from rich.console import Console

from orchestrator import demo


def _line(watch: demo._Watch) -> str:
    console = Console(record=True, force_terminal=False, width=300)
    world: Any = SimpleNamespace(
        store=SimpleNamespace(list_instances=lambda job, alive_only: []),
        controller=SimpleNamespace(spend_usd=lambda job, now_s: 1.5),
        clock=SimpleNamespace(start_s=0.0),
        replayer=SimpleNamespace(evictions=[]),
    )
    record: Any = SimpleNamespace(work_done_gpu_hours=0.0, state="running")
    job: Any = SimpleNamespace(work_gpu_hours=1.0, training={"iterations": 10}, budget_usd=40)
    demo._progress(console, world, watch, record, job, 3600.0)
    return console.export_text()


def test_the_loss_reads_a_dash_until_one_is_measured() -> None:
    watch = demo._Watch()
    assert "loss -  [running]" in _line(watch)
    watch.last_loss, watch.loss_seen = 0.25, True
    assert "loss 0.250  [running]" in _line(watch)
