"""Learned work rates: a job's measured speed on each GPU model, with the catalog's ν as prior.

The catalog's ν (V100 = 1) is a guess for any one job: a memory- or communication-bound job
runs at another relative speed on a K80 or a T4. Every instance that works for a job is a
measurement of its GPU model's rate *for that job*: `w` reference-GPU-hours of work in `h`
hours of useful time on `g` GPUs is a rate of w / (g·h) per GPU.

The model, per GPU model m (conjugate: each update is a weighted mean):

    log ν_m            ~ N(log ν_catalog_m, PRIOR_SIGMA²)          (the prior)
    log (w / (g·h))    ~ N(log ν_m, OBSERVATION_SIGMA² / h)         (one observation)

An observation over a longer time weighs more (its noise averages out). The rate BidBrain
decides with is the posterior median: after about an hour of one GPU model's work the
data outweighs the prior four to one (with the defaults), and a model never tried keeps the
catalog's ν. One posterior per job (a job's speed is its own); it is rebuilt from the same
observations by anyone who holds them (the simulator, the controller).

    belief = RateBelief.from_catalog({"V100": 1.0, "K80": 0.3})
    belief = belief.observe("K80", gpu_count=8, hours=0.5, work_gpu_hours=0.62)
    belief.rates()["K80"]   # ≈ 0.16, no longer 0.3
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from orchestrator.market.catalog import Catalog
from orchestrator.market.errors import UnknownInstanceTypeError

#: Prior spread of log ν around the catalog's value: a factor e^0.5 ≈ 1.65 is one σ.
PRIOR_SIGMA = 0.5
#: Noise of one hour's measured log rate (stragglers, noisy neighbours, warm-up).
OBSERVATION_SIGMA = 0.25
#: Observations shorter than this (hours) are ignored: start-up dominates them.
MIN_OBSERVATION_HOURS = 1.0 / 60.0
#: A measurement counts as at most this factor off the prior either way (log).
MAX_LOG_RATIO = math.log(20.0)


@dataclass(frozen=True, slots=True)
class RateEstimate:
    """One GPU model's posterior over log ν (mean, variance) and the evidence behind it."""

    prior_rate: float
    offset_log: float  # posterior mean of log(ν / prior_rate)
    var_log: float
    observed_hours: float = 0.0

    @property
    def rate(self) -> float:
        """The posterior median of ν: the rate decisions use (the prior's rate exactly while
        every measurement agreed with it)."""
        return self.prior_rate * math.exp(self.offset_log)

    @property
    def interval(self) -> tuple[float, float]:
        """The central 90% credible interval of ν."""
        half = 1.6449 * math.sqrt(self.var_log)
        return self.rate * math.exp(-half), self.rate * math.exp(half)


@dataclass(frozen=True)
class RateBelief:
    """A job's posterior over every GPU model's rate (see the module docstring). Immutable:
    `observe` returns the updated belief."""

    estimates: Mapping[str, RateEstimate] = field(default_factory=dict)
    prior_sigma: float = PRIOR_SIGMA
    observation_sigma: float = OBSERVATION_SIGMA

    @classmethod
    def from_catalog(
        cls,
        gpu_work_rates: Mapping[str, float],
        *,
        prior_sigma: float = PRIOR_SIGMA,
        observation_sigma: float = OBSERVATION_SIGMA,
    ) -> RateBelief:
        """The prior: each GPU model at its catalog (or the job's stated) rate.

        Raises:
            ValueError: a rate is not positive and finite, or a σ is not positive.
        """
        if not (prior_sigma > 0 and observation_sigma > 0):
            raise ValueError("prior_sigma and observation_sigma must be > 0")
        estimates = {}
        for model, rate in gpu_work_rates.items():
            if not (math.isfinite(rate) and rate > 0):
                raise ValueError(f"the prior rate of {model} must be finite and > 0, got {rate}")
            estimates[model] = RateEstimate(rate, 0.0, prior_sigma**2)
        return cls(MappingProxyType(estimates), prior_sigma, observation_sigma)

    def observe(
        self, gpu_model: str, *, gpu_count: int, hours: float, work_gpu_hours: float
    ) -> RateBelief:
        """The belief after `gpu_count` GPUs of `gpu_model` did `work_gpu_hours` of work in
        `hours` of useful time. An observation too short to say anything (under
        `MIN_OBSERVATION_HOURS`), or of no work (a stalled node is not a slow GPU), changes
        nothing.

        Raises:
            KeyError: `gpu_model` has no prior.
            ValueError: a count, time or work is negative or not finite.
        """
        if gpu_count <= 0 or not all(math.isfinite(x) and x >= 0 for x in (hours, work_gpu_hours)):
            raise ValueError(
                f"an observation needs gpu_count > 0 and finite hours, work >= 0; got "
                f"{gpu_count}, {hours}, {work_gpu_hours}"
            )
        est = self.estimates[gpu_model]
        if hours < MIN_OBSERVATION_HOURS or work_gpu_hours <= 0:
            return self
        # in offsets from the prior: a measurement equal to it leaves the rate exactly as is;
        # one off by more than 20x is a broken report: it counts as 20x off at most
        ratio = work_gpu_hours / (gpu_count * hours * est.prior_rate)
        measured = max(-MAX_LOG_RATIO, min(MAX_LOG_RATIO, math.log(ratio)))
        weight = hours / self.observation_sigma**2
        precision = 1.0 / est.var_log + weight
        offset = (est.offset_log / est.var_log + measured * weight) / precision
        updated = replace(
            est,
            offset_log=offset,
            var_log=1.0 / precision,
            observed_hours=est.observed_hours + hours,
        )
        return replace(self, estimates=MappingProxyType({**self.estimates, gpu_model: updated}))

    def measured(self, catalog: Catalog, m: WorkMeasurement) -> RateBelief:
        """`observe` for one instance's measurement: its GPU model and count from the
        catalog. A CPU instance, or a type the catalog or the prior lacks, changes nothing (it
        measures no GPU)."""
        try:
            kind = catalog.get(m.instance_type)
        except UnknownInstanceTypeError:
            return self
        if kind.gpu_model is None or kind.gpu_model not in self.estimates:
            return self
        gpus = kind.gpu_count if m.gpus is None else min(m.gpus, kind.gpu_count)
        return self.observe(
            kind.gpu_model, gpu_count=gpus, hours=m.hours, work_gpu_hours=m.work_gpu_hours
        )

    def rates(self) -> dict[str, float]:
        """Each GPU model's rate to decide with (the `gpu_work_rates` of a `JobSpec`)."""
        return {model: est.rate for model, est in self.estimates.items()}

    def learned(self) -> dict[str, RateEstimate]:
        """The GPU models something was measured on."""
        return {m: e for m, e in self.estimates.items() if e.observed_hours > 0}


@dataclass(frozen=True, slots=True)
class WorkMeasurement:
    """What one instance did for a job: `work_gpu_hours` in `hours` of useful time, on `gpus`
    of its GPUs (None: all of them; an AgileML node trains on one device)."""

    instance_type: str
    hours: float
    work_gpu_hours: float
    gpus: int | None = None


def learned_belief(
    catalog: Catalog,
    stated_rates: Mapping[str, float] | None,
    measurements: Iterable[WorkMeasurement],
) -> RateBelief:
    """The belief after `measurements`, from the job's stated rates (else the catalog's) as
    prior."""
    belief = RateBelief.from_catalog(stated_rates or catalog.gpu_work_rates)
    for m in measurements:
        belief = belief.measured(catalog, m)
    return belief
