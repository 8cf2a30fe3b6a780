"""The controller's tick: observe, decide, act — for every job, against EC2 and the store.

One tick (`Controller.tick(now_s)`):

1. **Observe.** Read the jobs and their alive instances from the store; reconcile with what EC2
   holds under this controller's tag (orphans are terminated, instances launched just before a
   crash are adopted, instances EC2 no longer runs are ended as evicted and billed); take the
   interruption notices received since the last tick; read the spot prices at `now_s`.
2. **Decide.** For each running job, BidBrain decides on the footprint (reliable tier, spot
   allocations, budget) from the same `DecisionInput` the simulator uses.
3. **Act.** Launch what was decided (idempotent per allocation id), terminate what was released,
   bill every instance that ended, and record decisions and events.

Crash safety: every fact is written to the store as soon as it is known, launches are tagged and
idempotent by allocation id, and the next tick's reconciliation repairs whatever a crash left
half done (a launched instance the store did not record is adopted; one the store thinks alive
but EC2 terminated is ended and billed once: ledger appends are idempotent).

The module imports from market, bidbrain, cloud and store; nothing imports it but the entry
points (CLI, demo).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from pydantic import ValidationError

from orchestrator.bidbrain.inputs import HeldInstance, decision_input
from orchestrator.bidbrain.model import AllocationRequest, JobSpec
from orchestrator.bidbrain.policy import (
    BidBrainPolicy,
    BidBrainSettings,
    Decision,
)
from orchestrator.cloud.availability import MarketAvailability
from orchestrator.cloud.errors import CapacityError, CloudError
from orchestrator.cloud.instances import CloudInstance, LaunchSpec
from orchestrator.cloud.notices import InterruptionNotice
from orchestrator.cloud.protocol import Cloud
from orchestrator.cloud.reconcile import Reconciler
from orchestrator.controller.clock import check_clock
from orchestrator.controller.job import ControllerJob, DecisionLag, last_decisions
from orchestrator.controller.market_view import MarketView, price_at
from orchestrator.controller.outcomes import InstanceLogs, JobTraining, TrainingOutcome
from orchestrator.controller.rates import RateLearning
from orchestrator.controller.training_gate import NOTHING_COUNTS_ITS_WORK, Patience, TrainingGate
from orchestrator.errors import clip_middle
from orchestrator.market.billing import BillingModel, EndReason
from orchestrator.market.catalog import Catalog
from orchestrator.market.eviction import (
    CapacityHazardModel,
)
from orchestrator.market.prices import Market, PriceHistory, PriceSource
from orchestrator.store.errors import ConflictError, LedgerConflictError, NotFoundError
from orchestrator.store.events import (
    DecisionEvent,
    Event,
    EvictionEvent,
    LaunchEvent,
    LaunchFailedEvent,
    NoticeEvent,
    ReconcileEvent,
    ReleaseEvent,
    StateEvent,
)
from orchestrator.store.models import (
    InstanceRecord,
    JobRecord,
    JobState,
    LedgerEntry,
    PriceSnapshot,
)
from orchestrator.store.protocol import Store
from orchestrator.units import SECONDS_PER_HOUR

log = logging.getLogger(__name__)

#: How much price history the controller reads each tick (the price model's fitting window).
PRICE_LOOKBACK_S = 14 * 86400.0


@dataclass
class TickReport:
    """What one tick did (for logs, tests and the demo's progress line)."""

    now_s: float
    launched: list[str] = field(default_factory=list)
    terminated: list[str] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)
    adopted: list[str] = field(default_factory=list)
    launch_failures: list[str] = field(default_factory=list)
    decisions: dict[str, Decision] = field(default_factory=dict)
    finished: dict[str, JobState] = field(default_factory=dict)


class Controller:
    """Runs BidBrain for the store's jobs against one EC2 region.

    Args:
        store: jobs, instances, ledger and events.
        cloud: where instances are launched (`EC2Cloud`; moto offline; a fake in tests).
        prices: where spot prices come from (EC2 live, trace files offline).
        billing: how instances are charged (for the ledger).
        settings: BidBrain's knobs.
        image_id: the AMI worker nodes boot.
        training: the jobs' training (the training host, `JobTraining`): launch tags, final
            weights, how far each job trained (it succeeds only trained).
        patience: how long a training job may go without progress, and an instance without
            its node in the job's training, before they are released (`Patience`).
        max_running_jobs: jobs run side by side, each on its own budget; with a limit, queued
            jobs wait (oldest first) until fewer than this many run — 1 runs them in sequence.
    """

    def __init__(
        self,
        *,
        store: Store,
        cloud: Cloud,
        prices: PriceSource,
        billing: BillingModel,
        catalog: Catalog | None = None,
        settings: BidBrainSettings | None = None,
        image_id: str = "ami-orchestrator",
        training: JobTraining | None = None,
        max_running_jobs: int | None = None,
        patience: Patience | None = None,
    ) -> None:
        if max_running_jobs is not None and max_running_jobs < 1:
            raise ValueError("max_running_jobs must be at least 1 (or None: no limit)")
        self.max_running_jobs = max_running_jobs
        self.store = store
        self.cloud = cloud
        self.prices = prices
        self.billing = billing
        self.catalog = catalog or Catalog.load()
        self.settings = settings or BidBrainSettings()
        self.capacity_model = CapacityHazardModel(prior_rate_per_hour=0.1)  # learns evictions
        self.availability = MarketAvailability()
        self.image_id = image_id
        self.training = training
        self.instance_logs: InstanceLogs | None = None  # the offline world's agents' logs
        patience = patience or Patience()
        self._gate = None if training is None else TrainingGate.of(training, store, patience)
        self._notices: list[InterruptionNotice] = []
        self._doomed: set[str] = set()
        self._market = MarketView(self.catalog)
        self._jobs: dict[str, ControllerJob] = {}  # running jobs: their typed spec and state
        self._ticks = DecisionLag()  # how late this controller's ticks come: a job new to
        # a lagging controller has no lag of its own yet, and its budget must hold all the same
        self._rates = RateLearning(store, self.catalog)  # the jobs' learned work rates

    # -- inputs from outside the tick -----------------------------------------------------
    def notify(self, notice: InterruptionNotice) -> None:
        """Take an interruption notice (node watcher or EventBridge); acted on at the next tick,
        which callers should run at once."""
        self._notices.append(notice)

    def spend_usd(self, job_id: str, now_s: float) -> float:
        """What the job has cost so far: its ledger plus what its alive instances have run up."""
        alive = self.store.list_instances(job_id, alive_only=True)
        history = self.prices.history(now_s - PRICE_LOOKBACK_S, now_s)
        return self.store.spent_usd(job_id) + sum(self._accrued(alive, history, now_s).values())

    # -- the tick -------------------------------------------------------------------------
    def tick(self, now_s: float) -> TickReport:
        """Observe, decide, act. Raises StoreUnavailableError if Redis is down (nothing is
        half-written: each store write is atomic and the next tick reconciles), and
        ClockRewoundError (doing nothing) if `now_s` is behind a tick already made."""
        check_clock(self.store, now_s)
        report = TickReport(now_s)
        jobs = {j.job_id: j for j in self.store.list_jobs()}
        history = self.prices.history(now_s - PRICE_LOOKBACK_S, now_s)
        self._reconcile(jobs, history, now_s, report)
        self._take_notices(jobs, now_s)
        running = sum(
            1 for j in jobs.values() if j.state in (JobState.RUNNING, JobState.CANCELLING)
        )
        for job in sorted(jobs.values(), key=lambda j: (j.submitted_at, j.job_id)):
            try:
                if job.state is JobState.QUEUED:
                    if self.max_running_jobs is not None and running >= self.max_running_jobs:
                        continue  # waits its turn in the queue
                    job = self._transition(job, JobState.RUNNING, now_s, "started")
                    running += 1
                if job.state is JobState.RUNNING:
                    self._run_job(job, history, now_s, report)
                elif job.state is JobState.CANCELLING:
                    self._stop_job(job, history, now_s, EndReason.RELEASED, report)
                    self._finish(job, JobState.CANCELLED, now_s, "cancelled by the user", report)
            except ConflictError:
                # the job changed under us (a cancel through the API): the next tick re-reads it
                log.info("job changed during the tick", extra={"job_id": job.job_id})
        self._ticks.decided(now_s)
        return report

    # -- observe --------------------------------------------------------------------------
    def _reconcile(
        self, jobs: dict[str, JobRecord], history: PriceHistory, now_s: float, report: TickReport
    ) -> None:
        alive = self.store.list_instances(alive_only=True)
        owned = {i.instance_id: i.job_id for i in alive}
        active = {
            j.job_id for j in jobs.values() if j.state in (JobState.RUNNING, JobState.CANCELLING)
        }
        plan = Reconciler(self.cloud).reconcile(owned, active)
        for inst in plan.adopt:
            self._record_launch(inst, now_s)
            report.adopted.append(inst.instance_id)
            self._log(
                ReconcileEvent(
                    job_id=inst.job_id or "",
                    at_s=now_s,
                    action="adopt",
                    instance_id=inst.instance_id,
                )
            )
        by_id = {i.instance_id: i for i in alive}
        for instance_id in plan.gone:
            rec = by_id.get(instance_id)
            if rec is None:
                continue
            owner = self._jobs.get(rec.job_id)
            try:
                ended = self._end(rec, history, now_s, EndReason.EVICTED)
            except BaseException:
                if owner is not None:  # it may have ended unseen: read them again
                    owner.forget_evictions()
                raise
            if owner is not None:
                owner.note_eviction(ended)
            report.evicted.append(instance_id)
            self.capacity_model.observe(
                Market(rec.instance_type, rec.zone), 1, now_s - rec.launched_at
            )
            self._log(
                EvictionEvent(
                    job_id=rec.job_id,
                    at_s=now_s,
                    instance_id=instance_id,
                    instance_type=rec.instance_type,
                    zone=rec.zone,
                )
            )
        report.terminated.extend(plan.terminate)

    def _take_notices(self, jobs: dict[str, JobRecord], now_s: float) -> None:
        notices, self._notices = self._notices, []
        for notice in notices:
            try:
                rec = self.store.get_instance(notice.instance_id)
            except NotFoundError:
                log.info("notice for unknown instance", extra={"instance_id": notice.instance_id})
                continue
            if notice.kind == "interruption":
                self._doomed.add(notice.instance_id)
            self._log(
                NoticeEvent(
                    job_id=rec.job_id,
                    at_s=now_s,
                    instance_id=notice.instance_id,
                    notice=notice.kind,
                    action=notice.action,
                )
            )

    # -- decide and act -------------------------------------------------------------------
    def _run_job(
        self, job: JobRecord, history: PriceHistory, now_s: float, report: TickReport
    ) -> None:
        owner = self._jobs.get(job.job_id)
        if owner is None:  # the job's first tick here: its spec typed once
            try:
                decided = last_decisions(self.store, job.job_id)
                owner = self._jobs[job.job_id] = ControllerJob.of(job, self.settings, decided)
            except ValidationError as exc:  # stored by an older version with looser checks
                self._stop_job(job, history, now_s, EndReason.RELEASED, report)
                why = clip_middle(f"its stored spec is no longer valid: {exc}", 2000)
                self._finish(job, JobState.FAILED, now_s, why, report)
                return
        submission = owner.submission
        spec = self._rates.spec_for(job.job_id, submission.job_spec(), now_s, owner.rates)
        remaining = max(spec.work_gpu_hours - job.work_done_gpu_hours, 0.0)
        alive = self.store.list_instances(job.job_id, alive_only=True)
        accrued = self._accrued(alive, history, now_s)
        # what the API, the CLI, the dashboard and /metrics show as spent: billed + this
        self.store.record_accrued(job.job_id, accrued, now_s)
        try:
            training = self.training.outcome(job) if self.training is not None else None
        except Exception:  # noqa: BLE001 - one job's runtime must not stop the others' ticks
            log.exception("reading the job's training failed", extra={"job_id": job.job_id})
            return
        if training is None and self._gate is not None:  # it would pay until its budget ran out
            self._stop_job(job, history, now_s, EndReason.RELEASED, report)
            self._finish(job, JobState.FAILED, now_s, NOTHING_COUNTS_ITS_WORK, report)
            return
        if training is not None and self._gate is not None:
            verdict = self._gate.judge(
                job, owner.watch, training, alive, now_s, self.instance_logs, self._doomed
            )
            if verdict.stall is not None:  # released for want of progress
                for rec in alive:
                    self._terminate(rec, history, now_s, EndReason.RELEASED, report)
                self._log(verdict.stall)
            elif verdict.fail is not None:
                self._stop_job(job, history, now_s, EndReason.RELEASED, report)
            if verdict.fail is not None:
                self._finish(job, JobState.FAILED, now_s, verdict.fail, report)
            if verdict.stops:
                return
            for silent in verdict.silent:  # paid for, not working: BidBrain replaces it
                self._terminate(silent.instance, history, now_s, EndReason.RELEASED, report,
                                detail=silent.why)  # fmt: skip
                accrued.pop(silent.instance.instance_id, None)  # billed now
            gone = {silent.instance.instance_id for silent in verdict.silent}
            alive = [rec for rec in alive if rec.instance_id not in gone]
            # the work left is at least what is not trained yet (the offline world counts
            # work on its faster market clock), and none once every iteration is
            remaining = 0.0 if training.trained else max(
                remaining, spec.work_gpu_hours * training.untrained_fraction
            )  # fmt: skip
        if remaining <= 1e-9:
            self._stop_job(job, history, now_s, EndReason.JOB_FINISHED, report)
            self._finish_done(job, training, spec.work_gpu_hours, now_s, report)
            return
        table = self._market.table(submission, spec, history)
        if len(table) == 0:
            self._stop_job(job, history, now_s, EndReason.RELEASED, report)
            why = submission.types_refused(self.catalog) or "no market offers the job's GPU types"
            self._finish(job, JobState.FAILED, now_s, why, report)
            return
        policy = BidBrainPolicy(
            table,
            billing=self.billing.name,
            price_model=self._market.price_model(history, now_s),
            capacity_model=self.capacity_model,
            settings=self.settings,
            catalog=self.catalog,
        )
        prices = np.array([price_at(history, m, now_s) for m in table.markets])
        inp = decision_input(
            now_s=now_s,
            job=spec,
            work_remaining_gpu_hours=remaining,
            spend_usd=self.store.spent_usd(job.job_id) + sum(accrued.values()),
            held=self._held(alive, spec),
            price_of=self._market.price_of(history, now_s),
            prices_usd_per_hour=prices,
            renewals=owner.renewals,
            doomed=self._doomed,
            unavailable=self.availability.unavailable(now_s, table.markets),
            last_eviction_s=owner.evicted_at(lambda: self.store.list_instances(job.job_id)),
            lag_reserve_s=max(owner.lag_reserve_s(now_s), self._ticks.reserve_s(now_s)),
        )
        decision = policy.decide(inp)
        owner.decided(now_s)
        report.decisions[job.job_id] = decision
        self._record_prices(owner, table.markets, prices, now_s)
        self._log(
            DecisionEvent(
                job_id=job.job_id,
                at_s=now_s,
                spent_usd=inp.spend_usd,
                work_done_gpu_hours=job.work_done_gpu_hours,
                expected_cost_per_work=_finite(decision.expected_cost_per_work),
                projected_cost_usd=_finite(decision.projected_cost_usd),
                projected_finish_at=_finite(decision.projected_finish_s),
                acquire=tuple(f"{r.count}x{r.instance_type}@{r.zone}" for r in decision.acquire),
                release=decision.release,
                reason=decision.reason,
            )
        )
        released = set(decision.release)
        for rec in alive:
            if rec.allocation_id in released:
                self._terminate(rec, history, now_s, EndReason.RELEASED, report)
        for request in decision.acquire:
            self._launch(job, request, now_s, report)
        if decision.budget_exhausted:
            # Nothing may bill past the budget: the reliable tier goes too. (Once the AgileML
            # runtime lands, it saves the model from the reliable tier before this.)
            self._stop_job(job, history, now_s, EndReason.RELEASED, report)
            self._finish(job, JobState.BUDGET_EXHAUSTED, now_s, decision.reason, report)

    def _record_prices(
        self, owner: ControllerJob, markets: Sequence[Market], prices: np.ndarray, now_s: float
    ) -> None:
        """Keep the prices the job's decision saw for the dashboard, when any changed."""
        seen = {str(m): float(p) for m, p in zip(markets, prices, strict=True) if np.isfinite(p)}
        if owner.prices_changed(seen):
            self.store.append_prices(owner.job_id, PriceSnapshot(at_s=now_s, prices=seen))

    def _launch(
        self, job: JobRecord, request: AllocationRequest, now_s: float, report: TickReport
    ) -> None:
        allocation_id = f"{job.job_id}-{int(now_s)}-{request.instance_type}-{request.zone}"
        spec = LaunchSpec.from_request(
            request,
            job_id=job.job_id,
            allocation_id=allocation_id,
            image_id=self.image_id,
            extra_tags=dict(self.training.tags_for(job.job_id)) if self.training else {},
        )
        try:
            instances = self.cloud.launch(spec)
        except CloudError as exc:
            if isinstance(exc, CapacityError):  # plan around the market for a while
                self.availability.mark(request.market, exc.code, now_s)
            report.launch_failures.append(f"{request.market}: {exc.code}")
            self._log(
                LaunchFailedEvent(
                    job_id=job.job_id, at_s=now_s, code=exc.code, market=str(request.market)
                )
            )
            return
        for inst in instances:
            self._record_launch(inst, now_s)
            report.launched.append(inst.instance_id)
            self._log(
                LaunchEvent(
                    job_id=job.job_id,
                    at_s=now_s,
                    instance_id=inst.instance_id,
                    instance_type=inst.instance_type,
                    zone=inst.zone,
                    lifecycle=inst.lifecycle,
                    max_price_usd_per_hour=inst.max_price_usd_per_hour,
                )
            )

    def _stop_job(
        self,
        job: JobRecord,
        history: PriceHistory,
        now_s: float,
        reason: EndReason,
        report: TickReport,
    ) -> None:
        alive = self.store.list_instances(job.job_id, alive_only=True)
        if alive and self.training is not None:
            try:
                self.training.save_final(job.job_id)
            except Exception:  # noqa: BLE001 - the instances must go whatever it did
                log.exception("saving the final weights failed", extra={"job_id": job.job_id})
        for rec in alive:
            self._terminate(rec, history, now_s, reason, report)

    def _finish_done(
        self,
        job: JobRecord,
        training: TrainingOutcome | None,
        work_gpu_hours: float,
        now_s: float,
        report: TickReport,
    ) -> None:
        """End a job whose work is done: succeeded; a training job as `TrainingGate.done`."""
        if training is None or self._gate is None:
            self._finish(job, JobState.SUCCEEDED, now_s, "all work done", report)
            return
        if job.work_done_gpu_hours < work_gpu_hours:
            # trained to the end: its work is done, though the last report may lag
            self.store.update_progress(job.job_id, work_gpu_hours, now_s)
        state, message = self._gate.done(job, training)
        self._finish(job, state, now_s, message, report)

    def _finish(
        self, job: JobRecord, state: JobState, now_s: float, message: str, report: TickReport
    ) -> None:
        self._transition(job, state, now_s, message)
        report.finished[job.job_id] = state
        self._jobs.pop(job.job_id, None)  # and with it all the controller kept of the job
        self.store.record_accrued(job.job_id, {}, now_s)  # its instances are all billed now

    # -- records ----------------------------------------------------------------------------
    def _record_launch(self, inst: CloudInstance, now_s: float) -> None:
        self.store.put_instance(
            InstanceRecord(
                instance_id=inst.instance_id,
                job_id=inst.job_id or "",
                allocation_id=inst.allocation_id or "",
                instance_type=inst.instance_type,
                zone=inst.zone,
                lifecycle=inst.lifecycle,
                max_price_usd_per_hour=inst.max_price_usd_per_hour,
                launched_at=now_s,
                state=str(inst.state),
            )
        )

    def _terminate(
        self,
        rec: InstanceRecord,
        history: PriceHistory,
        now_s: float,
        reason: EndReason,
        report: TickReport,
        detail: str = "",
    ) -> None:
        self.cloud.terminate([rec.instance_id])
        self._end(rec, history, now_s, reason)
        report.terminated.append(rec.instance_id)
        self._log(ReleaseEvent(job_id=rec.job_id, at_s=now_s, instance_id=rec.instance_id,
                               reason=str(reason), detail=detail))  # fmt: skip

    def _end(
        self, rec: InstanceRecord, history: PriceHistory, now_s: float, reason: EndReason
    ) -> InstanceRecord:
        """Bill the instance's whole life and mark it ended, in one atomic store write (a
        crash in between would leave half a bill that a later, longer one conflicts with);
        the record as stored now (its first end and bill stand)."""
        end = max(now_s, rec.launched_at)
        bill = [
            LedgerEntry.from_interval(
                interval,
                job_id=rec.job_id,
                instance_id=rec.instance_id,
                instance_type=rec.instance_type,
                zone=rec.zone,
            )
            for interval in self._bill(rec, history, end, reason)
        ]
        try:
            ended = self.store.end_instance(rec.instance_id, end, str(reason), bill)
        except LedgerConflictError:
            # half a bill from before bills were atomic: the charges recorded stand (the job
            # is not charged twice); the instance must end, or every tick would fail here
            log.error("instance's bill conflicts with its recorded charges; ended without it",
                      extra={"instance_id": rec.instance_id, "job_id": rec.job_id})  # fmt: skip
            ended = self.store.end_instance(rec.instance_id, end, str(reason))
        self._doomed.discard(rec.instance_id)
        return ended

    def _bill(
        self, rec: InstanceRecord, history: PriceHistory, end_s: float, reason: EndReason
    ) -> list:
        market = Market(rec.instance_type, rec.zone)
        if rec.lifecycle == "on-demand":
            price = self.catalog.get(rec.instance_type).on_demand_price(market.region)
            return self.billing.bill_on_demand(price, rec.launched_at, end_s, reason)
        series = self.prices.history(
            rec.launched_at - PRICE_LOOKBACK_S,
            end_s,
            instance_types=[rec.instance_type],
            zones=[rec.zone],
        )
        return self.billing.bill_spot(series[market], rec.launched_at, end_s, reason)

    def _accrued(
        self, alive: Sequence[InstanceRecord], history: PriceHistory, now_s: float
    ) -> dict[str, float]:
        """What each alive instance has cost so far (not yet in the ledger)."""
        accrued = {}
        for rec in alive:
            market = Market(rec.instance_type, rec.zone)
            if rec.lifecycle == "on-demand":
                price = self.catalog.get(rec.instance_type).on_demand_price(market.region)
                accrued[rec.instance_id] = (
                    price * max(now_s - rec.launched_at, 0.0) / SECONDS_PER_HOUR
                )
            elif market in history:
                accrued[rec.instance_id] = history[market].cost_usd(rec.launched_at, now_s)
        return accrued

    def _held(self, alive: Sequence[InstanceRecord], spec: JobSpec) -> list[HeldInstance]:
        """The job's alive instances as a decision sees them (ready σ after launch)."""
        return [
            HeldInstance(
                instance_id=rec.instance_id,
                allocation_id=rec.allocation_id,
                market=Market(rec.instance_type, rec.zone),
                reliable=rec.lifecycle == "on-demand",
                work_rate=self.catalog.work_rate(rec.instance_type, spec.gpu_work_rates),
                max_price_usd_per_hour=rec.max_price_usd_per_hour,
                launched_s=rec.launched_at,
                ready_s=rec.launched_at + spec.app.add_overhead_s,
            )
            for rec in alive
        ]

    def _transition(self, job: JobRecord, state: JobState, now_s: float, message: str) -> JobRecord:
        updated = self.store.transition(
            job.job_id, state, expected_version=job.version, now_s=now_s, message=message
        )
        self._log(
            StateEvent(
                job_id=job.job_id, at_s=now_s, state=state, from_state=job.state, message=message
            )
        )
        return updated

    def _log(self, event: Event) -> None:
        self.store.append_event(event)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
