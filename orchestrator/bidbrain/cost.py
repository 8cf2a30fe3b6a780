"""Expected cost, work and cost per work of a footprint (seed 002 Eq. 4.1-4.4).

The paper evaluates each allocation over the rest of its billing hour and charges the add
overhead σ to new allocations only. With today's cheap reliable tier that myopic form never
re-buys an evicted node (a new node's σ/ω exceeds the reliable tier's share of cost, so the
footprint shrinks to one instance and the job takes twice as long for no saving). We keep the
equations but take them over the job's remaining horizon t and treat every allocation as a *slot*
that is refilled when evicted, so σ is paid once per instance life by old and new alike:

* hazard h_i = h^price_i + h^capacity_i of one instance (per second);
* C_i = the billing model's expected charge of the slot over t: per-second `P_i·k_i·t`;
  hourly-refund Eq. 4.1 summed over the slot's instances: `P_i·k_i·t·f(h_i)`, f the fraction of
  time in hours that end before an eviction (`billing.charged_fraction`);
* N = Σ_i (h^price_i + k_i·h^capacity_i)·t, expected eviction events (a price crossing takes an
  allocation at once, capacity takes instances one by one); Eq. 4.2's 1-Π(1-β_j) is its
  first-order form for short horizons and stops counting when several evictions are likely;
* Δt_i = t - σ·(new_i + h_i·t) - N·λ (Eq. 4.2), one σ per replacement and one more if new;
* W = φ·Σ k_i·Δt_i·ν_i (Eq. 4.3) and E = C / W (Eq. 4.4).

All functions are pure and vectorised with numpy so that one decision over thousands of
candidates stays within milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SECONDS_PER_HOUR = 3600.0


def charged_fraction(hazard_per_s: np.ndarray) -> np.ndarray:
    """Vectorised `orchestrator.market.billing.charged_fraction` (tests keep them equal)."""
    x = np.asarray(hazard_per_s, dtype=np.float64) * SECONDS_PER_HOUR
    safe = np.where(x > 0, x, 1.0)
    return np.where(x > 0, safe * np.exp(-safe) / -np.expm1(-safe), 1.0)


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
        cost = cost * charged_fraction(hazard_per_s)
    return cost


@dataclass(frozen=True)
class FootprintTerms:
    """Sums over a footprint: cost Σ C_i, events N, rate Σ k_i·ν_i and
    busy Σ k_i·ν_i·(t - σ·(new_i + h_i·t)). W = φ·(busy - N·λ·rate)."""

    cost_usd: float
    events: float
    rate: float
    busy_s: float

    def work(self, phi: float, eviction_overhead_s: float) -> float:
        return phi * (self.busy_s - self.events * eviction_overhead_s * self.rate)

    def cost_per_work(self, phi: float, eviction_overhead_s: float) -> float:
        """$ per reference-GPU-second; inf when the footprint does no work."""
        w = self.work(phi, eviction_overhead_s)
        return self.cost_usd / w if w > 0 else float("inf")

    def __add__(self, other: FootprintTerms) -> FootprintTerms:
        return FootprintTerms(
            self.cost_usd + other.cost_usd,
            self.events + other.events,
            self.rate + other.rate,
            self.busy_s + other.busy_s,
        )


def allocation_terms(
    *,
    billing: str,
    count: np.ndarray,
    work_rate: np.ndarray,
    price_usd_per_hour: np.ndarray,
    hazard_price_per_s: np.ndarray,
    hazard_capacity_per_s: np.ndarray,
    horizon_s: float,
    add_overhead_s: float,
    pending_overhead_s: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per allocation (or candidate): cost, events, rate k·ν and busy time, as arrays.

    `pending_overhead_s` is the σ still ahead of each allocation now (σ for a candidate, what is
    left of it for an allocation still booting, 0 for a working one).
    """
    hazard = hazard_price_per_s + hazard_capacity_per_s
    cost = expected_cost_usd(billing, price_usd_per_hour, count, hazard, horizon_s)
    events = (hazard_price_per_s + count * hazard_capacity_per_s) * horizon_s
    kv = count * work_rate
    busy = kv * (horizon_s - pending_overhead_s - add_overhead_s * hazard * horizon_s)
    return cost, events, kv, busy


def footprint_terms(**kwargs: object) -> FootprintTerms:
    """Sum `allocation_terms` over a footprint (same keyword arguments)."""
    cost, events, kv, busy = allocation_terms(**kwargs)  # type: ignore[arg-type]
    return FootprintTerms(
        float(cost.sum()), float(events.sum()), float(kv.sum()), float(busy.sum())
    )


def cost_per_work_with(
    base: FootprintTerms,
    *,
    phi: float,
    eviction_overhead_s: float,
    cand_cost_usd: np.ndarray,
    cand_events: np.ndarray,
    cand_kv: np.ndarray,
    cand_busy_s: np.ndarray,
) -> np.ndarray:
    """E of the footprint plus each candidate, vectorised over candidates (inf: no work)."""
    events = base.events + cand_events
    work = phi * (base.busy_s + cand_busy_s - events * eviction_overhead_s * (base.rate + cand_kv))
    cost = base.cost_usd + cand_cost_usd
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(work > 0, cost / np.where(work > 0, work, 1.0), np.inf)
