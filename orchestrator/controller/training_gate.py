"""How a training job's tick goes, from its training's outcome: on (the work left is at least
what is not trained; instances whose nodes are not in its training are released, see
`controller.liveness`), failed with its runtime's error, stalled (its instances are released;
failed at the last attempt, see `controller.stall`), or done, and then succeeded only with
its final weights in the artifact store."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from orchestrator.controller.liveness import JobLiveness, LivenessWatch, SilentInstance
from orchestrator.controller.outcomes import InstanceLogs, JobTraining, TrainingOutcome
from orchestrator.controller.stall import JobStall, StallWatch
from orchestrator.errors import clip_middle
from orchestrator.store import Store
from orchestrator.store.events import StallEvent
from orchestrator.store.models import InstanceRecord, JobRecord, JobState

log = logging.getLogger(__name__)

#: Characters of a runtime's error or a stall's reason kept in the job's record and events
#: (they carry text from the nodes: a user's traceback, log lines).
MAX_REASON_CHARS = 6000
T = TypeVar("T")
#: Why a job without a `training` section fails under a controller that trains its jobs.
NOTHING_COUNTS_ITS_WORK = (
    "the job has no training section: the controller counts a job's work from the iterations "
    "it trains, so nothing would count this one's and it would pay until its budget ran out; "
    "add a `training` section naming your job file (the job contract: docs/job-contract.md)"
)


@dataclass
class JobWatch:
    """What the gate saw of one training job (kept by the job's owner, `ControllerJob`)."""

    stall: JobStall = field(default_factory=JobStall)
    liveness: JobLiveness = field(default_factory=JobLiveness)


@dataclass(frozen=True)
class Verdict:
    """What the controller does with a training job this tick: release its instances for a
    stall (`stall`, the event to log), end it failed (`fail`, the message), or neither, and
    then release the instances that do not work for it (`silent`)."""

    stall: StallEvent | None = None
    fail: str | None = None
    silent: tuple[SilentInstance, ...] = ()

    @property
    def stops(self) -> bool:
        """This tick is over for the job (nothing to decide)."""
        return self.stall is not None or self.fail is not None


@dataclass(frozen=True)
class Patience:
    """How long, on the controller's clock, a training job may run without progress before
    its instances are released (`stall_after_s`; the `stall_attempts`-th time fails it, see
    `controller.stall`), and an instance without its node in the job's training, from its
    launch (`join_grace_s`) or from when its node left (`rejoin_grace_s`), before it is
    released and replaced (see `controller.liveness`)."""

    stall_after_s: float = 600.0
    stall_attempts: int = 3
    join_grace_s: float = 900.0
    rejoin_grace_s: float = 180.0


class TrainingGate:
    """Judges the controller's training jobs (see the module docstring)."""

    @classmethod
    def of(cls, training: JobTraining, store: Store, patience: Patience) -> TrainingGate:
        """The gate of a controller over `store` (a job's stalls so far are its events)."""
        stalls = StallWatch(
            stall_after_s=patience.stall_after_s,
            attempts=patience.stall_attempts,
            stalls_so_far=lambda job_id: sum(
                1 for _, e in store.events(job_id) if isinstance(e, StallEvent)
            ),
        )
        liveness = LivenessWatch(
            join_grace_s=patience.join_grace_s, rejoin_grace_s=patience.rejoin_grace_s
        )
        return cls(training, stalls, liveness)

    def __init__(self, training: JobTraining, stalls: StallWatch, liveness: LivenessWatch) -> None:
        self.training = training
        self.stalls = stalls
        self.liveness = liveness

    def judge(
        self,
        job: JobRecord,
        watch: JobWatch,
        outcome: TrainingOutcome,
        alive: Sequence[InstanceRecord],
        now_s: float,
        logs: InstanceLogs | None = None,
        doomed: Collection[str] = (),
    ) -> Verdict:
        """Failed (its training was aborted), stalled, or on (with the instances to release
        that do not work for it; `doomed`: instances under an interruption notice). `watch`
        is what the gate saw of the job before (updated here)."""
        if outcome.error is not None:
            return Verdict(fail=clip_middle(f"training failed: {outcome.error}", MAX_REASON_CHARS))
        stall = self.stalls.check(job.job_id, watch.stall, outcome, alive, now_s)
        if stall is None:
            silent = self.liveness.check(watch.liveness, outcome, alive, doomed, now_s)
            released = self.liveness.hopeless(watch.liveness)
            if released:
                why = clip_middle(self._stall_reason(job.job_id, alive, logs), MAX_REASON_CHARS)
                return Verdict(fail=(
                    f"no progress: {released} instances released because their nodes left "
                    f"the training or never joined, with no iteration trained (at iteration "
                    f"{outcome.iterations_done}); {why}"))  # fmt: skip
            return Verdict(silent=tuple(silent))
        why = clip_middle(self._stall_reason(job.job_id, alive, logs), MAX_REASON_CHARS)
        event = StallEvent(
            job_id=job.job_id, at_s=now_s, attempt=stall.attempt, attempts=stall.attempts,
            stalled_s=stall.stalled_s, iteration=stall.iteration,
            released=tuple(r.instance_id for r in alive), reason=why,
        )  # fmt: skip
        if not stall.fails:  # a new attempt: new instances, and the runtime afresh
            self._call("restarting the runtime", lambda: self.training.restart(job.job_id))
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

        def final() -> str | None:
            return self.training.final_weights(job.job_id, outcome.iterations)

        weights = self._call("reading the final weights", final)
        if weights is None:
            self._call("saving the final weights", lambda: self.training.save_final(job.job_id))
            weights = self._call("reading the final weights", final)
        if weights is None:
            return JobState.FAILED, (
                f"trained {outcome.iterations} iterations, but the final weights could not "
                "be written to the artifact store (see the controller's log)"
            )
        return JobState.SUCCEEDED, (
            f"trained {outcome.iterations} iterations; final weights at {weights}"
        )

    @staticmethod
    def _call(what: str, call: Callable[[], T]) -> T | None:
        """A call into the training host that must not end the tick (an artifact store's
        hiccup, a runtime that will not stop): logged, None."""
        try:
            return call()
        except Exception:  # noqa: BLE001 - the controller goes on with the other jobs
            log.exception("training host: %s failed", what)
            return None

    def _stall_reason(
        self, job_id: str, alive: Sequence[InstanceRecord], logs: InstanceLogs | None
    ) -> str:
        """What the job's runtime saw, and each instance's agent's last log line where the
        world can read it (offline: the local agents' logs)."""
        parts = [self._call("diagnosing", lambda: self.training.diagnose(job_id)) or ""]
        for rec in alive if logs is not None else ():
            line = logs.last_log_line(rec.instance_id) if logs is not None else None
            if line:
                parts.append(f"agent of {rec.instance_id}: {line}")
        return "; ".join(parts)
