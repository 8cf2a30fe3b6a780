"""`Store`: the controller's durable state in Redis.

The key layout and the Lua scripts are in `redis_scripts`; JSON encoding, decoding and the
mapping of redis-py's errors in `redis_codec`.

Failure semantics:

* Each write is one atomic Redis step (a Lua script or a MULTI/EXEC transaction): Redis applies
  all of it or none of it, so a controller killed at any moment never leaves half a write.
* Nothing is retried. The client is built with no retries (redis-py retries by default), because
  a retried write whose first attempt did land would apply twice. A Redis that cannot be reached
  raises `StoreUnavailableError` within `timeout_s`.
* A write whose reply was lost (timeout) may or may not have been applied. Every write is either
  version-checked (`transition`: a replay raises `ConflictError`) or idempotent (`create_job`,
  `append_ledger`, `put_instance`, `end_instance`, `update_progress`), so re-reading after Redis
  is back tells which. The dashboard's series (`append_prices`, `append_training`) are neither:
  a lost reply may leave a repeated point, which only draws twice.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any, TypeVar, cast

import redis
from pydantic import BaseModel
from redis.backoff import NoBackoff
from redis.retry import Retry

from orchestrator.store.checks import (
    check_count,
    check_id,
    check_namespace,
    check_new_job,
    check_work_done,
    claim_ttl_ms,
    ended_record,
    ledger_identity,
    refused_transition,
)
from orchestrator.store.errors import (
    ConflictError,
    IllegalTransitionError,
    LedgerConflictError,
    NotFoundError,
    StoreError,
    StoreUnavailableError,
)
from orchestrator.store.events import Event, event_json
from orchestrator.store.models import (
    INSTANCE_ENDED,
    InstanceRecord,
    JobRecord,
    JobState,
    LedgerEntry,
    PriceSnapshot,
    TrainingReport,
    allowed_sources,
)
from orchestrator.store.redis_codec import (
    decode_event,
    decode_hash,
    decode_json,
    describe_client,
    enc,
    encode_fields,
    flat,
    pairs,
    redact_url,
    redis_errors,
)
from orchestrator.store.redis_scripts import RedisKeys, Scripts

logger = logging.getLogger(__name__)

#: Events kept per job; older ones are trimmed (approximately: `MAXLEN ~`, which is cheap).
EVENTS_MAXLEN = 100_000
#: Entries kept of each dashboard series of a job (prices, training reports).
SERIES_MAXLEN = 5_000
DEFAULT_NAMESPACE = "orchestrator"
DEFAULT_TIMEOUT_S = 2.0  # connect and per-command socket timeout: a dead Redis fails fast

M = TypeVar("M", bound=BaseModel)


class Store:
    """Jobs, instances, the spend ledger, event logs and launch claims, kept in Redis.

    Thread-safe (redis-py's client and connection pool are). Records returned are snapshots.

    Every method raises `StoreUnavailableError` when Redis cannot be reached and `StoreError`
    when it refuses a command; the others are listed per method.
    """

    def __init__(
        self, client: redis.Redis, namespace: str = DEFAULT_NAMESPACE, *, url: str | None = None
    ) -> None:
        """Wrap a client built with `decode_responses=True` (use `connect` to build one).

        `url` names the server in error messages (derived from the client when omitted).
        """
        kwargs = client.get_connection_kwargs()
        if not kwargs.get("decode_responses"):
            raise ValueError("the Redis client must be built with decode_responses=True")
        self._client = client
        self.namespace = check_namespace(namespace)
        self.url = redact_url(url) if url is not None else describe_client(kwargs)
        self._keys = RedisKeys(namespace)
        self._scripts = Scripts.register(client)

    @classmethod
    def connect(
        cls,
        url: str,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> Store:
        """Connect to the Redis at `url` and check that it answers.

        The client never retries and gives up on any command after `timeout_s`.

        Raises:
            StoreUnavailableError: `url` is malformed, or Redis did not answer PING in time.
        """
        try:
            client = redis.Redis.from_url(
                url,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0),
                decode_responses=True,
            )
        except ValueError as exc:
            raise StoreUnavailableError(redact_url(url), f"not a Redis URL ({exc})") from exc
        store = cls(client, namespace, url=url)
        try:
            store.ping()
        except StoreError:
            client.close()
            raise
        return store

    def close(self) -> None:
        """Close the client's connections."""
        self._client.close()

    def ping(self) -> None:
        """Check that Redis answers.

        Raises:
            StoreUnavailableError: it does not.
        """
        with redis_errors(self.url):
            self._client.ping()

    # --- jobs

    def create_job(self, record: JobRecord) -> JobRecord:
        """Store a new job as given (normally `JobRecord.submit(...)`: queued, version 0).

        Atomic with its entry in the jobs index. Spend enters only through `append_ledger`,
        so `record.spent_usd` must be 0.

        Raises:
            ConflictError: a job with this id exists (the existing one is unchanged).
            ValueError: `record.spent_usd` is not 0.
        """
        check_new_job(record)
        key = self._keys.job(record.job_id)
        with redis_errors(self.url):
            result = self._scripts.create_job(
                keys=[key, self._keys.jobs()], args=[record.job_id, *flat(encode_fields(record))]
            )
        if result[0] == "exists":
            raise ConflictError(key, None, int(result[1]))
        return record

    def get_job(self, job_id: str) -> JobRecord:
        """The job as stored now.

        Raises:
            NotFoundError: no such job.
        """
        key = self._keys.job(job_id)
        with redis_errors(self.url):
            raw = cast(dict[str, str], self._client.hgetall(key))
        if not raw:
            raise NotFoundError("job", job_id)
        return decode_hash(JobRecord, key, raw)

    def list_jobs(self, states: Iterable[JobState | str] | None = None) -> list[JobRecord]:
        """All jobs (or those in `states`), oldest submission first.

        Each record is read atomically; the list as a whole is not one snapshot.
        """
        wanted = None if states is None else {JobState(s) for s in states}
        with redis_errors(self.url):
            ids = sorted(cast(set[str], self._client.smembers(self._keys.jobs())))
            jobs = self._read_hashes(JobRecord, [self._keys.job(job_id) for job_id in ids])
        if wanted is not None:
            jobs = [j for j in jobs if j.state in wanted]
        return sorted(jobs, key=lambda j: (j.submitted_at, j.job_id))

    def transition(
        self,
        job_id: str,
        to_state: JobState | str,
        *,
        expected_version: int,
        now_s: float,
        message: str = "",
    ) -> JobRecord:
        """Move a job to `to_state` if it is still at `expected_version`; bump its version.

        One atomic check-and-set (Lua): of concurrent calls made with the same version, exactly
        one succeeds. Sets `updated_at` to `now_s` and `message`.

        Raises:
            NotFoundError: no such job.
            ConflictError: the job's version is not `expected_version` (checked first: a
                stale caller's idea of the current state is not judged).
            IllegalTransitionError: `ALLOWED_TRANSITIONS` has no edge from the current state
                to `to_state`. The refusal is logged; the record is unchanged.
            ValueError: `to_state` is not a `JobState`.
        """
        target = JobState(to_state)
        key = self._keys.job(job_id)
        sources = sorted(enc(s.value) for s in allowed_sources(target))
        args = [str(expected_version), enc(target.value), enc(now_s), enc(message), *sources]
        with redis_errors(self.url):
            result = self._scripts.transition(keys=[key], args=args)
        status = result[0]
        if status == "missing":
            raise NotFoundError("job", job_id)
        if status == "conflict":
            raise ConflictError(key, expected_version, int(result[1]))
        if status == "illegal":
            from_state = json.loads(result[2])
            raise refused_transition(logger, job_id, from_state, target.value, now_s)
        return decode_hash(JobRecord, key, pairs(result[1:]))

    def update_progress(self, job_id: str, work_done_gpu_hours: float, now_s: float) -> JobRecord:
        """Record the job's work done so far (and `updated_at = now_s`); last writer wins.

        Does not change `version`, so it never makes a concurrent `transition` fail.

        Raises:
            NotFoundError: no such job.
            ValueError: `work_done_gpu_hours` is negative or not finite.
        """
        work = check_work_done(work_done_gpu_hours)
        key = self._keys.job(job_id)
        with redis_errors(self.url):
            result = self._scripts.update_progress(keys=[key], args=[enc(work), enc(now_s)])
        if result[0] == "missing":
            raise NotFoundError("job", job_id)
        return decode_hash(JobRecord, key, pairs(result[1:]))

    # --- ledger

    def append_ledger(self, entry: LedgerEntry) -> bool:
        """Append a charge to the job's ledger and add it to the job's `spent_usd`, atomically.

        One Lua script (atomic like MULTI/EXEC, and able to check first): a crash never leaves
        the entry without the spend or the spend without the entry. An entry is identified by
        (`instance_id`, `start_s`); appending the same entry again (a restarted controller
        replaying its last bill) changes nothing and returns False.

        Returns:
            True if the entry was recorded, False if it already was.

        Raises:
            NotFoundError: no such job (nothing recorded).
            LedgerConflictError: a different entry with the same identity is recorded.
        """
        keys = [
            self._keys.job(entry.job_id),
            self._keys.job_part(entry.job_id, "ledger"),
            self._keys.job_part(entry.job_id, "ledger-index"),
        ]
        args = [ledger_identity(entry), entry.model_dump_json(), repr(entry.charged_usd)]
        with redis_errors(self.url):
            status = self._scripts.append_ledger(keys=keys, args=args)[0]
        if status == "missing":
            raise NotFoundError("job", entry.job_id)
        if status == "different":
            raise LedgerConflictError(entry.job_id, entry.instance_id, entry.start_s)
        return bool(status == "ok")

    def ledger(self, job_id: str) -> list[LedgerEntry]:
        """The job's charges in append order.

        Raises:
            NotFoundError: no such job.
        """
        key = self._keys.job_part(job_id, "ledger")
        with redis_errors(self.url):
            pipe = self._client.pipeline(transaction=True)
            pipe.exists(self._keys.job(job_id))
            pipe.lrange(key, 0, -1)
            exists, lines = cast(list[Any], pipe.execute())
        if not exists:
            raise NotFoundError("job", job_id)
        return [decode_json(LedgerEntry, key, line) for line in lines]

    def spent_usd(self, job_id: str) -> float:
        """The job's total spend: the sum of its ledger.

        Raises:
            NotFoundError: no such job.
        """
        with redis_errors(self.url):
            raw = cast(str | None, self._client.hget(self._keys.job(job_id), "spent_usd"))
        if raw is None:
            raise NotFoundError("job", job_id)
        return float(raw)

    # --- instances

    def put_instance(self, rec: InstanceRecord) -> InstanceRecord:
        """Create or overwrite an instance's record and keep the alive indexes in step.

        Atomic (Lua). Use `end_instance` to end one; putting an ended record also ends it.

        Raises:
            IllegalTransitionError: the stored instance has ended and `rec` is alive (an ended
                instance never comes back; the record is unchanged).
            StoreError: the stored instance belongs to another job.
        """
        keys = [
            self._keys.instance(rec.instance_id),
            self._keys.instances(),
            self._keys.instances(alive_only=True),
            self._keys.instances(rec.job_id),
            self._keys.instances(rec.job_id, alive_only=True),
        ]
        alive = "1" if rec.alive else "0"
        args = [rec.instance_id, enc(rec.job_id), alive, *flat(encode_fields(rec))]
        with redis_errors(self.url):
            result = self._scripts.put_instance(keys=keys, args=args)
        if result[0] == "other_job":
            raise StoreError(
                f"instance {rec.instance_id!r} belongs to job {json.loads(result[1])!r}, "
                f"not {rec.job_id!r}"
            )
        if result[0] == "ended":
            raise IllegalTransitionError(rec.job_id, json.loads(result[1]), rec.state)
        return rec

    def end_instance(self, instance_id: str, ended_at: float, reason: str) -> InstanceRecord:
        """Mark an instance ended (state `"ended"`) and drop it from the alive indexes.

        Atomic (Lua) and idempotent: if it has already ended, the first end stands and the
        stored record is returned unchanged.

        Raises:
            NotFoundError: no such instance.
            ValueError: `ended_at` is before the instance's `launched_at`.
        """
        current = self.get_instance(instance_id)
        if not current.alive:
            return current
        ended_record(current, ended_at, reason)  # validates before anything is written
        key = self._keys.instance(instance_id)
        keys = [
            key,
            self._keys.instances(alive_only=True),
            self._keys.instances(current.job_id, alive_only=True),
        ]
        args = [instance_id, enc(ended_at), enc(reason), enc(INSTANCE_ENDED)]
        with redis_errors(self.url):
            result = self._scripts.end_instance(keys=keys, args=args)
        if result[0] == "missing":
            raise NotFoundError("instance", instance_id)
        return decode_hash(InstanceRecord, key, pairs(result[1:]))

    def get_instance(self, instance_id: str) -> InstanceRecord:
        """The instance as stored now.

        Raises:
            NotFoundError: no such instance.
        """
        key = self._keys.instance(instance_id)
        with redis_errors(self.url):
            raw = cast(dict[str, str], self._client.hgetall(key))
        if not raw:
            raise NotFoundError("instance", instance_id)
        return decode_hash(InstanceRecord, key, raw)

    def list_instances(
        self, job_id: str | None = None, *, alive_only: bool = False
    ) -> list[InstanceRecord]:
        """Instances of one job (or of all jobs), optionally only those not ended; oldest first."""
        index = self._keys.instances(job_id, alive_only=alive_only)
        with redis_errors(self.url):
            ids = sorted(cast(set[str], self._client.smembers(index)))
            records = self._read_hashes(InstanceRecord, [self._keys.instance(i) for i in ids])
        return sorted(records, key=lambda r: (r.launched_at, r.instance_id))

    # --- events

    def append_event(self, event: Event) -> str:
        """Append to the job's event stream (XADD, trimmed to about `EVENTS_MAXLEN`).

        Returns:
            The stream id of the new entry (pass it as `since_id` to read what follows).
        """
        key = self._keys.job_part(event.job_id, "events")
        with redis_errors(self.url):
            return cast(
                str,
                self._client.xadd(
                    key, {"event": event_json(event)}, maxlen=EVENTS_MAXLEN, approximate=True
                ),
            )

    def events(
        self, job_id: str, since_id: str = "-", count: int | None = None
    ) -> list[tuple[str, Event]]:
        """The job's events, oldest first: all of them, or those strictly after `since_id`.

        At most `count` of them when given. An unknown job has no events.

        Raises:
            StoreError: `since_id` is not a stream id.
        """
        check_count(count)
        key = self._keys.job_part(job_id, "events")
        start = "-" if since_id == "-" else f"({since_id}"
        with redis_errors(self.url):
            entries = cast(
                list[tuple[str, dict[str, str]]],
                self._client.xrange(key, min=start, max="+", count=count),
            )
        return [(entry_id, decode_event(key, fields["event"])) for entry_id, fields in entries]

    # --- series for the dashboard: prices considered, training reports

    def append_prices(self, job_id: str, snapshot: PriceSnapshot) -> str:
        """Append a price snapshot to the job's series (trimmed to about `SERIES_MAXLEN`)."""
        return self._append_series(job_id, "prices", snapshot)

    def prices(self, job_id: str) -> list[PriceSnapshot]:
        """The job's price snapshots, oldest first (an unknown job has none)."""
        return self._series(job_id, "prices", PriceSnapshot)

    def append_training(self, job_id: str, report: TrainingReport) -> str:
        """Append a training report to the job's series (trimmed to about `SERIES_MAXLEN`)."""
        return self._append_series(job_id, "training", report)

    def training(self, job_id: str) -> list[TrainingReport]:
        """The job's training reports, oldest first (an unknown job has none)."""
        return self._series(job_id, "training", TrainingReport)

    def latest_training(self, job_id: str) -> TrainingReport | None:
        """The job's newest training report (one read, for summaries and /metrics)."""
        return next(iter(self._series(job_id, "training", TrainingReport, newest=1)), None)

    def _append_series(self, job_id: str, name: str, record: BaseModel) -> str:
        key = self._keys.job_part(job_id, name)
        with redis_errors(self.url):
            return cast(
                str,
                self._client.xadd(
                    key, {"r": record.model_dump_json()}, maxlen=SERIES_MAXLEN, approximate=True
                ),
            )

    def _series(self, job_id: str, name: str, model: type[M], newest: int | None = None) -> list[M]:
        """The series oldest first; with `newest`, only that many of the latest, newest first."""
        key = self._keys.job_part(job_id, name)
        with redis_errors(self.url):
            raw = (
                self._client.xrange(key)
                if newest is None
                else self._client.xrevrange(key, count=newest)
            )
            entries = cast(list[tuple[str, dict[str, str]]], raw)
        return [decode_json(model, key, fields["r"]) for _, fields in entries]

    # --- the AgileML controllers this controller hosts (agileml/host.py)

    def set_training_port(self, job_id: str, port: int) -> None:
        """Remember the port the job's AgileML controller listens on (its workers' tags name
        it), so that a restarted controller hosts it there again."""
        with redis_errors(self.url):
            self._client.hset(self._keys.training_ports(), check_id("job", job_id), port)

    def training_ports(self) -> dict[str, int]:
        """Job id -> the port of its hosted AgileML controller."""
        with redis_errors(self.url):
            raw = cast(dict[str, str], self._client.hgetall(self._keys.training_ports()))
        return {job_id: int(port) for job_id, port in raw.items()}

    def forget_training_port(self, job_id: str) -> None:
        with redis_errors(self.url):
            self._client.hdel(self._keys.training_ports(), job_id)

    # --- claims

    def claim(self, key: str, owner: str, ttl_s: float) -> bool:
        """Take the claim `key` for `owner` for `ttl_s` seconds unless someone holds it.

        E.g. claim `launch:{job_id}:{allocation_id}` before asking the cloud for instances, so
        that a restarted controller does not launch them again while the first launch is in
        flight. SET NX PX: atomic. Even the holder cannot claim it again until it is released
        or expires.

        Returns:
            True if `owner` now holds it, False if it was already held.
        """
        ttl_ms = claim_ttl_ms(key, owner, ttl_s)
        with redis_errors(self.url):
            return bool(self._client.set(self._keys.claim(key), enc(owner), nx=True, px=ttl_ms))

    def release_claim(self, key: str, owner: str) -> bool:
        """Release `key` if `owner` still holds it (atomic compare-and-delete, Lua).

        Returns:
            True if released; False if it was not held by `owner` (expired, or someone else's).
        """
        with redis_errors(self.url):
            released = self._scripts.release_claim(keys=[self._keys.claim(key)], args=[enc(owner)])
        return bool(released)

    def claim_owner(self, key: str) -> str | None:
        """Who holds `key` now, or None."""
        with redis_errors(self.url):
            raw = cast(str | None, self._client.get(self._keys.claim(key)))
        return None if raw is None else str(json.loads(raw))

    # --- internals

    def _read_hashes(self, model: type[M], keys: list[str]) -> list[M]:
        """The records at `keys` (one round trip, not one snapshot); keys gone since are skipped.

        Call inside `redis_errors`.
        """
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(key)
        raws = cast(list[dict[str, str]], pipe.execute())
        return [decode_hash(model, key, raw) for key, raw in zip(keys, raws, strict=True) if raw]
