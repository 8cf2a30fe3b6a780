"""A node's first forward/backward and FlexRR's chunk calibration happen while it loads, not in
its first clock (a joiner's first clock is one every running worker waits on under BSP)."""

from __future__ import annotations

import torch
from torch import nn

from orchestrator.agileml.examples import gaussian_mixture, initial_model, mlr_factory
from orchestrator.agileml.partitions import PartitionLayout, PartitionTable
from orchestrator.agileml.reassign import Reassigner
from orchestrator.agileml.worker import Worker, WorkerSpec
from orchestrator.straggler.spec import StragglerSpec

DATA = gaussian_mixture(300, 12, 3, seed=2)


def _worker() -> Worker:
    model = initial_model(mlr_factory(12, 3), seed=0)
    return Worker(
        WorkerSpec("w-0", "j", batch_size=32),
        token=b"tok",
        layout=PartitionLayout(model, 2),
        table=PartitionTable(2),
        endpoints={},
        model_factory=mlr_factory(12, 3),
        data=DATA,
        loss_fn=nn.functional.cross_entropy,
    )


def test_warm_up_leaves_no_gradient_behind() -> None:
    w = _worker()
    w.warm_up()
    assert all(p.grad is None for p in w._model.parameters())
    # and the gradients a computation had accumulated survive it
    w.backward_first_rows(4)
    before = [p.grad.clone() for p in w._model.parameters()]  # type: ignore[union-attr]
    w.warm_up()
    after = [p.grad for p in w._model.parameters()]
    assert all(a is not None and torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_flexrr_calibrates_once_before_any_clock() -> None:
    w = _worker()
    calls: list[int] = []
    first_rows = w.backward_first_rows

    def counted(n: int) -> float:
        calls.append(n)
        return first_rows(n)

    w.backward_first_rows = counted  # type: ignore[method-assign]
    r = Reassigner(StragglerSpec(), worker_id="w-0", link=None)
    chunk = r.calibrate(w)  # no roster, no clock: the data set's first rows
    assert chunk >= 1
    assert sorted(set(calls)) == [1, 32]  # best of 3 each, on up to a step's batch (32)
    assert r.calibrate(w) == chunk and len(calls) == 6  # never again
    assert all(p.grad is None for p in w._model.parameters())


def test_a_node_warms_up_at_the_lowest_priority_and_survives_a_failed_warm_up() -> None:
    import os
    import sys
    import threading

    from orchestrator.agileml.elasticity import NodeTier
    from orchestrator.agileml.lowprio import LOADING_NICENESS
    from orchestrator.agileml.node import AgileMLNode

    def node(low: bool) -> AgileMLNode:
        return AgileMLNode(
            "n", NodeTier.TRANSIENT, job_id="j", controller="tcp://127.0.0.1:9", token=b"t",
            low_priority_load=low,
        )  # fmt: skip

    w = _worker()
    seen: list[int] = []

    def warm_up() -> None:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    w.warm_up = warm_up  # type: ignore[method-assign]
    node(low=True)._warm_up(w, None)
    node(low=False)._warm_up(w, None)  # a held joiner: released when needed, loads at once
    here = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    if sys.platform.startswith("linux") and not torch.cuda.is_available():
        assert seen == [LOADING_NICENESS, here]

    r = Reassigner(StragglerSpec(), worker_id="w-0", link=None)

    def broken(n: int) -> float:
        raise RuntimeError("a model that only runs on the main thread")

    w.backward_first_rows = broken  # type: ignore[method-assign]
    node(low=True)._warm_up(w, r)  # logged, not raised: the first clock calibrates instead
    assert r._min_chunk_rows is None
