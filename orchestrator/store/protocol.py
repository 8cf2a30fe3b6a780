"""`Store`: what the controller, the API and the training host may ask of the durable state.

Two implementations keep this contract: `RedisStore` (production: survives the controller) and
`MemoryStore` (tests: one process, nothing persisted). The contract tests
(`tests/support/store_contract/`, run on `MemoryStore` from `tests/unit/store/` and on
`RedisStore` from `tests/integration/store/`) check that they behave alike.

Failure semantics, for every implementation:

* Each write is atomic: applied whole or not at all, and concurrent callers (threads, or
  controllers sharing a Redis) never see half of one.
* Nothing is retried behind the caller's back. A store that cannot be reached raises
  `StoreUnavailableError` (only `RedisStore` can); a write whose reply was lost may or may not
  have been applied. Every write is therefore either version-checked (`transition`: a replay
  raises `ConflictError`) or idempotent (`create_job`, `append_ledger`, `put_instance`,
  `end_instance`, `update_progress`), so re-reading tells which. The dashboard's series
  (`append_prices`, `append_training`) and the event log are neither: a repeated append only
  draws a point twice.
* Records returned are snapshots: changing the store later does not change them.
* Ids: job and instance ids match `models.RecordId`; an id that cannot match names no record,
  so reading or writing through one raises `NotFoundError` (never a `ValueError`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from orchestrator.store.events import Event
from orchestrator.store.models import (
    InstanceRecord,
    InstanceWork,
    JobRecord,
    JobState,
    LedgerEntry,
    PriceSnapshot,
    TrainingReport,
)

#: Events kept per job; older ones are trimmed (`RedisStore` trims approximately, keeping at
#: least this many; `MemoryStore` keeps exactly this many).
EVENTS_MAXLEN = 100_000
#: Entries kept of each dashboard series of a job (prices, training reports); trimmed like events.
SERIES_MAXLEN = 5_000
#: The prefix of every key (`RedisStore`) and of the keys errors name (both).
DEFAULT_NAMESPACE = "orchestrator"


@runtime_checkable
class Store(Protocol):
    """Jobs, instances, the spend ledger, event logs, dashboard series and launch claims.

    Thread-safe: the API and the controller share one store across threads.

    Every method may raise `StoreUnavailableError` (the backing service cannot be reached) and
    `StoreError` (it refused a command, or a stored record is corrupt); the other errors are
    listed per method.
    """

    def ping(self) -> None:
        """Check that the store answers.

        Raises:
            StoreUnavailableError: it does not.
        """
        ...

    def close(self) -> None:
        """Let go of connections. What was written stays written."""
        ...

    # --- jobs

    def create_job(self, record: JobRecord) -> JobRecord:
        """Store a new job as given (normally `JobRecord.submit(...)`: queued, version 0).

        Atomic with its entry in the job list. Spend enters only through `append_ledger`, so
        `record.spent_usd` must be 0.

        Returns:
            `record`.

        Raises:
            ConflictError: a job with this id exists (`expected_version` None, `actual_version`
                the existing one's; the existing job is unchanged).
            ValueError: `record.spent_usd` is not 0.
        """
        ...

    def get_job(self, job_id: str) -> JobRecord:
        """The job as stored now.

        Raises:
            NotFoundError: no such job.
        """
        ...

    def list_jobs(self, states: Iterable[JobState | str] | None = None) -> list[JobRecord]:
        """All jobs (or those in `states`; `[]` selects none), oldest submission first (ties by
        id).

        Each record is read atomically; the list as a whole is not one snapshot.

        Raises:
            ValueError: a state in `states` is not a `JobState`.
        """
        ...

    def transition(
        self,
        job_id: str,
        to_state: JobState | str,
        *,
        expected_version: int,
        now_s: float,
        message: str = "",
    ) -> JobRecord:
        """Move a job to `to_state` if it is still at `expected_version`; bump its version by 1.

        One atomic check-and-set: of concurrent calls made with the same version, exactly one
        succeeds. Sets `updated_at` to `now_s` and `message`; nothing else changes.

        Returns:
            The job as it is now.

        Raises:
            ValueError: `to_state` is not a `JobState` (checked before anything is read).
            NotFoundError: no such job.
            ConflictError: the job's version is not `expected_version` (checked first: a
                stale caller's idea of the current state is not judged).
            IllegalTransitionError: `ALLOWED_TRANSITIONS` has no edge from the current state
                to `to_state`. The refusal is logged (a warning with `job_id`, `from_state`,
                `to_state` and `at_s`); the record is unchanged.
        """
        ...

    def update_progress(self, job_id: str, work_done_gpu_hours: float, now_s: float) -> JobRecord:
        """Record the job's work done so far (and `updated_at = now_s`); last writer wins.

        Does not change `version`, so it never makes a concurrent `transition` fail. A job in a
        terminal state is left as it is (an ended job's numbers do not change: a late report
        from a worker that had not yet stopped is dropped).

        Returns:
            The job as it is now.

        Raises:
            ValueError: `work_done_gpu_hours` is negative or not finite (checked first).
            NotFoundError: no such job.
        """
        ...

    # --- ledger

    def append_ledger(self, entry: LedgerEntry) -> bool:
        """Append a charge to the job's ledger and add it to the job's `spent_usd`, atomically.

        A crash never leaves the entry without the spend or the spend without the entry. An
        entry is identified by (`instance_id`, `start_s`); appending the same entry again (a
        restarted controller replaying its last bill) changes nothing and returns False.
        `spent_usd` does not change `version`.

        Returns:
            True if the entry was recorded, False if it already was.

        Raises:
            NotFoundError: no such job (nothing recorded).
            LedgerConflictError: a different entry with the same identity is recorded (nothing
                recorded).
        """
        ...

    def ledger(self, job_id: str) -> list[LedgerEntry]:
        """The job's charges in append order.

        Raises:
            NotFoundError: no such job.
        """
        ...

    def spent_usd(self, job_id: str) -> float:
        """The job's total spend: the sum of its ledger (up to float rounding), as
        `get_job(job_id).spent_usd`.

        Raises:
            NotFoundError: no such job.
        """
        ...

    def record_accrued(self, job_id: str, accrued: Mapping[str, float], at_s: float) -> None:
        """Record what each of the job's alive instances has run up and is not billed yet
        (instance id -> USD, as of `at_s`; the controller writes it every tick). Replaces
        the previous record.

        Raises:
            NotFoundError: `job_id` cannot be a job's id.
        """
        ...

    def live_spend_usd(self, job_id: str) -> float:
        """What the job has cost so far: its ledger plus what its alive instances had run up
        at the last `record_accrued` (instances ended since are in the ledger instead; one
        consistent read, so nothing counts twice or not at all).

        Raises:
            NotFoundError: no such job.
        """
        ...

    # --- instances

    def put_instance(self, rec: InstanceRecord) -> InstanceRecord:
        """Create or overwrite an instance's record, atomically with the alive lists.

        The job need not exist. Use `end_instance` to end one; putting an ended record also
        ends it.

        Returns:
            `rec`.

        Raises:
            IllegalTransitionError: the stored instance has ended and `rec` is alive (an ended
                instance never comes back; `from_state` is the stored state; the record is
                unchanged).
            StoreError: the stored instance belongs to another job (the record is unchanged).
        """
        ...

    def end_instance(
        self,
        instance_id: str,
        ended_at: float,
        reason: str,
        bill: Sequence[LedgerEntry] = (),
    ) -> InstanceRecord:
        """Mark an instance ended (state `INSTANCE_ENDED`, `ended_at`, `end_reason = reason`),
        drop it from the alive lists and append `bill` (its life's charges, as
        `append_ledger` would, to the instance's job) in one atomic step: a crash leaves the
        instance either alive and unbilled or ended and billed, so the bill a restarted
        controller computes later (with a later end) never meets half of an earlier one.

        Idempotent: if it has already ended, the first end (and its bill) stands and the stored
        record is returned unchanged (`ended_at` and `bill` are then not used).

        Returns:
            The instance as it is now.

        Raises:
            NotFoundError: no such instance, or (with a bill) no such job (nothing changed).
            LedgerConflictError: an entry of `bill` differs from one recorded under its
                identity (nothing changed).
            ValueError: `ended_at` is before the instance's `launched_at`, or an entry is
                another job's (nothing changed).
        """
        ...

    def get_instance(self, instance_id: str) -> InstanceRecord:
        """The instance as stored now.

        Raises:
            NotFoundError: no such instance.
        """
        ...

    def list_instances(
        self, job_id: str | None = None, *, alive_only: bool = False
    ) -> list[InstanceRecord]:
        """Instances of one job (or of all jobs), optionally only those not ended; oldest launch
        first (ties by id). An unknown job has none.

        Raises:
            NotFoundError: `job_id` cannot be a job id.
        """
        ...

    # --- events

    def append_event(self, event: Event) -> str:
        """Append to the job's event log (the job need not exist; the log keeps at least the
        newest `EVENTS_MAXLEN`).

        Returns:
            The new entry's id: `"<ms>-<seq>"`, decimal integers, greater (as the pair) than
            every earlier id of the job's log. Pass it as `since_id` to read what follows.
        """
        ...

    def events(
        self, job_id: str, since_id: str = "-", count: int | None = None
    ) -> list[tuple[str, Event]]:
        """The job's events with their ids, oldest first: all of them (`since_id` "-"), or
        those strictly after `since_id` (`"<ms>-<seq>"`, or `"<ms>"` meaning `"<ms>-0"`).

        At most `count` of them when given. An unknown job has no events.

        Raises:
            ValueError: `count` is not positive.
            StoreError: `since_id` is not an id.
        """
        ...

    # --- series for the dashboard: prices considered, training reports

    def append_prices(self, job_id: str, snapshot: PriceSnapshot) -> str:
        """Append a price snapshot to the job's series (keeping at least the newest
        `SERIES_MAXLEN`). Returns its id, as `append_event`."""
        ...

    def prices(self, job_id: str) -> list[PriceSnapshot]:
        """The job's price snapshots, oldest first (an unknown job has none)."""
        ...

    def latest_prices(self, job_id: str) -> PriceSnapshot | None:
        """The job's newest price snapshot, or None (one read, for /metrics)."""
        ...

    def append_training(self, job_id: str, report: TrainingReport) -> str:
        """Append a training report to the job's series (keeping at least the newest
        `SERIES_MAXLEN`). Returns its id, as `append_event`."""
        ...

    def training(self, job_id: str) -> list[TrainingReport]:
        """The job's training reports, oldest first (an unknown job has none)."""
        ...

    def latest_training(self, job_id: str) -> TrainingReport | None:
        """The job's newest training report, or None (one read, for summaries and /metrics)."""
        ...

    # --- each instance's measured work (BidBrain learns the job's rates from it)

    def record_instance_work(self, job_id: str, work: Mapping[str, InstanceWork]) -> None:
        """Record each instance's work for the job so far (instance id -> its work and useful
        hours: the instance agents' count offline, the runtime's on AWS). Overwrites those
        instances' values; others stay.

        Raises:
            NotFoundError: `job_id` cannot be a job's id.
        """
        ...

    def instance_work(self, job_id: str) -> dict[str, InstanceWork]:
        """Instance id -> its work for the job, as last recorded."""
        ...

    # --- the AgileML controllers this controller hosts (controller/training.py)

    def set_training_port(self, job_id: str, port: int) -> None:
        """Remember the port the job's AgileML controller listens on (its workers' tags name
        it), so that a restarted controller hosts it there again. Overwrites."""
        ...

    def training_ports(self) -> dict[str, int]:
        """Job id -> the port of its hosted AgileML controller."""
        ...

    def forget_training_port(self, job_id: str) -> None:
        """Forget the job's port (nothing happens if none is remembered)."""
        ...

    # --- the clock's high-water mark

    def advance_clock(self, now_s: float) -> float:
        """Raise the controller clock's high-water mark to `now_s` if it is higher; return
        the mark (atomic: concurrent callers never lower it). A controller whose clock reads
        below the mark is behind what was already decided and billed (see
        `controller.clock`).

        Raises:
            ValueError: `now_s` is not finite.
        """
        ...

    def clock_high_water(self) -> float | None:
        """The furthest time a controller of this store ticked at, None before the first."""
        ...

    # --- the fleet's controller: its id, and the lease one controller process holds

    def bind_controller_id(self, controller_id: str) -> str:
        """The id of the controller whose fleet this store records: set to `controller_id`
        the first time, never changed after (its instances are tagged with it). Returns the
        bound id (another controller's, when it differs)."""
        ...

    def acquire_lease(self, owner: str, ttl_s: float) -> int | None:
        """Take or renew the fleet's lease for `owner` for `ttl_s` seconds. Atomic: of
        concurrent callers one holds it. Returns its fencing token (a counter that rises with
        every new holder, kept while the holder renews), or None while someone else holds it.

        Raises:
            ValueError: `owner` is empty, or `ttl_s` is not positive and finite.
        """
        ...

    def lease_holder(self) -> tuple[str, int] | None:
        """Who holds the fleet's lease now, with its fencing token; None: no one."""
        ...

    def release_lease(self, owner: str) -> bool:
        """Give the lease up if `owner` holds it (a standby takes over at once)."""
        ...

    # --- claims

    def claim(self, key: str, owner: str, ttl_s: float) -> bool:
        """Take the claim `key` for `owner` for `ttl_s` seconds unless someone holds it.

        E.g. claim `launch:{job_id}:{allocation_id}` before asking the cloud for instances, so
        that a restarted controller does not launch them again while the first launch is in
        flight. Atomic: of concurrent claims, one wins. Even the holder cannot claim it again
        until it is released or expires. The TTL is kept in whole milliseconds (at least 1).

        Returns:
            True if `owner` now holds it, False if it was already held.

        Raises:
            ValueError: `key` or `owner` is empty, or `ttl_s` is not positive and finite.
        """
        ...

    def release_claim(self, key: str, owner: str) -> bool:
        """Release `key` if `owner` still holds it (atomic compare-and-delete).

        Returns:
            True if released; False if it was not held by `owner` (expired, or someone else's).
        """
        ...

    def claim_owner(self, key: str) -> str | None:
        """Who holds `key` now, or None."""
        ...
