"""What a user submits: a training job with a budget (`orchestrator submit job.yaml`).

A `JobSubmission` is validated at the edge (CLI, HTTP API) and stored as JSON with the job; the
controller turns it into the `JobSpec` BidBrain plans with.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Annotated, Any

import numpy as np
from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationInfo,
    field_validator,
    model_validator,
)

from orchestrator.bidbrain.deadline import DeadlineQuote, cheapest_fill, deadline_quote
from orchestrator.bidbrain.errors import DeadlineError
from orchestrator.bidbrain.model import AppParams, JobSpec
from orchestrator.bidbrain.policy import BidBrainSettings
from orchestrator.market.catalog import Catalog, InstanceType
from orchestrator.units import MAX_DEVICES, MAX_WORK_RATE, SECONDS_PER_HOUR

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
#: One V100: a reference-GPU-hour is an hour of it (work rate 1).
REFERENCE_INSTANCE_TYPE = "p3.2xlarge"
MAX_GPUS = 4096
#: Bounds no real job reaches: a number past one is a typo (or a probe), and BidBrain could not
#: decide for it (the job would sit running, paying for its on-demand node).
MAX_BUDGET_USD = 10_000_000.0
MAX_WORK_GPU_HOURS = 10_000_000.0
MAX_USD_PER_HOUR = 100_000.0
MAX_SECONDS_PER_ITERATION = 86_400.0


class IterationTime(BaseModel):
    """How long one iteration (one global batch) of a training job takes on one instance of a
    GPU type: with the training section's iterations it gives the job's work."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seconds_per_iteration: Annotated[
        float, Field(gt=0, le=MAX_SECONDS_PER_ITERATION, allow_inf_nan=False, strict=True)
    ]
    measured_on: str = Field(
        REFERENCE_INSTANCE_TYPE,
        description="the GPU instance type it was measured on (its GPUs' catalog work rates "
        "convert it to reference-GPU-hours)",
    )

    @field_validator("measured_on")
    @classmethod
    def _gpu_type(cls, value: str) -> str:
        if not _catalog_type(value).is_gpu:
            raise ValueError(f"{value} has no GPU; name the GPU type the time was measured on")
        return value

    def work_gpu_hours(self, iterations: int, rates: Mapping[str, Any]) -> float:
        """`iterations` of this time, in reference-GPU-hours (the catalog's rates, with the
        job's own `gpu_work_rates` over them)."""
        catalog = Catalog.load()
        it = catalog.get(self.measured_on)
        assert it.gpu_model is not None  # checked above
        merged = {**catalog.gpu_work_rates, **rates}
        rate = it.gpu_count * float(merged[it.gpu_model])
        return iterations * self.seconds_per_iteration / SECONDS_PER_HOUR * rate


#: `model_validate(..., context=STORED)`: a spec the store kept (validated when it was
#: submitted; checks added since then that only guard new submissions are skipped).
STORED = {"stored": True}


class JobSubmission(BaseModel):
    """A job as submitted. Work is in reference-GPU-hours (one V100 for an hour = 1), given as
    `work_gpu_hours` or, for a training job, as its iterations times `iteration_time`.

    Every number is finite: the spec travels as JSON (the CLI's request, the API's answers)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    name: str = Field(description="letters, digits, '.', '_' and '-', up to 64")
    # strict: a number (an int or a float), never `true` or "40"
    budget_usd: Annotated[float, Field(gt=0, le=MAX_BUDGET_USD, allow_inf_nan=False, strict=True)]
    iteration_time: IterationTime | None = Field(
        None,
        description="a training job's seconds per iteration on one instance of a GPU type: "
        "its work is training.iterations of it, sized once at submission from the catalog's "
        "rates with the job's gpu_work_rates over them",
    )
    work_gpu_hours: Annotated[
        float, Field(gt=0, le=MAX_WORK_GPU_HOURS, allow_inf_nan=False, strict=True)
    ] = Field(
        description="the work in reference-GPU-hours; a training job may give iteration_time "
        "instead (filled in from it at submission; when both are given this one counts)"
    )
    max_gpus: Annotated[float, Field(gt=0, le=MAX_GPUS, allow_inf_nan=False, strict=True)] = 16.0
    regions: tuple[str, ...] = ("us-east-1",)
    instance_types: tuple[str, ...] | None = Field(
        None, description="GPU types the job may run on (default: every GPU type priced)"
    )
    reliable_type: str = "m5.xlarge"
    reliable_count: Annotated[int, Field(ge=1, le=64, strict=True)] = 1
    app: AppParams = AppParams()
    time_value_usd_per_hour: (
        Annotated[float, Field(ge=0, le=MAX_USD_PER_HOUR, strict=True)] | None
    ) = None
    gpu_work_rates: (
        dict[str, Annotated[float, Field(gt=0, le=MAX_WORK_RATE, strict=True)]] | None
    ) = None
    training: dict[str, Any] | None = Field(
        None,
        description="train a model with AgileML (TrainingSpec fields but job_id): on AWS the "
        "controller hosts the job's elasticity controller and counts iterations as its work",
    )
    deadline: AwareDatetime | None = Field(
        None,
        description="when the work must be done, ISO 8601 with a zone (2026-11-27T17:00:00Z); "
        "BidBrain keeps a safety net of on-demand GPUs for when the slack runs out",
    )
    deadline_hours: (
        Annotated[float, Field(gt=0, le=24 * 366, allow_inf_nan=False, strict=True)] | None
    ) = Field(None, description="the deadline as hours after submission (becomes `deadline`)")
    deadline_soft: bool = Field(
        False,
        description="when meeting the deadline could cost more than the budget: false (the "
        "default) refuses the submission with the numbers, true lets the budget win (the job "
        "may finish late; it never spends past its budget)",
    )

    @model_validator(mode="before")
    @classmethod
    def _work_from_iterations(cls, data: Any) -> Any:
        """Fill in `work_gpu_hours` from the training's iterations and `iteration_time`."""
        if not isinstance(data, dict) or data.get("iteration_time") is None:
            return data
        if data.get("work_gpu_hours") is not None:  # given, or filled in at submission
            return data
        training = data.get("training")
        if not isinstance(training, dict):
            raise ValueError("iteration_time needs a training section (its iterations)")
        from orchestrator.agileml.spec import validate_training_section

        try:
            iterations = validate_training_section(training).iterations
            timing = IterationTime.model_validate(data["iteration_time"])
            rates = _GPU_WORK_RATES.validate_python(data.get("gpu_work_rates") or {})
        except ValueError:  # (ValidationError too) that field's own check names it, and is
            # the first error: work_gpu_hours, checked before training and gpu_work_rates, is
            # not reported missing (this placeholder never survives: that check fails)
            return {**data, "work_gpu_hours": 1.0}
        try:
            work = timing.work_gpu_hours(iterations, rates)
        except OverflowError:  # an int iterations beyond any float
            work = math.inf
        if not 0 < work < math.inf:
            raise ValueError(
                "training.iterations times iteration_time.seconds_per_iteration is no positive, "
                f"finite amount of work ({work} reference-GPU-hours); give smaller or larger values"
            )
        return {**data, "work_gpu_hours": work}

    @field_validator("training")
    @classmethod
    def _training(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            # loaded only for training jobs: the runtime's models pull in torch
            from orchestrator.agileml.spec import validate_training_section

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
                shown = region if len(region) <= 64 else f"{region[:61]}..."
                raise ValueError(f"unknown region {shown!r}; known: {', '.join(known)}")
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
    def _one_deadline(self) -> JobSubmission:
        if self.deadline is not None and self.deadline_hours is not None:
            raise ValueError("give deadline or deadline_hours, not both")
        return self

    @model_validator(mode="after")
    def _every_gpu_used(self, info: ValidationInfo) -> JobSubmission:
        if self.training is None or (info.context or {}).get("stored"):
            return self
        catalog, cap = Catalog.load(), self.devices_per_node()
        usable = [t for t in catalog.gpu_types() if self._fits(catalog, t)]
        if not usable:  # a pipeline asking for a GPU count no instance type has
            counts = sorted({catalog.get(t).gpu_count for t in catalog.gpu_types()})
            raise ValueError(
                f"training.devices_per_node: {cap}: no instance type has exactly {_gpus(cap)} "
                f"for a pipeline node's {cap} stage workers (a GPU each); the types have "
                f"{', '.join(map(str, counts))} GPUs: ask for one of those counts"
            )
        unfit = [t for t in self.instance_types or () if not self._fits(catalog, t)]
        if unfit:
            raise ValueError(
                f"instance_types: {'; '.join(self._why_unfit(catalog, t) for t in unfit)}: the "
                f"job's nodes train on {_gpus(cap)} each ({self._cap_reason()}); list types "
                f"with {self._fit_rule()} ({', '.join(usable)}) or leave instance_types out"
            )
        return self

    def devices_per_node(self) -> int:
        """The most GPUs of an instance a training node of the job uses: its training
        section's `devices_per_node`; when not given, 1 for a pipeline, else every GPU an
        instance has."""
        given = self._devices_given()
        if self._pipeline():
            return given or 1
        return given or MAX_DEVICES

    def _devices_given(self) -> int | None:
        cap = (self.training or {}).get("devices_per_node")
        return cap if type(cap) is int and 1 <= cap <= MAX_DEVICES else None

    def _pipeline(self) -> bool:
        return (self.training or {}).get("parallelism") == "pipeline"

    def _fits(self, catalog: Catalog, instance_type: str) -> bool:
        """Whether the job's nodes use every GPU of `instance_type`, each on a GPU of its own:
        a pipeline node's stage workers (one per device, `devices_per_node` of them) need
        exactly that many GPUs; a data-parallel node trains on every GPU up to its cap."""
        gpus = catalog.get(instance_type).gpu_count
        cap = self.devices_per_node()
        return gpus == cap if self._pipeline() else gpus <= cap

    def _why_unfit(self, catalog: Catalog, instance_type: str) -> str:
        gpus, cap = catalog.get(instance_type).gpu_count, self.devices_per_node()
        if gpus > cap:
            return f"{instance_type} has {_gpus(gpus)}: {gpus - cap} would be paid for and idle"
        them = "it" if gpus == 1 else "them"
        return f"{instance_type} has {_gpus(gpus)}: {cap} stage workers would share {them}"

    def _fit_rule(self) -> str:
        gpus = _gpus(self.devices_per_node())
        return f"exactly {gpus}" if self._pipeline() else f"at most {gpus}"

    def _cap_reason(self) -> str:
        if not self._pipeline():
            return "training.devices_per_node"
        if self._devices_given() is None:
            return "a pipeline node runs one stage worker unless training.devices_per_node says"
        return "training.devices_per_node: a pipeline node's stage workers, a GPU each"

    def usable_types(self, catalog: Catalog) -> tuple[str, ...]:
        """The instance types BidBrain may buy for the job: its `instance_types` (else every
        GPU type); for a training job, only those whose every GPU its nodes train on
        (`devices_per_node`)."""
        types = self.instance_types or tuple(catalog.gpu_types())
        if self.training is None:
            return tuple(types)
        return tuple(t for t in types if self._fits(catalog, t))

    def types_refused(self, catalog: Catalog) -> str | None:
        """Why the job may use none of its instance types (a training job stored before they
        were checked at submission), None if it may use some."""
        if self.usable_types(catalog):
            return None
        listed = self.instance_types or tuple(catalog.gpu_types())
        which = "the job's instance_types" if self.instance_types else "the instance types"
        return (
            f"none of {which} ({', '.join(listed)}) has {self._fit_rule()}, which the job's "
            f"nodes train on ({self._cap_reason()}); submit it again with types of "
            f"{self._fit_rule()}"
        )

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
            deadline_s=None if self.deadline is None else self.deadline.timestamp(),
        )

    def with_deadline_at(self, now_s: float) -> JobSubmission:
        """`deadline_hours` (hours after `now_s`) turned into `deadline`."""
        if self.deadline_hours is None:
            return self
        at = datetime.fromtimestamp(now_s + self.deadline_hours * SECONDS_PER_HOUR, UTC)
        return self.model_copy(update={"deadline": at, "deadline_hours": None})


#: `gpu_work_rates` as the field checks it (for the work from `iteration_time`, before it is)
_GPU_WORK_RATES = TypeAdapter(dict[str, Annotated[float, Field(gt=0, allow_inf_nan=False)]])


def _catalog_type(name: str) -> InstanceType:
    """The catalog entry, or a ValueError carrying the catalog's "Did you mean" message."""
    from orchestrator.errors import UserError

    try:
        return Catalog.load().get(name)
    except UserError as exc:
        raise ValueError(exc.message) from None


def check_deadline(
    submission: JobSubmission, now_s: float, bidbrain: BidBrainSettings | None = None
) -> DeadlineQuote | None:
    """What the submission's deadline asks (None: it has none); see `deadline_quote`.

    Raises:
        DeadlineError: the work cannot be done by the deadline at `max_gpus`, no GPU type it
            may use is offered in its regions, or meeting the deadline could cost more than
            the budget and `deadline_soft` is false. The message gives the numbers and the
            choices; the field is the one the user set (`deadline` or `deadline_hours`).
    """
    field = "deadline_hours" if submission.deadline_hours is not None else "deadline"
    spec = submission.with_deadline_at(now_s).job_spec()
    if spec.deadline_s is None:
        return None
    settings = bidbrain or BidBrainSettings()
    catalog = Catalog.load()
    types = submission.usable_types(catalog)
    offers = [
        (catalog.get(t).on_demand_price(region), catalog.work_rate(t, spec.gpu_work_rates))
        for t in types
        for region in submission.regions
        if catalog.get(t).offered_in(region)
    ]
    if not offers:
        raise DeadlineError(
            f"no GPU type the job may use is offered in {', '.join(submission.regions)}, so "
            "no on-demand GPUs could meet its deadline",
            fix="add a region or instance type where one is offered",
            field="instance_types",
        )
    prices, rates = (np.array(v, dtype=np.float64) for v in zip(*offers, strict=True))
    i, count = cheapest_fill(spec.max_work_rate, rates, prices, rates > 0)
    reliable = catalog.get(submission.reliable_type)
    region = next(r for r in submission.regions if reliable.offered_in(r))
    quote = deadline_quote(
        spec,
        now_s,
        fleet_usd_per_hour=float(prices[i]) * count,
        reliable_usd_per_hour=reliable.on_demand_price(region) * submission.reliable_count,
        decision_interval_s=settings.decision_interval_s,
        reserve_s=settings.budget_reserve_s,
    )
    if spec.deadline_s < quote.earliest_finish_s:
        if quote.gpus_needed <= MAX_GPUS:
            more = f", or raise max_gpus to {math.ceil(quote.gpus_needed)} or more"
        else:
            more = " (no max_gpus up to 4096 can make it)"
        raise DeadlineError(
            f"the deadline cannot be met: at max_gpus {submission.max_gpus:g} the work "
            f"({submission.work_gpu_hours:g} reference-GPU-hours) is done at the earliest "
            f"{_iso(quote.earliest_finish_s)} (start-up included), after the deadline "
            f"{_iso(spec.deadline_s)}",
            fix=f"set a deadline after {_iso(quote.earliest_finish_s)}{more}",
            field=field,
        )
    if quote.worst_cost_usd > submission.budget_usd and not submission.deadline_soft:
        raise DeadlineError(
            f"meeting the deadline could cost up to ${quote.worst_cost_usd:,.2f} (if spot "
            f"capacity runs out: the work on on-demand GPUs, the reliable tier until the "
            f"deadline) against the ${submission.budget_usd:,.2f} budget; the job never spends "
            "past its budget, so it could then finish late",
            fix=f"raise budget_usd to {math.ceil(quote.worst_cost_usd * 100) / 100:.2f}, set a "
            "later deadline, or set deadline_soft: true to let the budget win",
            field="budget_usd",
        )
    return quote


def _gpus(count: int) -> str:
    return f"{count} GPU{'' if count == 1 else 's'}"


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
