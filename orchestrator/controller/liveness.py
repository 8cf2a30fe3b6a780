"""Pay only for work: an instance whose node its job's runtime does not count as a member (it
never joined, or it failed and did not come back) is released, so that BidBrain buys a working
one in its place, instead of paying on while the instance stands idle.

Liveness is the runtime's own view (`TrainingOutcome.members`): a node is a member while it
heartbeats (its failure detector, not a fixed timeout here, decides when a silent node has
failed: slow is not dead). The watch then gives an instance

- `join_grace_s` from its launch for its node to join (boot, setup, loading the job), and
- `rejoin_grace_s` from when its node was first seen gone for it to come back (systemd
  restarts a dead agent on AWS),

both on the controller's clock. A job first seen by this controller (after a restart) gives each
of its instances a fresh join grace from that moment, so a restart never releases a working
instance whose node has not reconnected yet. Instances under an interruption notice, and jobs
whose runtime is not live or has trained every iteration, are left alone. A job that has
released `MAX_RELEASE_ROUNDS_WITHOUT_PROGRESS` fleets' worth of instances (its most instances
alive at once, at least two) without training an iteration in between fails (`hopeless`): its
nodes die however often they are replaced.

    watch = LivenessWatch(join_grace_s=900.0, rejoin_grace_s=180.0)
    seen = JobLiveness()  # the job's own (its `ControllerJob` keeps it)
    for silent in watch.check(seen, outcome, alive, doomed, now_s):
        release(silent.instance, why=silent.why)
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from orchestrator.controller.outcomes import TrainingOutcome
from orchestrator.store.models import InstanceRecord


@dataclass(frozen=True)
class SilentInstance:
    """An instance to release: its node is not a member of its job's runtime (`why`)."""

    instance: InstanceRecord
    unheard_s: float
    joined_before: bool

    @property
    def why(self) -> str:
        if self.joined_before:
            return (
                f"its node left the job's training {self.unheard_s:.0f} s ago and did not "
                "come back (its agent or node died, or it was taken for failed)"
            )
        return (
            f"its node did not join the job's training in the {self.unheard_s:.0f} s since "
            "launch (its agent did not start, or died before joining)"
        )


#: Fleets' worth of instances released for their nodes with no iteration trained in between:
#: the job fails (nodes that keep dying after they join, e.g. killed loading its data, would
#: otherwise be replaced until the budget is gone). Counted in fleets (the most instances the
#: job had alive at once, at least `MIN_FLEET`): a job of eight one-GPU instances is replaced
#: as often as one of two, whether its instances die together or one by one.
MAX_RELEASE_ROUNDS_WITHOUT_PROGRESS = 3
MIN_FLEET = 2


@dataclass
class JobLiveness:
    """What the watch saw of one job's instances and nodes (kept by the job's owner)."""

    first_seen_s: float | None = None  # the watch's first check of the job
    members_seen: set[str] = field(default_factory=set)  # instances seen a member once
    absent_at: dict[str, float] = field(default_factory=dict)  # first seen gone after that
    iterations: int = -1
    released_since_progress: int = 0
    fleet: int = MIN_FLEET  # the most instances alive at once since its last iteration


class LivenessWatch:
    """Finds the instances whose nodes a training job's runtime does not count (see the
    module docstring); what it saw of a job is the job's `JobLiveness`."""

    def __init__(self, *, join_grace_s: float, rejoin_grace_s: float) -> None:
        if not (join_grace_s > 0 and rejoin_grace_s > 0):
            raise ValueError("join_grace_s and rejoin_grace_s must be positive")
        self.join_grace_s = join_grace_s
        self.rejoin_grace_s = rejoin_grace_s

    def check(
        self,
        seen: JobLiveness,
        outcome: TrainingOutcome,
        alive: Sequence[InstanceRecord],
        doomed: Collection[str],
        now_s: float,
    ) -> list[SilentInstance]:
        """The job's instances to release now (see the module docstring)."""
        if outcome.members is None or not outcome.live or outcome.trained:
            return []
        if seen.first_seen_s is None:
            seen.first_seen_s = now_s
        if outcome.iterations_done != seen.iterations:
            seen.iterations, seen.released_since_progress = outcome.iterations_done, 0
            seen.fleet = MIN_FLEET
        alive_ids = {r.instance_id for r in alive}
        seen.members_seen &= alive_ids
        for gone in [i for i in seen.absent_at if i not in alive_ids]:
            del seen.absent_at[gone]
        silent = []
        for rec in alive:
            iid = rec.instance_id
            if iid in outcome.members:
                seen.members_seen.add(iid)
                seen.absent_at.pop(iid, None)
                continue
            if iid in doomed:
                continue
            joined = iid in seen.members_seen or iid in outcome.heard
            if joined:  # from when it was first seen gone, not its last tick as a member
                since, grace = seen.absent_at.setdefault(iid, now_s), self.rejoin_grace_s
            else:
                since, grace = max(rec.launched_at, seen.first_seen_s), self.join_grace_s
            if now_s - since > grace:
                silent.append(SilentInstance(rec, now_s - since, joined_before=joined))
        seen.released_since_progress += len(silent)
        seen.fleet = max(seen.fleet, len(alive))
        return silent

    @staticmethod
    def hopeless(seen: JobLiveness) -> int:
        """How many instances the job had released since its last iteration, once they are
        `MAX_RELEASE_ROUNDS_WITHOUT_PROGRESS` fleets' worth or more (it should fail); 0
        otherwise."""
        enough = MAX_RELEASE_ROUNDS_WITHOUT_PROGRESS * seen.fleet
        return seen.released_since_progress if seen.released_since_progress >= enough else 0
