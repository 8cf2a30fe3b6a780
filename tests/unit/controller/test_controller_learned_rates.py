"""The controller decides with the work rates its instances measured (`controller.rates`):
a job whose V100s do half the catalog's work is sized up, a restarted controller decides the
same, and the dashboard shows learned against prior rates."""

from __future__ import annotations

import pytest
from test_controller_tick import T0, Spy, controller, submit

from orchestrator.api.views import job_dashboard
from orchestrator.market.catalog import Catalog
from orchestrator.store import EventKind, InstanceWork, MemoryStore

HOUR = 3600.0


def _gpus(store: MemoryStore) -> int:
    catalog = Catalog.load()
    return sum(
        catalog.get(r.instance_type).gpu_count
        for r in store.list_instances("job-1", alive_only=True)
    )


def _measure_at(store: MemoryStore, fraction: float, hours: float = 2.0) -> None:
    """Each alive GPU instance did `fraction` of its catalog rate's work in `hours`."""
    catalog = Catalog.load()
    work = {}
    for rec in store.list_instances("job-1", alive_only=True):
        kind = catalog.get(rec.instance_type)
        if kind.gpu_count:
            done = fraction * catalog.work_rate(rec.instance_type) * hours
            work[rec.instance_id] = InstanceWork(work_gpu_hours=done, hours=hours)
    store.record_instance_work("job-1", work)


def test_v100s_measured_at_half_the_catalog_rate_get_the_job_more_of_them(
    store, ec2, prices, monkeypatch
) -> None:
    submit(store)
    ctl = controller(store, ec2, prices)
    ctl.tick(T0)
    assert _gpus(store) == 8  # max_gpus at the catalog's rate
    _measure_at(store, 0.5)
    spy = Spy(monkeypatch)
    ctl.tick(T0 + 600.0)
    [inp] = spy.inputs
    learned = inp.job.gpu_work_rates["V100"]
    assert 0.5 < learned < 0.55  # the data outweighs the prior: 2 h of 8 GPUs
    spot = [a for a in inp.footprint.allocations if not a.reliable]
    for a in spot:  # held instances are taken at the learned rate, not the catalog's
        gpus = Catalog.load().get(a.market.instance_type).gpu_count
        assert a.work_rate_per_instance == pytest.approx(gpus * learned)
    assert _gpus(store) > 8  # sized up towards max_gpus' worth of throughput
    [event] = [e for _, e in store.events("job-1") if e.kind is EventKind.WORK_RATES]
    assert event.rates["V100"].prior == 1.0
    assert event.rates["V100"].learned == pytest.approx(learned)
    assert event.rates["V100"].low < learned < event.rates["V100"].high


def test_a_restarted_controller_decides_with_the_same_learned_rates(
    store, ec2, prices, monkeypatch
) -> None:
    submit(store)
    controller(store, ec2, prices).tick(T0)
    _measure_at(store, 0.5)
    spy = Spy(monkeypatch)
    controller(store, ec2, prices).tick(T0 + 600.0)
    controller(store, ec2, prices).tick(T0 + 660.0)  # a new controller process
    first, second = spy.inputs
    assert second.job.gpu_work_rates == pytest.approx(first.job.gpu_work_rates)


def test_rates_that_agree_with_the_catalog_change_nothing_but_say_so(
    store, ec2, prices, monkeypatch
) -> None:
    submit(store)
    ctl = controller(store, ec2, prices)
    ctl.tick(T0)
    spy = Spy(monkeypatch)
    ctl.tick(T0 + 300.0)
    assert spy.inputs[-1].job.gpu_work_rates is None  # nothing measured yet: the catalog's
    _measure_at(store, 1.0)
    ctl.tick(T0 + 600.0)
    assert spy.inputs[-1].job.gpu_work_rates["V100"] == 1.0
    assert _gpus(store) == 8
    page = job_dashboard(store, "job-1", T0 + 600.0)
    [row] = page["work_rates"]
    assert row["gpu_model"] == "V100" and row["prior"] == row["learned"] == 1.0
    assert row["observed_hours"] == pytest.approx(2.0 * len(store.instance_work("job-1")))
    assert any(e["kind"] == "work_rates" and "V100 1 (prior 1" in e["text"]
               for e in page["events"])  # fmt: skip
