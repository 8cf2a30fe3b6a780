"""End-to-end training on local parameter servers and stateless worker threads."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

from orchestrator.agileml import chunks
from orchestrator.agileml.batches import TensorRows
from orchestrator.agileml.errors import WorkerError
from orchestrator.agileml.examples import (
    gaussian_mixture,
    initial_model,
    mlp_factory,
    mlr_factory,
    train_local,
)
from orchestrator.agileml.partitions import PartitionLayout, PartitionTable
from orchestrator.agileml.precision import LossScale
from orchestrator.agileml.server import ParamServer
from orchestrator.agileml.updates import sgd_rules
from orchestrator.agileml.worker import Worker, WorkerSpec

FEATURES, CLASSES = 16, 4
DATA = gaussian_mixture(2000, FEATURES, CLASSES, seed=7)


def _full_loss(model: nn.Module) -> float:
    with torch.no_grad():
        return float(nn.functional.cross_entropy(model(DATA[0]), DATA[1]))


def test_two_worker_bsp_mlr_on_two_servers_lowers_the_loss() -> None:
    threads_before = threading.active_count()
    iterations, partitions = 30, 4
    result = train_local(
        mlr_factory(FEATURES, CLASSES),
        DATA,
        num_workers=2,
        num_servers=2,
        num_partitions=partitions,
        iterations=iterations,
        batch_size=64,
        lr=0.5,
        seed=3,
    )
    for losses in result.losses.values():
        assert len(losses) == iterations
        assert sum(losses[-5:]) / 5 <= 0.7 * losses[0]
    start = _full_loss(initial_model(mlr_factory(FEATURES, CLASSES), seed=3))
    assert _full_loss(result.final_model) <= 0.7 * start
    # BSP and exactly-once: each server applied one push per worker, clock and owned partition.
    for stats in result.server_stats.values():
        assert stats.pushes_applied == 2 * iterations * (partitions // 2)
        assert (stats.pushes_duplicate, stats.rejected, stats.dropped) == (0, 0, 0)
    assert threading.active_count() == threads_before


def test_three_worker_ssp_mlp_trains_within_the_slack() -> None:
    result = train_local(
        mlp_factory(FEATURES, 16, CLASSES),
        DATA,
        num_workers=3,
        num_servers=2,
        num_partitions=5,
        iterations=25,
        batch_size=32,
        lr=0.3,
        slack=2,
        seed=1,
    )
    start = _full_loss(initial_model(mlp_factory(FEATURES, 16, CLASSES), seed=1))
    assert _full_loss(result.final_model) <= 0.7 * start


def _deep_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, CLASSES)
    )


@pytest.mark.parametrize("slack", [0, 1])
def test_overlapped_pulls_and_pushes_train_the_same_model_as_whole_round_trips(
    slack: int,
) -> None:
    """Computing on the first pulled partitions and pushing partitions from the gradient
    hooks changes when bytes move, not what is computed: the same weights to the bit (with two
    workers a server's sum of a clock's pushes does not depend on the order they arrive)."""
    runs = {
        overlap: train_local(
            _deep_mlp,
            DATA,
            num_workers=2,
            num_servers=2,
            num_partitions=6,
            iterations=12,
            batch_size=32,
            lr=0.2,
            slack=slack,
            seed=5,
            overlap=overlap,
        )
        for overlap in (True, False)
    }
    assert runs[True].early_pushes > 0 and runs[False].early_pushes == 0
    if slack == 0:  # under SSP the clocks a worker sees depend on timing
        assert runs[True].losses == runs[False].losses
        for a, b in zip(
            runs[True].final_model.parameters(), runs[False].final_model.parameters(), strict=True
        ):
            assert torch.equal(a, b)
    start = _full_loss(initial_model(_deep_mlp, seed=5))
    assert _full_loss(runs[True].final_model) < start


def _single_worker_setup(server_token: bytes, worker_token: bytes) -> tuple[ParamServer, Worker]:
    model = initial_model(mlr_factory(FEATURES, CLASSES), seed=0)
    layout, table = PartitionLayout(model, 2), PartitionTable(2)
    table.assign_round_robin(["ps-0"])
    server = ParamServer("ps-0", job_id="j", token=server_token)
    server.set_update_rules(sgd_rules(0.1))
    for p, part in enumerate(layout.gather(model)):
        server.add_partition(p, part)
    server.register_workers(["w-0"])
    worker = Worker(
        WorkerSpec("w-0", "j", batch_size=16, request_timeout_s=2.0),
        token=worker_token,
        layout=layout,
        table=table,
        endpoints={"ps-0": ""},
        model_factory=mlr_factory(FEATURES, CLASSES),
        data=DATA,
        loss_fn=nn.functional.cross_entropy,
    )
    return server, worker


def test_redone_iteration_is_not_applied_twice() -> None:
    server, worker = _single_worker_setup(b"tok", b"tok")
    with server:
        worker.endpoints["ps-0"] = server.endpoint
        worker.run(1)
        after_first = [server.state(p) for p in range(2)]
        worker.clock = 0  # as if the worker died before recording its clock: redo clock 0
        worker.run(1)
        assert all(torch.equal(server.state(p), after_first[p]) for p in range(2))
        assert server.stats().pushes_duplicate == 2 and server.stats().pushes_applied == 2


def test_worker_with_wrong_token_fails_and_changes_nothing() -> None:
    server, worker = _single_worker_setup(b"tok", b"wrong")
    with server:
        worker.endpoints["ps-0"] = server.endpoint
        before = [server.state(p) for p in range(2)]
        with pytest.raises(WorkerError):
            worker.run(1)
        assert worker.clock == 0
        assert all(torch.equal(server.state(p), before[p]) for p in range(2))
        assert server.stats().rejected >= 1


def _trained_state(*, inproc: bool, clocks: int = 3) -> list[torch.Tensor]:
    server, worker = _single_worker_setup(b"tok", b"tok")
    with server:
        if inproc:  # nothing listens on the TCP address: only the inproc path can work
            worker.endpoints["ps-0"] = "tcp://127.0.0.1:9"
            worker.local_endpoints = {"tcp://127.0.0.1:9": server.inproc_endpoint}
        else:
            worker.endpoints["ps-0"] = server.endpoint
        worker.run(clocks)
        worker.close()
        assert server.stats().pushes_applied == 2 * clocks
        return [server.state(p) for p in range(2)]


def test_a_worker_reaches_its_own_nodes_server_in_process_with_the_same_result() -> None:
    by_inproc, by_tcp = _trained_state(inproc=True), _trained_state(inproc=False)
    assert all(torch.equal(a, b) for a, b in zip(by_inproc, by_tcp, strict=True))


def test_the_in_process_path_still_checks_the_mac() -> None:
    server, worker = _single_worker_setup(b"tok", b"wrong")
    with server:
        worker.endpoints["ps-0"] = "tcp://127.0.0.1:9"
        worker.local_endpoints = {"tcp://127.0.0.1:9": server.inproc_endpoint}
        before = [server.state(p) for p in range(2)]
        with pytest.raises(WorkerError):
            worker.run(1)
        worker.close()
        assert all(torch.equal(server.state(p), before[p]) for p in range(2))
        assert server.stats().rejected >= 1


BIG_FEATURES, BIG_CLASSES = 300, 120  # partitions of ~72 KB: ZMQ passes them by reference
BIG_DATA = gaussian_mixture(400, BIG_FEATURES, BIG_CLASSES, seed=5)


def _two_workers_one_in_process(*, inproc: bool) -> list[torch.Tensor]:
    model = initial_model(mlr_factory(BIG_FEATURES, BIG_CLASSES), seed=0)
    layout = PartitionLayout(model, 2)
    server = ParamServer("ps-0", job_id="j", token=b"tok")
    server.set_update_rules(sgd_rules(0.1))
    for p, part in enumerate(layout.gather(model)):
        server.add_partition(p, part)
    server.register_workers(["w-0", "w-1"])
    with server:
        workers = []
        for w in ("w-0", "w-1"):
            table = PartitionTable(2)
            table.assign_round_robin(["ps-0"])
            workers.append(
                Worker(
                    WorkerSpec(w, "j", batch_size=32, request_timeout_s=5.0),
                    token=b"tok",
                    layout=layout,
                    table=table,
                    endpoints={"ps-0": server.endpoint},
                    model_factory=mlr_factory(BIG_FEATURES, BIG_CLASSES),
                    data=BIG_DATA,
                    loss_fn=nn.functional.cross_entropy,
                    # w-0 shares the server's process: the frames it pushes are its gradient
                    # memory and the replies it pulls are the server's frozen copy, which w-1
                    # then pulls over TCP; any write through either view would show below
                    local_endpoints={server.endpoint: server.inproc_endpoint}
                    if w == "w-0" and inproc
                    else None,
                )
            )
        threads = [threading.Thread(target=w.run, args=(4,)) for w in workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for w in workers:
            w.close()
        assert [w.clock for w in workers] == [4, 4]
        assert server.stats().pushes_applied == 2 * 2 * 4
        return [server.state(p) for p in range(2)]


def test_large_frames_by_reference_in_process_change_nothing() -> None:
    by_inproc = _two_workers_one_in_process(inproc=True)
    by_tcp = _two_workers_one_in_process(inproc=False)
    assert all(torch.equal(a, b) for a, b in zip(by_inproc, by_tcp, strict=True))


def test_pushes_through_the_staging_vectors_of_a_gpu_worker_change_nothing() -> None:
    """`PushStaging` (on a GPU: pinned, copied without blocking) run here unpinned: the
    same pushes to the bit, the vector reused across iterations and identities kept apart."""
    from orchestrator.agileml.staging import PushStaging

    plain = _trained_state(inproc=False, clocks=3)
    server, worker = _single_worker_setup(b"tok", b"tok")
    worker.staging = PushStaging(worker.layout, torch.device("cpu"), pin=False)
    with server:
        worker.endpoints["ps-0"] = server.endpoint
        worker.run(3)
        staged = [server.state(p) for p in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(staged, plain, strict=True))
    vectors = worker.staging._vectors  # one vector, its own identity's, allocated once
    assert list(vectors) == ["w-0"] and vectors["w-0"].shape == (worker.layout.total,)
    worker.staging.keep_only(set())
    assert not worker.staging._vectors


def test_an_fp16_iteration_redone_after_a_failed_push_computes_at_the_same_scale() -> None:
    """The loss scale changes only once an iteration's pushes all went through: a redo
    after a push failed half-way pushes what the first try pushed (the servers keep the first
    of each push), so no partition applies a clock that another skips."""
    server, worker = _single_worker_setup(b"tok", b"tok")
    worker.spec = WorkerSpec("w-0", "j", batch_size=16, request_timeout_s=2.0, precision="fp16")
    worker._loss_scale = LossScale()
    worker._rows = TensorRows(torch.full_like(DATA[0], 1e5), DATA[1])  # overflows in fp16
    failed = []

    def fail_once(phase: str, clock: int) -> None:
        if phase == "pushing" and not failed:
            failed.append(clock)
            raise WorkerError("w-0", "the push failed half-way (injected)")

    worker.phase_hook = fail_once
    with server:
        worker.endpoints["ps-0"] = server.endpoint
        with pytest.raises(WorkerError, match="injected"):
            worker.step()
        assert worker._loss_scale.exponent == 16 and worker.clock == 0  # not changed yet
        worker.step()  # the redo: the same scale, the same NaN pushes
        assert worker._loss_scale.exponent == 15 and worker.skipped_clocks == {0}
        worker.close()


def _count_chunked_sends(monkeypatch: pytest.MonkeyPatch, chunk_bytes: int) -> list[bool]:
    """Large messages in chunks of `chunk_bytes`; returns, per message sent, whether it went
    in chunks."""
    monkeypatch.setattr(chunks, "CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(chunks, "CHUNK_ABOVE_BYTES", chunk_bytes)
    sent: list[bool] = []
    send = chunks.send

    def counted(sock: Any, prefix: list[bytes], message: Any) -> None:
        sent.append(isinstance(message, chunks.ChunkedMessage))
        send(sock, prefix, message)

    monkeypatch.setattr(chunks, "send", counted)
    return sent


@pytest.mark.parametrize("inproc", [True, False])
def test_pushes_and_pull_replies_in_chunks_train_the_same_weights(
    monkeypatch: pytest.MonkeyPatch, inproc: bool
) -> None:
    """Partitions of ~72 KB pushed and pulled in chunks of 5,000 bytes: the same weights to
    the bit as in one message each. A worker's pushes to its own node's server and their
    replies go whole (by reference in process: there is no transfer to overlap)."""
    whole = _two_workers_one_in_process(inproc=inproc)
    sent = _count_chunked_sends(monkeypatch, 5000)
    in_chunks = _two_workers_one_in_process(inproc=inproc)
    pushes, replies = 2 * 2 * 4, 2 * 2 * 4  # 2 workers, 2 partitions, 4 clocks
    assert sent.count(True) == (pushes + replies) // (2 if inproc else 1)
    assert all(torch.equal(a, b) for a, b in zip(whole, in_chunks, strict=True))


def test_overlapped_pulls_in_chunks_load_the_same_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pulls that stream into the forward pass, each reply in chunks of 256 bytes."""

    def run() -> list[torch.Tensor]:
        result = train_local(_deep_mlp, DATA, num_workers=2, num_servers=2, num_partitions=3,
                             iterations=6, batch_size=32, lr=0.2, seed=5, overlap=True)  # fmt: skip
        return [p.detach().clone() for p in result.final_model.parameters()]

    whole = run()
    sent = _count_chunked_sends(monkeypatch, 256)
    in_chunks = run()
    assert sent.count(True) > 0
    assert all(torch.equal(a, b) for a, b in zip(whole, in_chunks, strict=True))
