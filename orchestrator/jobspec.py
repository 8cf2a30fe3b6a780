"""What a user submits: a training job with a budget (`orchestrator submit job.yaml`).

A `JobSubmission` is validated at the edge (CLI, HTTP API) and stored as JSON with the job; the
controller turns it into the `JobSpec` BidBrain plans with.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from orchestrator.bidbrain.model import AppParams, JobSpec
from orchestrator.market.catalog import Catalog, InstanceType

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class JobSubmission(BaseModel):
    """A job as submitted. Work is in reference-GPU-hours (one V100 for an hour = 1)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="letters, digits, '.', '_' and '-', up to 64")
    budget_usd: Annotated[float, Field(gt=0, allow_inf_nan=False)]
    work_gpu_hours: Annotated[float, Field(gt=0, allow_inf_nan=False)]
    max_gpus: Annotated[float, Field(gt=0, le=4096, allow_inf_nan=False)] = 16.0
    regions: tuple[str, ...] = ("us-east-1",)
    instance_types: tuple[str, ...] | None = Field(
        None, description="GPU types the job may run on (default: every GPU type priced)"
    )
    reliable_type: str = "m5.xlarge"
    reliable_count: Annotated[int, Field(ge=1, le=64)] = 1
    app: AppParams = AppParams()
    time_value_usd_per_hour: Annotated[float, Field(ge=0)] | None = None
    gpu_work_rates: dict[str, Annotated[float, Field(gt=0)]] | None = None
    training: dict[str, Any] | None = Field(
        None,
        description="train a model with AgileML (TrainingSpec fields but job_id): on AWS the "
        "controller hosts the job's elasticity controller and counts iterations as its work",
    )

    @field_validator("training")
    @classmethod
    def _training(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            # loaded only for training jobs: the runtime's models pull in torch
            from orchestrator.agileml.hosting import validate_training_section

            validate_training_section(value)
        return value

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not NAME_PATTERN.match(value):
            raise ValueError(
                "use letters, digits, '.', '_' and '-' (1-64, not starting with a symbol)"
            )
        return value

    @field_validator("regions")
    @classmethod
    def _regions(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        known = Catalog.load().regions()
        for region in value:
            if region not in known:
                raise ValueError(f"unknown region {region!r}; known: {', '.join(known)}")
        if not value:
            raise ValueError("give at least one region")
        return value

    @field_validator("instance_types")
    @classmethod
    def _instance_types(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        for name in value or ():
            it = _catalog_type(name)
            if not it.is_gpu:
                raise ValueError(f"{name} has no GPU; list GPU types only")
        if value is not None and not value:
            raise ValueError("give at least one GPU type, or leave it out for all")
        return value

    @field_validator("reliable_type")
    @classmethod
    def _reliable_type(cls, value: str) -> str:
        _catalog_type(value)
        return value

    @model_validator(mode="after")
    def _reliable_offered(self) -> JobSubmission:
        reliable = Catalog.load().get(self.reliable_type)
        if not any(reliable.offered_in(r) for r in self.regions):
            raise ValueError(
                f"reliable_type {self.reliable_type} is not offered in {', '.join(self.regions)}"
            )
        return self

    def job_spec(self) -> JobSpec:
        """The spec BidBrain plans with."""
        rates = None
        if self.gpu_work_rates:
            rates = {**Catalog.load().gpu_work_rates, **self.gpu_work_rates}
        return JobSpec(
            name=self.name,
            work_gpu_hours=self.work_gpu_hours,
            max_work_rate=self.max_gpus,
            budget_usd=self.budget_usd,
            reliable_type=self.reliable_type,
            reliable_count=self.reliable_count,
            app=self.app,
            time_value_usd_per_hour=self.time_value_usd_per_hour,
            gpu_work_rates=rates,
        )


def _catalog_type(name: str) -> InstanceType:
    """The catalog entry, or a ValueError carrying the catalog's "Did you mean" message."""
    from orchestrator.errors import UserError

    try:
        return Catalog.load().get(name)
    except UserError as exc:
        raise ValueError(exc.message) from None
