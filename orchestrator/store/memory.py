"""`MemoryStore`: the `Store` in one process's memory, for fast tests.

It keeps `protocol.Store`'s contract the way `RedisStore` does, and the contract tests
(`tests/support/store_contract/`, run on both) hold both to it: the same
checks (`checks`), the same version bumps, refusals and errors (a `ConflictError` names the key
`RedisStore` would), the same idempotent ledger and instance ends, event ids in Redis's stream
form, and claims that expire.

Where it differs, on purpose:

* Nothing survives the object: there is no restart to test, and `close` changes nothing (the
  store stays usable, as a closed redis-py client reconnects).
* It is never unavailable: no `StoreUnavailableError`, no lost replies.
* Trimming is exact: an event log keeps exactly `events_maxlen` entries, a series exactly
  `series_maxlen` (Redis's `MAXLEN ~` keeps at least that many).
* `spent_usd` is summed in Python floats (Redis's HINCRBYFLOAT in long doubles): the last digit
  may differ.
* Time comes from the injected `clock` (seconds; default the wall clock, like the Redis server's
  own): the milliseconds of event ids and the expiry of claims. A fake clock makes both
  deterministic.

Values are kept as JSON text, as Redis keeps them, so what reads back is what a Redis round trip
gives (a tuple in a job's spec comes back a list) and every read returns a fresh snapshot.
Thread-safe: one lock around every operation, so each one is atomic.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel

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
)
from orchestrator.store.events import Event, event_json, parse_event
from orchestrator.store.models import (
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

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

StreamId = tuple[int, int]  # (milliseconds, sequence), as Redis's "<ms>-<seq>"

_U64_MAX = 2**64 - 1  # the largest part of a Redis stream id
_STREAM_ID_RE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _json(record: BaseModel) -> str:
    """`record` as stored: JSON that refuses NaN and infinities, like `RedisStore`'s values."""
    return json.dumps(record.model_dump(mode="json"), allow_nan=False, separators=(",", ":"))


def _load(model: type[M], text: str) -> M:
    """A fresh record from its stored JSON (validated in Python mode, as `RedisStore` does)."""
    return model.model_validate(json.loads(text))


def _format_id(stream_id: StreamId) -> str:
    return f"{stream_id[0]}-{stream_id[1]}"


def _parse_since(since_id: str) -> StreamId:
    """The id after which a read starts: `"<ms>-<seq>"`, or `"<ms>"` meaning `"<ms>-0"`.

    Raises:
        StoreError: not an id, or the largest id (nothing can follow it), as Redis refuses them.
    """
    match = _STREAM_ID_RE.match(since_id)
    ms, seq = (int(match[1]), int(match[2] or 0)) if match else (-1, -1)
    if not (0 <= ms <= _U64_MAX and 0 <= seq <= _U64_MAX) or (ms, seq) == (_U64_MAX, _U64_MAX):
        raise StoreError(f"not a stream id to read after: {since_id!r} (ids are '<ms>-<seq>')")
    return ms, seq


@dataclass
class _Stream:
    """One Redis-like stream: entries in id order, ids strictly increasing, oldest trimmed."""

    maxlen: int
    entries: list[tuple[StreamId, str]] = field(default_factory=list)
    last_id: StreamId = (0, 0)  # kept when entries are trimmed, as Redis keeps it

    def add(self, now_ms: int, text: str) -> str:
        """Append `text` under the next id: `now_ms` with sequence 0 if that is later than the
        last id, else the last id's milliseconds with the next sequence (Redis's `XADD *`)."""
        last_ms, last_seq = self.last_id
        self.last_id = (now_ms, 0) if now_ms > last_ms else (last_ms, last_seq + 1)
        self.entries.append((self.last_id, text))
        if len(self.entries) > self.maxlen:
            del self.entries[: len(self.entries) - self.maxlen]
        return _format_id(self.last_id)

    def after(self, start: StreamId | None, count: int | None) -> list[tuple[str, str]]:
        """Entries with ids greater than `start` (all with None), oldest first, at most `count`."""
        found = [(i, text) for i, text in self.entries if start is None or i > start]
        return [(_format_id(i), text) for i, text in found[:count]]


@dataclass
class _Claim:
    owner: str
    expires_ms: float  # held while the clock (in ms) is not past this, as Redis's PX


class MemoryStore:
    """The `Store` in memory (see the module docstring for what differs from `RedisStore`).

    Args:
        namespace: names keys in errors as `RedisStore` would (`{namespace}:job:{job_id}`).
        clock: seconds; the milliseconds of event ids and the expiry of claims.
        events_maxlen: events kept per job.
        series_maxlen: entries kept of each dashboard series of a job.

    Raises:
        ValueError: `namespace` could not prefix Redis keys.
    """

    def __init__(
        self,
        namespace: str = DEFAULT_NAMESPACE,
        *,
        clock: Callable[[], float] = time.time,
        events_maxlen: int = EVENTS_MAXLEN,
        series_maxlen: int = SERIES_MAXLEN,
    ) -> None:
        self.namespace = check_namespace(namespace)
        self._clock = clock
        self._events_maxlen = events_maxlen
        self._series_maxlen = series_maxlen
        self._lock = threading.RLock()
        self._jobs: dict[str, str] = {}  # job id -> JobRecord JSON
        self._ledgers: dict[str, list[str]] = {}  # job id -> LedgerEntry JSON, append order
        self._ledger_index: dict[str, dict[str, str]] = {}  # job id -> identity -> entry JSON
        self._instances: dict[str, str] = {}  # instance id -> InstanceRecord JSON
        self._streams: dict[tuple[str, str], _Stream] = {}  # (job id, "events"|...) -> stream
        self._ports: dict[str, int] = {}
        self._instance_work: dict[str, dict[str, InstanceWork]] = {}
        self._accrued: dict[str, dict[str, float]] = {}  # job -> instance -> USD not billed
        self._claims: dict[str, _Claim] = {}
        self._clock_mark: float | None = None
        self._controller_id: str | None = None
        self._lease: tuple[str, int, float] | None = None  # owner, token, expires (ms)
        self._fence = 0

    def ping(self) -> None:
        """Always answers."""

    def close(self) -> None:
        """Nothing to let go of; the data stays and the store stays usable."""

    # --- jobs

    def create_job(self, record: JobRecord) -> JobRecord:
        check_new_job(record)
        key = self._job_key(record.job_id)
        text = _json(record)
        with self._lock:
            if record.job_id in self._jobs:
                raise ConflictError(key, None, self._job(record.job_id).version)
            self._jobs[record.job_id] = text
            self._ledgers[record.job_id] = []
            self._ledger_index[record.job_id] = {}
        return record

    def get_job(self, job_id: str) -> JobRecord:
        check_id("job", job_id)
        with self._lock:
            return self._job(job_id)

    def list_jobs(self, states: Iterable[JobState | str] | None = None) -> list[JobRecord]:
        wanted = None if states is None else {JobState(s) for s in states}
        with self._lock:
            jobs = [_load(JobRecord, text) for text in self._jobs.values()]
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
        target = JobState(to_state)
        key = self._job_key(job_id)
        with self._lock:
            current = self._job(job_id)
            # compared as text, as RedisStore's script compares them (so 0.0 is not version 0)
            if str(expected_version) != str(current.version):
                raise ConflictError(key, expected_version, current.version)
            if current.state not in allowed_sources(target):
                raise refused_transition(logger, job_id, current.state.value, target.value, now_s)
            changes = {"state": target, "version": current.version + 1, "updated_at": now_s}
            return self._put_job(current, changes | {"message": message})

    def update_progress(self, job_id: str, work_done_gpu_hours: float, now_s: float) -> JobRecord:
        work = check_work_done(work_done_gpu_hours)
        check_id("job", job_id)
        with self._lock:
            current = self._job(job_id)
            if current.state.is_terminal:
                return current  # an ended job's numbers are frozen
            return self._put_job(current, {"work_done_gpu_hours": work, "updated_at": now_s})

    # --- ledger

    def append_ledger(self, entry: LedgerEntry) -> bool:
        check_id("job", entry.job_id)
        with self._lock:
            return self._charge(entry.job_id, [entry]) == 1

    def _charge(self, job_id: str, entries: Sequence[LedgerEntry]) -> int:
        """Check every entry against the job's ledger, then record those not recorded yet and
        add them to its spend (the caller holds the lock); how many were new.

        Raises:
            NotFoundError, LedgerConflictError: before anything is recorded.
        """
        job = self._job(job_id)
        index = self._ledger_index[job_id]
        texts = [(ledger_identity(e), e.model_dump_json(), e) for e in entries]
        for identity, text, e in texts:
            if index.get(identity, text) != text:
                raise LedgerConflictError(e.job_id, e.instance_id, e.start_s)
        new = 0
        for identity, text, e in texts:
            if identity not in index:
                job = self._put_job(job, {"spent_usd": job.spent_usd + e.charged_usd})
                self._ledgers[job_id].append(text)
                index[identity] = text
                new += 1
        return new

    def ledger(self, job_id: str) -> list[LedgerEntry]:
        check_id("job", job_id)
        with self._lock:
            self._job(job_id)
            lines = list(self._ledgers[job_id])
        return [LedgerEntry.model_validate_json(line) for line in lines]

    def spent_usd(self, job_id: str) -> float:
        return self.get_job(job_id).spent_usd

    def record_accrued(self, job_id: str, accrued: Mapping[str, float], at_s: float) -> None:
        check_id("job", job_id)
        with self._lock:
            self._accrued[job_id] = {i: float(usd) for i, usd in accrued.items()}

    def live_spend_usd(self, job_id: str) -> float:
        with self._lock:  # one consistent read: a bill and its instance's end are one write
            billed = self.get_job(job_id).spent_usd
            accrued = self._accrued.get(job_id, {})
            alive = {r.instance_id for r in self.list_instances(job_id, alive_only=True)}
        return billed + sum(usd for i, usd in accrued.items() if i in alive)

    # --- instances

    def put_instance(self, rec: InstanceRecord) -> InstanceRecord:
        check_id("instance", rec.instance_id)
        text = _json(rec)
        with self._lock:
            stored = self._instances.get(rec.instance_id)
            current = None if stored is None else _load(InstanceRecord, stored)
            if current is not None and current.job_id != rec.job_id:
                raise StoreError(
                    f"instance {rec.instance_id!r} belongs to job {current.job_id!r}, "
                    f"not {rec.job_id!r}"
                )
            if current is not None and not current.alive and rec.alive:
                raise IllegalTransitionError(rec.job_id, current.state, rec.state)
            self._instances[rec.instance_id] = text
        return rec

    def end_instance(
        self,
        instance_id: str,
        ended_at: float,
        reason: str,
        bill: Sequence[LedgerEntry] = (),
    ) -> InstanceRecord:
        with self._lock:  # the check, the bill and the end in one step, as RedisStore's script
            current = self.get_instance(instance_id)
            if not current.alive:
                return current
            ended = ended_record(current, ended_at, reason)
            check_bill(current, bill)
            if bill:
                self._charge(current.job_id, bill)
            self._instances[instance_id] = _json(ended)
            return _load(InstanceRecord, self._instances[instance_id])

    def get_instance(self, instance_id: str) -> InstanceRecord:
        check_id("instance", instance_id)
        with self._lock:
            text = self._instances.get(instance_id)
        if text is None:
            raise NotFoundError("instance", instance_id)
        return _load(InstanceRecord, text)

    def list_instances(
        self, job_id: str | None = None, *, alive_only: bool = False
    ) -> list[InstanceRecord]:
        if job_id is not None:
            check_id("job", job_id)
        with self._lock:
            records = [_load(InstanceRecord, text) for text in self._instances.values()]
        records = [
            r
            for r in records
            if (job_id is None or r.job_id == job_id) and (r.alive or not alive_only)
        ]
        return sorted(records, key=lambda r: (r.launched_at, r.instance_id))

    # --- events

    def append_event(self, event: Event) -> str:
        return self._append(event.job_id, "events", event_json(event), self._events_maxlen)

    def events(
        self, job_id: str, since_id: str = "-", count: int | None = None
    ) -> list[tuple[str, Event]]:
        check_count(count)
        check_id("job", job_id)
        start = None if since_id == "-" else _parse_since(since_id)
        entries = self._read(job_id, "events", start, count)
        return [(entry_id, parse_event(text)) for entry_id, text in entries]

    # --- series for the dashboard: prices considered, training reports

    def append_prices(self, job_id: str, snapshot: PriceSnapshot) -> str:
        return self._append(job_id, "prices", snapshot.model_dump_json(), self._series_maxlen)

    def prices(self, job_id: str) -> list[PriceSnapshot]:
        check_id("job", job_id)
        return [PriceSnapshot.model_validate_json(t) for _, t in self._read(job_id, "prices")]

    def latest_prices(self, job_id: str) -> PriceSnapshot | None:
        return next(reversed(self.prices(job_id)), None)

    def append_training(self, job_id: str, report: TrainingReport) -> str:
        return self._append(job_id, "training", report.model_dump_json(), self._series_maxlen)

    def training(self, job_id: str) -> list[TrainingReport]:
        check_id("job", job_id)
        return [TrainingReport.model_validate_json(t) for _, t in self._read(job_id, "training")]

    def latest_training(self, job_id: str) -> TrainingReport | None:
        return next(reversed(self.training(job_id)), None)

    # --- the AgileML controllers this controller hosts (controller/training.py)

    def record_instance_work(self, job_id: str, work: Mapping[str, InstanceWork]) -> None:
        check_id("job", job_id)
        with self._lock:
            self._instance_work.setdefault(job_id, {}).update(work)

    def instance_work(self, job_id: str) -> dict[str, InstanceWork]:
        check_id("job", job_id)
        with self._lock:
            return dict(self._instance_work.get(job_id, {}))

    def set_training_port(self, job_id: str, port: int) -> None:
        check_id("job", job_id)
        with self._lock:
            self._ports[job_id] = int(port)

    def training_ports(self) -> dict[str, int]:
        with self._lock:
            return dict(self._ports)

    def forget_training_port(self, job_id: str) -> None:
        with self._lock:
            self._ports.pop(job_id, None)

    # --- the clock's high-water mark

    def advance_clock(self, now_s: float) -> float:
        now_s = float(check_finite("now_s", now_s))
        with self._lock:
            mark = self._clock_mark
            self._clock_mark = now_s if mark is None else max(mark, now_s)
            return self._clock_mark

    def clock_high_water(self) -> float | None:
        with self._lock:
            return self._clock_mark

    # --- the fleet's controller

    def bind_controller_id(self, controller_id: str) -> str:
        if not controller_id:
            raise ValueError("controller_id must not be empty")
        with self._lock:
            self._controller_id = self._controller_id or controller_id
            return self._controller_id

    def acquire_lease(self, owner: str, ttl_s: float) -> int | None:
        ttl_ms = claim_ttl_ms("lease", owner, ttl_s)
        with self._lock:
            held = self._lease_held()
            if held is not None and held[0] != owner:
                return None
            if held is None:
                self._fence += 1
                held = (owner, self._fence)
            self._lease = (held[0], held[1], self._now_ms() + ttl_ms)
            return held[1]

    def lease_holder(self) -> tuple[str, int] | None:
        with self._lock:
            return self._lease_held()

    def release_lease(self, owner: str) -> bool:
        with self._lock:
            held = self._lease_held()
            if held is None or held[0] != owner:
                return False
            self._lease = None
            return True

    def _lease_held(self) -> tuple[str, int] | None:
        if self._lease is None or self._lease[2] <= self._now_ms():
            return None
        return self._lease[0], self._lease[1]

    # --- claims

    def claim(self, key: str, owner: str, ttl_s: float) -> bool:
        ttl_ms = claim_ttl_ms(key, owner, ttl_s)
        with self._lock:
            if self._holder(key) is not None:
                return False
            self._claims[key] = _Claim(owner, self._now_ms() + ttl_ms)
            return True

    def release_claim(self, key: str, owner: str) -> bool:
        with self._lock:
            if self._holder(key) != owner:
                return False
            del self._claims[key]
            return True

    def claim_owner(self, key: str) -> str | None:
        with self._lock:
            return self._holder(key)

    # --- internals (call with the lock held where they touch state)

    def _job_key(self, job_id: str) -> str:
        """The key `RedisStore` keeps the job at (errors name it)."""
        return f"{self.namespace}:job:{check_id('job', job_id)}"

    def _job(self, job_id: str) -> JobRecord:
        text = self._jobs.get(job_id)
        if text is None:
            raise NotFoundError("job", job_id)
        return _load(JobRecord, text)

    def _put_job(self, current: JobRecord, changes: dict[str, Any]) -> JobRecord:
        """Validate `current` with `changes` (nothing is written if that fails), store it and
        return a fresh copy."""
        text = _json(JobRecord.model_validate(current.model_dump() | changes))
        self._jobs[current.job_id] = text
        return _load(JobRecord, text)

    def _now_ms(self) -> float:
        return self._clock() * 1000.0

    def _holder(self, key: str) -> str | None:
        """The owner of `key` if it is held; an expired claim is dropped."""
        claim = self._claims.get(key)
        if claim is not None and self._now_ms() > claim.expires_ms:
            del self._claims[key]
            claim = None
        return None if claim is None else claim.owner

    def _append(self, job_id: str, name: str, text: str, maxlen: int) -> str:
        check_id("job", job_id)
        with self._lock:
            stream = self._streams.setdefault((job_id, name), _Stream(maxlen))
            return stream.add(int(self._now_ms()), text)

    def _read(
        self, job_id: str, name: str, start: StreamId | None = None, count: int | None = None
    ) -> list[tuple[str, str]]:
        with self._lock:
            stream = self._streams.get((job_id, name))
            return [] if stream is None else stream.after(start, count)
