"""The EC2 instance catalog: hardware, on-demand prices per region, and GPU work rates.

The catalog is a versioned data file shipped in the package (`data/catalog.json`), read and
validated on first use. Prices are AWS's published Linux on-demand list prices as of the file's
`as_of` date; a price of `null` means AWS does not offer the type in that region. Work rates are
relative training throughput per GPU (V100 = 1.0), the ν of BidBrain's expected work (Eq. 4.3);
they are defaults for jobs whose measured rates are not known yet.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import re
from collections.abc import Iterable, Mapping
from datetime import date
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any

import pydantic
from pydantic import Field, ValidationInfo, field_validator, model_validator

from orchestrator.errors import UserError
from orchestrator.market.errors import UnknownInstanceTypeError, UnknownMarketError

CATALOG_FORMAT_VERSION = 1
PACKAGED_CATALOG_RESOURCE = ("data", "catalog.json")  # under the orchestrator.market package
REFERENCE_GPU_MODEL = "V100"  # work rates are relative to one V100

PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class InstanceType(pydantic.BaseModel, frozen=True, extra="forbid", strict=True):
    """One EC2 instance type: its hardware and its on-demand price in each catalog region.

    `gpu_memory_gib` is the total over the instance's GPUs. `on_demand_usd_per_hour` maps every
    catalog region to the Linux on-demand price, or to None where AWS does not offer the type.
    """

    name: str = Field(min_length=1)
    vcpus: int = Field(gt=0)
    memory_gib: PositiveFloat
    gpu_count: int = Field(ge=0)
    gpu_model: str | None = Field(default=None, min_length=1)
    gpu_memory_gib: PositiveFloat | None = None
    on_demand_usd_per_hour: dict[str, PositiveFloat | None]

    @field_validator("gpu_model")
    @classmethod
    def _gpu_model_matches_count(cls, value: str | None, info: ValidationInfo) -> str | None:
        count = info.data.get("gpu_count")
        if count is not None and (value is None) != (count == 0):
            raise ValueError(
                f"gpu_model must be null exactly when gpu_count is 0 (gpu_count is {count})"
            )
        return value

    @field_validator("gpu_memory_gib")
    @classmethod
    def _gpu_memory_matches_model(cls, value: float | None, info: ValidationInfo) -> float | None:
        count = info.data.get("gpu_count")
        if count is not None and (value is None) != (count == 0):
            raise ValueError(
                f"gpu_memory_gib must be null exactly when gpu_count is 0 (gpu_count is {count})"
            )
        return value

    @property
    def is_gpu(self) -> bool:
        return self.gpu_count > 0

    def offered_in(self, region: str) -> bool:
        """Whether the catalog has an on-demand price for this type in `region`."""
        return self.on_demand_usd_per_hour.get(region) is not None

    def offered_regions(self) -> list[str]:
        """The regions where this type is offered, sorted."""
        return sorted(r for r, p in self.on_demand_usd_per_hour.items() if p is not None)

    def on_demand_price(self, region: str) -> float:
        """The Linux on-demand price in USD per instance-hour in `region`.

        Raises:
            UnknownMarketError: the type is not offered in `region`, or the catalog has no
                such region.
        """
        price = self.on_demand_usd_per_hour.get(region)
        if price is not None:
            return price
        if region in self.on_demand_usd_per_hour:
            message = f"instance type {self.name} is not offered in region {region}"
        else:
            message = f"the catalog has no region {region!r} (for instance type {self.name})"
        offered = self.offered_regions()
        fix = (
            f"use a region where {self.name} is offered: {', '.join(offered)}"
            if offered
            else f"{self.name} is offered in no catalog region; choose another instance type"
        )
        raise UnknownMarketError(message, fix=fix, field="region")


class _CatalogFile(pydantic.BaseModel, extra="forbid", strict=True):
    """The schema of `catalog.json`, version 1."""

    version: int
    source: str
    as_of: date = Field(strict=False)
    gpu_work_rates: dict[str, PositiveFloat]
    gpu_work_rates_source: str
    instance_types: dict[str, InstanceType] = Field(min_length=1)

    @field_validator("version")
    @classmethod
    def _supported_version(cls, value: int) -> int:
        if value != CATALOG_FORMAT_VERSION:
            raise ValueError(
                f"catalog format version {value} is not supported "
                f"(this release reads version {CATALOG_FORMAT_VERSION})"
            )
        return value

    @model_validator(mode="before")
    @classmethod
    def _name_types_by_key(cls, data: Any) -> Any:
        """Instance types are keyed by name in the file; copy each key into its entry."""
        if isinstance(data, dict) and isinstance(data.get("instance_types"), dict):
            data = dict(data)
            data["instance_types"] = {
                key: {"name": key, **entry} if isinstance(entry, dict) else entry
                for key, entry in data["instance_types"].items()
            }
        return data

    @field_validator("instance_types")
    @classmethod
    def _keys_are_names(cls, value: dict[str, InstanceType]) -> dict[str, InstanceType]:
        for key, instance in value.items():
            if instance.name != key:
                raise ValueError(f"entry {key!r} has name {instance.name!r}; omit name or match")
        return value


def _field_path(loc: Iterable[int | str]) -> str:
    """A pydantic error location as a readable path: `instance_types["p3.2xlarge"].vcpus`."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part == "[key]":
            text += " (key)"
        elif _IDENTIFIER.match(part):
            text += f".{part}" if text else part
        else:
            text += f'["{part}"]'
    return text


class Catalog:
    """The instance types the orchestrator knows, their prices per region, and GPU work rates.

    Build one with `Catalog.load()` (the packaged file, cached) or `Catalog.load(path)`; tests
    may construct one directly from `InstanceType`s.
    """

    def __init__(
        self,
        instance_types: Iterable[InstanceType],
        *,
        gpu_work_rates: Mapping[str, float],
        version: int = CATALOG_FORMAT_VERSION,
        source: str = "",
        as_of: date | None = None,
        gpu_work_rates_source: str = "",
        path: str | None = None,
    ) -> None:
        """Index validated instance types by name.

        Raises:
            UserError: a GPU type's model has no entry in `gpu_work_rates`.
        """
        self._types: dict[str, InstanceType] = {t.name: t for t in instance_types}
        self.gpu_work_rates: Mapping[str, float] = MappingProxyType(dict(gpu_work_rates))
        self.version = version
        self.source = source
        self.as_of = as_of
        self.gpu_work_rates_source = gpu_work_rates_source
        self.path = path
        where = f"catalog {path}: " if path else ""
        for t in self._types.values():
            if t.gpu_model is not None and t.gpu_model not in self.gpu_work_rates:
                raise UserError(
                    f"{where}instance type {t.name} has GPU model {t.gpu_model!r}, "
                    "which has no entry in gpu_work_rates",
                    fix=f"add {t.gpu_model!r} to gpu_work_rates (training throughput per GPU "
                    f"relative to one {REFERENCE_GPU_MODEL})",
                    field="gpu_work_rates",
                    path=path,
                )

    @classmethod
    def load(cls, path: Path | None = None) -> Catalog:
        """Read and validate a catalog file; None means the packaged one (read once, cached).

        Raises:
            UserError: the file is unreadable, not JSON, or does not match the catalog schema;
                the message names the file and the offending field.
        """
        if path is None:
            return _packaged_catalog()
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise UserError(
                f"cannot read catalog file {path}: {exc.strerror}",
                fix="pass an existing catalog JSON file, or none to use the packaged catalog",
                path=str(path),
            ) from None
        return cls._parse(text, str(path))

    @classmethod
    def _parse(cls, text: str, path: str) -> Catalog:
        try:
            body = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(
                f"catalog file {path} is not valid JSON "
                f"(line {exc.lineno}, column {exc.colno}: {exc.msg})",
                fix="correct the JSON syntax",
                path=path,
            ) from None
        try:
            parsed = _CatalogFile.model_validate(body)
        except pydantic.ValidationError as exc:
            error = exc.errors()[0]
            field = _field_path(error["loc"]) or None
            reason = error["msg"].removeprefix("Value error, ")
            others = exc.error_count() - 1
            more = f" (and {others} more error{'s' if others > 1 else ''})" if others else ""
            raise UserError(
                f"catalog file {path}: {field or 'top level'}: {reason}{more}",
                fix=f"correct {field or 'the file'} to match the catalog format version "
                f"{CATALOG_FORMAT_VERSION} (see orchestrator/market/data/catalog.json)",
                field=field,
                path=path,
            ) from None
        regions = sorted(
            {r for t in parsed.instance_types.values() for r in t.on_demand_usd_per_hour}
        )
        for name, t in parsed.instance_types.items():
            missing = [r for r in regions if r not in t.on_demand_usd_per_hour]
            if missing:
                field = _field_path(("instance_types", name, "on_demand_usd_per_hour", missing[0]))
                raise UserError(
                    f"catalog file {path}: {field} is missing; every instance type must list "
                    f"every catalog region ({', '.join(missing)} missing for {name})",
                    fix="give the on-demand price, or null where AWS does not offer the type",
                    field=field,
                    path=path,
                )
        return cls(
            parsed.instance_types.values(),
            gpu_work_rates=parsed.gpu_work_rates,
            version=parsed.version,
            source=parsed.source,
            as_of=parsed.as_of,
            gpu_work_rates_source=parsed.gpu_work_rates_source,
            path=path,
        )

    def __contains__(self, name: object) -> bool:
        return name in self._types

    def __len__(self) -> int:
        return len(self._types)

    def get(self, name: str) -> InstanceType:
        """The instance type called `name`.

        Raises:
            UnknownInstanceTypeError: the catalog has no such type (suggests close matches).
        """
        try:
            return self._types[name]
        except KeyError:
            pass
        wanted = name.strip().lower()
        matches = (
            [wanted] if wanted in self._types else difflib.get_close_matches(wanted, self.names())
        )
        hint = f" Did you mean {', '.join(repr(m) for m in matches)}?" if matches else ""
        shown = name if len(name) <= 64 else f"{name[:61]}..."  # not a whole file's worth
        raise UnknownInstanceTypeError(
            f"unknown instance type {shown!r}.{hint}",
            fix=f"use one of the catalog's instance types: {', '.join(self.names())}",
            field="instance_type",
            path=self.path,
        )

    def names(self) -> list[str]:
        """All instance type names, sorted."""
        return sorted(self._types)

    def regions(self) -> list[str]:
        """Every region the catalog lists a price (or explicit absence) for, sorted."""
        return sorted({r for t in self._types.values() for r in t.on_demand_usd_per_hour})

    def gpu_types(self) -> list[str]:
        """Names of the instance types that have GPUs, sorted."""
        return sorted(name for name, t in self._types.items() if t.is_gpu)

    def work_rate(self, name: str, gpu_work_rates: Mapping[str, float] | None = None) -> float:
        """Training throughput of one instance: gpu_count × the rate of its GPU model.

        `gpu_work_rates` replaces the catalog's rates (it is not merged with them); pass
        `{**catalog.gpu_work_rates, **yours}` to override only some models. CPU types have rate 0.

        Raises:
            UnknownInstanceTypeError: `name` is not in the catalog.
            UserError: `gpu_work_rates` has no positive finite rate for the type's GPU model.
        """
        instance = self.get(name)
        if instance.gpu_model is None:
            return 0.0
        rates = self.gpu_work_rates if gpu_work_rates is None else gpu_work_rates
        model = instance.gpu_model
        if model not in rates:
            raise UserError(
                f"gpu_work_rates has no rate for GPU model {model!r} (of instance type {name})",
                fix=f"add {model!r} to gpu_work_rates (training throughput per GPU relative to "
                f"one {REFERENCE_GPU_MODEL}); it has {', '.join(sorted(rates)) or 'no models'}",
                field="gpu_work_rates",
            )
        rate = rates[model]
        valid = isinstance(rate, int | float) and not isinstance(rate, bool)
        if not (valid and math.isfinite(rate) and rate > 0):
            raise UserError(
                f"gpu_work_rates[{model!r}] is {rate!r}; a work rate must be a positive number",
                fix=f"set gpu_work_rates[{model!r}] to its throughput relative to one "
                f"{REFERENCE_GPU_MODEL} (e.g. {self.gpu_work_rates.get(model, 1.0)})",
                field="gpu_work_rates",
            )
        return instance.gpu_count * float(rate)

    def price_per_work(
        self, name: str, region: str, gpu_work_rates: Mapping[str, float] | None = None
    ) -> float:
        """On-demand USD per hour divided by the work rate: dollars per V100-hour of work.

        CPU types do no training work, so their price per work is `math.inf`.

        Raises:
            UnknownInstanceTypeError: `name` is not in the catalog.
            UnknownMarketError: the type is not offered in `region`.
            UserError: `gpu_work_rates` lacks the type's GPU model (see `work_rate`).
        """
        price = self.get(name).on_demand_price(region)
        rate = self.work_rate(name, gpu_work_rates)
        return price / rate if rate > 0 else math.inf


@functools.lru_cache(maxsize=1)
def _packaged_catalog() -> Catalog:
    resource = resources.files("orchestrator.market").joinpath(*PACKAGED_CATALOG_RESOURCE)
    return Catalog._parse(resource.read_text(encoding="utf-8"), str(resource))


DEFAULT_GPU_WORK_RATES: Mapping[str, float] = _packaged_catalog().gpu_work_rates
