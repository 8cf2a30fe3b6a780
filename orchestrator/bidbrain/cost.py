"""Expected cost, work and cost per work of a footprint (seed 002 Eq. 4.1-4.4).

The paper evaluates each allocation over the rest of its billing hour and charges the add
overhead σ to new allocations only. With today's cheap reliable tier that myopic form never
re-buys an evicted node (a new node's σ/ω exceeds the reliable tier's share of the cost, so the
footprint shrinks and the job runs twice as long for no saving: we measured it). We keep the
paper's terms but evaluate them until the job is done: every allocation is a *slot* that is
refilled when evicted, and E is the expected cost of finishing the remaining work W_rem divided
by W_rem. For allocation i (k_i instances, work rate ν_i, price P_i, hazard h_i per instance):

* cost rate Σ_i C_i + R: C_i = P_i·k_i under per-second billing; under hourly-refund
  Eq. 4.1 summed over the slot's successive instances, P_i·k_i·f(h_i), with f the share of time
  in hours that end before an eviction (`market.billing.charged_fraction`); R the reliable tier;
* eviction events per second N = Σ_i (h^price_i + k_i·h^capacity_i) (a price crossing takes
  the whole allocation, capacity takes instances one by one); each stalls the job for λ
  (Eq. 4.2's (1-Π(1-β_j))·λ, per unit of time);
* each eviction costs its slot σ of replacement; a new (or still booting) allocation has σ
  (or what is left of it) ahead once more (Eq. 4.2's σ);
* effective work rate φ·(Σ k_i·ν_i·(1 - σ·h_i) - N·λ·Σ k_i·ν_i) (Eq. 4.3 per unit time);
* time to finish T = (W_rem + φ·Σ k_i·ν_i·σ^pending_i) / effective rate;
* E = (cost rate × T) / W_rem (Eq. 4.4); `projected cost = spend + E·W_rem`.

All functions are pure and vectorised with numpy so that one decision over thousands of
candidates stays within a millisecond.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from orchestrator.market.billing import charged_fraction
from orchestrator.units import SECONDS_PER_HOUR


def expected_cost_usd(
    billing: str,
    price_usd_per_hour: np.ndarray,
    count: np.ndarray,
    hazard_per_s: np.ndarray,
    horizon_s: np.ndarray | float,
) -> np.ndarray:
    """Expected charge of slots kept filled for the horizon; vectorised counterpart of
    `BillingModel.expected_cost_usd` (tests keep the two equal)."""
    cost = np.asarray(price_usd_per_hour) * count * horizon_s / SECONDS_PER_HOUR
    if billing == "hourly-refund":
        cost = cost * charged_fraction(np.asarray(hazard_per_s))
    return cost


@dataclass(frozen=True)
class FootprintTerms:
    """Sums over a footprint (per second unless named otherwise).

    cost_usd_per_s: Σ C_i + R. events_per_s: N. rate: Σ k·ν. renewal_loss: Σ k·ν·σ·h
    (work rate lost to replacing evicted instances). pending_s: Σ k·ν·σ^pending (work lost once
    to allocations not yet working).
    """

    cost_usd_per_s: float
    events_per_s: float
    rate: float
    renewal_loss: float
    pending_s: float

    def effective_rate(self, phi: float, eviction_overhead_s: float) -> float:
        return phi * (
            self.rate - self.renewal_loss - self.events_per_s * eviction_overhead_s * self.rate
        )

    def cost_to_finish_usd(self, work_s: float, phi: float, eviction_overhead_s: float) -> float:
        """Expected cost of doing `work_s` reference-GPU-seconds (inf if it never finishes)."""
        eff = self.effective_rate(phi, eviction_overhead_s)
        if eff <= 0:
            return float("inf")
        return self.cost_usd_per_s * (work_s + phi * self.pending_s) / eff

    def cost_per_work(self, work_s: float, phi: float, eviction_overhead_s: float) -> float:
        """E: $ per reference-GPU-second of the remaining work."""
        return self.cost_to_finish_usd(work_s, phi, eviction_overhead_s) / work_s

    def __add__(self, other: FootprintTerms) -> FootprintTerms:
        return FootprintTerms(
            self.cost_usd_per_s + other.cost_usd_per_s,
            self.events_per_s + other.events_per_s,
            self.rate + other.rate,
            self.renewal_loss + other.renewal_loss,
            self.pending_s + other.pending_s,
        )


ZERO = FootprintTerms(0.0, 0.0, 0.0, 0.0, 0.0)


def allocation_terms(
    *,
    billing: str,
    count: np.ndarray,
    work_rate: np.ndarray,
    price_usd_per_hour: np.ndarray,
    hazard_price_per_s: np.ndarray,
    hazard_capacity_per_s: np.ndarray,
    add_overhead_s: float,
    pending_overhead_s: np.ndarray,
) -> tuple[np.ndarray, ...]:
    """Per allocation (or candidate), the five `FootprintTerms` fields as arrays.

    `pending_overhead_s` is the σ still ahead of each allocation now (σ for a candidate, what is
    left of it for an allocation still booting, 0 for a working one).
    """
    hazard = hazard_price_per_s + hazard_capacity_per_s
    cost = expected_cost_usd(billing, price_usd_per_hour, count, hazard, 1.0)
    events = hazard_price_per_s + count * hazard_capacity_per_s
    kv = count * work_rate
    return cost, events, kv, kv * add_overhead_s * hazard, kv * pending_overhead_s


def footprint_terms(**kwargs: object) -> FootprintTerms:
    """Sum `allocation_terms` over a footprint (same keyword arguments)."""
    parts = allocation_terms(**kwargs)  # type: ignore[arg-type]
    return FootprintTerms(*(float(p.sum()) for p in parts))


def cost_per_work_with(
    base: FootprintTerms,
    *,
    work_s: float,
    phi: float,
    eviction_overhead_s: float,
    cand: tuple[np.ndarray, ...],
) -> np.ndarray:
    """E of the footprint plus each candidate (`allocation_terms` arrays), vectorised;
    inf where the footprint would make no progress."""
    cost, events, kv, loss, pending = cand
    rate = base.rate + kv
    eff = phi * (
        rate
        - (base.renewal_loss + loss)
        - (base.events_per_s + events) * eviction_overhead_s * rate
    )
    total = (base.cost_usd_per_s + cost) * (work_s + phi * (base.pending_s + pending))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(eff > 0, total / np.where(eff > 0, eff, 1.0) / work_s, np.inf)
