"""Durable controller state: jobs, instances, the spend ledger, events, series and claims.

The controller keeps nothing that matters only in memory, so it can be killed with SIGKILL at any
moment and restarted: a restarted controller reads back every job (with its version), every live
instance, every charge and every launch still in flight from Redis.

* `protocol.Store`: the operations and their contract (what is atomic, what each one raises).
  Callers take a `Store`.
* `redis_store.RedisStore`: the `Store` in Redis (`RedisStore.connect(url)`); each write is one
  atomic Redis step (a Lua script, a MULTI/EXEC transaction or a single command), so a crash
  leaves either all of it or none of it. `redis_scripts` holds its key layout and Lua scripts,
  `redis_codec` its JSON encoding and the mapping of redis-py's errors.
* `memory.MemoryStore`: the `Store` in memory, for fast tests; the contract tests hold it to
  `RedisStore`'s behaviour.
* `checks`: the argument checks every implementation makes before anything changes.
* `models`: the job lifecycle (`JobState`, `ALLOWED_TRANSITIONS`) and the stored records.
* `events`: the typed entries of a job's event log.
* `errors`: the `StoreError` family.
"""

from orchestrator.store.errors import (
    ConflictError,
    IllegalTransitionError,
    LedgerConflictError,
    NotFoundError,
    StoreError,
    StoreUnavailableError,
)
from orchestrator.store.events import (
    DecisionEvent,
    Event,
    EventKind,
    EvictionEvent,
    LaunchEvent,
    LaunchFailedEvent,
    NoticeEvent,
    ReconcileEvent,
    ReleaseEvent,
    StallEvent,
    StateEvent,
    WorkRatesEvent,
)
from orchestrator.store.memory import MemoryStore
from orchestrator.store.models import (
    ALLOWED_TRANSITIONS,
    TERMINAL_STATES,
    Evaluation,
    InstanceRecord,
    InstanceWork,
    JobRecord,
    JobState,
    LedgerEntry,
    PipelineStageReport,
    PriceSnapshot,
    TrainingReport,
)
from orchestrator.store.protocol import Store
from orchestrator.store.redis_store import RedisStore

__all__ = [
    "ALLOWED_TRANSITIONS",
    "TERMINAL_STATES",
    "ConflictError",
    "DecisionEvent",
    "Event",
    "EventKind",
    "EvictionEvent",
    "IllegalTransitionError",
    "InstanceRecord",
    "InstanceWork",
    "JobRecord",
    "JobState",
    "LaunchEvent",
    "LaunchFailedEvent",
    "LedgerConflictError",
    "LedgerEntry",
    "MemoryStore",
    "NotFoundError",
    "NoticeEvent",
    "PriceSnapshot",
    "ReconcileEvent",
    "StallEvent",
    "WorkRatesEvent",
    "RedisStore",
    "ReleaseEvent",
    "StateEvent",
    "Store",
    "StoreError",
    "StoreUnavailableError",
    "PipelineStageReport",
    "TrainingReport",
    "Evaluation",
]
