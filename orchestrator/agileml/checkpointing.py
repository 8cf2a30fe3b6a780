"""When and from where the elasticity controller takes a job's checkpoints (`checkpoints` has the
files). Every checkpoint holds all partitions at one clock, so that resuming is exact:

* with BackupPSs (stages 2 and 3) it is free: the BackupPSs all stand at their common ceiling
  (`server_calls.advance_backups`), and each writes its partitions there;
* without (stage 1: the reliable nodes own every partition as ParamServs) the controller holds
  the horizon where it is until every partition has reached it (the workers cannot compute
  past it), has the owners write their partitions, then lets the horizon move on. The workers
  wait for the write only; failures are still handled meanwhile (the hold is re-checked at
  each step, not waited for), and a hold that does not complete in `HOLD_LIMIT_S` is dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from orchestrator.agileml.checkpoints import CheckpointSchedule
from orchestrator.agileml.control import TrainingSpec
from orchestrator.agileml.errors import AgileMLError
from orchestrator.agileml.server_calls import (
    CheckpointSource,
    NodeCall,
    owners_at,
    take_checkpoint,
)

log = logging.getLogger(__name__)

HOLD_LIMIT_S = 60.0


class Checkpointer:
    """Takes the checkpoints of one job (see the module docstring). `record(clock, seconds)`
    is told of each one taken and how long writing it took."""

    def __init__(
        self,
        spec: TrainingSpec,
        *,
        start_clock: int,
        now_s: float,
        record: Callable[[int, float], None],
    ) -> None:
        self.spec = spec
        self._schedule = CheckpointSchedule(
            spec.checkpoint_every, spec.checkpoint_every_s, start_clock - 1, now_s
        )
        self._record = record
        self._held: tuple[int, float] | None = None  # (clock, since) of a stage-1 hold

    @property
    def enabled(self) -> bool:
        return self.spec.checkpoint_dir is not None

    def hold_horizon(
        self, call: NodeCall, *, horizon: int, owners: list[str], now_s: float
    ) -> bool:
        """Stage 1: whether the horizon must stay where it is for a checkpoint at it (held
        until the owners' partitions are all there, then written)."""
        if not self.enabled:
            return False
        clock = min(horizon, self.spec.iterations - 1)
        if self._held is None:
            if not self._schedule.due(clock, now_s):
                return False
            self._held = (clock, now_s)
        clock, since = self._held
        try:
            if not owners_at(call, owners, clock):
                if now_s - since < HOLD_LIMIT_S:
                    return True
                log.warning("checkpoint dropped", extra={"clock": clock, "why": "not reached"})
            else:
                self._write(call, owners, clock, now_s, source="owned")
        except AgileMLError as exc:
            log.warning("checkpoint failed", extra={"clock": clock, "error": str(exc)})
        self._held = None
        return False

    def drop_hold(self) -> None:
        """Forget a stage-1 hold (the job has BackupPSs again)."""
        self._held = None

    def at_ceiling(self, call: NodeCall, *, backups: list[str], ceiling: int, now_s: float) -> None:
        """Stages 2 and 3: a checkpoint at the BackupPSs' common ceiling, if one is due."""
        if not self.enabled or not self._schedule.due(ceiling, now_s):
            return
        try:
            self._write(call, backups, ceiling, now_s, source="backup")
        except AgileMLError as exc:
            log.warning("checkpoint failed", extra={"clock": ceiling, "error": str(exc)})

    def _write(
        self, call: NodeCall, nodes: list[str], clock: int, now_s: float, source: CheckpointSource
    ) -> None:
        assert self.spec.checkpoint_dir is not None
        started = time.monotonic()
        take_checkpoint(
            call,
            nodes,
            root=self.spec.checkpoint_dir,
            clock=clock,
            job_id=self.spec.job_id,
            num_partitions=self.spec.num_partitions,
            source=source,
            spare=self.spec.resume_from,
        )
        self._schedule.taken(clock, now_s)
        self._record(clock, time.monotonic() - started)
