"""`Store`: the controller's durable state in Redis.

Layout (every key under `{namespace}:`; every value JSON, never pickle)::

    {ns}:jobs                              set of job ids
    {ns}:job:{job_id}                      hash, one JSON value per JobRecord field
    {ns}:job:{job_id}:ledger               list of LedgerEntry JSON, in append order
    {ns}:job:{job_id}:ledger-index         hash "{instance_id}@{start_s}" -> sha1 of the entry JSON
    {ns}:job:{job_id}:events               stream, one field "event" = Event JSON
    {ns}:job:{job_id}:prices|training      streams, one field "r" = PriceSnapshot or
                                           TrainingReport JSON (the dashboard's series)
    {ns}:job:{job_id}:instances[:alive]    sets of instance ids
    {ns}:instances[:alive]                 sets of instance ids, all jobs
    {ns}:instance:{instance_id}            hash, one JSON value per InstanceRecord field
    {ns}:claim:{key}                       string: the claim's owner (JSON), with a TTL

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
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar, cast
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
import redis.exceptions
from pydantic import BaseModel, ValidationError
from redis.backoff import NoBackoff
from redis.commands.core import Script
from redis.retry import Retry

from orchestrator.store.errors import (
    ConflictError,
    IllegalTransitionError,
    LedgerConflictError,
    NotFoundError,
    StoreError,
    StoreUnavailableError,
)
from orchestrator.store.events import Event, event_json, parse_event
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

logger = logging.getLogger(__name__)

#: Events kept per job; older ones are trimmed (approximately: `MAXLEN ~`, which is cheap).
EVENTS_MAXLEN = 100_000
#: Entries kept of each dashboard series of a job (prices, training reports).
SERIES_MAXLEN = 5_000
DEFAULT_NAMESPACE = "orchestrator"
DEFAULT_TIMEOUT_S = 2.0  # connect and per-command socket timeout: a dead Redis fails fast

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # as models.RecordId
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9._-]+$")

M = TypeVar("M", bound=BaseModel)

# --- Lua scripts. Each runs atomically. Redis does not roll a script back if a command in it
# fails, so each one checks everything first and does its writes last, the one most likely to
# fail (a type error on a corrupted key) first.

# KEYS: job hash, jobs index. ARGV: job id, then field, value, ...
_CREATE_JOB_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {'exists', redis.call('HGET', KEYS[1], 'version')}
end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('SADD', KEYS[2], ARGV[1])
return {'ok'}
"""

# KEYS: job hash. ARGV: expected version, state, updated_at, message, then the allowed sources.
_TRANSITION_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'missing'} end
local version = redis.call('HGET', KEYS[1], 'version')
local state = redis.call('HGET', KEYS[1], 'state')
if version ~= ARGV[1] then return {'conflict', version, state} end
local allowed = false
for i = 5, #ARGV do
  if ARGV[i] == state then allowed = true end
end
if not allowed then return {'illegal', version, state} end
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'version', tostring(tonumber(version) + 1),
           'updated_at', ARGV[3], 'message', ARGV[4])
local out = redis.call('HGETALL', KEYS[1])
table.insert(out, 1, 'ok')
return out
"""

# KEYS: job hash. ARGV: work done, updated_at.
_UPDATE_PROGRESS_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'missing'} end
redis.call('HSET', KEYS[1], 'work_done_gpu_hours', ARGV[1], 'updated_at', ARGV[2])
local out = redis.call('HGETALL', KEYS[1])
table.insert(out, 1, 'ok')
return out
"""

# KEYS: job hash, ledger list, ledger index. ARGV: identity, entry JSON, charge.
_APPEND_LEDGER_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'missing'} end
local digest = '"' .. redis.sha1hex(ARGV[2]) .. '"'  -- a JSON string, like every value
local seen = redis.call('HGET', KEYS[3], ARGV[1])
if seen then
  if seen == digest then return {'duplicate'} end
  return {'different'}
end
redis.call('HINCRBYFLOAT', KEYS[1], 'spent_usd', ARGV[3])
redis.call('RPUSH', KEYS[2], ARGV[2])
redis.call('HSET', KEYS[3], ARGV[1], digest)
return {'ok'}
"""

# KEYS: instance hash, all index, all-alive index, job index, job-alive index.
# ARGV: instance id, encoded job id, '1' if alive else '0', then field, value, ...
_PUT_INSTANCE_LUA = """
local job = redis.call('HGET', KEYS[1], 'job_id')
if job and job ~= ARGV[2] then return {'other_job', job} end
local ended = redis.call('HGET', KEYS[1], 'ended_at')
if ended and ended ~= 'null' and ARGV[3] == '1' then
  return {'ended', redis.call('HGET', KEYS[1], 'state')}
end
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('SADD', KEYS[4], ARGV[1])
if ARGV[3] == '1' then
  redis.call('SADD', KEYS[3], ARGV[1])
  redis.call('SADD', KEYS[5], ARGV[1])
else
  redis.call('SREM', KEYS[3], ARGV[1])
  redis.call('SREM', KEYS[5], ARGV[1])
end
return {'ok'}
"""

# KEYS: instance hash, all-alive index, job-alive index.
# ARGV: instance id, ended_at, end_reason, state.
_END_INSTANCE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'missing'} end
local status = 'already'
if redis.call('HGET', KEYS[1], 'ended_at') == 'null' then
  redis.call('HSET', KEYS[1], 'ended_at', ARGV[2], 'end_reason', ARGV[3], 'state', ARGV[4])
  redis.call('SREM', KEYS[2], ARGV[1])
  redis.call('SREM', KEYS[3], ARGV[1])
  status = 'ok'
end
local out = redis.call('HGETALL', KEYS[1])
table.insert(out, 1, status)
return out
"""

# KEYS: claim. ARGV: owner.
_RELEASE_CLAIM_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def redact_url(url: str) -> str:
    """`url` with any password replaced by `***` (in the netloc or a `password=` query)."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if parts.password is not None:
            host = netloc.rsplit("@", 1)[1]
            netloc = f"{parts.username or ''}:***@{host}"
        query = parts.query
        if "password=" in query:
            pairs = parse_qsl(query, keep_blank_values=True)
            query = urlencode([(k, "***" if k == "password" else v) for k, v in pairs])
        return urlunsplit(parts._replace(netloc=netloc, query=query))
    except ValueError:
        return "<unparseable Redis URL>"


def _enc(value: Any) -> str:
    return json.dumps(value, allow_nan=False, separators=(",", ":"))


def _encode_fields(model: BaseModel) -> dict[str, str]:
    """One JSON document per field (so Redis can update single fields atomically)."""
    return {name: _enc(value) for name, value in model.model_dump(mode="json").items()}


def _flat(mapping: Mapping[str, str]) -> list[str]:
    return [item for pair in mapping.items() for item in pair]


def _pairs(flat: Sequence[str]) -> dict[str, str]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


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
        if not _NAMESPACE_RE.match(namespace):
            raise ValueError(f"namespace {namespace!r} must match {_NAMESPACE_RE.pattern}")
        kwargs = client.get_connection_kwargs()
        if not kwargs.get("decode_responses"):
            raise ValueError("the Redis client must be built with decode_responses=True")
        self._client = client
        self.namespace = namespace
        self.url = redact_url(url) if url is not None else _describe(kwargs)
        self._create_job = client.register_script(_CREATE_JOB_LUA)
        self._transition = client.register_script(_TRANSITION_LUA)
        self._update_progress = client.register_script(_UPDATE_PROGRESS_LUA)
        self._append_ledger = client.register_script(_APPEND_LEDGER_LUA)
        self._put_instance = client.register_script(_PUT_INSTANCE_LUA)
        self._end_instance = client.register_script(_END_INSTANCE_LUA)
        self._release_claim = client.register_script(_RELEASE_CLAIM_LUA)

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
        with self._redis_errors():
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
        if record.spent_usd != 0.0:
            raise ValueError(
                f"job {record.job_id!r}: a new job's spent_usd must be 0 (got "
                f"{record.spent_usd}); spend is recorded through append_ledger"
            )
        key = self._job_key(record.job_id)
        with self._redis_errors():
            result = self._run(
                self._create_job,
                [key, self._key("jobs")],
                [record.job_id, *_flat(_encode_fields(record))],
            )
        if result[0] == "exists":
            raise ConflictError(key, None, int(result[1]))
        return record

    def get_job(self, job_id: str) -> JobRecord:
        """The job as stored now.

        Raises:
            NotFoundError: no such job.
        """
        key = self._job_key(job_id)
        with self._redis_errors():
            raw = cast(dict[str, str], self._client.hgetall(key))
        if not raw:
            raise NotFoundError("job", job_id)
        return self._decode(JobRecord, key, raw)

    def list_jobs(self, states: Iterable[JobState | str] | None = None) -> list[JobRecord]:
        """All jobs (or those in `states`), oldest submission first.

        Each record is read atomically; the list as a whole is not one snapshot.
        """
        wanted = None if states is None else {JobState(s) for s in states}
        with self._redis_errors():
            ids = sorted(cast(set[str], self._client.smembers(self._key("jobs"))))
            pipe = self._client.pipeline(transaction=False)
            for job_id in ids:
                pipe.hgetall(self._job_key(job_id))
            raws = cast(list[dict[str, str]], pipe.execute())
        jobs = [
            self._decode(JobRecord, self._job_key(job_id), raw)
            for job_id, raw in zip(ids, raws, strict=True)
            if raw
        ]
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
        key = self._job_key(job_id)
        sources = sorted(_enc(s.value) for s in allowed_sources(target))
        with self._redis_errors():
            result = self._run(
                self._transition,
                [key],
                [str(expected_version), _enc(target.value), _enc(now_s), _enc(message), *sources],
            )
        status = result[0]
        if status == "missing":
            raise NotFoundError("job", job_id)
        if status == "conflict":
            raise ConflictError(key, expected_version, int(result[1]))
        if status == "illegal":
            from_state = json.loads(result[2])
            logger.warning(
                "refused illegal job transition",
                extra={
                    "job_id": job_id,
                    "from_state": from_state,
                    "to_state": target.value,
                    "at_s": now_s,
                },
            )
            raise IllegalTransitionError(job_id, from_state, target.value)
        return self._decode(JobRecord, key, _pairs(result[1:]))

    def update_progress(self, job_id: str, work_done_gpu_hours: float, now_s: float) -> JobRecord:
        """Record the job's work done so far (and `updated_at = now_s`); last writer wins.

        Does not change `version`, so it never makes a concurrent `transition` fail.

        Raises:
            NotFoundError: no such job.
            ValueError: `work_done_gpu_hours` is negative or not finite.
        """
        if not math.isfinite(work_done_gpu_hours) or work_done_gpu_hours < 0:
            raise ValueError(f"work_done_gpu_hours must be finite and >= 0: {work_done_gpu_hours}")
        key = self._job_key(job_id)
        with self._redis_errors():
            result = self._run(
                self._update_progress, [key], [_enc(float(work_done_gpu_hours)), _enc(now_s)]
            )
        if result[0] == "missing":
            raise NotFoundError("job", job_id)
        return self._decode(JobRecord, key, _pairs(result[1:]))

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
        job_key = self._job_key(entry.job_id)
        identity = f"{entry.instance_id}@{entry.start_s!r}"
        with self._redis_errors():
            result = self._run(
                self._append_ledger,
                [job_key, self._key("job", entry.job_id, "ledger"), self._ledger_index(entry)],
                [identity, entry.model_dump_json(), repr(entry.charged_usd)],
            )
        status = result[0]
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
        key = self._key("job", self._check_id("job", job_id), "ledger")
        with self._redis_errors():
            pipe = self._client.pipeline(transaction=True)
            pipe.exists(self._job_key(job_id))
            pipe.lrange(key, 0, -1)
            exists, lines = cast(list[Any], pipe.execute())
        if not exists:
            raise NotFoundError("job", job_id)
        return [self._decode_json(LedgerEntry, key, line) for line in lines]

    def spent_usd(self, job_id: str) -> float:
        """The job's total spend: the sum of its ledger.

        Raises:
            NotFoundError: no such job.
        """
        key = self._job_key(job_id)
        with self._redis_errors():
            raw = cast(str | None, self._client.hget(key, "spent_usd"))
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
        key = self._instance_key(rec.instance_id)
        with self._redis_errors():
            result = self._run(
                self._put_instance,
                [
                    key,
                    self._key("instances"),
                    self._key("instances", "alive"),
                    self._key("job", rec.job_id, "instances"),
                    self._key("job", rec.job_id, "instances", "alive"),
                ],
                [
                    rec.instance_id,
                    _enc(rec.job_id),
                    "1" if rec.alive else "0",
                    *_flat(_encode_fields(rec)),
                ],
            )
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
        InstanceRecord.model_validate(
            current.model_dump() | {"ended_at": ended_at, "end_reason": reason}
        )
        key = self._instance_key(instance_id)
        with self._redis_errors():
            result = self._run(
                self._end_instance,
                [
                    key,
                    self._key("instances", "alive"),
                    self._key("job", current.job_id, "instances", "alive"),
                ],
                [instance_id, _enc(ended_at), _enc(reason), _enc(INSTANCE_ENDED)],
            )
        if result[0] == "missing":
            raise NotFoundError("instance", instance_id)
        return self._decode(InstanceRecord, key, _pairs(result[1:]))

    def get_instance(self, instance_id: str) -> InstanceRecord:
        """The instance as stored now.

        Raises:
            NotFoundError: no such instance.
        """
        key = self._instance_key(instance_id)
        with self._redis_errors():
            raw = cast(dict[str, str], self._client.hgetall(key))
        if not raw:
            raise NotFoundError("instance", instance_id)
        return self._decode(InstanceRecord, key, raw)

    def list_instances(
        self, job_id: str | None = None, *, alive_only: bool = False
    ) -> list[InstanceRecord]:
        """Instances of one job (or of all jobs), optionally only those not ended; oldest first."""
        parts = ("instances",) if job_id is None else ("job", job_id, "instances")
        if job_id is not None:
            self._check_id("job", job_id)
        index = self._key(*parts, "alive") if alive_only else self._key(*parts)
        with self._redis_errors():
            ids = sorted(cast(set[str], self._client.smembers(index)))
            pipe = self._client.pipeline(transaction=False)
            for instance_id in ids:
                pipe.hgetall(self._instance_key(instance_id))
            raws = cast(list[dict[str, str]], pipe.execute())
        records = [
            self._decode(InstanceRecord, self._instance_key(i), raw)
            for i, raw in zip(ids, raws, strict=True)
            if raw
        ]
        return sorted(records, key=lambda r: (r.launched_at, r.instance_id))

    # --- events

    def append_event(self, event: Event) -> str:
        """Append to the job's event stream (XADD, trimmed to about `EVENTS_MAXLEN`).

        Returns:
            The stream id of the new entry (pass it as `since_id` to read what follows).
        """
        key = self._key("job", self._check_id("job", event.job_id), "events")
        with self._redis_errors():
            return cast(
                str,
                self._client.xadd(
                    key,
                    {"event": event_json(event)},
                    maxlen=EVENTS_MAXLEN,
                    approximate=True,
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
        if count is not None and count <= 0:
            raise ValueError(f"count must be positive: {count}")
        key = self._key("job", self._check_id("job", job_id), "events")
        start = "-" if since_id == "-" else f"({since_id}"
        with self._redis_errors():
            entries = cast(
                list[tuple[str, dict[str, str]]],
                self._client.xrange(key, min=start, max="+", count=count),
            )
        return [(entry_id, _decode_event(key, fields["event"])) for entry_id, fields in entries]

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
        key = self._key("job", self._check_id("job", job_id), name)
        with self._redis_errors():
            return cast(
                str,
                self._client.xadd(
                    key, {"r": record.model_dump_json()}, maxlen=SERIES_MAXLEN, approximate=True
                ),
            )

    def _series(self, job_id: str, name: str, model: type[M], newest: int | None = None) -> list[M]:
        """The series oldest first; with `newest`, only that many of the latest, newest first."""
        key = self._key("job", self._check_id("job", job_id), name)
        with self._redis_errors():
            raw = (
                self._client.xrange(key)
                if newest is None
                else self._client.xrevrange(key, count=newest)
            )
            entries = cast(list[tuple[str, dict[str, str]]], raw)
        return [self._decode_json(model, key, fields["r"]) for _, fields in entries]

    # --- the AgileML controllers this controller hosts (agileml/host.py)

    def set_training_port(self, job_id: str, port: int) -> None:
        """Remember the port the job's AgileML controller listens on (its workers' tags name
        it), so that a restarted controller hosts it there again."""
        with self._redis_errors():
            self._client.hset(self._key("training-ports"), self._check_id("job", job_id), port)

    def training_ports(self) -> dict[str, int]:
        """Job id -> the port of its hosted AgileML controller."""
        with self._redis_errors():
            raw = cast(dict[str, str], self._client.hgetall(self._key("training-ports")))
        return {job_id: int(port) for job_id, port in raw.items()}

    def forget_training_port(self, job_id: str) -> None:
        with self._redis_errors():
            self._client.hdel(self._key("training-ports"), job_id)

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
        if not key or not owner:
            raise ValueError("claim key and owner must be non-empty")
        if not (math.isfinite(ttl_s) and ttl_s > 0):
            raise ValueError(f"ttl_s must be positive and finite: {ttl_s}")
        ttl_ms = max(1, round(ttl_s * 1000))
        with self._redis_errors():
            return bool(self._client.set(self._claim_key(key), _enc(owner), nx=True, px=ttl_ms))

    def release_claim(self, key: str, owner: str) -> bool:
        """Release `key` if `owner` still holds it (atomic compare-and-delete, Lua).

        Returns:
            True if released; False if it was not held by `owner` (expired, or someone else's).
        """
        with self._redis_errors():
            return bool(self._run(self._release_claim, [self._claim_key(key)], [_enc(owner)]))

    def claim_owner(self, key: str) -> str | None:
        """Who holds `key` now, or None."""
        with self._redis_errors():
            raw = cast(str | None, self._client.get(self._claim_key(key)))
        return None if raw is None else str(json.loads(raw))

    # --- internals

    def _key(self, *parts: str) -> str:
        return ":".join((self.namespace, *parts))

    @staticmethod
    def _check_id(kind: str, record_id: str) -> str:
        # An id that could not have been stored cannot be found (and must not reach a key).
        if not _ID_RE.match(record_id):
            raise NotFoundError(kind, record_id)
        return record_id

    def _job_key(self, job_id: str) -> str:
        return self._key("job", self._check_id("job", job_id))

    def _instance_key(self, instance_id: str) -> str:
        return self._key("instance", self._check_id("instance", instance_id))

    def _ledger_index(self, entry: LedgerEntry) -> str:
        return self._key("job", entry.job_id, "ledger-index")

    def _claim_key(self, key: str) -> str:
        return self._key("claim", key)

    @staticmethod
    def _run(script: Script, keys: list[str], args: list[str]) -> Any:
        return script(keys=keys, args=args)

    @staticmethod
    def _decode(model: type[M], key: str, raw: Mapping[str, str]) -> M:
        try:
            return model.model_validate({name: json.loads(value) for name, value in raw.items()})
        except (ValueError, ValidationError) as exc:
            raise StoreError(f"corrupt {model.__name__} at {key}: {exc}") from exc

    @staticmethod
    def _decode_json(model: type[M], key: str, text: str) -> M:
        try:
            return model.model_validate_json(text)
        except ValidationError as exc:
            raise StoreError(f"corrupt {model.__name__} in {key}: {exc}") from exc

    @contextmanager
    def _redis_errors(self) -> Iterator[None]:
        """Turn redis-py's exceptions into the store's (never retrying)."""
        try:
            yield
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            raise StoreUnavailableError(self.url, str(exc) or type(exc).__name__) from exc
        except redis.exceptions.RedisError as exc:
            raise StoreError(f"Redis at {self.url} refused a command: {exc}") from exc


def _decode_event(key: str, text: str) -> Event:
    try:
        return parse_event(text)
    except ValueError as exc:
        raise StoreError(f"corrupt event in {key}: {exc}") from exc


def _describe(kwargs: Mapping[str, Any]) -> str:
    """A redacted URL for a client built without one."""
    if "path" in kwargs:
        return f"unix://{kwargs['path']}?db={kwargs.get('db', 0)}"
    host, port, db = kwargs.get("host", "localhost"), kwargs.get("port", 6379), kwargs.get("db", 0)
    return f"redis://{host}:{port}/{db}"
