"""What the store contract's tests build: sample records, the namespace, thread races."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from itertools import product
from typing import Any

from orchestrator.bidbrain.model import JobSpec
from orchestrator.market.billing import EndReason
from orchestrator.store import (
    ALLOWED_TRANSITIONS,
    InstanceRecord,
    JobRecord,
    JobState,
    LedgerEntry,
    NoticeEvent,
    Store,
)

NS = "test"  # the namespace every store under test uses (errors name keys in it)
NOTICE = NoticeEvent(job_id="j1", at_s=1.0, instance_id="i-1", notice="rebalance")
SPEC = JobSpec(name="resnet", work_gpu_hours=10.0, max_work_rate=4.0, budget_usd=50.0)

#: Builds an empty store under test; keyword arguments `events_maxlen`, `series_maxlen`.
StoreFactory = Callable[..., Store]

EDGES = [(a, b) for a, targets in ALLOWED_TRANSITIONS.items() for b in sorted(targets)]
NON_EDGES = [(a, b) for a, b in product(JobState, JobState) if b not in ALLOWED_TRANSITIONS[a]]
#: A trim limit far below the appends of the trimming tests. Redis trims `MAXLEN ~` only whole
#: nodes of 100 entries, so it keeps between LIMIT and about LIMIT + 100 of them.
LIMIT = 10
APPENDS = 300


def job(
    job_id: str = "j1", *, now_s: float = 100.0, state: JobState = JobState.QUEUED
) -> JobRecord:
    record = JobRecord.submit(job_id, SPEC.model_dump(mode="json"), 50.0, now_s)
    return record.model_copy(update={"state": state})


def charge(
    job_id: str = "j1", instance_id: str = "i-1", start_s: float = 0.0, billed_s: float = 600.0
) -> LedgerEntry:
    price = 0.9
    return LedgerEntry(
        job_id=job_id,
        instance_id=instance_id,
        instance_type="p3.2xlarge",
        zone="us-east-1a",
        start_s=start_s,
        end_s=start_s + billed_s,
        price_usd_per_hour=price,
        billed_s=billed_s,
        charged_usd=price * billed_s / 3600.0,
        reason=EndReason.PRICE_CHANGE.value,
    )


def instance(instance_id: str, job_id: str = "j1", launched_at: float = 10.0) -> InstanceRecord:
    return InstanceRecord(
        instance_id=instance_id,
        job_id=job_id,
        allocation_id="alloc-1",
        instance_type="p3.2xlarge",
        zone="us-east-1a",
        lifecycle="spot",
        max_price_usd_per_hour=1.2,
        launched_at=launched_at,
        state="running",
    )


def run_together(n: int, fn: Callable[[int], Any]) -> tuple[list[Any], list[BaseException]]:
    """Run fn(0..n-1) on n threads released at the same instant; results and exceptions."""
    barrier = threading.Barrier(n)
    results: list[Any] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        barrier.wait()
        try:
            out = fn(i)
        except BaseException as exc:  # collected; the test asserts on them
            with lock:
                errors.append(exc)
        else:
            with lock:
                results.append(out)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    return results, errors


def stream_id(text: str) -> tuple[int, int]:
    """An event id as the pair it orders by; fails the test if it is not `"<ms>-<seq>"`."""
    match = re.fullmatch(r"(\d+)-(\d+)", text)
    assert match, f"not a stream id: {text!r}"
    return int(match[1]), int(match[2])
