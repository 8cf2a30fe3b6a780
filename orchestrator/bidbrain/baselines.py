"""The policies BidBrain is measured against (seed 002 §4.5.2, DESIGN §3).

* `OnDemandPolicy`: the job's reference GPUs on-demand, nothing else.
* `StandardPolicy`: Spot Fleet's old default: the spot market that is cheapest now (per unit of
  work, as Spot Fleet's weighted capacity does), bid the on-demand price, hold it until evicted,
  then pick the cheapest market again for the replacement.
* `CheapestFailoverPolicy`: what SkyPilot managed jobs do for a spot cluster: launch the whole
  cluster of the requested type in the cheapest zone; when a node is preempted the cluster is torn
  down and relaunched, preferring a zone other than the one just preempted (EAGER_NEXT_REGION), for
  example "us-east-1b preempted -> relaunch in us-east-1c (cheapest other zone) -> ok".
* `UniformProgressPolicy`: "Can't Be Late" (Wu et al., NSDI'24, from the SkyPilot team): a job
  with a deadline on one instance type in one zone, switching its whole cluster between spot,
  on-demand and idle by the Uniform Progress rules.
"""

from __future__ import annotations

import math

import numpy as np

from orchestrator.bidbrain.errors import DeadlineError
from orchestrator.bidbrain.model import AllocationRequest
from orchestrator.bidbrain.policy import POLICIES, Decision, DecisionInput, Policy
from orchestrator.units import SECONDS_PER_HOUR

#: How long a preempted zone is avoided by the failover policy (SkyPilot moves to the next
#: region/zone at once; it comes back to a zone only when the others failed).
FAILOVER_AVOID_SECONDS = 1800.0


class OnDemandPolicy(Policy):
    """Hold `max_work_rate` worth of the reference type, on-demand, in the first zone."""

    name = "on-demand"
    uses_reliable_tier = False

    def __init__(self, table, *, reference_type: str = "p3.2xlarge", **kwargs) -> None:
        super().__init__(table, **kwargs)
        self.reference_type = reference_type

    def decide(self, inp: DecisionInput) -> Decision:
        if inp.footprint.allocations:
            return Decision()
        rate = self.catalog.work_rate(self.reference_type, inp.job.gpu_work_rates)
        zone = next(m.zone for m in self.table.markets if m.instance_type == self.reference_type)
        return Decision(
            acquire=(
                AllocationRequest(
                    instance_type=self.reference_type,
                    zone=zone,
                    count=math.ceil(inp.job.max_work_rate / rate - 1e-9),
                    reliable=True,
                ),
            )
        )


class StandardPolicy(Policy):
    """Cheapest current spot market per unit of work, bid = on-demand price, re-pick on eviction.

    It fills the gap to the job's max rate in one allocation, like a Spot Fleet request with
    weighted capacity; the market is the cheapest per unit of the work it fills.
    """

    name = "standard"

    def __init__(self, table, *, with_reliable_tier: bool = True, **kwargs) -> None:
        super().__init__(table, **kwargs)
        self._reliable = with_reliable_tier

    def decide(self, inp: DecisionInput) -> Decision:
        reliable = self._reliable_request(inp) if self._reliable else ()
        remaining = self._remaining_rate(inp)
        usable = self._usable(inp) & (self.table.on_demand_usd_per_hour > inp.prices_usd_per_hour)
        if remaining <= 1e-9 or not usable.any():
            return Decision(acquire=reliable)
        # Price per unit of the work the fill is for, counting what a whole instance
        # overshoots (a 4-GPU gap filled by an 8-GPU instance pays for 8).
        counts = np.ceil(remaining / np.maximum(self.table.work_rate, 1e-9) - 1e-9)
        per_work = np.where(usable, inp.prices_usd_per_hour * counts / remaining, np.inf)
        # Equal prices per work are common (p3 sizes are priced per GPU); pick among them at
        # random rather than by name, so the baseline is not lucky or unlucky by sort order.
        ties = np.flatnonzero(per_work <= per_work.min() * (1 + 1e-9))
        i = int(self.rng.choice(ties))
        m = self.table.markets[i]
        count = math.ceil(remaining / self.table.work_rate[i] - 1e-9)
        return Decision(
            acquire=reliable
            + (
                AllocationRequest(
                    instance_type=m.instance_type,
                    zone=m.zone,
                    count=count,
                    max_price_usd_per_hour=float(self.table.on_demand_usd_per_hour[i]),
                ),
            )
        )


class CheapestFailoverPolicy(Policy):
    """SkyPilot managed jobs: whole cluster of the reference type in the cheapest zone."""

    name = "cheapest-failover"
    uses_reliable_tier = False

    def __init__(self, table, *, reference_type: str = "p3.2xlarge", **kwargs) -> None:
        super().__init__(table, **kwargs)
        self.reference_type = reference_type

    def decide(self, inp: DecisionInput) -> Decision:
        if inp.footprint.spot:
            return Decision()
        usable = self._usable(inp)
        options = [
            (float(inp.prices_usd_per_hour[i]), m, i)
            for i, m in enumerate(self.table.markets)
            if usable[i] and m.instance_type == self.reference_type
        ]
        if not options:
            return Decision(reason="no zone offers the reference type")
        recent = {
            m for m, t in inp.last_eviction_s.items() if inp.now_s - t < FAILOVER_AVOID_SECONDS
        }
        fresh = [o for o in options if o[1] not in recent] or options
        price, m, i = min(fresh, key=lambda o: (o[0], o[1]))
        count = math.ceil(inp.job.max_work_rate / self.table.work_rate[i] - 1e-9)
        return Decision(
            acquire=(
                AllocationRequest(
                    instance_type=m.instance_type,
                    zone=m.zone,
                    count=count,
                    max_price_usd_per_hour=float(self.table.on_demand_usd_per_hour[i]),
                ),
            )
        )


class UniformProgressPolicy(Policy):
    """Can't Be Late's Uniform Progress, on the reference type in the zone cheapest at the
    job's start (as in the paper: one market), the cluster all spot, all on-demand, or idle.

    With cp the work done, ep(t) = total × (t − t0) / (deadline − t0) the uniform progress
    line, R the time left, C the remaining work's time at the max rate and d the changeover
    delay (boot and restore):

    1. Uniform progress: idle and cp < ep(now): on-demand, to catch up.
    2. Exploitation: idle and spot available: spot (even when behind); stay on it until it
       is preempted.
    3. Hysteresis: on on-demand, stay until cp ≥ ep(now + 2d); then spot if available, else
       idle.
    4. Safety net: idle (or on on-demand) and R < C + 2d: on-demand to the end.

    Spot counts as available when the zone has a price under on-demand and took none of the
    job's instances back in the last `spot_retry_s` (the paper reads availability off its
    traces; here a preemption says the zone is out of capacity for a while).
    """

    name = "uniform-progress"
    uses_reliable_tier = False

    def __init__(
        self,
        table,
        *,
        reference_type: str = "p3.2xlarge",
        changeover_s: float = 300.0,
        spot_retry_s: float = 600.0,
        **kwargs,
    ) -> None:
        super().__init__(table, **kwargs)
        self.reference_type = reference_type
        self.changeover_s = changeover_s
        self.spot_retry_s = spot_retry_s
        self._start_s: float | None = None
        self._zone: int | None = None
        self._safety_net = False

    def decide(self, inp: DecisionInput) -> Decision:
        job, now, d = inp.job, inp.now_s, self.changeover_s
        if job.deadline_s is None:
            raise DeadlineError(
                "the uniform-progress strategy needs a deadline", fix="pass --deadline-hours"
            )
        if self._start_s is None:
            self._start_s, self._zone = now, self._cheapest_zone(inp)
        if self._zone is None:
            return Decision(reason="no zone offers the reference type")
        rate_h = job.app.phi * job.max_work_rate
        done = job.work_gpu_hours - inp.work_remaining_gpu_hours
        left_s, need_s = (
            job.deadline_s - now,
            inp.work_remaining_gpu_hours / rate_h * SECONDS_PER_HOUR,
        )
        od = [a for a in inp.footprint.allocations if a.reliable]
        spot = inp.footprint.spot
        # 2d as in the paper, and a decision interval: decisions here come that far apart
        if not spot and left_s < need_s + 2 * d + self.settings.decision_interval_s:
            self._safety_net = True
        if self._safety_net:
            return self._switch(inp, to="on-demand", reason="safety net")
        if spot:
            return Decision()  # exploitation: stay until preempted
        if od:
            if done < self._expected(job, now + 2 * d):
                return Decision()  # hysteresis
            if self._spot_available(inp):
                return self._switch(inp, to="spot", reason="ahead: back to spot")
            return self._switch(inp, to="idle", reason="ahead: wait for spot")
        if self._spot_available(inp):
            return self._switch(inp, to="spot", reason="spot available")
        if done < self._expected(job, now):
            return self._switch(inp, to="on-demand", reason="behind: catch up on on-demand")
        return Decision(reason="ahead: wait for spot")

    def _expected(self, job, at_s: float) -> float:
        assert self._start_s is not None and job.deadline_s is not None
        span = max(job.deadline_s - self._start_s, 1e-9)
        return job.work_gpu_hours * min(1.0, max(at_s - self._start_s, 0.0) / span)

    def _cheapest_zone(self, inp: DecisionInput) -> int | None:
        options = [
            (float(inp.prices_usd_per_hour[i]), i)
            for i, m in enumerate(self.table.markets)
            if m.instance_type == self.reference_type and np.isfinite(inp.prices_usd_per_hour[i])
        ]
        return min(options)[1] if options else None

    def _spot_available(self, inp: DecisionInput) -> bool:
        i = self._zone
        assert i is not None
        market = self.table.markets[i]
        evicted = inp.last_eviction_s.get(market, -math.inf)
        return bool(
            self._usable(inp)[i]
            and inp.prices_usd_per_hour[i] < self.table.on_demand_usd_per_hour[i]
            and inp.now_s - evicted >= self.spot_retry_s
        )

    def _switch(self, inp: DecisionInput, *, to: str, reason: str) -> Decision:
        """Release what is held of the other kinds and hold the whole cluster as `to`."""
        assert self._zone is not None
        fp, market = inp.footprint, self.table.markets[self._zone]
        keep_reliable = to == "on-demand"
        release = tuple(
            a.allocation_id for a in fp.allocations if to == "idle" or a.reliable != keep_reliable
        )
        held = any(a.reliable == keep_reliable for a in fp.allocations)
        if to == "idle" or held:
            return Decision(release=release, reason=reason)
        count = math.ceil(inp.job.max_work_rate / self.table.work_rate[self._zone] - 1e-9)
        request = AllocationRequest(
            instance_type=market.instance_type,
            zone=market.zone,
            count=count,
            reliable=keep_reliable,
            max_price_usd_per_hour=None
            if keep_reliable
            else float(self.table.on_demand_usd_per_hour[self._zone]),
        )
        return Decision(acquire=(request,), release=release, reason=reason)


for _cls in (OnDemandPolicy, StandardPolicy, CheapestFailoverPolicy, UniformProgressPolicy):
    POLICIES[_cls.name] = _cls
