"""One pipeline stage: a process that runs its layers of an `nn.Sequential` by a schedule.

Activations go downstream and gradients upstream as authenticated `pipe` messages on the
runtime's ZMQ wire (one PULL inbox per stage). Weights are versioned: a forward runs on a
version's own leaf tensors (`torch.func.functional_call`), so the backward of that minibatch
computes its gradient on exactly those weights while newer versions exist (weight stashing);
an update makes a new version from the live weights and the summed gradients. With
`vertical_sync`, every stage runs minibatch i on the version number the input stage used.

Run by `pipeline.local.PipelineJob`: `python -m orchestrator.agileml.pipeline.stage CONFIG.json`
with the job token hex in `ORCHESTRATOR_AGILEML_TOKEN`; prints its result as one JSON line.
"""

from __future__ import annotations

import hashlib
import json
import signal
import sys
import threading
import time
import warnings
from collections import deque
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from safetensors.torch import load_file
from safetensors.torch import save as save_entries
from torch import nn
from torch.func import functional_call

from orchestrator.agileml import wire
from orchestrator.agileml.batches import to_device
from orchestrator.agileml.devices import node_devices
from orchestrator.agileml.errors import AgileMLError
from orchestrator.agileml.pipeline.link import Rewind, StageLink
from orchestrator.agileml.pipeline.schedule import Schedule, stage_ops, update_group
from orchestrator.agileml.pipeline.source import (
    ChainModelSpec,
    ChainSource,
    builtin_source,
    job_source,
    layer_state,
)
from orchestrator.agileml.roster import global_batch_indices
from orchestrator.agileml.token import token_from_env
from orchestrator.lifecycle import exit_with_parent


def stage_device(name: str) -> torch.device:
    """The torch device a stage trains on (`StageConfig.device`).

    Raises:
        AgileMLError: a CUDA device on a machine without it, or past its GPUs.
    """
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device.index is not None and device.index >= count:
            raise AgileMLError(f"the stage's device {name} is not here: this machine has "
                               f"{count} GPUs")  # fmt: skip
    return device


def device_for(worker: int) -> str:
    """The device of worker `worker` (of those on this machine) as `StageConfig.device`: GPU
    `worker` modulo the GPUs here (workers beyond them share), else the CPU
    (`devices.node_devices`, as a data-parallel node's first device)."""
    return str(node_devices(1, first=worker)[0])


def stage_source(config: StageConfig) -> ChainSource:
    """The model and data a stage trains: the job's code, or the built-in chain."""
    if config.code is not None:
        return job_source(config.code, config.seed)
    return builtin_source(config.model, config.seed)


class StageConfig(BaseModel):
    """What one stage runs. Layers [first_layer, last_layer] are indexes into the chain."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    job_id: str
    stage: Annotated[int, Field(ge=0)]
    stages: Annotated[int, Field(ge=1)]
    # workers per stage (default one each); this one is replica `replica` of its stage and runs
    # the minibatches m with m % replicas[stage] == replica (round-robin)
    replicas: tuple[int, ...] | None = None
    replica: Annotated[int, Field(ge=0)] = 0
    first_layer: Annotated[int, Field(ge=0)]
    last_layer: Annotated[int, Field(ge=0)]
    model: ChainModelSpec = ChainModelSpec()
    code: str | None = None  # a user's job file (see `source`); replaces `model`
    schedule: Schedule = Schedule.ONE_F_ONE_B
    minibatches: Annotated[int, Field(ge=1)]
    microbatches: Annotated[int, Field(ge=1)] = 1
    microbatch_size: Annotated[int, Field(ge=1)] = 32
    lr: Annotated[float, Field(gt=0)] = 0.05
    seed: int = 0
    vertical_sync: bool = False
    # emulated compute per microbatch (calibrated sleeps), added to the real compute
    forward_ms: Annotated[float, Field(ge=0)] = 0.0
    backward_ms: Annotated[float, Field(ge=0)] = 0.0
    rendezvous: str  # the launcher's endpoint
    host: str = "127.0.0.1"
    out_dir: str  # where the final weights go (`stage{N}.npy`)
    # resuming after an eviction: start at this minibatch (every stage's update boundary) from
    # these weights (a flat float32 .npy)
    first_minibatch: Annotated[int, Field(ge=0)] = 0
    initial_weights: str | None = None
    # and this optimizer state (a safetensors file of `PipelineStage.optimizer_entries`)
    initial_optimizer: str | None = None
    # after every update, send the weights to the launcher (the reliable tier keeps them) with
    # the number of minibatches they include, so a lost stage can be re-created from there
    backup: bool = False
    # where the backups go: a reliable node's holder (`pipeline.holder`); None: `rendezvous`
    backup_to: str | None = None
    # the device the stage's layers train on ("cpu", "cuda:N"; see `stage_device`)
    device: Annotated[str, Field(pattern=r"^(cpu|cuda:[0-9]{1,2})$")] = "cpu"

    @model_validator(mode="after")
    def _replica_in_range(self) -> StageConfig:
        counts = self.replica_counts
        if len(counts) != self.stages or min(counts) < 1:
            raise ValueError(f"replicas {counts} must give at least 1 for each of {self.stages}")
        if not (self.stage < self.stages and self.replica < counts[self.stage]):
            raise ValueError(f"stage {self.stage} replica {self.replica} is not in {counts}")
        return self

    @property
    def replica_counts(self) -> tuple[int, ...]:
        return self.replicas if self.replicas is not None else (1,) * self.stages

    def worker(self, stage: int, minibatch: int) -> int:
        """The worker index (stages in order, replicas within) that runs `minibatch` at
        `stage`."""
        counts = self.replica_counts
        return sum(counts[:stage]) + minibatch % counts[stage]

    @property
    def worker_index(self) -> int:
        return sum(self.replica_counts[: self.stage]) + self.replica


class PipelineStage:
    """The stage's state and its operations (see the module docstring)."""

    def __init__(self, config: StageConfig, token: bytes) -> None:
        self.config = config
        self._token = token
        self.device = stage_device(config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # no stray context on GPU 0 in every stage
        self.source = source = stage_source(config)
        layers = source.layers()[config.first_layer : config.last_layer + 1]
        self.module = nn.Sequential(*layers).to(self.device)
        self.names = [n for n, _ in self.module.named_parameters()]
        # the weights, detached; frozen ones (requires_grad False) are not trained
        self.live = [
            p.detach().clone().requires_grad_(p.requires_grad) for p in self.module.parameters()
        ]
        # the travelling state, layer by layer (see `source`): live weights, then buffers
        live_of = {id(p): w for p, w in zip(self.module.parameters(), self.live, strict=True)}
        self.state = [live_of.get(id(t), t) for layer in layers for t in layer_state(layer)]
        self.loss_fn = source.loss
        # each live weight's name across layouts: "<layer index in the chain>.<name in it>"
        key_of: dict[int, str] = {}
        for index, layer in enumerate(layers, start=config.first_layer):
            for name, p in layer.named_parameters():
                key_of.setdefault(id(p), f"{index}.{name}")
        self.param_keys = [key_of[id(p)] for p in self.module.parameters()]
        self.first, self.last = config.stage == 0, config.stage == config.stages - 1
        if self.first or self.last:
            self.data = source.rows()
        # the gradient of an update is the mean over the minibatches it sums: a step's M
        # (gpipe/flush, whichever replicas ran them), or each replica's 1 (1f1b) or M (2bw)
        share = config.replica_counts[config.stage]
        self.group = update_group(config.schedule, config.microbatches, share)
        self.loss_minibatches: list[int] = []
        self.losses: list[float] = []
        self.busy_s = 0.0
        self.versions_kept_max = 1  # the most weight versions alive at once
        self.start_from(config)

    def start_from(self, config: StageConfig) -> None:
        """(Re)start at `config.first_minibatch`: the weights and optimizer state of
        `config.initial_weights`/`initial_optimizer` (else as they are), the scheduler at the
        updates done, one weight version, nothing in flight. A survivor of another worker's
        loss calls it with the reliable copy's cut (`Rewind`)."""
        self.config = config
        if config.initial_weights is not None:
            flat = torch.from_numpy(np.load(config.initial_weights))
            if flat.numel() != sum(t.numel() for t in self.state):
                raise AgileMLError(f"stage {config.stage}: initial weights of the wrong size")
            offset = 0
            with torch.no_grad():
                for t in self.state:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()
        source = self.source
        self.optimizer = None  # plain SGD, or a stage without parameters (ReLU, Flatten)
        if source.optimizer is not None and self.live:
            self.optimizer = source.optimizer(self.live)
            if config.initial_optimizer is not None:
                self._load_optimizer(load_file(config.initial_optimizer))
        self.scheduler = None
        if self.optimizer is not None and source.scheduler is not None:
            # told the updates this stage makes in the run (its scheduler steps once each)
            self.scheduler = source.scheduler(self.optimizer, config.minibatches // self.group)
            with warnings.catch_warnings():  # stepped ahead of the optimizer on purpose
                warnings.simplefilter("ignore", UserWarning)
                for _ in range(config.first_minibatch // self.group):  # a function of steps
                    self.scheduler.step()
        self.current = 0
        self.versions: dict[int, list[torch.Tensor]] = {0: self._leaves(self.live)}
        # kept for vertical sync: a stage never runs more than `stages` updates ahead of the
        # version the input stage used
        self.recent: deque[int] = deque([0], maxlen=config.stages + 1)
        self.in_flight: dict[int, int] = {}  # version -> minibatches using it
        self.acc = [torch.zeros_like(p) for p in self.live]
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}

    @staticmethod
    def _leaves(values: list[torch.Tensor]) -> list[torch.Tensor]:
        return [v.detach().clone().requires_grad_(v.requires_grad) for v in values]

    def rows(self, minibatch: int) -> torch.Tensor:
        """Microbatch `minibatch % M` of the global batch of iteration `minibatch // M`: the
        rows a data-parallel run of the same seed and global batch trains on (`roster`)."""
        c = self.config
        iteration, j = divmod(minibatch, c.microbatches)
        batch = c.microbatches * c.microbatch_size
        rows = global_batch_indices(c.seed, iteration, len(self.data), batch)
        return rows[j * c.microbatch_size : (j + 1) * c.microbatch_size]

    def forward(self, minibatch: int, x_in: torch.Tensor | None, version: int | None) -> Any:
        """Run the stage's layers on minibatch `minibatch`; returns what goes downstream
        (activation, version), or None at the last stage."""
        c = self.config
        batch = None
        if self.first or self.last:
            batch = to_device(self.data.take(self.rows(minibatch)), self.device)
        if self.first:
            assert batch is not None
            x_in = batch[0]
            version = self.current
        assert x_in is not None
        x_in = x_in.to(self.device, non_blocking=True)  # from the wire: on the host
        if not self.first and x_in.is_floating_point():
            x_in.requires_grad_(True)
        v = version if c.vertical_sync and version is not None else self.current  # None: stage 0
        if v not in self.versions:
            raise AgileMLError(f"stage {c.stage}: weight version {v} is gone")
        params = dict(zip(self.names, self.versions[v], strict=True))
        out = functional_call(self.module, params, (x_in,))
        self.in_flight[v] = self.in_flight.get(v, 0) + 1
        self.versions_kept_max = max(self.versions_kept_max, len(self.versions))
        if self.last:
            assert batch is not None
            loss = self.loss_fn(out, batch[1])
            self.losses.append(float(loss.item()))
            self.loss_minibatches.append(minibatch)
            self.saved[minibatch] = (x_in, loss / self.group, v)
            return None
        self.saved[minibatch] = (x_in, out, v)
        return out.detach().cpu(), version

    def backward(self, minibatch: int, grad_out: torch.Tensor | None) -> torch.Tensor | None:
        """Backward of `minibatch` on the weights its forward used; returns the gradient for
        upstream (None at the first stage)."""
        x_in, out, v = self.saved.pop(minibatch)
        if grad_out is not None:
            grad_out = grad_out.to(self.device, non_blocking=True)
        torch.autograd.backward(out, grad_out)
        for acc, leaf in zip(self.acc, self.versions[v], strict=True):
            if leaf.grad is not None:
                acc.add_(leaf.grad)
                leaf.grad = None
        self.in_flight[v] -= 1
        self._drop_unused()
        if self.first:
            return None
        return (x_in.grad if x_in.grad is not None else torch.zeros_like(x_in)).cpu()

    def flat_gradient(self) -> torch.Tensor:
        """The gradients accumulated since the last update, flat in parameter order (on the
        host: the replicas sum them over the wire)."""
        if not self.acc:
            return torch.zeros(0)
        return torch.cat([g.reshape(-1) for g in self.acc]).cpu()

    def update(self, summed: torch.Tensor | None = None) -> None:
        """SGD on the accumulated gradients (or `summed`, the replicas' flat sum): a new
        weight version."""
        if summed is not None:
            summed, offset = summed.to(self.device), 0
            for g in self.acc:
                g.copy_(summed[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        with torch.no_grad():
            if self.optimizer is None:
                for w, g in zip(self.live, self.acc, strict=True):
                    if w.requires_grad:
                        w.add_(g, alpha=-self.config.lr)
            else:  # the job's own optimizer and schedule, on this stage's weights
                for w, g in zip(self.live, self.acc, strict=True):
                    w.grad = g.clone() if w.requires_grad else None
                self.optimizer.step()
                if self.scheduler is not None:
                    self.scheduler.step()
            for g in self.acc:
                g.zero_()
        self.current += 1
        self.versions[self.current] = self._leaves(self.live)
        self.versions_kept_max = max(self.versions_kept_max, len(self.versions))
        self.recent.append(self.current)
        self._drop_unused()

    def _drop_unused(self) -> None:
        keep = set(self.recent) if self.config.vertical_sync else {self.current}
        for v in [v for v in self.versions if v not in keep and not self.in_flight.get(v)]:
            del self.versions[v]
            self.in_flight.pop(v, None)

    def _optimizer_keys(self) -> list[str]:
        """The weight key of each index of the optimizer's state: its param groups' order."""
        assert self.optimizer is not None
        key_of = {id(w): key for w, key in zip(self.live, self.param_keys, strict=True)}
        return [key_of[id(p)] for g in self.optimizer.param_groups for p in g["params"]]

    def optimizer_entries(self) -> dict[str, torch.Tensor]:
        """The optimizer's state per weight, keyed "<weight key>.<state key>" (see
        `param_keys`), so that it follows each layer into any later layout."""
        if self.optimizer is None:
            return {}
        state = self.optimizer.state_dict()["state"]
        out = {}
        for i, key in enumerate(self._optimizer_keys()):
            for name, value in state.get(i, {}).items():
                tensor = value if isinstance(value, torch.Tensor) else torch.tensor(value)
                out[f"{key}.{name}"] = tensor.detach().cpu().clone().contiguous()
        return out

    def _load_optimizer(self, entries: dict[str, torch.Tensor]) -> None:
        assert self.optimizer is not None
        state: dict[int, dict[str, torch.Tensor]] = {}
        for i, key in enumerate(self._optimizer_keys()):
            prefix = key + "."
            got = {k[len(prefix) :]: v for k, v in entries.items() if k.startswith(prefix)}
            if got:
                state[i] = got
        saved = self.optimizer.state_dict()
        saved["state"] = state
        self.optimizer.load_state_dict(saved)

    def flat_weights(self) -> np.ndarray:
        """The stage's travelling state, flat float32 (see `source`)."""
        if not self.state:
            return np.zeros(0, dtype=np.float32)  # a stage of parameter-free layers
        return torch.cat([t.detach().reshape(-1).float() for t in self.state]).cpu().numpy()


#: Set by SIGUSR1, the node's eviction notice: the worker leaves after its next update's
#: backup, so the reliable copy holds everything it computed (`_StageRun.update`).
NOTICE = threading.Event()


class _Leave(Exception):  # noqa: N818 - a signal to the run loop, not an error
    """The notice came and the last update is backed up: stop."""


def run_stage(config: StageConfig, token: bytes) -> dict[str, Any]:
    """Rendezvous, run every operation of the schedule, save the weights; returns the
    worker's result (timings and losses). On a `Rewind` (another worker was lost and is
    being replaced) the stage goes back to the reliable copy's cut in place, rendezvous again
    under the new job id and runs on from the cut: its process, model and data are kept."""
    torch.set_num_threads(1)
    stage = PipelineStage(config, token)
    link = StageLink(token, config.job_id, config.host, config.stage, config.worker_index)
    me = config.worker_index
    started = time.time()
    try:
        while True:
            link.send(config.rendezvous, "hello", me, wire.json_body({"inbox": link.endpoint}))
            _, body = link.receive("peers", 0)
            inboxes = {int(k): v for k, v in wire.parse_json_body(body).items()}
            run = _StageRun(config, stage, link, inboxes)
            try:
                _run_ops(config, run)
                break
            except _Leave:
                return {"stage": config.stage, "replica": config.replica, "left": True}
            except Rewind as rewind:
                config = _rewound(config, rewind)
                stage.start_from(config)
                link.restart(config.job_id)
        ended = time.time()
        final = stage.flat_weights()
        if config.replica == 0:
            np.save(Path(config.out_dir) / f"stage{config.stage}.npy", final)
        link.send(config.rendezvous, "done", me, {})
        return {
            "stage": config.stage,
            "replica": config.replica,
            "device": str(stage.device),
            "started": started,
            "ended": ended,
            "busy_s": stage.busy_s,
            "backward_ends": run.backward_ends,
            "losses": stage.losses,
            "loss_minibatches": stage.loss_minibatches,
            "versions_kept_max": stage.versions_kept_max,
            "weights_sha256": hashlib.sha256(final.tobytes()).hexdigest(),
        }
    finally:
        link.close()


def _rewound(config: StageConfig, rewind: Rewind) -> StageConfig:
    """The config to run on from a rewind's cut (its weights and optimizer state written to
    files in the stage's `out_dir`, where `start_from` reads them)."""
    weights = optimizer = None
    prefix = Path(config.out_dir) / f"rewind{config.worker_index}-{rewind.body['job_id']}"
    if "w" in rewind.cut:
        weights = f"{prefix}.npy"
        np.save(weights, rewind.cut["w"].numpy())
    if "o" in rewind.cut:
        optimizer = f"{prefix}.safetensors"
        Path(optimizer).write_bytes(rewind.cut["o"].numpy().tobytes())
    update = {"job_id": rewind.body["job_id"], "initial_weights": weights,
              "first_minibatch": int(rewind.body["first_minibatch"]),
              "initial_optimizer": optimizer}  # fmt: skip
    return config.model_copy(update=update)


def _run_ops(config: StageConfig, run: _StageRun) -> None:
    for op in stage_ops(
        config.schedule,
        stages=config.stages,
        stage=config.stage,
        minibatches=config.minibatches,
        microbatches=config.microbatches,
        replicas=config.replica_counts,
        replica=config.replica,
        first_minibatch=config.first_minibatch,
    ):
        if op.kind == "F":
            run.forward(op.minibatch)
        elif op.kind == "B":
            run.backward(op.minibatch)
        else:
            run.update()


class _StageRun:
    """One worker's pass through its schedule: each operation receives what it needs from the
    neighbouring stages, computes, and sends on; the stage's busy time counts from the moment
    its input is there (waiting for a neighbour is idle time)."""

    def __init__(
        self, config: StageConfig, stage: PipelineStage, link: StageLink, inboxes: dict[int, str]
    ) -> None:
        self.config, self.stage, self.link, self.inboxes = config, stage, link, inboxes
        me, share = config.worker_index, config.replica_counts[config.stage]
        self.mates = [inboxes[me - config.replica + r] for r in range(share) if r != config.replica]
        self.completed = config.first_minibatch  # minibatches in the weights
        self.sent_losses = 0
        self.backward_ends: list[float] = []  # wall time each backward ended, in schedule order

    def forward(self, minibatch: int) -> None:
        config, stage = self.config, self.stage
        x_in, version = None, None
        if not stage.first:
            header, tensors = self.link.receive("act", minibatch)
            x_in, version = tensors["x"], header.epoch
        t0 = time.perf_counter()
        out = stage.forward(minibatch, x_in, version)
        _emulate(config.forward_ms)  # the output exists once the compute is done
        if out is not None:
            activation, v = out
            down = self.inboxes[config.worker(config.stage + 1, minibatch)]
            self.link.send(down, "act", minibatch, {"x": activation}, epoch=v)
        stage.busy_s += time.perf_counter() - t0

    def backward(self, minibatch: int) -> None:
        config, stage = self.config, self.stage
        grad_out = None
        if not stage.last:
            grad_out = self.link.receive("grad", minibatch)[1]["x"]
        t0 = time.perf_counter()
        grad_in = stage.backward(minibatch, grad_out)
        _emulate(config.backward_ms)
        if grad_in is not None:
            up = self.inboxes[config.worker(config.stage - 1, minibatch)]
            self.link.send(up, "grad", minibatch, {"x": grad_in})
        self.backward_ends.append(time.time())
        if stage.first and len(self.backward_ends) == 1:
            self.link.send(config.rendezvous, "first", minibatch, {})
        stage.busy_s += time.perf_counter() - t0

    def update(self) -> None:
        t0 = time.perf_counter()
        self._update()
        self.stage.busy_s += time.perf_counter() - t0
        last = self.completed >= self.config.minibatches  # nothing left to hand over
        if NOTICE.is_set() and self.config.backup and not last:  # the backup has it all
            self.link.send(self.config.rendezvous, "leaving", self.completed, {})
            raise _Leave

    def _update(self) -> None:
        config, stage = self.config, self.stage
        summed = None  # an unreplicated stage steps on its own gradient where it is
        if self.mates:
            grads = stage.flat_gradient()
            summed = _replicas_sum(self.link, config, self.mates, self.completed, grads)
        stage.update(summed)
        self.completed += stage.group
        if not config.backup:
            return
        losses = torch.tensor(stage.losses[self.sent_losses :], dtype=torch.float64)
        indexes = torch.tensor(stage.loss_minibatches[self.sent_losses :])
        self.sent_losses = len(stage.losses)
        # replicas hold the same weights: replica 0 sends them for the stage
        first = config.replica == 0
        weights = torch.from_numpy(stage.flat_weights() if first else np.zeros(0, np.float32))
        blob = save_entries(stage.optimizer_entries()) if first else b""
        optimizer = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else None
        tensors = {"w": weights, "loss": losses, "mb": indexes}
        if optimizer is not None:
            tensors["o"] = optimizer
        self.link.send(config.backup_to or config.rendezvous, "backup", self.completed, tensors)


def _replicas_sum(
    link: StageLink, config: StageConfig, mates: list[str], update: int, own: torch.Tensor
) -> torch.Tensor:
    """The stage's replicas exchange their gradients for update `update` and each sums them in
    replica order, so every replica applies the same bits."""
    for endpoint in mates:
        link.send(endpoint, f"sync{config.replica}", update, {"g": own})
    parts = [
        own if r == config.replica else link.receive(f"sync{r}", update)[1]["g"]
        for r in range(config.replica_counts[config.stage])
    ]
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


def _emulate(ms: float) -> None:
    if ms > 0:
        time.sleep(ms / 1000)


def main(argv: list[str] | None = None) -> int:
    """`stage CONFIG.json` (`LocalSpawner` forks it, with this module imported)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m orchestrator.agileml.pipeline.stage CONFIG.json", file=sys.stderr)
        return 2
    signal.signal(signal.SIGUSR1, lambda *_: NOTICE.set())
    exit_with_parent()  # a SIGKILLed launcher leaves no stage behind
    config = StageConfig.model_validate_json(Path(args[0]).read_text())
    result = run_stage(config, token_from_env())
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
