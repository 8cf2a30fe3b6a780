"""Acquisition policies: BidBrain and the baselines it is measured against.

Every policy is one small class with one public method, `decide(DecisionInput) -> Decision`.
Decisions are pure: the time, prices, spend and footprint come in, actions go out; nothing reads
the wall clock. The simulator and the live controller call the same code.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Annotated, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from orchestrator.bidbrain import deadline
from orchestrator.bidbrain.cost import (
    FootprintTerms,
    allocation_terms,
    cost_per_work_with,
    footprint_terms,
)
from orchestrator.bidbrain.errors import UnknownPolicyError
from orchestrator.bidbrain.model import (
    DEFAULT_TIME_VALUE_FRACTION,
    AllocationRequest,
    Footprint,
    JobSpec,
)
from orchestrator.market.catalog import Catalog
from orchestrator.market.eviction import DEFAULT_BID_DELTAS_USD, EvictionModel
from orchestrator.market.prices import Market
from orchestrator.units import SECONDS_PER_HOUR

#: Extra grid points past the Proteus range, so a bid capped at the on-demand price (often
#: several dollars over the market) looks up a hazard close to its real delta.
WIDE_BID_DELTAS_USD = (1.0, 2.0, 5.0, 10.0, 20.0)


class BidBrainSettings(BaseModel):
    """Knobs of the decision, with the paper's values where it gave them (seed 002 §4.3-4.4).
    Every number is finite (an infinite renew lead or interval cannot be scheduled)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    decision_interval_s: float = Field(120.0, gt=0, description="periodic decision (2 min)")
    renew_period_s: float = Field(
        3600.0, gt=0, description="each allocation is reconsidered once per period (billing hour)"
    )
    renew_lead_s: float = Field(120.0, ge=0, description="renew-or-release this long before it")
    bid_deltas_usd: Annotated[
        tuple[Annotated[float, Field(gt=0)], ...],
        Field(min_length=1, description="bids over the market price, in USD per hour"),
    ] = DEFAULT_BID_DELTAS_USD
    counts: Annotated[
        tuple[Annotated[int, Field(ge=1)], ...],
        Field(min_length=1, description="instances per allocation BidBrain may buy at once"),
    ] = (1, 2, 4, 8, 16)
    min_improvement: float = Field(
        0.002, ge=0, description="act only if E falls by at least this fraction"
    )
    max_adds_per_decision: int = Field(32, gt=0)
    budget_reserve_s: float = Field(
        900.0,
        ge=0,
        description="spend held back past the next decision, so that the budget holds while "
        "the controller is away this long (a crash and restart, a lost tick)",
    )


@dataclass(frozen=True)
class MarketTable:
    """The markets a job may use, with their static facts as aligned arrays."""

    markets: tuple[Market, ...]
    work_rate: np.ndarray  # ν per instance (reference GPUs)
    on_demand_usd_per_hour: np.ndarray
    index: Mapping[Market, int]

    @classmethod
    def build(
        cls,
        markets: Sequence[Market],
        catalog: Catalog,
        gpu_work_rates: Mapping[str, float] | None = None,
    ) -> MarketTable:
        """Raises UnknownInstanceTypeError / UnknownMarketError for types the catalog lacks."""
        ms = tuple(sorted(markets))
        rates = np.array([catalog.work_rate(m.instance_type, gpu_work_rates) for m in ms])
        od = np.array([catalog.get(m.instance_type).on_demand_price(m.region) for m in ms])
        return cls(ms, rates, od, {m: i for i, m in enumerate(ms)})

    def with_work_rates(
        self, catalog: Catalog, gpu_work_rates: Mapping[str, float] | None
    ) -> MarketTable:
        """The same markets at other per-GPU-model rates (a job's learned ones)."""
        rates = np.array([catalog.work_rate(m.instance_type, gpu_work_rates) for m in self.markets])
        return replace(self, work_rate=rates)

    def __len__(self) -> int:
        return len(self.markets)


@dataclass(frozen=True)
class DecisionInput:
    """Everything a decision may look at. `prices_usd_per_hour` aligns with the `MarketTable`
    (NaN: no price known). `renewal_due` names allocations at their renew-or-release point."""

    now_s: float
    job: JobSpec
    work_remaining_gpu_hours: float
    spend_usd: float
    footprint: Footprint
    prices_usd_per_hour: np.ndarray
    unavailable: frozenset[Market] = frozenset()
    renewal_due: frozenset[str] = frozenset()
    last_eviction_s: Mapping[Market, float] = field(default_factory=dict)
    # how long past the next decision the budget must hold when the controller's decisions
    # come later than planned (its measured lag); the settings' reserve is the least
    lag_reserve_s: float = 0.0


@dataclass(frozen=True)
class Decision:
    """What to do now. `expected_cost_per_work` is in $ per reference-GPU-hour of work."""

    acquire: tuple[AllocationRequest, ...] = ()
    release: tuple[str, ...] = ()
    expected_cost_per_work: float = math.inf
    projected_cost_usd: float = math.inf
    projected_finish_s: float = math.inf  # when the work is expected done (epoch seconds)
    budget_exhausted: bool = False
    reason: str = ""

    @property
    def is_noop(self) -> bool:
        return not self.acquire and not self.release and not self.budget_exhausted


class Policy(abc.ABC):
    """Decides which allocations a job should add or release now."""

    name: ClassVar[str]
    #: whether the job keeps its model on reliable on-demand nodes (AgileML) or checkpoints
    uses_reliable_tier: ClassVar[bool] = True

    def __init__(
        self,
        table: MarketTable,
        *,
        billing: str,
        price_model: EvictionModel,
        capacity_model: EvictionModel,
        settings: BidBrainSettings | None = None,
        catalog: Catalog | None = None,
        rng: np.random.Generator | None = None,
    ) -> None:
        self.table = table
        self.rng = rng if rng is not None else np.random.default_rng(0)
        self.catalog = catalog or Catalog.load()
        self.billing = billing
        self.price_model = price_model
        self.capacity_model = capacity_model
        self.settings = settings or BidBrainSettings()

    @abc.abstractmethod
    def decide(self, inp: DecisionInput) -> Decision:
        """The actions to take at `inp.now_s`."""

    def use_work_rates(self, gpu_work_rates: Mapping[str, float] | None) -> None:
        """Decide from now on with these per-GPU-model rates (what the job's runs measured,
        `bidbrain.rates`); the markets stay the same."""
        self.table = self.table.with_work_rates(self.catalog, gpu_work_rates)

    # -- helpers shared by policies -------------------------------------------------------
    def _reliable_request(self, inp: DecisionInput) -> tuple[AllocationRequest, ...]:
        if not self.uses_reliable_tier or inp.job.reliable_count == 0:
            return ()
        if any(
            a.reliable and a.market.instance_type == inp.job.reliable_type
            for a in inp.footprint.allocations
        ):  # the tier is held (on-demand GPUs of a deadline's safety net are not it)
            return ()
        zone = self.table.markets[0].zone
        return (
            AllocationRequest(
                instance_type=inp.job.reliable_type,
                zone=zone,
                count=inp.job.reliable_count,
                reliable=True,
            ),
        )

    def _usable(self, inp: DecisionInput) -> np.ndarray:
        ok = np.isfinite(inp.prices_usd_per_hour) & (self.table.work_rate > 0)
        for m in inp.unavailable:
            i = self.table.index.get(m)
            if i is not None:
                ok[i] = False
        return ok

    def _remaining_rate(self, inp: DecisionInput) -> float:
        """The work rate the job could still use: its max less what its GPUs give (spot, and
        on-demand ones a deadline's safety net bought)."""
        return inp.job.max_work_rate - sum(
            a.count * a.work_rate_per_instance for a in inp.footprint.allocations
        )


class BidBrainPolicy(Policy):
    """Proteus' BidBrain (seed 002 §4.3): add the allocation that lowers the footprint's
    expected cost per work (`orchestrator.bidbrain.cost`) the most, again and again; at each
    allocation's renewal point, release it if the footprint without it, refilled greedily, has
    a lower cost per work. Reliable nodes are always held.

    Candidates are every usable market × bid option (the on-demand price, then the delta grid
    over the market price, highest first so that ties go to the safer bid) × count (the count
    ladder plus "fill the remaining rate").

    Budgets: the spend so far plus what the footprint commits until the next decision, and for
    `budget_reserve_s` past it (or the input's `lag_reserve_s`, when the controller's decisions
    come that late), never exceeds the job's budget: the reserve keeps the budget whole when
    the next decision comes late (a controller restart, failed ticks, a lagging controller). Spot is
    committed at its price now: a price that rises toward the bid inside that window can
    still take the spend past it (by at most the rise times the window). When the
    budget cannot carry the reliable tier and one more spot instance that long, every spot
    allocation is released and the decision says `budget_exhausted`.
    """

    name = "bidbrain"

    def __init__(self, table: MarketTable, **kwargs: object) -> None:
        super().__init__(table, **kwargs)  # type: ignore[arg-type]
        s = self.settings
        self._deltas = np.array(sorted(s.bid_deltas_usd, reverse=True), dtype=np.float64)
        self._counts = np.array(s.counts, dtype=np.float64)
        # Price-crossing hazards of the grid deltas are static for a fitted model; the
        # on-demand cap is looked up per decision because its delta moves with the price.
        self._hazard_grid = np.array(
            [
                [self.price_model.hazard_per_s(m, float(d)) for d in self._deltas]
                for m in table.markets
            ]
        ).reshape(len(table), len(self._deltas))
        self._cap_cache: dict[tuple[int, float], float] = {}

    def decide(self, inp: DecisionInput) -> Decision:
        job, s = inp.job, self.settings
        phi, lam = job.app.phi, job.app.eviction_overhead_s
        work_s = max(inp.work_remaining_gpu_hours, 1e-9) * SECONDS_PER_HOUR
        commit_h = self._commit_hours(inp)
        reliable = self._reliable_request(inp)
        reliable_rate = self._reliable_rate_usd_per_hour(inp, reliable)
        time_value = self._time_value_usd_per_hour(job)
        fixed_rate = reliable_rate + time_value
        reliable_terms = FootprintTerms(fixed_rate / SECONDS_PER_HOUR, 0.0, 0.0, 0.0, 0.0)
        budget_left = math.inf if job.budget_usd is None else job.budget_usd - inp.spend_usd
        if deadline.on_demand_gpus(inp.footprint) or deadline.is_pressing(
            job, inp.now_s, inp.work_remaining_gpu_hours, s.decision_interval_s
        ):  # once in the safety net, to the end
            return self._safety_net(inp, reliable, reliable_rate, budget_left)
        held = self._held_arrays(inp)
        spot = held["alloc"]

        # Budget guard: drop the spot allocations that cost most per work until what the
        # footprint commits to the next decision fits.
        releases: list[str] = []
        commit_rate = reliable_rate + sum(a.price_usd_per_hour * a.count for a in spot)
        for a in sorted(spot, key=lambda a: -a.price_usd_per_hour / a.work_rate_per_instance):
            if commit_rate * commit_h <= budget_left:
                break
            releases.append(a.allocation_id)
            commit_rate -= a.price_usd_per_hour * a.count
        keep = np.array([a.allocation_id not in releases for a in spot], dtype=bool)
        base = reliable_terms + self._terms(held, keep)
        cand = self._candidates(inp)
        freed = sum(a.count * a.work_rate_per_instance for a in spot if a.allocation_id in releases)
        remaining_rate = self._remaining_rate(inp) + freed
        budget_for_adds = budget_left - commit_rate * commit_h
        adds, terms = self._greedy(
            base, cand, remaining_rate, budget_for_adds, work_s, phi, lam, commit_h
        )
        current_e = terms.cost_per_work(work_s, phi, lam)

        # Renew or release at renewal points: would the footprint do better without it?
        for i, a in enumerate(spot):
            if a.allocation_id not in inp.renewal_due or not keep[i]:
                continue
            keep_without = keep.copy()
            keep_without[i] = False
            alt_adds, alt = self._greedy(
                reliable_terms + self._terms(held, keep_without),
                cand,
                remaining_rate + a.count * a.work_rate_per_instance,
                budget_for_adds + a.price_usd_per_hour * a.count * commit_h,
                work_s,
                phi,
                lam,
                commit_h,
            )
            alt_e = alt.cost_per_work(work_s, phi, lam)
            if alt_e < current_e * (1.0 - s.min_improvement):
                releases.append(a.allocation_id)
                keep, adds, terms, current_e = keep_without, alt_adds, alt, alt_e
                remaining_rate += a.count * a.work_rate_per_instance

        requests = reliable + tuple(self._request(cand, j, current_e) for j in adds)
        exhausted = (
            job.budget_usd is not None
            and budget_left < (reliable_rate + self._cheapest_instance_rate(cand)) * commit_h
        )
        if exhausted:
            releases = [a.allocation_id for a in spot]
            requests = reliable
        time_s = terms.cost_to_finish_usd(work_s, phi, lam) / terms.cost_usd_per_s
        projected = inp.spend_usd + (
            terms.cost_to_finish_usd(work_s, phi, lam) - time_value / SECONDS_PER_HOUR * time_s
        )
        return Decision(
            acquire=requests,
            release=tuple(releases),
            expected_cost_per_work=current_e * SECONDS_PER_HOUR,
            projected_cost_usd=projected,
            projected_finish_s=inp.now_s + time_s,
            budget_exhausted=exhausted,
            reason="budget exhausted: released spot nodes, model kept on the reliable tier"
            if exhausted
            else "",
        )

    def _safety_net(
        self,
        inp: DecisionInput,
        reliable: tuple[AllocationRequest, ...],
        reliable_rate: float,
        budget_left: float,
    ) -> Decision:
        """The deadline's safety net (`orchestrator.bidbrain.deadline`): on-demand GPUs to the
        max rate, spot released once they work; nothing past the budget."""
        job, fp = inp.job, inp.footprint
        hours_left = inp.work_remaining_gpu_hours / (job.app.phi * job.max_work_rate)
        # pay for the footprint to the next decision and the reserve, or to the end if sooner
        to_end_h = hours_left + self.settings.decision_interval_s / SECONDS_PER_HOUR
        commit_h = min(self._commit_hours(inp), to_end_h)
        release = list(deadline.spot_to_release(job, fp))
        # spot kept is paid only until the on-demand GPUs work (σ), then released
        overlap_h = min(commit_h, job.app.add_overhead_s / SECONDS_PER_HOUR)
        spot_usd = overlap_h * sum(
            a.price_usd_per_hour * a.count for a in fp.spot if a.allocation_id not in release
        )
        if reliable_rate * commit_h + spot_usd > budget_left:  # the budget first
            release = [a.allocation_id for a in fp.spot]
            spot_usd = 0.0
        spot_rate = spot_usd / commit_h if commit_h > 0 else 0.0
        usable = np.ones(len(self.table), dtype=bool)  # on-demand: no price needed
        for m in inp.unavailable:  # but a capacity error counts
            if m in self.table.index:
                usable[self.table.index[m]] = False
        fill = deadline.on_demand_fill(
            job,
            fp,
            self.table.markets,
            self.table.work_rate,
            self.table.on_demand_usd_per_hour,
            usable,
            (budget_left - spot_usd) / commit_h - reliable_rate,
        )
        acquire = reliable + ((fill,) if fill is not None else ())
        cost_rate = reliable_rate + spot_rate
        if fill is not None:
            cost_rate += fill.count * float(
                self.table.on_demand_usd_per_hour[self.table.index[fill.market]]
            )
        exhausted = (
            job.budget_usd is not None and fill is None and cost_rate * commit_h > budget_left
        )
        slack_min = deadline.slack_s(job, inp.now_s, inp.work_remaining_gpu_hours) / 60
        return Decision(
            acquire=() if exhausted else acquire,
            release=tuple(a.allocation_id for a in fp.spot) if exhausted else tuple(release),
            expected_cost_per_work=cost_rate / (job.app.phi * job.max_work_rate),
            projected_cost_usd=inp.spend_usd + cost_rate * hours_left,
            projected_finish_s=inp.now_s + hours_left * SECONDS_PER_HOUR,
            budget_exhausted=exhausted,
            reason="budget exhausted inside the deadline's safety net"
            if exhausted
            else f"deadline safety net: {slack_min:.0f} min of slack, on-demand GPUs to max rate",
        )

    # -- pieces ---------------------------------------------------------------------------
    def _time_value_usd_per_hour(self, job: JobSpec) -> float:
        if job.time_value_usd_per_hour is not None:
            return job.time_value_usd_per_hour
        gpu = self.table.work_rate > 0
        if not gpu.any():
            return 0.0
        od_per_work = float(
            np.min(self.table.on_demand_usd_per_hour[gpu] / self.table.work_rate[gpu])
        )
        return DEFAULT_TIME_VALUE_FRACTION * od_per_work * job.max_work_rate

    def _reliable_rate_usd_per_hour(
        self, inp: DecisionInput, reliable: tuple[AllocationRequest, ...]
    ) -> float:
        rate = sum(a.price_usd_per_hour * a.count for a in inp.footprint.allocations if a.reliable)
        for r in reliable:
            rate += (
                self.catalog.get(r.instance_type).on_demand_price(self.table.markets[0].region)
                * r.count
            )
        return rate

    def _held_arrays(self, inp: DecisionInput) -> dict:
        allocs = inp.footprint.spot
        sigma = inp.job.app.add_overhead_s
        return {
            "alloc": allocs,
            "count": np.array([a.count for a in allocs], dtype=np.float64),
            "rate": np.array([a.work_rate_per_instance for a in allocs], dtype=np.float64),
            "price": np.array([a.price_usd_per_hour for a in allocs], dtype=np.float64),
            "hp": np.array(
                [self.price_model.hazard_per_s(a.market, a.bid_delta_usd) for a in allocs],
                dtype=np.float64,
            ),
            "hc": np.array(
                [self.capacity_model.hazard_per_s(a.market, a.bid_delta_usd) for a in allocs],
                dtype=np.float64,
            ),
            "pending": np.array(
                [0.0 if a.ready else max(0.0, sigma - (inp.now_s - a.started_s)) for a in allocs],
                dtype=np.float64,
            ),
            "sigma": sigma,
        }

    def _terms(self, held: dict, keep: np.ndarray) -> FootprintTerms:
        return footprint_terms(
            billing=self.billing,
            count=held["count"][keep],
            work_rate=held["rate"][keep],
            price_usd_per_hour=held["price"][keep],
            hazard_price_per_s=held["hp"][keep],
            hazard_capacity_per_s=held["hc"][keep],
            add_overhead_s=held["sigma"],
            pending_overhead_s=held["pending"][keep],
        )

    def _candidates(self, inp: DecisionInput) -> dict:
        """Every (market, bid option, count) as flat arrays (see the class doc)."""
        t = self.table
        price = inp.prices_usd_per_hour
        usable = self._usable(inp)
        n_m, n_d = len(t), len(self._deltas)
        max_price = np.empty((n_m, n_d + 1))
        max_price[:, 0] = t.on_demand_usd_per_hour
        max_price[:, 1:] = price[:, None] + self._deltas[None, :]
        hp = np.zeros((n_m, n_d + 1))
        hp[:, 1:] = self._hazard_grid
        hc = np.zeros(n_m)
        for i in np.flatnonzero(usable):
            hp[i, 0] = self._cap_hazard(int(i), float(t.on_demand_usd_per_hour[i] - price[i]))
            hc[i] = self.capacity_model.hazard_per_s(t.markets[i], math.inf)
        valid_bid = usable[:, None] & (max_price <= t.on_demand_usd_per_hour[:, None] + 1e-9)
        valid_bid[:, 0] = usable & (t.on_demand_usd_per_hour > price)
        remaining = max(self._remaining_rate(inp), 0.0)
        fill = np.floor(remaining / np.where(t.work_rate > 0, t.work_rate, 1.0) + 1e-9)
        counts = np.concatenate(
            [np.broadcast_to(self._counts, (n_m, len(self._counts))), fill[:, None]], axis=1
        )
        shape = (n_m, n_d + 1, counts.shape[1])
        m_idx = np.broadcast_to(np.arange(n_m)[:, None, None], shape).ravel()
        o_idx = np.broadcast_to(np.arange(n_d + 1)[None, :, None], shape).ravel()
        k = np.broadcast_to(counts[:, None, :], shape).ravel()
        valid = np.broadcast_to(valid_bid[:, :, None], shape).ravel() & (k > 0)
        p = np.where(valid, price[m_idx], 0.0)
        sigma = inp.job.app.add_overhead_s
        terms = allocation_terms(
            billing=self.billing,
            count=k,
            work_rate=t.work_rate[m_idx],
            price_usd_per_hour=p,
            hazard_price_per_s=hp[m_idx, o_idx],
            hazard_capacity_per_s=hc[m_idx],
            add_overhead_s=sigma,
            pending_overhead_s=np.full(k.shape, sigma),
        )
        return {
            "valid": valid,
            "market": m_idx,
            "count": k,
            "max_price": max_price[m_idx, o_idx],
            "terms": terms,
            "kv": terms[2],
            "commit_rate": p * k,
        }

    def _cap_hazard(self, market_index: int, delta: float) -> float:
        key = (market_index, round(delta, 4))
        h = self._cap_cache.get(key)
        if h is None:
            h = self.price_model.hazard_per_s(self.table.markets[market_index], delta)
            self._cap_cache[key] = h
        return h

    def _greedy(
        self,
        base: FootprintTerms,
        cand: dict,
        remaining_rate: float,
        budget_usd: float,
        work_s: float,
        phi: float,
        lam: float,
        commit_h: float,
    ) -> tuple[list[int], FootprintTerms]:
        """Add the best candidate while it lowers E by at least `min_improvement` (each paid
        for `commit_h` hours out of `budget_usd`)."""
        chosen: list[int] = []
        for _ in range(self.settings.max_adds_per_decision):
            feasible = cand["valid"] & (cand["kv"] <= remaining_rate + 1e-9)
            if math.isfinite(budget_usd):
                feasible &= cand["commit_rate"] * commit_h <= budget_usd
            idx = np.flatnonzero(feasible)
            if len(idx) == 0:
                break
            e = cost_per_work_with(
                base,
                work_s=work_s,
                phi=phi,
                eviction_overhead_s=lam,
                cand=tuple(arr[idx] for arr in cand["terms"]),
            )
            best = int(np.argmin(e))
            current = base.cost_per_work(work_s, phi, lam)
            if not e[best] < current * (1.0 - self.settings.min_improvement):
                break
            j = int(idx[best])
            chosen.append(j)
            base = base + FootprintTerms(*(float(arr[j]) for arr in cand["terms"]))
            remaining_rate -= float(cand["kv"][j])
            budget_usd -= float(cand["commit_rate"][j]) * commit_h
        return chosen, base

    def _commit_hours(self, inp: DecisionInput) -> float:
        """How long a footprint is paid for out of the budget: to the next decision and the
        reserve past it (the longer of the settings' and the one the controller's lag
        needs)."""
        s = self.settings
        reserve_s = max(s.budget_reserve_s, inp.lag_reserve_s)
        return (s.decision_interval_s + reserve_s) / SECONDS_PER_HOUR

    def _cheapest_instance_rate(self, cand: dict) -> float:
        valid = cand["valid"]
        if not valid.any():
            return 0.0
        return float(np.min(cand["commit_rate"][valid] / cand["count"][valid]))

    def _request(self, cand: dict, j: int, e_per_s: float) -> AllocationRequest:
        m = self.table.markets[int(cand["market"][j])]
        return AllocationRequest(
            instance_type=m.instance_type,
            zone=m.zone,
            count=int(cand["count"][j]),
            max_price_usd_per_hour=round(float(cand["max_price"][j]), 6),
            expected_cost_per_work=e_per_s * SECONDS_PER_HOUR,
        )


POLICIES: dict[str, type[Policy]] = {BidBrainPolicy.name: BidBrainPolicy}


def policy_class(name: str) -> type[Policy]:
    try:
        return POLICIES[name]
    except KeyError:
        raise UnknownPolicyError(
            f"unknown policy {name!r}",
            fix=f"use one of: {', '.join(sorted(POLICIES))}",
            field="policy",
        ) from None
