"""An AgileML job's spec (`TrainingSpec`) and what it is made of, free of torch: the API and
the job spec validate a submission's `training` section with it without importing the
runtime (`control`, `elasticity` and `hosting` re-export these names)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from orchestrator.straggler.spec import StragglerSpec
from orchestrator.units import MAX_DEVICES, MAX_SEED, MAX_SETTING_S

NodeId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")]
#: The most DataLoader processes a node may run for its rows (`loader_workers`).
MAX_LOADER_WORKERS = 16
#: The most micro-batches a worker may split its share of an iteration into (`accumulate`).
MAX_ACCUMULATE = 4096


class StageThresholds(BaseModel):
    """Transient:reliable ratios above which stages 2 and 3 start; 0 < stage2 < stage3.

    Raises:
        pydantic.ValidationError: on construction, for thresholds out of order, not positive
            or not finite.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    stage2_above: Annotated[float, Field(le=1e6, strict=True)] = 1.0
    stage3_above: Annotated[float, Field(le=1e6, strict=True)] = 15.0

    @model_validator(mode="after")
    def _ordered(self) -> StageThresholds:
        if not 0 < self.stage2_above < self.stage3_above:
            raise ValueError(
                f"need 0 < stage2_above < stage3_above, got {self.stage2_above} and "
                f"{self.stage3_above}"
            )
        return self


class ModelSpec(BaseModel):
    """Which example model to train (see `examples.build_model`).

    `mlr`: multinomial logistic regression (features x classes); `mlp`: one hidden ReLU layer;
    `additive`: a probe whose update per row is the row itself, so the exact final parameters
    are known (for exactly-once checks).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["mlr", "mlp", "additive"] = "mlr"
    features: Annotated[int, Field(ge=1, le=1_000_000, strict=True)] = 64
    classes: Annotated[int, Field(ge=2, le=100_000, strict=True)] = 10
    hidden: Annotated[int, Field(ge=1, le=100_000, strict=True)] = 64


class TrainingSpec(BaseModel):
    """An AgileML job: model, data, optimizer, consistency, and elasticity settings.

    Raises:
        pydantic.ValidationError: naming the field, e.g. a global batch smaller than the
            number of partitions' minimum or a slack below 0, or a number that is not finite.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    job_id: NodeId
    # the user's job file (or directory with job.py) on the nodes' machines (see `jobcode`);
    # None: the built-in example `model` on generated data, trained by SGD with `lr`
    code: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    # the job's data: an S3 prefix (copied to each node once) or a folder on the nodes; the
    # job's dataset() finds it at $ORCHESTRATOR_DATA_DIR (see `orchestrator.artifacts.data`)
    data: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    model: ModelSpec = ModelSpec()
    samples: Annotated[int, Field(ge=1, le=10_000_000, strict=True)] = 4096
    data_seed: Annotated[int, Field(ge=0, le=MAX_SEED, strict=True)] = 0
    global_batch: Annotated[int, Field(ge=1, le=10_000_000, strict=True)] = 256
    lr: Annotated[float, Field(gt=0, le=1_000, strict=True)] = 0.05
    slack: Annotated[int, Field(ge=0, le=1000, strict=True)] = 0
    iterations: Annotated[int, Field(ge=1, le=1_000_000_000, strict=True)] = 100
    num_partitions: Annotated[int, Field(ge=1, le=4096, strict=True)] = 4
    seed: Annotated[int, Field(ge=0, le=MAX_SEED, strict=True)] = 0
    min_nodes: Annotated[int, Field(ge=1, le=4096, strict=True)] = 1  # ready before clock 0
    thresholds: StageThresholds = StageThresholds()
    heartbeat_s: Annotated[float, Field(gt=0, le=10, strict=True)] = 0.1
    failure_timeout_s: Annotated[float, Field(gt=0, le=600, strict=True)] = 1.0
    # how far ahead of the fastest worker servers let workers compute, at least (more when
    # iterations are short, see `horizon`); joins and evictions take effect just past it, so
    # no worker ever computes a clock on an outdated roster
    horizon_clocks: Annotated[int, Field(ge=2, le=10_000, strict=True)] = 8
    # workers compute on the first pulled partitions while the rest arrive, and push each
    # partition as soon as backward has its gradients (`agileml.streams`); same gradients.
    # Off by default: no gain measured on a 2-core machine, and a worse eviction blip there
    overlap: bool = False
    # gradient accumulation: each worker computes its share of an iteration in this many
    # micro-batches (activations of one at a time), their gradients summed before the push;
    # the global batch and the update are unchanged
    accumulate: Annotated[int, Field(ge=1, le=MAX_ACCUMULATE, strict=True)] = 1
    # mixed precision: `bf16` (`fp16`) computes each worker's forward and loss under autocast
    # to bfloat16 (float16, with a dynamic loss scale: a step whose gradient is not finite is
    # skipped on every partition); the parameter servers keep fp32 weights and optimizer
    # state, and the gradients travel in fp32 (see `precision`)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    # what pushes and pulls carry between workers and parameter servers: `bf16` halves the
    # bytes (the servers still sum and keep float32; each worker computes on the values
    # rounded to bfloat16 and pushes its gradient rounded so); hand-offs, backups and
    # checkpoints stay float32
    wire_precision: Literal["fp32", "bf16"] = "fp32"
    # gradient clipping: each iteration's gradient scaled to at most this global 2-norm over
    # every partition, as `torch.nn.utils.clip_grad_norm_` on one process (see `clipping`:
    # one more round between workers and servers per iteration; bulk-synchronous jobs only)
    clip_grad_norm: Annotated[float, Field(gt=0, le=1e9, strict=True)] | None = None
    # the job's evaluate(model) during the run, on checkpoints at least this many iterations
    # apart (`evaluations`): through the controller, checkpoints are then taken at least as
    # often, and the results go to the training reports (API, dashboard, /metrics, TensorBoard)
    eval_every: Annotated[int, Field(ge=1, le=1_000_000_000, strict=True)] | None = None
    # the most devices each node trains on (one worker per device, their gradients reduced
    # inside the node before its push, see `devices`); None: every device a node has. A
    # pipeline node runs this many stage workers, a GPU each (None: 1; `pipeline.hosted`)
    devices_per_node: Annotated[int, Field(ge=1, le=MAX_DEVICES, strict=True)] | None = None
    # processes of a torch DataLoader that read a worker's next share while it computes (for a
    # job's own dataset read item by item; `loading`); 0: the worker takes its rows itself
    loader_workers: Annotated[int, Field(ge=0, le=MAX_LOADER_WORKERS, strict=True)] = 2
    # FlexRR (RapidReassignment between workers); `{"flexrr": false}` turns it off
    straggler: StragglerSpec = StragglerSpec()
    # checkpoints (see `checkpoints`): written under `checkpoint_dir` (a directory the reliable
    # nodes and the elasticity controller share) every `checkpoint_every` iterations and every
    # `checkpoint_every_s` seconds (0: not by that measure); `resume_from` a checkpoint to start
    # from instead of the initial model
    checkpoint_dir: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    checkpoint_every: Annotated[int, Field(ge=0, le=1_000_000_000, strict=True)] = 0
    checkpoint_every_s: Annotated[float, Field(ge=0, le=MAX_SETTING_S, strict=True)] = 0.0
    resume_from: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    # the artifact store (location string) that uploaded code (`code` = "sha256:<hex>") is
    # fetched from (see `orchestrator.artifacts.code`)
    code_store: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    # `pipeline`: the job's layers split into stages across its nodes (PipeDream's planner,
    # see `pipeline.hosted`) instead of data-parallel workers; needs `code` whose model() is an
    # nn.Sequential (or has a stages() hook). `schedule` and `stages` (the depth; default: the
    # planner's) apply to pipeline jobs only
    parallelism: Literal["data", "pipeline"] = "data"
    schedule: Literal["flush", "gpipe", "1f1b", "2bw"] = "flush"
    stages: Annotated[int, Field(ge=1, le=1024, strict=True)] | None = None

    @model_validator(mode="after")
    def _timeouts(self) -> TrainingSpec:
        if self.horizon_clocks <= self.slack + 1:
            raise ValueError(
                f"horizon_clocks ({self.horizon_clocks}) must exceed slack + 1 "
                f"({self.slack + 1}); otherwise workers stall at the horizon"
            )
        if self.parallelism == "pipeline" and self.code is None:
            raise ValueError(
                "parallelism `pipeline` needs the job's code (a job file whose model() is an "
                "nn.Sequential); the built-in example models train data-parallel only"
            )
        if self.parallelism == "pipeline" and self.accumulate > 1:
            raise ValueError(
                "accumulate applies to data-parallel jobs: a pipeline already runs each "
                "iteration as microbatches through its stages"
            )
        if self.parallelism == "pipeline" and self.precision != "fp32":
            raise ValueError(
                f"precision {self.precision} applies to data-parallel jobs for now: a "
                "pipeline's stages compute in fp32"
            )
        if self.parallelism == "pipeline" and self.wire_precision != "fp32":
            raise ValueError(
                "wire_precision applies to data-parallel jobs: a pipeline's stages send "
                "activations to each other, not values through parameter servers"
            )
        if self.clip_grad_norm is not None and (self.slack or self.parallelism == "pipeline"):
            raise ValueError(
                "clip_grad_norm needs a data-parallel job with slack 0: the global norm of an "
                "iteration's gradient needs every worker's share of it before any update"
            )
        if self.eval_every is not None and (self.code is None or self.parallelism == "pipeline"):
            raise ValueError(
                "eval_every needs a data-parallel job with code that defines evaluate(model); "
                "a pipeline is evaluated at its end"
            )
        if self.precision == "fp16" and self.code is None:
            raise ValueError(
                "precision fp16 needs the job's code (its optimizer skips a step whose "
                "gradient overflowed); the built-in example models train in fp32 or bf16"
            )
        if self.parallelism == "data" and (self.stages is not None or self.schedule != "flush"):
            raise ValueError("schedule and stages apply to parallelism `pipeline` only")
        if self.failure_timeout_s <= 2 * self.heartbeat_s:
            raise ValueError(
                f"failure_timeout_s ({self.failure_timeout_s}) must exceed two heartbeats "
                f"(2 x {self.heartbeat_s}); otherwise a live node is taken for dead"
            )
        return self


HOST_SET_FIELDS = ("checkpoint_dir", "resume_from", "code_store")


def validate_training_section(section: Mapping[str, Any]) -> TrainingSpec:
    """A job submission's `training` section as the spec it describes (its job id, its
    checkpoint folder and what it resumes from are filled in by the host).

    Raises:
        pydantic.ValidationError: a field is invalid (named).
        ValueError: the section sets a field the host sets.
    """
    for name in HOST_SET_FIELDS:
        if name in section:
            raise ValueError(
                f"{name} is set by the controller (the job's artifacts folder); remove it"
            )
    return TrainingSpec.model_validate({**dict(section), "job_id": "validate"})
