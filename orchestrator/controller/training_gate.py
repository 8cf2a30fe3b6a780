"""How a training job's tick goes, from its training's outcome: on (the work left is at least
what is not trained), failed with its runtime's error, stalled (its instances are released;
failed at the last attempt, see `controller.stall`), or done, and then succeeded only with
its final weights in the artifact store."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from orchestrator.controller.outcomes import InstanceLogs, JobTraining, TrainingOutcome
from orchestrator.controller.stall import StallWatch
from orchestrator.store.events import StallEvent
from orchestrator.store.models import InstanceRecord, JobRecord, JobState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verdict:
    """What the controller does with a training job this tick: release its instances for a
    stall (`stall`, the event to log), end it failed (`fail`, the message), or neither."""

    stall: StallEvent | None = None
    fail: str | None = None

    @property
    def stops(self) -> bool:
        """This tick is over for the job (nothing to decide)."""
        return self.stall is not None or self.fail is not None


class TrainingGate:
    """Judges the controller's training jobs (see the module docstring)."""

    def __init__(self, training: JobTraining, stalls: StallWatch) -> None:
        self.training = training
        self.stalls = stalls

    def judge(
        self,
        job: JobRecord,
        outcome: TrainingOutcome,
        alive: Sequence[InstanceRecord],
        now_s: float,
        logs: InstanceLogs | None = None,
    ) -> Verdict:
        """Failed (its training was aborted), stalled, or on."""
        if outcome.error is not None:
            return Verdict(fail=f"training failed: {outcome.error}")
        stall = self.stalls.check(job.job_id, outcome, alive, now_s)
        if stall is None:
            return Verdict()
        why = self._stall_reason(job.job_id, alive, logs)
        event = StallEvent(
            job_id=job.job_id, at_s=now_s, attempt=stall.attempt, attempts=stall.attempts,
            stalled_s=stall.stalled_s, iteration=stall.iteration,
            released=tuple(r.instance_id for r in alive), reason=why,
        )  # fmt: skip
        if not stall.fails:
            return Verdict(stall=event)
        message = (
            f"no progress: no iteration trained in {stall.stalled_s / 60:.0f} min, "
            f"{stall.attempts} times (at iteration {stall.iteration}); {why}"
        )
        return Verdict(stall=event, fail=message)

    def done(self, job: JobRecord, outcome: TrainingOutcome) -> tuple[JobState, str]:
        """How a job whose every iteration is trained ends: succeeded with its final weights
        in the artifact store (saved as its instances went; from a checkpoint if they were
        gone before), else failed saying so."""
        weights = self.training.final_weights(job.job_id)
        if weights is None:
            try:
                self.training.save_final(job.job_id)
            except Exception:  # noqa: BLE001 - the job fails with the reason below
                log.exception("saving the final weights failed", extra={"job_id": job.job_id})
            weights = self.training.final_weights(job.job_id)
        if weights is None:
            return JobState.FAILED, (
                f"trained {outcome.iterations} iterations, but the final weights could not "
                "be written to the artifact store (see the controller's log)"
            )
        return JobState.SUCCEEDED, (
            f"trained {outcome.iterations} iterations; final weights at {weights}"
        )

    def forget(self, job_id: str) -> None:
        self.stalls.forget(job_id)

    def _stall_reason(
        self, job_id: str, alive: Sequence[InstanceRecord], logs: InstanceLogs | None
    ) -> str:
        """What the job's runtime saw, and each instance's agent's last log line where the
        world can read it (offline: the local agents' logs)."""
        parts = [self.training.diagnose(job_id)]
        for rec in alive if logs is not None else ():
            line = logs.last_log_line(rec.instance_id) if logs is not None else None
            if line:
                parts.append(f"agent of {rec.instance_id}: {line}")
        return "; ".join(parts)
