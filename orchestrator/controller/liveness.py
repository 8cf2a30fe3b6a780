"""Pay only for work: an instance whose node its job's runtime does not count as a member (it
never joined, or it failed and did not come back) is released, so that BidBrain buys a working
one in its place, instead of paying on while the instance stands idle.

Liveness is the runtime's own view (`TrainingOutcome.members`): a node is a member while it
heartbeats (its failure detector, not a fixed timeout here, decides when a silent node has
failed: slow is not dead). The watch then gives an instance

- `join_grace_s` from its launch for its node to join (boot, setup, loading the job), and
- `rejoin_grace_s` after its node was last a member for it to come back (systemd restarts a
  dead agent on AWS),

both on the controller's clock. A job first seen by this controller (after a restart) gives each
of its instances a fresh join grace from that moment, so a restart never releases a working
instance whose node has not reconnected yet. Instances under an interruption notice, and jobs
whose runtime is not live or has trained every iteration, are left alone.

    watch = LivenessWatch(join_grace_s=900.0, rejoin_grace_s=180.0)
    for silent in watch.check(job_id, outcome, alive, doomed, now_s):
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


@dataclass
class _JobSeen:
    first_seen_s: float
    member_at: dict[str, float] = field(default_factory=dict)  # instance -> last seen a member


class LivenessWatch:
    """Tracks which instances' nodes each training job's runtime counts (see the module
    docstring)."""

    def __init__(self, *, join_grace_s: float, rejoin_grace_s: float) -> None:
        if not (join_grace_s > 0 and rejoin_grace_s > 0):
            raise ValueError("join_grace_s and rejoin_grace_s must be positive")
        self.join_grace_s = join_grace_s
        self.rejoin_grace_s = rejoin_grace_s
        self._jobs: dict[str, _JobSeen] = {}

    def check(
        self,
        job_id: str,
        outcome: TrainingOutcome,
        alive: Sequence[InstanceRecord],
        doomed: Collection[str],
        now_s: float,
    ) -> list[SilentInstance]:
        """The job's instances to release now (see the module docstring)."""
        if outcome.members is None or not outcome.live or outcome.trained:
            return []
        seen = self._jobs.setdefault(job_id, _JobSeen(now_s))
        alive_ids = {r.instance_id for r in alive}
        for gone in [i for i in seen.member_at if i not in alive_ids]:
            del seen.member_at[gone]
        silent = []
        for rec in alive:
            if rec.instance_id in outcome.members:
                seen.member_at[rec.instance_id] = now_s
                continue
            if rec.instance_id in doomed:
                continue
            last = seen.member_at.get(rec.instance_id)
            if last is None:
                since = max(rec.launched_at, seen.first_seen_s)
                grace = self.join_grace_s
            else:
                since, grace = last, self.rejoin_grace_s
            if now_s - since > grace:
                silent.append(SilentInstance(rec, now_s - since, joined_before=last is not None))
        return silent

    def forget(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)
