"""Eviction risk: how likely a spot instance is to be taken back, per market and bid.

Two causes, two models, combined as competing risks (their hazards add):

* `PriceCrossingModel` (the Proteus method): an instance is evicted when the market price rises
  above its max price. Fitted on price history: for every start time in the window, the time until
  the price first exceeds `price at start + bid delta`.
* `CapacityHazardModel` (today's market): EC2 reclaims capacity whatever the price. Fitted from an
  availability trace (`ms,add|remove,nodeN`) as removals per node-hour, one prior shared by all
  markets, then updated online per market from the evictions the controller observes
  (a Gamma-Poisson posterior: (prior events + observed) / (prior hours + observed hours)).

Each model answers with a constant hazard rate over the planning horizon, from which
β (the probability of eviction within the horizon) and the median time to eviction follow.
"""

from __future__ import annotations

import abc
import csv
import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from orchestrator.errors import UserError
from orchestrator.market.prices import Market, PriceHistory, PriceSeries
from orchestrator.units import SECONDS_PER_HOUR

#: The Proteus bid-delta range: [$0.0001, $0.4] over the market price (seed 002 §4.3.1).
DEFAULT_BID_DELTAS_USD = tuple(float(x) for x in np.round(np.geomspace(0.0001, 0.4, 12), 4))


@dataclass(frozen=True, slots=True)
class EvictionEstimate:
    """Eviction risk of one instance in one market at one bid."""

    hazard_per_s: float
    horizon_s: float

    @property
    def beta(self) -> float:
        """Probability of eviction within the horizon."""
        return -math.expm1(-self.hazard_per_s * self.horizon_s)

    @property
    def median_s(self) -> float:
        """Median time to eviction (inf when the hazard is zero)."""
        return math.log(2.0) / self.hazard_per_s if self.hazard_per_s > 0 else math.inf


class EvictionModel(abc.ABC):
    """Answers the eviction hazard of one instance in a market, bidding a delta over its price."""

    name: str

    @abc.abstractmethod
    def hazard_per_s(self, market: Market, bid_delta_usd: float) -> float:
        """Eviction rate (per second) of one instance; `inf` bid delta means no price cap."""

    def estimate(self, market: Market, bid_delta_usd: float, horizon_s: float) -> EvictionEstimate:
        """β within `horizon_s` and the median time to eviction."""
        return EvictionEstimate(self.hazard_per_s(market, bid_delta_usd), horizon_s)

    def observe(self, market: Market, evictions: int, exposure_s: float) -> None:  # noqa: B027
        """Learn from `evictions` seen over `exposure_s` instance-seconds (default: ignore)."""


@dataclass
class _CrossingTable:
    deltas: np.ndarray  # sorted bid deltas (USD)
    hazards: np.ndarray  # per delta, per second


class PriceCrossingModel(EvictionModel):
    """Eviction when the market price exceeds the bid, fitted on price history.

    For each market and each bid delta d on a grid, every start time t in the fitting window is
    an experiment: the instance bids `p(t) + d` and lives until the price first exceeds that.
    The hazard is the maximum-likelihood exponential rate with right-censoring at the window's
    end: crossings / total exposure. A delta between grid points uses the nearest lower one
    (conservative: a lower bid is evicted at least as often).
    """

    name = "price-crossing"

    def __init__(
        self,
        history: PriceHistory,
        *,
        fit_until_s: float | None = None,
        bid_deltas_usd: Sequence[float] = DEFAULT_BID_DELTAS_USD,
    ) -> None:
        self.deltas = np.array(sorted(bid_deltas_usd), dtype=np.float64)
        self._tables: dict[Market, _CrossingTable] = {}
        for market in history:
            self._tables[market] = _CrossingTable(
                self.deltas, crossing_hazards(history[market], self.deltas, fit_until_s)
            )

    def hazard_per_s(self, market: Market, bid_delta_usd: float) -> float:
        table = self._tables.get(market)
        if table is None or math.isinf(bid_delta_usd):
            return 0.0
        i = int(np.searchsorted(table.deltas, bid_delta_usd, side="right")) - 1
        if i < 0:
            i = 0
        return float(table.hazards[i])

    def hazards_for(self, market: Market) -> np.ndarray:
        """The hazard per grid delta of `market` (zeros for an unknown market)."""
        table = self._tables.get(market)
        return table.hazards if table is not None else np.zeros_like(self.deltas)


def crossing_hazards(
    series: PriceSeries, deltas: np.ndarray, until_s: float | None = None
) -> np.ndarray:
    """Exponential MLE of the price-crossing rate for each bid delta.

    Start times are uniform over [series start, until]. For a start t in segment i (price p_i
    on [t_i, t_{i+1})), the crossing time c is the first later record with price > p_i + d.
    Exposure over the segment integrates min(c, until) - t over t; crossings count the
    segment's length when c <= until.
    """
    end = float(series.end_s if until_s is None else min(until_s, series.end_s))
    times = series.times_s
    prices = series.prices_usd_per_hour
    keep = times < end
    times, prices = times[keep], prices[keep]
    n = len(times)
    crossings = np.zeros(len(deltas))
    exposure = np.zeros(len(deltas))
    if n == 0:
        return crossings
    seg_ends = np.append(times[1:], end)
    for i in range(n):
        a, b = float(times[i]), float(seg_ends[i])
        length = b - a
        if length <= 0:
            continue
        later = prices[i + 1 :]
        if len(later):
            running_max = np.maximum.accumulate(later)
            j = np.searchsorted(running_max, prices[i] + deltas, side="right")
            cross_at = np.where(j < len(later), times[np.minimum(i + 1 + j, n - 1)], np.inf)
        else:
            cross_at = np.full(len(deltas), np.inf)
        crossed = cross_at <= end
        stop = np.where(crossed, cross_at, end)
        # integral over t in [a, b] of (stop - t) dt = length * (stop - (a + b) / 2)
        exposure += length * (stop - (a + b) / 2.0)
        crossings += np.where(crossed, length, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        rate = np.where(exposure > 0, crossings / exposure, 0.0)
    return rate


@dataclass(frozen=True)
class AvailabilityTrace:
    """A node availability trace: (ms, add|remove, node) events of one spot cluster."""

    events: tuple[tuple[int, str, str], ...]
    source: str = ""

    @classmethod
    def read(cls, path: Path | str) -> AvailabilityTrace:
        """Parse `ms,add|remove,nodeN` lines.

        Raises:
            UserError: the file is missing, empty, or a line is malformed (line number named).
        """
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as exc:
            raise UserError(
                f"cannot read availability trace {p}: {exc.strerror}",
                path=str(p),
                field="--availability",
                fix="pass a CSV of `ms,add|remove,nodeN` lines",
            ) from None
        events: list[tuple[int, str, str]] = []
        for lineno, row in enumerate(csv.reader(text.splitlines()), start=1):
            if not row or not "".join(row).strip():
                continue
            if len(row) != 3 or row[1] not in ("add", "remove"):
                raise UserError(
                    f"{p}:{lineno}: expected `ms,add|remove,node`, got {','.join(row)!r}",
                    path=str(p),
                    field="--availability",
                    fix="fix or remove that line",
                )
            try:
                ms = int(row[0])
            except ValueError:
                raise UserError(
                    f"{p}:{lineno}: time {row[0]!r} is not an integer of milliseconds",
                    path=str(p),
                    field="--availability",
                    fix="fix that line",
                ) from None
            events.append((ms, row[1], row[2]))
        if not any(op == "remove" for _, op, _ in events):
            raise UserError(
                f"availability trace {p} has no remove events",
                path=str(p),
                field="--availability",
                fix="pass a trace with node removals (`ms,remove,nodeN`)",
            )
        events.sort(key=lambda e: e[0])
        return cls(tuple(events), str(p))

    @classmethod
    def bundled(cls) -> AvailabilityTrace:
        """The 11.4-hour, 32-node p3 spot cluster trace shipped in the package (MIT)."""
        path = (
            resources.files("orchestrator.market") / "data" / "availability" / "p3-node-trace.csv"
        )
        return cls.read(Path(str(path)))

    @property
    def duration_s(self) -> float:
        return self.events[-1][0] / 1000.0 if self.events else 0.0

    def removal_schedule(self) -> tuple[np.ndarray, np.ndarray]:
        """Times (s) of removal instants and, per instant, the chance that a given live node was
        among those removed (removed at that instant / live just before)."""
        live: set[str] = set()
        times: list[float] = []
        probs: list[float] = []
        i = 0
        ev = self.events
        while i < len(ev):
            ms = ev[i][0]
            j = i
            while j < len(ev) and ev[j][0] == ms:
                j += 1
            batch = ev[i:j]
            for _, op, node in batch:
                if op == "add":
                    live.add(node)
            removed = [node for _, op, node in batch if op == "remove" and node in live]
            if removed:
                times.append(ms / 1000.0)
                probs.append(len(removed) / len(live))
                live.difference_update(removed)
            i = j
        return np.array(times), np.array(probs)

    def replay(
        self, markets: Sequence[Market], start_s: float, horizon_s: float, seed: Sequence[int]
    ) -> dict[Market, RemovalStream]:
        """Per market, the capacity-removal instants over [start, start+horizon] and the chance
        that any one live instance is among those removed at each.

        Each market replays this trace, repeated, from its own random offset, so markets are
        independent. The n-th instance launched in a market draws the same random numbers
        whoever launches it (common random numbers, for paired comparisons).
        """
        times, probs = self._schedule
        period = max(self.duration_s, float(times[-1]) + 1.0)
        cycles = int(math.ceil(horizon_s / period)) + 1
        rng = np.random.default_rng(list(seed))
        out = {}
        for k, m in enumerate(markets):
            offset = rng.uniform(0.0, period)
            rel = (times[None, :] + period * np.arange(cycles)[:, None]).ravel() - offset
            p = np.tile(probs, cycles)
            keep = (rel >= 0) & (rel <= horizon_s)
            out[m] = RemovalStream(start_s + rel[keep], p[keep], (*seed, k))
        return out

    @functools.cached_property
    def _schedule(self) -> tuple[np.ndarray, np.ndarray]:
        return self.removal_schedule()

    def node_hours_and_removals(self) -> tuple[float, int]:
        """Node-hours the trace covers and the removals it saw (computed once per trace)."""
        return self._exposure

    @functools.cached_property
    def _exposure(self) -> tuple[float, int]:
        live: set[str] = set()
        last = 0.0
        area = 0.0
        removals = 0
        for ms, op, node in self.events:
            t = ms / 1000.0
            area += len(live) * (t - last)
            last = t
            if op == "add":
                live.add(node)
            elif node in live:
                live.discard(node)
                removals += 1
        return area / SECONDS_PER_HOUR, removals


#: Launch slots that draw independent random numbers; slot n and n + SLOTS share draws, which
#: is harmless because a later instance looks at later removal instants.
DRAW_SLOTS = 32
_SCAN_CHUNK = 128


@dataclass
class RemovalStream:
    """Capacity removals of one market: instants, per-instance removal chance, and the seed of
    the launch slots' uniform draws."""

    times_s: np.ndarray
    probs: np.ndarray
    seed: tuple[int, ...]
    _draws: np.ndarray | None = None

    def eviction_after(self, t_s: float, slot: int, before_s: float = math.inf) -> float:
        """First removal instant after `t_s` (and before `before_s`) that takes the instance
        in launch slot `slot`; inf if none."""
        if self._draws is None:
            rng = np.random.default_rng(list(self.seed))
            self._draws = rng.random((DRAW_SLOTS, len(self.times_s)))
        draws = self._draws[slot % DRAW_SLOTS]
        i = int(np.searchsorted(self.times_s, t_s, side="right"))
        end = int(np.searchsorted(self.times_s, before_s, side="left"))
        while i < end:
            j = min(i + _SCAN_CHUNK, end)
            hits = np.flatnonzero(draws[i:j] < self.probs[i:j])
            if len(hits):
                return float(self.times_s[i + int(hits[0])])
            i = j
        return math.inf


@dataclass
class CapacityHazardModel(EvictionModel):
    """Capacity evictions as a per-market Gamma-Poisson hazard.

    The prior is the trace's rate (removals per node-hour) with the weight of
    `prior_weight_hours` node-hours; each market's posterior adds what `observe` reports.
    """

    prior_rate_per_hour: float
    prior_weight_hours: float = 48.0
    applies_to: Iterable[str] | None = None  # instance types with capacity risk (None: all)
    _events: dict[Market, float] = field(default_factory=dict)
    _exposure_h: dict[Market, float] = field(default_factory=dict)

    name = "capacity"

    def __post_init__(self) -> None:
        if self.applies_to is not None:
            self.applies_to = frozenset(self.applies_to)

    @classmethod
    def from_trace(cls, trace: AvailabilityTrace, **kwargs: object) -> CapacityHazardModel:
        node_hours, removals = trace.node_hours_and_removals()
        if node_hours <= 0:
            raise UserError(
                f"availability trace {trace.source} covers no node-hours",
                field="--availability",
                fix="pass a trace with nodes that run",
            )
        return cls(prior_rate_per_hour=removals / node_hours, **kwargs)  # type: ignore[arg-type]

    def hazard_per_s(self, market: Market, bid_delta_usd: float) -> float:
        if self.applies_to is not None and market.instance_type not in self.applies_to:
            return 0.0
        events = self.prior_rate_per_hour * self.prior_weight_hours + self._events.get(market, 0.0)
        hours = self.prior_weight_hours + self._exposure_h.get(market, 0.0)
        return events / hours / SECONDS_PER_HOUR

    def observe(self, market: Market, evictions: int, exposure_s: float) -> None:
        self._events[market] = self._events.get(market, 0.0) + evictions
        self._exposure_h[market] = self._exposure_h.get(market, 0.0) + exposure_s / SECONDS_PER_HOUR


class CombinedEvictionModel(EvictionModel):
    """Competing risks: the hazards of the component models add."""

    name = "combined"

    def __init__(self, models: Sequence[EvictionModel]) -> None:
        self.models = list(models)

    def hazard_per_s(self, market: Market, bid_delta_usd: float) -> float:
        return sum(m.hazard_per_s(market, bid_delta_usd) for m in self.models)

    def observe(self, market: Market, evictions: int, exposure_s: float) -> None:
        for m in self.models:
            m.observe(market, evictions, exposure_s)
