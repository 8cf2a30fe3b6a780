"""What the controller asks of a job's training (the training host answers): where its
instances find its runtime, its weights kept before they go, and how far it trained.

A job that trains ends `succeeded` only when every iteration is trained and its final weights
are in the artifact store, and `failed` with the runtime's reason (the user's error, with its
traceback's end) when its training was aborted: never from work counted some other way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from orchestrator.store.models import JobRecord


@dataclass(frozen=True)
class TrainingOutcome:
    """How far a job's training is: `iterations_done` of `iterations`, whether the runtime
    finished them all (`done`) and, if it was aborted, why (`error`)."""

    iterations_done: int
    iterations: int
    done: bool = False
    error: str | None = None
    # from the job's live runtime (False: its last report, read back after a restart): only a
    # live runtime's figures tell whether it is progressing
    live: bool = True
    nodes_heard: int = 0  # nodes the runtime has heard from: a new one is a sign of life
    # the instances whose nodes the live runtime counts as members now (heartbeating);
    # None: not known (a runtime that does not say, or not live)
    members: frozenset[str] | None = None
    # every node the runtime has heard from (joined at some time): one not among the members
    # left, even if no tick of the controller saw it a member
    heard: frozenset[str] = frozenset()

    @property
    def trained(self) -> bool:
        """Every iteration trained, nothing aborted."""
        return self.done and self.error is None

    @property
    def untrained_fraction(self) -> float:
        """The share of the job's iterations not trained yet: 0 once trained, and never 0
        before (the last iterations count as half of one until the runtime says done)."""
        if self.trained:
            return 0.0
        done = min(max(self.iterations_done, 0), self.iterations)
        return max(1.0 - done / self.iterations, 0.5 / self.iterations)


class JobTraining(Protocol):
    """The controller's one port to the jobs' training (`controller.training.TrainingHost`)."""

    def tags_for(self, job_id: str) -> Mapping[str, str]:
        """More launch tags for the job's next instance (where its runtime listens)."""
        ...

    def save_final(self, job_id: str) -> None:
        """Keep the job's final weights now, before its instances go (an error is logged by
        the caller, and the instances go all the same)."""
        ...

    def outcome(self, job: JobRecord) -> TrainingOutcome | None:
        """How far the job trained; None for a job that does not train."""
        ...

    def final_weights(self, job_id: str, iterations: int) -> str | None:
        """Where the job's final weights are in the artifact store, if they hold all of its
        `iterations` (None: not there, or older ones, such as a checkpoint's)."""
        ...

    def restart(self, job_id: str) -> None:
        """Start the job's runtime afresh (from its newest checkpoint), for a new attempt
        after its instances were released for want of progress."""
        ...

    def diagnose(self, job_id: str) -> str:
        """One line on what the job's runtime sees (for a stall's event)."""
        ...


class InstanceLogs(Protocol):
    """Where the world can read an instance's agent's log (offline: the local agents')."""

    def last_log_line(self, instance_id: str) -> str | None:
        """The agent's last log line (None: not known)."""
        ...
