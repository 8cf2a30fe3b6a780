"""One simulated job under one strategy from one start time: an event loop over replayed prices
and evictions that calls the same policy code as the live controller and bills every instance
through the billing model.

Runtimes (how the job turns held instances into progress):

* `agileml`: elastic; every ready spot instance works; a new instance is productive after σ
  (`add_overhead_s`), others are not disturbed; each eviction instant stalls the job for λ
  (`eviction_overhead_s`); nothing is lost (state lives on the reliable tier).
* `checkpoint`: a fixed gang; it works only when every member is ready and restored; it writes a
  checkpoint of `checkpoint_s` every τ = sqrt(2·checkpoint_s·MTTF) of compute (Young's
  interval, MTTF of the gang from the eviction model); an eviction rolls the work back to the last
  checkpoint and the gang waits for its replacement, then `restart_s` to restore.
* `gang-checkpoint`: as `checkpoint`, but a preemption tears the whole cluster down and the policy
  relaunches all of it (SkyPilot managed jobs).
* `gang-notice-checkpoint`: as `gang-checkpoint`, but it writes no periodic checkpoints: it
  writes one in each preemption's two-minute notice, so a preemption loses no work (one with
  less than `checkpoint_s` of notice loses the segment's); the model of Can't Be Late, where
  only the changeover delay is lost.
* `on-demand`: fixed, never evicted, no start-up cost: the reference the others are compared to.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from orchestrator.bidbrain.inputs import RenewalSchedule, decision_input
from orchestrator.bidbrain.model import AllocationRequest, JobSpec
from orchestrator.bidbrain.policy import Decision, Policy
from orchestrator.errors import OrchestratorError
from orchestrator.market.billing import BilledInterval, BillingModel, EndReason
from orchestrator.market.eviction import RemovalStream
from orchestrator.market.prices import Market
from orchestrator.sim.learning import RateLearner
from orchestrator.sim.results import LedgerLine, RunResult
from orchestrator.sim.world import World
from orchestrator.units import SECONDS_PER_HOUR

#: A run handles a few thousand events; far more means a loop that makes no progress.
MAX_EVENTS_PER_RUN = 2_000_000


class SimulationError(OrchestratorError):
    """The simulator reached a state it should not (a bug, not bad input)."""


class RuntimeParams(BaseModel):
    """Overheads of the runtimes, in seconds. Defaults and where they come from:

    * `boot_s` 180: spot request fulfilment plus instance boot (EC2 typically 1-3 min).
    * `checkpoint_s` 60: writing a consistent checkpoint of the model to S3; with Young's interval
      this gives the ~17% checkpoint overhead the Proteus evaluation measured (seed 002 §4.5.2).
    * `restart_s` 120: process start and restore from the checkpoint after the gang is back.
    * `notice_s` 120: EC2's spot interruption notice; strategies that act on notices
      (BidBrain) buy the replacement as soon as it arrives.
    * `capacity_cooldown_s` 600: a node noticed before it was even ready means the market is out
      of capacity; it is avoided this long.
    * AgileML's σ and λ come from the job's `AppParams` (seed 002 Table 4.2).

    Every value is finite (the engine schedules events at these offsets).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    boot_s: float = Field(180.0, ge=0)
    checkpoint_s: float = Field(60.0, gt=0)
    restart_s: float = Field(120.0, ge=0)
    notice_s: float = Field(120.0, ge=0, description="EC2's interruption notice (2 minutes)")
    capacity_cooldown_s: float = Field(
        600.0, gt=0, description="a market whose new node is reclaimed at once is avoided this long"
    )
    max_runtime_factor: float = Field(
        10.0, gt=1, description="give up when the job has run this many times its nominal time"
    )


@dataclass(frozen=True, slots=True)
class CheckpointSegment:
    """A stretch of a checkpointing gang's work since its last (re)start: compute for τ, then
    write a checkpoint for δ, again and again."""

    start_s: float
    work_at_start_s: float
    raw_rate: float  # work per second while computing
    tau_s: float  # compute between checkpoints (inf: never checkpoints)
    checkpoint_s: float

    @property
    def rate(self) -> float:
        """Average progress, checkpoint pauses included."""
        if math.isinf(self.tau_s):
            return self.raw_rate
        return self.raw_rate * self.tau_s / (self.tau_s + self.checkpoint_s)

    def saved_work_s(self, now_s: float) -> float:
        """The work held by the last checkpoint completed by `now_s`."""
        if math.isinf(self.tau_s):
            return self.work_at_start_s
        periods = math.floor((now_s - self.start_s) / (self.tau_s + self.checkpoint_s))
        return self.work_at_start_s + periods * self.raw_rate * self.tau_s


@dataclass(slots=True)
class SimInstance:
    instance_id: str
    allocation_id: str
    market: Market
    work_rate: float
    reliable: bool  # on-demand (the reliable tier)
    max_price_usd_per_hour: float | None
    launched_s: float
    ready_s: float
    evict_s: float
    ended_s: float | None = None
    end_reason: EndReason | None = None


class Run:
    """The event loop of one job under one strategy."""

    def __init__(
        self,
        world: World,
        *,
        policy: Policy,
        runtime: str,
        billing: BillingModel,
        job: JobSpec,
        start_s: float,
        params: RuntimeParams,
        removal_events: dict[Market, RemovalStream],
        keep_ledger: bool = False,
        periodic_decisions: bool = True,
        acts_on_notice: bool = False,
        true_work_rates: Mapping[str, float] | None = None,
        learns_rates: bool = False,
    ) -> None:
        self.world = world
        self.policy = policy
        self.runtime = runtime
        self.billing = billing
        self.job = job
        self.params = params
        self.removals = removal_events
        self.acts_on_notice = acts_on_notice
        # the instances work at the true rates; the policy decides with the job's (stated,
        # then learned) ones
        self.true_work_rates = true_work_rates or job.gpu_work_rates
        self.learner = RateLearner(world.catalog, job.gpu_work_rates) if learns_rates else None
        self.keep_ledger = keep_ledger
        self.periodic = periodic_decisions
        self.start_s = start_s
        self.now = start_s
        self.give_up_s = (  # a run still going then is cut off (counted as not completed)
            start_s
            + params.max_runtime_factor * job.work_gpu_hours / job.max_work_rate * SECONDS_PER_HOUR
        )
        self.work_total_s = job.work_gpu_hours * SECONDS_PER_HOUR
        self.work_s = 0.0
        self.instances: dict[str, SimInstance] = {}
        self._ids = itertools.count()
        self._alloc_ids = itertools.count()
        self._events: list[tuple[float, int, str, str]] = []
        self._seq = itertools.count()
        self._decide_at: float | None = None
        self._rates_used: dict[str, float] | None = None
        self.cost_usd = 0.0
        self.compute_s = 0.0
        self.free_compute_s = 0.0
        self.evictions = 0
        self.decisions = 0
        self.ledger: list[LedgerLine] = []
        self.last_eviction_s: dict[Market, float] = {}
        self.alloc_started: dict[str, float] = {}
        self.renewals = RenewalSchedule(policy.settings)
        self._launches: dict[Market, int] = {}
        self.doomed: set[str] = set()
        self.unavailable_until: dict[Market, float] = {}
        # runtime state
        self.stall_until = start_s
        self.segment: CheckpointSegment | None = None
        table = world.table
        self._series = {m: world.history[m] for m in table.markets}
        self._prices_from = self._prices_until = math.nan
        self._prices_cache = np.empty(0)
        self._price_times = world.price_change_times()

    # -- event plumbing -------------------------------------------------------------------
    def _push(self, t: float, kind: str, key: str = "") -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, key))

    def _schedule_decision(self, t: float) -> None:
        if self._decide_at is None or t < self._decide_at:
            self._decide_at = t
            self._push(t, "decide")

    def _schedule_periodic(self) -> None:
        if not self.periodic:
            return
        step = self.policy.settings.decision_interval_s
        k = math.floor((self.now - self.start_s) / step) + 1
        self._schedule_decision(self.start_s + k * step)

    # -- main loop ------------------------------------------------------------------------
    def run(self) -> RunResult:
        self._schedule_decision(self.start_s)
        if self.periodic:
            i = int(np.searchsorted(self._price_times, self.start_s, side="right"))
            if i < len(self._price_times):
                self._push(float(self._price_times[i]), "price")
        completed = False
        handled = 0
        while True:
            t_next = self._events[0][0] if self._events else math.inf
            rate = self._rate()
            if self.work_total_s - self.work_s <= 1e-9 * self.work_total_s:
                completed = True
                break
            if rate > 0:
                t_finish = self.now + (self.work_total_s - self.work_s) / rate
                if t_finish <= min(t_next, self.give_up_s):
                    self.now = t_finish
                    self.work_s = self.work_total_s
                    completed = True
                    break
            if t_next >= self.give_up_s:
                self.work_s += rate * (self.give_up_s - self.now)
                self.now = self.give_up_s
                break
            self.work_s += rate * (t_next - self.now)
            self.now = t_next
            while self._events and self._events[0][0] <= self.now:
                _, _, kind, key = heapq.heappop(self._events)
                self._handle(kind, key)
                handled += 1
                if handled > MAX_EVENTS_PER_RUN:
                    raise SimulationError(
                        f"run from {self.start_s} handled {handled} events without finishing "
                        f"(last: {kind} at {self.now}); this is a simulator bug"
                    )
        for inst in list(self.instances.values()):
            self._end(inst, EndReason.JOB_FINISHED)
        return RunResult(
            start_s=self.start_s,
            completed=completed,
            runtime_s=self.now - self.start_s,
            cost_usd=self.cost_usd,
            work_done_gpu_hours=self.work_s / SECONDS_PER_HOUR,
            evictions=self.evictions,
            compute_s=self.compute_s,
            free_compute_s=self.free_compute_s,
            decisions=self.decisions,
            ledger=self.ledger,
            deadline_met=None
            if self.job.deadline_s is None
            else completed and self.now <= self.job.deadline_s + 1e-6,
        )

    def _handle(self, kind: str, key: str) -> None:
        if kind == "decide":
            if self._decide_at is not None and self.now >= self._decide_at:
                self._decide_at = None
                self._decide()
                if self.job.budget_usd is not None or self.job.deadline_s is not None:
                    # Spend grows and slack shrinks with time: such a job is re-decided
                    # every interval.
                    self._schedule_periodic()
        elif kind == "evict":
            inst = self.instances.get(key)
            if inst is not None and inst.evict_s <= self.now:
                self._evict(inst)
        elif kind == "notice":
            inst = self.instances.get(key)
            if inst is not None:
                self.doomed.add(key)
                if self.now < inst.ready_s:
                    # Reclaimed before it even worked: the market is short of capacity, so it
                    # is left alone for a while (as the controller does on capacity errors).
                    until = self.now + self.params.capacity_cooldown_s
                    self.unavailable_until[inst.market] = until
                    self._push(until, "decide-after-cooldown")
                self._schedule_decision(self.now)
        elif kind == "decide-after-cooldown":
            self._schedule_decision(self.now)
        elif kind == "ready":
            if self.runtime == "agileml":
                self._schedule_periodic()
            else:
                self._maybe_restart()
        elif kind == "restart":
            self._start_segment()
        elif kind == "renew":
            alloc = key
            if any(i.allocation_id == alloc for i in self.instances.values()):
                self._schedule_decision(self.now)  # `renewals` names it due then
                self._push(self.now + self.policy.settings.renew_period_s, "renew", alloc)
        elif kind == "price":
            self._schedule_periodic()
            i = int(np.searchsorted(self._price_times, self.now, side="right"))
            if i < len(self._price_times):
                self._push(float(self._price_times[i]), "price")
        # "stall-end" needs no action: the rate is recomputed after every event

    # -- progress -------------------------------------------------------------------------
    def _rate(self) -> float:
        """Progress per second now; never above the job's max rate (it cannot use more)."""
        phi = self.job.app.phi
        if self.runtime == "agileml":
            if self.now < self.stall_until or not self._reliable_ready():
                return 0.0
            held = sum(i.work_rate for i in self.instances.values() if i.ready_s <= self.now)
            return phi * min(held, self.job.max_work_rate)
        if self.runtime == "on-demand":
            held = sum(i.work_rate for i in self.instances.values())
            return phi * min(held, self.job.max_work_rate)
        return 0.0 if self.segment is None else self.segment.rate

    def _reliable_ready(self) -> bool:
        if not self.policy.uses_reliable_tier or self.job.reliable_count == 0:
            return True
        return any(
            i.reliable
            and i.market.instance_type == self.job.reliable_type
            and i.ready_s <= self.now
            for i in self.instances.values()
        )

    def _gang(self) -> list[SimInstance]:
        """A checkpointing job's GPU instances (spot, or on-demand ones a policy bought)."""
        return [i for i in self.instances.values() if i.work_rate > 0]

    def _gang_ready(self) -> bool:
        """The whole gang the policy bought is there and ready (judged at the rates it bought
        at: its true rates may fall short of the job's max)."""
        gang = self._gang()
        rate = sum(self._stated_rate_of(i.market.instance_type) for i in gang)
        return (
            bool(gang)
            and rate >= self.job.max_work_rate - 1e-9
            and all(i.ready_s <= self.now for i in gang)
        )

    def _maybe_restart(self) -> None:
        if self.segment is None and self._gang_ready():
            self._push(self.now + self.params.restart_s, "restart")

    def _start_segment(self) -> None:
        if self.segment is not None or not self._gang_ready():
            return
        gang = self._gang()
        by_market: dict[tuple[Market, float | None], int] = defaultdict(int)
        for i in gang:
            if not i.reliable:  # on-demand ones are not evicted
                by_market[(i.market, i.max_price_usd_per_hour)] += 1
        hazard = sum(
            n
            * (
                self.policy.capacity_model.hazard_per_s(m, math.inf)
                + self.policy.price_model.hazard_per_s(m, (bid or 0) - self._price(m))
            )
            for (m, bid), n in by_market.items()
        )
        delta = self.params.checkpoint_s
        mttf = 1.0 / hazard if hazard > 0 else math.inf
        tau = max(delta, math.sqrt(2.0 * delta * mttf)) if math.isfinite(mttf) else math.inf
        if self.runtime == "gang-notice-checkpoint":
            tau = math.inf  # it checkpoints in each notice instead
        raw = self.job.app.phi * min(sum(i.work_rate for i in gang), self.job.max_work_rate)
        self.segment = CheckpointSegment(self.now, self.work_s, raw, tau, delta)

    def _rollback(self) -> None:
        """Checkpoint runtimes: lose the work since the last completed checkpoint."""
        if self.segment is not None:
            self.work_s = min(self.work_s, self.segment.saved_work_s(self.now))
        self.segment = None

    # -- market ---------------------------------------------------------------------------
    def _price(self, market: Market) -> float:
        p = self._series[market].price_at(self.now)
        return math.nan if p is None else p

    def _prices(self) -> np.ndarray:
        """Current price of every market (NaN before a market's first record), cached until
        the next price change anywhere."""
        if not (self._prices_from <= self.now < self._prices_until):
            self._prices_cache = np.array([self._price(m) for m in self.world.table.markets])
            i = int(np.searchsorted(self._price_times, self.now, side="right"))
            self._prices_from = float(self._price_times[i - 1]) if i > 0 else -math.inf
            self._prices_until = (
                float(self._price_times[i]) if i < len(self._price_times) else math.inf
            )
        return self._prices_cache

    # -- decisions ------------------------------------------------------------------------
    def _spend_so_far(self) -> float:
        running = 0.0
        for inst in self.instances.values():
            if inst.reliable:
                running += self._on_demand_price(inst.market) * (self.now - inst.launched_s) / 3600
            else:
                running += self._series[inst.market].cost_usd(inst.launched_s, self.now)
        return self.cost_usd + running

    def _decide(self) -> None:
        self.decisions += 1
        rate_of = self._stated_rate_of
        if self.learner is not None:
            for inst in self.instances.values():
                self.learner.measure(inst, self.now)
            rates = self.learner.rates()
            if rates != self._rates_used:
                self.policy.use_work_rates(rates)
                self._rates_used = rates
            rate_of = functools.partial(self.world.catalog.work_rate, gpu_work_rates=rates)
        remaining = max(self.work_total_s - self.work_s, 0.0) / SECONDS_PER_HOUR
        inp = decision_input(
            now_s=self.now,
            job=self.job,
            work_remaining_gpu_hours=remaining,
            spend_usd=self._spend_so_far() if self.job.budget_usd is not None else self.cost_usd,
            held=self.instances.values(),
            price_of=self._price_held,
            prices_usd_per_hour=self._prices(),
            renewals=self.renewals,
            doomed=self.doomed,
            unavailable=frozenset(m for m, t in self.unavailable_until.items() if t > self.now),
            last_eviction_s=self.last_eviction_s,
            work_rate_of=rate_of,
        )
        decision = self.policy.decide(inp)
        self._apply(decision)

    def _stated_rate_of(self, instance_type: str) -> float:
        return self.world.catalog.work_rate(instance_type, self.job.gpu_work_rates)

    def _price_held(self, market: Market, reliable: bool) -> float:
        return self._on_demand_price(market) if reliable else self._price(market)

    def _apply(self, decision: Decision) -> None:
        released = set(decision.release)
        for inst in [i for i in self.instances.values() if i.allocation_id in released]:
            self._end(inst, EndReason.RELEASED)
        if released and self.runtime != "agileml":
            # a gang let go on purpose writes its checkpoint as it stops (the write's time is
            # not charged: it favours the checkpointing baselines, not BidBrain)
            self.segment = None
        for req in decision.acquire:
            self._launch(req)
        if decision.budget_exhausted:
            self.give_up_s = self.now

    def _on_demand_price(self, market: Market) -> float:
        return self.world.catalog.get(market.instance_type).on_demand_price(market.region)

    def _launch(self, req: AllocationRequest) -> None:
        alloc_id = f"a{next(self._alloc_ids)}"
        self.alloc_started[alloc_id] = self.now
        market = req.market
        on_demand = req.reliable
        rate = self.world.catalog.work_rate(req.instance_type, self.true_work_rates)
        if self.runtime == "on-demand":
            ready_delay = 0.0
        elif self.runtime == "agileml":
            ready_delay = self.job.app.add_overhead_s
        else:
            ready_delay = self.params.boot_s
        for _ in range(req.count):
            iid = f"i{next(self._ids)}"
            evict_s = (
                math.inf if on_demand else self._sample_eviction(market, req.max_price_usd_per_hour)
            )
            inst = SimInstance(
                instance_id=iid,
                allocation_id=alloc_id,
                market=market,
                work_rate=rate,
                reliable=on_demand,
                max_price_usd_per_hour=req.max_price_usd_per_hour,
                launched_s=self.now,
                ready_s=self.now + ready_delay,
                evict_s=evict_s,
            )
            self.instances[iid] = inst
            if math.isfinite(evict_s):
                self._push(evict_s, "evict", iid)
                if self.acts_on_notice:
                    self._push(max(self.now, evict_s - self.params.notice_s), "notice", iid)
        if ready_delay > 0:
            self._push(self.now + ready_delay, "ready")
        elif self.runtime not in ("agileml", "on-demand"):
            self._maybe_restart()
        if not on_demand:
            self._push(
                self.now + self.policy.settings.renew_period_s - self.policy.settings.renew_lead_s,
                "renew",
                alloc_id,
            )

    def _sample_eviction(self, market: Market, max_price: float | None) -> float:
        evict = math.inf
        if max_price is not None:
            crossing = self._series[market].first_time_above(self.now, max_price)
            if crossing is not None:
                evict = crossing
        stream = self.removals.get(market)
        if stream is not None:
            slot = self._launches[market] = self._launches.get(market, -1) + 1
            evict = min(evict, stream.eviction_after(self.now, slot, evict))
        return evict

    # -- instance lifecycle ---------------------------------------------------------------
    def _evict(self, inst: SimInstance) -> None:
        self.evictions += 1
        noticed = inst.instance_id in self.doomed
        self.last_eviction_s[inst.market] = self.now
        self._end(inst, EndReason.EVICTED)
        if self.runtime == "agileml":
            if self.stall_until <= self.now:
                self.stall_until = self.now + self.job.app.eviction_overhead_s
                self._push(self.stall_until, "stall-end")
        else:
            warned_s = self.now - max(inst.launched_s, self.now - self.params.notice_s)
            if self.runtime == "gang-notice-checkpoint" and warned_s >= self.params.checkpoint_s:
                self.segment = None  # the checkpoint written in the notice keeps the work
            else:
                self._rollback()
            if self.runtime in ("gang-checkpoint", "gang-notice-checkpoint"):
                for other in [i for i in self.instances.values() if not i.reliable]:
                    self._end(other, EndReason.RELEASED)
        if not noticed:  # a noticed eviction was planned for when its notice came
            self._schedule_decision(self.now)

    def _end(self, inst: SimInstance, reason: EndReason) -> None:
        if self.learner is not None:
            self.learner.measure(inst, self.now)
            self.learner.forget(inst.instance_id)
        del self.instances[inst.instance_id]
        self.doomed.discard(inst.instance_id)
        inst.ended_s = self.now
        inst.end_reason = reason
        run_s = self.now - inst.launched_s
        if not inst.reliable:
            self.policy.capacity_model.observe(
                inst.market, 1 if reason is EndReason.EVICTED else 0, run_s
            )
        if inst.reliable:
            intervals = self.billing.bill_on_demand(
                self._on_demand_price(inst.market), inst.launched_s, self.now, reason
            )
        else:
            intervals = self.billing.bill_spot(
                self._series[inst.market], inst.launched_s, self.now, reason
            )
        self._account(inst, intervals)

    def _account(self, inst: SimInstance, intervals: list[BilledInterval]) -> None:
        for iv in intervals:
            charged = iv.charged_usd
            self.cost_usd += charged
            run = iv.end_s - iv.start_s
            # compute = run time weighted by work rate (a CPU-only reliable node adds none)
            self.compute_s += run * inst.work_rate
            if iv.billed_s < run:
                self.free_compute_s += (run - iv.billed_s) * inst.work_rate
            if self.keep_ledger:
                self.ledger.append(
                    LedgerLine(
                        instance_id=inst.instance_id,
                        instance_type=inst.market.instance_type,
                        zone=inst.market.zone,
                        start_s=iv.start_s,
                        end_s=iv.end_s,
                        price_usd_per_hour=iv.price_usd_per_hour,
                        billed_s=iv.billed_s,
                        charged_usd=charged,
                        reason=str(iv.reason),
                        market="on-demand" if inst.reliable else "spot",
                    )
                )
