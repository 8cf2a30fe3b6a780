"""`RedisStore`: the `Store` in Redis, the controller's durable state.

The key layout and the Lua scripts are in `redis_scripts`; JSON encoding, decoding and the
mapping of redis-py's errors in `redis_codec`. The contract (what each operation guarantees and
raises) is `protocol.Store`'s; this module says how Redis keeps it:

* Each write is one atomic Redis step (a Lua script, a MULTI/EXEC transaction or a single
  command): Redis applies all of it or none of it, so a controller killed at any moment never
  leaves half a write, and every controller sharing the Redis sees it whole.
* Nothing is retried. The client is built with no retries (redis-py retries by default), because
  a retried write whose first attempt did land would apply twice. A Redis that cannot be reached
  raises `StoreUnavailableError` within `timeout_s`; a write whose reply was lost (timeout) may
  or may not have been applied, and re-reading after Redis is back tells which.
* Event logs and series are streams (ids `"<ms>-<seq>"` from the Redis server's clock), trimmed
  with `MAXLEN ~` (cheap; keeps at least the limit).
* Claims are keys with a TTL (`SET NX PX`), expired by the Redis server's clock.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar, cast

import redis
from pydantic import BaseModel
from redis.backoff import NoBackoff
from redis.retry import Retry

from orchestrator.store.checks import (
    check_bill,
    check_count,
    check_finite,
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
    TERMINAL_STATES,
    InstanceRecord,
    InstanceWork,
    JobRecord,
    JobState,
    LedgerEntry,
    PriceSnapshot,
    TrainingReport,
    allowed_sources,
)
from orchestrator.store.protocol import DEFAULT_NAMESPACE, EVENTS_MAXLEN, SERIES_MAXLEN
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

DEFAULT_TIMEOUT_S = 2.0  # connect and per-command socket timeout: a dead Redis fails fast

M = TypeVar("M", bound=BaseModel)


class RedisStore:
    """The `Store` kept in Redis, under the keys of one namespace (see `redis_scripts`).

    Thread-safe (redis-py's client and connection pool are). Every method raises
    `StoreUnavailableError` when Redis cannot be reached and `StoreError` when it refuses a
    command; the rest of each method's contract is in `protocol.Store`.
    """

    def __init__(
        self,
        client: redis.Redis,
        namespace: str = DEFAULT_NAMESPACE,
        *,
        url: str | None = None,
        events_maxlen: int = EVENTS_MAXLEN,
        series_maxlen: int = SERIES_MAXLEN,
    ) -> None:
        """Wrap a client built with `decode_responses=True` (use `connect` to build one).

        `url` names the server in error messages (derived from the client when omitted).
        `events_maxlen` and `series_maxlen` are where trimming starts (tests make them small).

        Raises:
            ValueError: the client does not decode responses, or `namespace` cannot prefix keys.
        """
        kwargs = client.get_connection_kwargs()
        if not kwargs.get("decode_responses"):
            raise ValueError("the Redis client must be built with decode_responses=True")
        self._client = client
        self.namespace = check_namespace(namespace)
        self.url = redact_url(url) if url is not None else describe_client(kwargs)
        self._keys = RedisKeys(namespace)
        self._scripts = Scripts.register(client)
        self._events_maxlen = events_maxlen
        self._series_maxlen = series_maxlen

    @classmethod
    def connect(
        cls,
        url: str,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> RedisStore:
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
        """Close the client's connections (redis-py reconnects if the store is used again)."""
        self._client.close()

    def ping(self) -> None:
        """PING."""
        with redis_errors(self.url):
            self._client.ping()

    # --- jobs

    def create_job(self, record: JobRecord) -> JobRecord:
        """One Lua script: refuse an existing id, else write the hash and index the id."""
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
        """HGETALL."""
        key = self._keys.job(job_id)
        with redis_errors(self.url):
            raw = cast(dict[str, str], self._client.hgetall(key))
        if not raw:
            raise NotFoundError("job", job_id)
        return decode_hash(JobRecord, key, raw)

    def list_jobs(self, states: Iterable[JobState | str] | None = None) -> list[JobRecord]:
        """The id set, then each hash (pipelined): each record is one read, the list is not."""
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
        """One Lua script: compare the version, check the edge, write, read back."""
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
        """One Lua script: write the two fields unless the job has ended, read it back."""
        work = check_work_done(work_done_gpu_hours)
        key = self._keys.job(job_id)
        ended = [enc(state) for state in sorted(TERMINAL_STATES)]
        with redis_errors(self.url):
            result = self._scripts.update_progress(keys=[key], args=[enc(work), enc(now_s), *ended])
        if result[0] == "missing":
            raise NotFoundError("job", job_id)
        return decode_hash(JobRecord, key, pairs(result[1:]))

    # --- ledger

    def append_ledger(self, entry: LedgerEntry) -> bool:
        """One Lua script: compare the entry's sha1 under its identity in the job's
        ledger index, then HINCRBYFLOAT the spend, RPUSH the entry and index it."""
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
        """EXISTS and LRANGE in one MULTI/EXEC."""
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
        """HGET of the job's `spent_usd` field (HINCRBYFLOAT keeps it)."""
        with redis_errors(self.url):
            raw = cast(str | None, self._client.hget(self._keys.job(job_id), "spent_usd"))
        if raw is None:
            raise NotFoundError("job", job_id)
        return float(raw)

    # --- instances

    def put_instance(self, rec: InstanceRecord) -> InstanceRecord:
        """One Lua script: check the stored job and end, write the hash, move the id
        between the alive sets."""
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

    def end_instance(
        self,
        instance_id: str,
        ended_at: float,
        reason: str,
        bill: Sequence[LedgerEntry] = (),
    ) -> InstanceRecord:
        """Validated first (a read), then one Lua script that, only if the instance is still
        alive, checks every charge, appends them and ends it (so a concurrent end cannot be
        overwritten, and a crash leaves no half bill)."""
        current = self.get_instance(instance_id)
        if not current.alive:
            return current
        ended_record(current, ended_at, reason)  # validates before anything is written
        check_bill(current, bill)
        key = self._keys.instance(instance_id)
        keys = [
            key,
            self._keys.instances(alive_only=True),
            self._keys.instances(current.job_id, alive_only=True),
            self._keys.job(current.job_id),
            self._keys.job_part(current.job_id, "ledger"),
            self._keys.job_part(current.job_id, "ledger-index"),
        ]
        args = [instance_id, enc(ended_at), enc(reason), enc(INSTANCE_ENDED)]
        for entry in bill:
            args += [ledger_identity(entry), entry.model_dump_json(), repr(entry.charged_usd)]
        with redis_errors(self.url):
            result = self._scripts.end_instance(keys=keys, args=args)
        if result[0] == "missing":
            raise NotFoundError("instance", instance_id)
        if result[0] == "missing_job":
            raise NotFoundError("job", current.job_id)
        if result[0] == "different":
            entry = next(e for e in bill if ledger_identity(e) == result[1])
            raise LedgerConflictError(entry.job_id, entry.instance_id, entry.start_s)
        return decode_hash(InstanceRecord, key, pairs(result[1:]))

    def get_instance(self, instance_id: str) -> InstanceRecord:
        """HGETALL."""
        key = self._keys.instance(instance_id)
        with redis_errors(self.url):
            raw = cast(dict[str, str], self._client.hgetall(key))
        if not raw:
            raise NotFoundError("instance", instance_id)
        return decode_hash(InstanceRecord, key, raw)

    def list_instances(
        self, job_id: str | None = None, *, alive_only: bool = False
    ) -> list[InstanceRecord]:
        """The id set of the index asked for, then each hash (pipelined)."""
        index = self._keys.instances(job_id, alive_only=alive_only)
        with redis_errors(self.url):
            ids = sorted(cast(set[str], self._client.smembers(index)))
            records = self._read_hashes(InstanceRecord, [self._keys.instance(i) for i in ids])
        return sorted(records, key=lambda r: (r.launched_at, r.instance_id))

    # --- events

    def append_event(self, event: Event) -> str:
        """XADD to the job's stream, `MAXLEN ~ events_maxlen`."""
        key = self._keys.job_part(event.job_id, "events")
        with redis_errors(self.url):
            return cast(
                str,
                self._client.xadd(
                    key, {"event": event_json(event)}, maxlen=self._events_maxlen, approximate=True
                ),
            )

    def events(
        self, job_id: str, since_id: str = "-", count: int | None = None
    ) -> list[tuple[str, Event]]:
        """XRANGE from `(since_id` (exclusive) to `+`."""
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
        """XADD, `MAXLEN ~ series_maxlen`."""
        return self._append_series(job_id, "prices", snapshot)

    def prices(self, job_id: str) -> list[PriceSnapshot]:
        """XRANGE of the whole series."""
        return self._series(job_id, "prices", PriceSnapshot)

    def latest_prices(self, job_id: str) -> PriceSnapshot | None:
        """XREVRANGE COUNT 1."""
        return next(iter(self._series(job_id, "prices", PriceSnapshot, newest=1)), None)

    def append_training(self, job_id: str, report: TrainingReport) -> str:
        """XADD, `MAXLEN ~ series_maxlen`."""
        return self._append_series(job_id, "training", report)

    def training(self, job_id: str) -> list[TrainingReport]:
        """XRANGE of the whole series."""
        return self._series(job_id, "training", TrainingReport)

    def latest_training(self, job_id: str) -> TrainingReport | None:
        """XREVRANGE COUNT 1."""
        return next(iter(self._series(job_id, "training", TrainingReport, newest=1)), None)

    def _append_series(self, job_id: str, name: str, record: BaseModel) -> str:
        key = self._keys.job_part(job_id, name)
        with redis_errors(self.url):
            return cast(
                str,
                self._client.xadd(
                    key,
                    {"r": record.model_dump_json()},
                    maxlen=self._series_maxlen,
                    approximate=True,
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

    # --- the AgileML controllers this controller hosts (controller/training.py)

    def record_accrued(self, job_id: str, accrued: Mapping[str, float], at_s: float) -> None:
        """DEL and HSET of the job's `accrued` hash, in one transaction."""
        key = self._keys.job_part(job_id, "accrued")
        with redis_errors(self.url):
            pipe = self._client.pipeline(transaction=True)
            pipe.delete(key)
            if accrued:
                pipe.hset(key, mapping={i: repr(float(usd)) for i, usd in accrued.items()})
            pipe.execute()

    def live_spend_usd(self, job_id: str) -> float:
        """The job's `spent_usd`, its alive set and its `accrued` hash in one transaction
        (MULTI/EXEC): an instance's end and its bill are one script, so it is counted in
        exactly one of them."""
        keys = (
            self._keys.job(job_id),
            self._keys.instances(job_id, alive_only=True),
            self._keys.job_part(job_id, "accrued"),
        )
        with redis_errors(self.url):
            pipe = self._client.pipeline(transaction=True)
            pipe.exists(keys[0])
            pipe.hget(keys[0], "spent_usd")
            pipe.smembers(keys[1])
            pipe.hgetall(keys[2])
            exists, billed, alive, accrued = pipe.execute()
        if not exists:
            raise NotFoundError("job", job_id)
        total = float(billed) if billed is not None else 0.0
        for instance_id, usd in cast(dict[str, str], accrued).items():
            if instance_id in alive:
                total += float(usd)
        return total

    def record_instance_work(self, job_id: str, work: Mapping[str, InstanceWork]) -> None:
        """HSET of the job's `instance-work` hash (values: the models' JSON)."""
        key = self._keys.job_part(job_id, "instance-work")
        if not work:
            return
        with redis_errors(self.url):
            self._client.hset(key, mapping={i: w.model_dump_json() for i, w in work.items()})

    def instance_work(self, job_id: str) -> dict[str, InstanceWork]:
        """HGETALL of the job's `instance-work` hash."""
        key = self._keys.job_part(job_id, "instance-work")
        with redis_errors(self.url):
            raw = cast(dict[str, str], self._client.hgetall(key))
        return {i: InstanceWork.model_validate_json(w) for i, w in raw.items()}

    def set_training_port(self, job_id: str, port: int) -> None:
        """HSET in the namespace's `training-ports` hash."""
        with redis_errors(self.url):
            self._client.hset(self._keys.training_ports(), check_id("job", job_id), port)

    def training_ports(self) -> dict[str, int]:
        """HGETALL of the `training-ports` hash."""
        with redis_errors(self.url):
            raw = cast(dict[str, str], self._client.hgetall(self._keys.training_ports()))
        return {job_id: int(port) for job_id, port in raw.items()}

    def forget_training_port(self, job_id: str) -> None:
        """HDEL (of any id: one that cannot be a job's is simply not there)."""
        with redis_errors(self.url):
            self._client.hdel(self._keys.training_ports(), job_id)

    # --- claims

    def claim(self, key: str, owner: str, ttl_s: float) -> bool:
        """`SET NX PX` of the claim's key (owner as JSON)."""
        ttl_ms = claim_ttl_ms(key, owner, ttl_s)
        with redis_errors(self.url):
            return bool(self._client.set(self._keys.claim(key), enc(owner), nx=True, px=ttl_ms))

    def release_claim(self, key: str, owner: str) -> bool:
        """One Lua script: DEL if the key still holds `owner`."""
        with redis_errors(self.url):
            released = self._scripts.release_claim(keys=[self._keys.claim(key)], args=[enc(owner)])
        return bool(released)

    def claim_owner(self, key: str) -> str | None:
        """GET."""
        with redis_errors(self.url):
            raw = cast(str | None, self._client.get(self._keys.claim(key)))
        return None if raw is None else str(json.loads(raw))

    # --- the clock's high-water mark

    def advance_clock(self, now_s: float) -> float:
        """One Lua script: SET if higher; the mark after."""
        check_finite("now_s", now_s)
        with redis_errors(self.url):
            mark = self._scripts.advance_clock(keys=[self._keys.clock()], args=[repr(float(now_s))])
        return float(mark)

    def clock_high_water(self) -> float | None:
        """GET."""
        with redis_errors(self.url):
            raw = cast(str | None, self._client.get(self._keys.clock()))
        return None if raw is None else float(raw)

    # --- the fleet's controller

    def bind_controller_id(self, controller_id: str) -> str:
        """SET NX, then GET."""
        if not controller_id:
            raise ValueError("controller_id must not be empty")
        key = self._keys.controller_id()
        with redis_errors(self.url):
            self._client.set(key, controller_id, nx=True)
            return str(self._client.get(key))

    def acquire_lease(self, owner: str, ttl_s: float) -> int | None:
        """One Lua script: renew if `owner` holds it, take it (a new token) if no one does."""
        ttl_ms = claim_ttl_ms("lease", owner, ttl_s)
        keys = [self._keys.lease(), self._keys.lease_fence()]
        with redis_errors(self.url):
            token = self._scripts.acquire_lease(keys=keys, args=[owner, ttl_ms])
        return None if token is None else int(token)

    def lease_holder(self) -> tuple[str, int] | None:
        """GET."""
        with redis_errors(self.url):
            raw = cast(str | None, self._client.get(self._keys.lease()))
        if raw is None:
            return None
        lease = json.loads(raw)
        return str(lease["owner"]), int(lease["token"])

    def release_lease(self, owner: str) -> bool:
        """One Lua script: DEL if `owner` holds it."""
        with redis_errors(self.url):
            released = self._scripts.release_lease(keys=[self._keys.lease()], args=[owner])
        return bool(released)

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
