"""BidBrain's view of a pipeline job, from the planner.

BidBrain plans in reference-GPU units: a job's work is reference-GPU-hours and each instance
adds ν = GPUs × the rate of its GPU model (one V100 = 1). A pipeline job does not scale
linearly: on N workers the planner predicts T(N) minibatches/s where one worker does T(1). So
for a job of `minibatches` on up to N workers, with the profile measured on one reference GPU:

    work_gpu_hours = minibatches / T(1) / 3600
    efficiency     = T(N) / (N * T(1))
    ν per GPU      = rate of its model * efficiency

and holding N reference GPUs then gives Σ k·ν = T(N) / T(1), the planner's throughput in
reference-GPU units. BidBrain's model is additive, so a smaller fleet gets the same efficiency
as N workers (conservative when scaling is sublinear: fewer workers waste less).
`orchestrator plan ... --minibatches N` prints these as job-spec fields.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.agileml.pipeline.planner import plan
from orchestrator.agileml.pipeline.profiler import ModelProfile
from orchestrator.units import MAX_WORK_RATE, SECONDS_PER_HOUR


class PipelineSizing(BaseModel):
    """The planner's throughput for one worker and for `workers`, and what BidBrain plans with."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    workers: Annotated[int, Field(ge=1)]
    minibatches: Annotated[int, Field(ge=1)]
    single_worker_per_s: Annotated[float, Field(gt=0)]
    planned_per_s: Annotated[float, Field(gt=0)]
    parallel_efficiency: Annotated[float, Field(gt=0, le=1)]
    work_gpu_hours: Annotated[float, Field(gt=0)]
    gpu_work_rates: dict[str, Annotated[float, Field(gt=0, le=MAX_WORK_RATE)]]

    def job_fields(self) -> dict[str, Any]:
        """The fields of a job submission (`orchestrator submit`) this sizing sets."""
        return {
            "work_gpu_hours": self.work_gpu_hours,
            "max_gpus": float(self.workers),
            "gpu_work_rates": dict(self.gpu_work_rates),
        }


def size_pipeline_job(
    profile: ModelProfile,
    workers: int,
    bandwidth_bytes_per_s: float,
    minibatches: int,
    gpu_work_rates: Mapping[str, float],
    *,
    levels: Sequence[tuple[int, float]] | None = None,
) -> PipelineSizing:
    """Size a job of `minibatches` on up to `workers` for BidBrain (see the module docstring).

    `gpu_work_rates` are the per-GPU-model rates for data-parallel work (the catalog's);
    `profile` is taken as measured on one reference GPU.

    Raises:
        PlanError: the planner's input errors.
    """
    single = plan(profile, 1, bandwidth_bytes_per_s).throughput_per_s()
    planned = plan(profile, workers, bandwidth_bytes_per_s, levels=levels).throughput_per_s()
    # the cost model cannot beat perfect scaling; the clamp only absorbs float rounding
    efficiency = min(1.0, planned / (workers * single))
    return PipelineSizing(
        workers=workers,
        minibatches=minibatches,
        single_worker_per_s=single,
        planned_per_s=planned,
        parallel_efficiency=efficiency,
        work_gpu_hours=minibatches / single / SECONDS_PER_HOUR,
        gpu_work_rates={model: rate * efficiency for model, rate in gpu_work_rates.items()},
    )
