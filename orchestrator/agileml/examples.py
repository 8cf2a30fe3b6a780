"""Small example models and synthetic data, plus a local harness that trains them on AgileML.

No downloads: data is a seeded Gaussian mixture (one Gaussian per class around a random mean),
so the classes are mostly, not perfectly, separable. `build_*` turn a `TrainingSpec` into the
model factory, data and loss every node of a job builds identically.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from orchestrator.agileml.control import TrainingSpec
from orchestrator.agileml.partitions import PartitionLayout, PartitionTable
from orchestrator.agileml.roster import global_batch_indices
from orchestrator.agileml.seeding import seeded
from orchestrator.agileml.server import ParamServer
from orchestrator.agileml.server_loop import ServerStats
from orchestrator.agileml.updates import sgd_rules
from orchestrator.agileml.worker import LossFn, Worker, WorkerSpec

ModelFactory = Callable[[], nn.Module]


def gaussian_mixture(
    n_samples: int, n_features: int, n_classes: int, *, seed: int = 0, separation: float = 3.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Features (float32, n_samples x n_features) and labels (int64) of a seeded mixture."""
    gen = torch.Generator().manual_seed(seed)
    means = torch.randn(n_classes, n_features, generator=gen) * separation / n_features**0.5
    labels = torch.randint(0, n_classes, (n_samples,), generator=gen)
    features = means[labels] + torch.randn(n_samples, n_features, generator=gen)
    return features.float(), labels


def mlr_factory(n_features: int, n_classes: int) -> ModelFactory:
    """Multinomial logistic regression: one linear layer; train with cross-entropy."""
    return lambda: nn.Linear(n_features, n_classes)


def mlp_factory(n_features: int, hidden: int, n_classes: int) -> ModelFactory:
    """A one-hidden-layer ReLU MLP; train with cross-entropy."""
    return lambda: nn.Sequential(
        nn.Linear(n_features, hidden), nn.ReLU(), nn.Linear(hidden, n_classes)
    )


class AdditiveProbe(nn.Module):
    """out_i = w . x_i; with `additive_loss`, a clock adds lr x (its global batch row sum) / batch.

    Since the update does not depend on w, the exact final parameters of a run are known
    (`additive_expected`), which makes lost or doubled updates visible to the last bit (the
    data are small integers, so float32 sums are exact).
    """

    def __init__(self, n_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def additive_loss(out: torch.Tensor, _y: torch.Tensor) -> torch.Tensor:
    """Minus the sum of the outputs: the gradient for w is minus the batch's row sum."""
    return -out.sum()


def build_model(spec: TrainingSpec) -> ModelFactory:
    """The model factory of a job."""
    m = spec.model
    if m.kind == "mlr":
        return mlr_factory(m.features, m.classes)
    if m.kind == "mlp":
        return mlp_factory(m.features, m.hidden, m.classes)
    return lambda: AdditiveProbe(m.features)


def build_data(spec: TrainingSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The training set of a job (every node builds the same one from the seed)."""
    m = spec.model
    if m.kind == "additive":
        gen = torch.Generator().manual_seed(spec.data_seed)
        x = torch.randint(0, 4, (spec.samples, m.features), generator=gen).float()
        return x, torch.zeros(spec.samples, dtype=torch.int64)
    return gaussian_mixture(spec.samples, m.features, m.classes, seed=spec.data_seed)


def summed_cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the batch (workers scale it by the global batch)."""
    return nn.functional.cross_entropy(out, y, reduction="sum")


def build_loss(spec: TrainingSpec) -> LossFn:
    """The loss of a job's model, summed over a batch (as roster workers need it)."""
    return additive_loss if spec.model.kind == "additive" else summed_cross_entropy


def additive_expected(spec: TrainingSpec, clocks: int) -> torch.Tensor:
    """The exact parameters of an additive job after `clocks` clocks, each applied once.

    Exact in float32 when the global batch is a power of two (the data are small integers).
    """
    x, _ = build_data(spec)
    total = torch.zeros(spec.model.features)
    for clock in range(clocks):
        rows = global_batch_indices(spec.seed, clock, len(x), spec.global_batch)
        total += spec.lr * x[rows].sum(dim=0) / spec.global_batch
    return total


def full_loss(spec: TrainingSpec, model: nn.Module) -> float:
    """The job's loss over its whole training set."""
    x, y = build_data(spec)
    with torch.no_grad():
        return float(build_loss(spec)(model(x), y).item()) / len(x)


def initial_model(factory: ModelFactory, seed: int) -> nn.Module:
    """A model from `factory` with parameters drawn from `seed`; the global RNG is untouched."""
    with seeded(seed):
        return factory()


def shard(
    data: tuple[torch.Tensor, torch.Tensor], num_shards: int, index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `index`-th of `num_shards` interleaved shards of (features, labels)."""
    return data[0][index::num_shards], data[1][index::num_shards]


@dataclass(frozen=True)
class LocalRunResult:
    """Per-worker losses, the final model (from the servers) and each server's counters."""

    losses: dict[str, list[float]]
    final_model: nn.Module
    server_stats: dict[str, ServerStats]
    early_pushes: int = 0  # partitions pushed while backward was still running, all workers


def train_local(
    factory: ModelFactory,
    data: tuple[torch.Tensor, torch.Tensor],
    *,
    num_workers: int,
    num_servers: int,
    num_partitions: int,
    iterations: int,
    batch_size: int,
    lr: float,
    slack: int = 0,
    seed: int = 0,
    loss_fn: LossFn = nn.functional.cross_entropy,
    overlap: bool = False,
) -> LocalRunResult:
    """Train on `num_servers` local parameter servers and `num_workers` worker threads
    (`overlap`: see `WorkerSpec`).

    Partitions go round-robin to the servers. Everything is stopped and closed on return.

    Raises:
        WorkerError: the first worker failure (the other workers are stopped by timeout or
            by the servers stopping).
    """
    job_id, token = "local", secrets.token_bytes(32)
    model = initial_model(factory, seed)
    layout = PartitionLayout(model, num_partitions)
    table = PartitionTable(num_partitions)
    server_ids = [f"ps-{i}" for i in range(num_servers)]
    worker_ids = [f"w-{i}" for i in range(num_workers)]
    table.assign_round_robin(server_ids)
    parts = layout.gather(model)
    servers = [ParamServer(sid, job_id=job_id, token=token) for sid in server_ids]
    try:
        for server in servers:
            server.set_update_rules(sgd_rules(lr))
            for p in table.owned_by(server.node_id):
                server.add_partition(p, parts[p])
            server.register_workers(worker_ids)
            server.start()
        endpoints = {s.node_id: s.endpoint for s in servers}
        workers = [
            Worker(
                WorkerSpec(wid, job_id, batch_size, slack=slack, seed=seed, overlap=overlap),
                token=token,
                layout=layout,
                table=table,
                endpoints=endpoints,
                model_factory=factory,
                data=shard(data, num_workers, i),
                loss_fn=loss_fn,
            )
            for i, wid in enumerate(worker_ids)
        ]
        losses: dict[str, list[float]] = {}
        errors: list[BaseException] = []

        def run(w: Worker) -> None:
            try:
                losses[w.spec.worker_id] = w.run(iterations)
            except BaseException as exc:  # re-raised in the caller's thread below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(w,)) for w in workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        by_server = {s.node_id: s for s in servers}
        layout.scatter(model, [by_server[table.owner(p)].state(p) for p in range(num_partitions)])
        return LocalRunResult(
            losses,
            model,
            {s.node_id: s.stats() for s in servers},
            sum(w.early_pushes for w in workers),
        )
    finally:
        for server in servers:
            server.stop()
