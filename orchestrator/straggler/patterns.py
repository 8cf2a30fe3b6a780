"""Injected straggler patterns (seed 002 §5.2, "Naturally-occurring and Injected Straggler
Patterns").

Workers process the rows of their share of each iteration's global batch in chunks. A chunk's work
is emulated by sleeping (so 8+ workers fit on 2 cores), and the pattern decides how slow each
worker is right now:

* `NoStragglers`: every row takes `row_ms`.
* `SlowWorker`: at each of `points_per_iteration` delay points of its own work, a worker starts a
  slow period with `probability`; while slowed it runs `1 + delay_percent/100` times slower.
* `DisruptedMachine`: every `period_s` each emulated machine is disrupted with `probability` for
  the whole window, slowing every worker on it (the thesis ran a CPU-hogging disruptor process).
* `PowerLaw`: each (worker, iteration) takes `t` times nominal, `p(t) ∝ t^-alpha`, `t >= 1`.
* `UnevenWorkload`: persistent skew; rows owned by the first half of the ranks cost more.

Every random draw comes from a `random.Random` seeded by a string of its parts (`InjectedWork.seed`,
the worker name or machine, the clock or window), never from global state. String seeds are
hashed with SHA-512, so separate processes draw the same values without sharing anything.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from orchestrator.units import MAX_SEED

logger = logging.getLogger(__name__)

_MODEL_CONFIG = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class NoStragglers(BaseModel):
    """No injected slowdown: every row takes the nominal time."""

    model_config = _MODEL_CONFIG

    kind: Literal["none"] = "none"


class SlowWorker(BaseModel):
    """The thesis's Slow Worker pattern: transient, independent per-worker slowdowns.

    At each delay point (own-work fractions `0, 1/points, ..., (points-1)/points`) the worker
    starts a slow period with `probability`; the period lasts `U(0, max_period_iterations)`
    nominal iterations of wall time. A period starting while one runs extends it if longer.
    """

    model_config = _MODEL_CONFIG

    kind: Literal["slow_worker"] = "slow_worker"
    delay_percent: Annotated[
        float, Field(ge=0, le=100_000, strict=True, description="100 = twice as slow while slowed")
    ]
    probability: Annotated[float, Field(ge=0, le=1, strict=True, description="per delay point")] = (
        0.01
    )
    points_per_iteration: Annotated[int, Field(ge=1, le=10_000, strict=True)] = 10
    max_period_iterations: Annotated[float, Field(gt=0, le=1e6, strict=True)] = 2.0


class DisruptedMachine(BaseModel):
    """Transient contention on a machine, emulated as a slowdown of every worker on it.

    Wall time is cut into windows of `period_s`; in each window each machine is disrupted with
    `probability` for the whole window. Worker rank r lives on machine `r % machines`.
    """

    model_config = _MODEL_CONFIG

    kind: Literal["disrupted_machine"] = "disrupted_machine"
    delay_percent: Annotated[float, Field(ge=0, le=100_000, strict=True)]
    period_s: Annotated[float, Field(gt=0, le=86_400, strict=True)] = 20.0
    probability: Annotated[float, Field(ge=0, le=1, strict=True)] = 0.2
    machines: Annotated[int, Field(ge=1, le=4096, strict=True)] = 4


class PowerLaw(BaseModel):
    """Per (worker, iteration) time `t` x nominal with density `p(t) ∝ t^-alpha`, `t >= 1`.

    The mean is `(alpha-1)/(alpha-2)`; the thesis uses alpha = 11 to match measured clusters.
    """

    model_config = _MODEL_CONFIG

    kind: Literal["power_law"] = "power_law"
    alpha: Annotated[float, Field(le=1e6, strict=True)]

    @field_validator("alpha")
    @classmethod
    def _finite_mean(cls, alpha: float) -> float:
        if alpha <= 2:
            raise ValueError(
                f"the mean iteration time is infinite for alpha <= 2 (got {alpha}); "
                "use alpha > 2 (the thesis uses 11)"
            )
        return alpha


class UnevenWorkload(BaseModel):
    """Persistent skew: rows owned by the first half of the ranks (`rank < workers // 2`) cost
    more, so that half does `heavy_share` of the work; the mean cost factor over ranks is 1."""

    model_config = _MODEL_CONFIG

    kind: Literal["uneven"] = "uneven"
    heavy_share: Annotated[float, Field(gt=0.5, lt=1, strict=True)] = 0.75


StragglerPattern = Annotated[
    NoStragglers | SlowWorker | DisruptedMachine | PowerLaw | UnevenWorkload,
    Field(discriminator="kind"),
]


class InjectedWork(BaseModel):
    """Emulated per-row work and the straggler pattern applied to it."""

    model_config = _MODEL_CONFIG

    pattern: StragglerPattern = NoStragglers()
    row_ms: Annotated[
        float, Field(gt=0, le=60_000, strict=True, description="nominal emulated work per row")
    ] = 2.0
    seed: Annotated[int, Field(ge=0, le=MAX_SEED, strict=True)] = 0


def _rng(*parts: object) -> random.Random:
    # A str seed is hashed with SHA-512: stable across processes (unlike hash()) and free of
    # the collisions a 32-bit checksum would give over thousands of clocks.
    return random.Random("/".join(str(p) for p in parts))


def _check_rank(name: str, rank: int, workers: int) -> None:
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if not 0 <= rank < workers:
        raise ValueError(f"{name} must be in 0..{workers - 1} (workers={workers}), got {rank}")


class Pacer:
    """Emulates one worker's work under a pattern: sleeps for the time `rows` rows take now.

    Not thread-safe: one pacer per worker thread. The slow-period draws of `SlowWorker` come from
    one stream per (seed, worker), consumed in delay-point order, so a rerun with the same
    chunking reproduces the same periods. `busy_s` sums every emulated sleep.
    """

    def __init__(
        self,
        work: InjectedWork,
        *,
        worker: str,
        nominal_iteration_s: float,
        now: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not worker:
            raise ValueError("worker must be a non-empty name (it seeds the worker's draws)")
        if not (math.isfinite(nominal_iteration_s) and nominal_iteration_s > 0):
            raise ValueError(
                f"nominal_iteration_s must be finite and > 0, got {nominal_iteration_s}"
            )
        self.work_spec = work
        self.worker = worker
        self.nominal_iteration_s = nominal_iteration_s
        self.busy_s = 0.0
        self._now = now
        self._sleep = sleep
        self._slow_rng = _rng("slow_worker", work.seed, worker)
        self._slow_until = -math.inf
        # Delay points already crossed in `_crossed_clock`, so a re-covered span never redraws.
        self._crossed_clock: int | None = None
        self._crossed: set[int] = set()
        self._power: tuple[int, float] | None = None

    def multiplier(self, clock: int, rank: int, workers: int) -> float:
        """How many times slower than nominal this worker runs now (>= 1), at its iteration
        `clock`, as rank `rank` of `workers`. Raises ValueError on a rank outside 0..workers-1."""
        _check_rank("rank", rank, workers)
        pattern = self.work_spec.pattern
        if isinstance(pattern, SlowWorker):
            slowed = self._now() < self._slow_until
            return 1.0 + pattern.delay_percent / 100.0 if slowed else 1.0
        if isinstance(pattern, DisruptedMachine):
            return self._disrupted_multiplier(pattern, rank % pattern.machines)
        if isinstance(pattern, PowerLaw):
            return self._power_law_multiplier(pattern, clock)
        return 1.0

    def work(
        self,
        rows: int,
        *,
        clock: int,
        rank: int,
        workers: int,
        owner_rank: int,
        own_fraction: tuple[float, float] | None = None,
    ) -> float:
        """Emulate `rows` rows of data owned by rank `owner_rank`; return the seconds slept.

        `own_fraction=(before, after)` is the span of the worker's own iteration this chunk
        covers: `SlowWorker` delay points in `[before, after)` are crossed first, so a period
        they start slows this whole chunk. Help chunks pass None and cross no points, but are
        slowed during a running period. The multiplier is sampled once per chunk, so keep chunks
        short next to a slow period or a disruption window.

        Raises:
            ValueError: on negative rows, a rank outside 0..workers-1, or a bad own_fraction.
        """
        if rows < 0:
            raise ValueError(f"rows must be >= 0, got {rows}")
        _check_rank("owner_rank", owner_rank, workers)
        if own_fraction is not None:
            self._cross_delay_points(clock, own_fraction)
        seconds = (
            rows
            * self.work_spec.row_ms
            / 1000.0
            * self.multiplier(clock, rank, workers)
            * self._owner_factor(owner_rank, workers)
        )
        if seconds > 0:
            self._sleep(seconds)
            self.busy_s += seconds
        return seconds

    def _cross_delay_points(self, clock: int, own_fraction: tuple[float, float]) -> None:
        before, after = own_fraction
        if not 0.0 <= before <= after <= 1.0:
            raise ValueError(
                f"own_fraction must satisfy 0 <= before <= after <= 1, got {own_fraction}"
            )
        pattern = self.work_spec.pattern
        if not isinstance(pattern, SlowWorker):
            return
        if clock != self._crossed_clock:
            self._crossed_clock = clock
            self._crossed.clear()
        points = pattern.points_per_iteration
        # Compare k / points (not before * points) so that a fraction computed as i / n lands
        # exactly on the point it names; the range is only a cheap superset of the candidates.
        first = max(0, math.floor(before * points) - 1)
        last = min(points, math.ceil(after * points) + 1)
        for k in range(first, last):
            if before <= k / points < after and k not in self._crossed:
                self._crossed.add(k)
                self._draw_slow_period(pattern, clock, k)

    def _draw_slow_period(self, pattern: SlowWorker, clock: int, point: int) -> None:
        # Both draws happen at every point, so period lengths do not depend on `probability`.
        starts = self._slow_rng.random() < pattern.probability
        length_s = self._slow_rng.uniform(
            0.0, pattern.max_period_iterations * self.nominal_iteration_s
        )
        if not starts:
            return
        now = self._now()
        self._slow_until = max(self._slow_until, now + length_s)
        logger.debug(
            "slow period starts",
            extra={
                "worker": self.worker,
                "clock": clock,
                "delay_point": point,
                "period_s": length_s,
                "slow_until": self._slow_until,
            },
        )

    def _disrupted_multiplier(self, pattern: DisruptedMachine, machine: int) -> float:
        # Absolute wall-time windows, so workers in separate processes agree on a machine's state.
        window = math.floor(self._now() / pattern.period_s)
        disrupted = _rng("machine", self.work_spec.seed, machine, window).random()
        return 1.0 + pattern.delay_percent / 100.0 if disrupted < pattern.probability else 1.0

    def _power_law_multiplier(self, pattern: PowerLaw, clock: int) -> float:
        if self._power is not None and self._power[0] == clock:
            return self._power[1]
        u = 1.0 - _rng("power_law", self.work_spec.seed, self.worker, clock).random()  # (0, 1]
        t = u ** (-1.0 / (pattern.alpha - 1.0))  # inverse CDF of p(t) ∝ t^-alpha on [1, inf)
        self._power = (clock, t)
        return t

    def _owner_factor(self, owner_rank: int, workers: int) -> float:
        pattern = self.work_spec.pattern
        if not isinstance(pattern, UnevenWorkload) or workers < 2:
            return 1.0
        heavy = workers // 2
        if owner_rank < heavy:
            return pattern.heavy_share * workers / heavy
        return (1.0 - pattern.heavy_share) * workers / (workers - heavy)
