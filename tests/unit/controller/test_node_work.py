"""Each AgileML node's work as the training host records it (`NodeWork`): in the job's units,
on one GPU, and summed over the node's restarts, also across a controller restart."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from orchestrator.controller.training import NodeWork
from orchestrator.store import InstanceWork, MemoryStore

WORK = 2.0  # the job's GPU-hours: 100 iterations of 64 rows, so a row is 2 / 6400


class Training:
    """What `NodeWork` reads of a hosted training: its spec and each node's counts."""

    def __init__(self) -> None:
        self.spec = SimpleNamespace(global_batch=64, iterations=100)
        self.counts: dict[str, tuple[int, float]] = {}

        self.devices: dict[str, int] = {}

    def node_work(self) -> dict[str, tuple[int, float]]:
        return dict(self.counts)

    def node_devices(self) -> dict[str, int]:
        return dict(self.devices)


def test_rows_become_the_jobs_work_on_one_gpu():
    training, work = Training(), NodeWork(MemoryStore())
    training.counts = {"i-1": (640, 36.0), "i-2": (0, 0.0)}  # i-2 has computed nothing yet
    assert work.totals("j1", training, WORK) == {
        "i-1": InstanceWork(work_gpu_hours=0.2, hours=0.01, gpus=1)
    }


def test_a_node_on_four_devices_counts_four_gpus_of_work():
    """A 4-GPU instance whose node trains on all four: BidBrain learns the rate per GPU from
    its work over 4 GPUs, not 1 (which would credit one GPU with four GPUs' work)."""
    training, work = Training(), NodeWork(MemoryStore())
    training.counts = {"i-4": (2560, 36.0), "i-1": (640, 36.0)}
    training.devices = {"i-4": 4}
    totals = work.totals("j1", training, WORK)
    assert totals["i-4"] == InstanceWork(work_gpu_hours=0.8, hours=0.01, gpus=4)
    assert totals["i-1"].gpus == 1  # not heard: one device


def test_a_restarted_node_keeps_what_its_earlier_process_counted():
    training, work = Training(), NodeWork(MemoryStore())
    training.counts = {"i-1": (640, 36.0)}
    work.totals("j1", training, WORK)
    training.counts = {"i-1": (64, 3.6)}  # its process restarted: counting from 0 again
    [total] = work.totals("j1", training, WORK).values()
    assert total.work_gpu_hours == pytest.approx(0.22) and total.hours == pytest.approx(0.011)


def test_a_restarted_controller_starts_from_the_stores_record():
    store, training = MemoryStore(), Training()
    store.record_instance_work("j1", {"i-1": InstanceWork(work_gpu_hours=0.2, hours=0.01)})
    training.counts = {"i-1": (64, 3.6)}  # less than recorded: the node restarted meanwhile
    [total] = NodeWork(store).totals("j1", training, WORK).values()
    assert total.work_gpu_hours == pytest.approx(0.22)
    training.counts = {"i-1": (1280, 72.0)}  # more than recorded: the same process goes on
    [total] = NodeWork(store).totals("j1", training, WORK).values()
    assert total.work_gpu_hours == pytest.approx(0.4)
