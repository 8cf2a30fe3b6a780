"""The soak's instance agents and their jobs' training, simulated on the soak's clock.

Every instance of a running job gets an agent when EC2 first shows it running; once the
instance has been up σ (the job's `app.add_overhead_s`) its agent is a member of the job's
training, and a GPU instance's member trains at its type's work rate. The controller sees the
training through the port it sees the training host through (`JobTraining`): how many of the
job's iterations are trained (`ITERATIONS_PER_GPU_HOUR`), which instances' nodes are members
now, and the final weights once every iteration is trained. So the controller's own liveness
and stall checks (`controller.training_gate`) judge the soak's instances.

The fault: an agent is SIGKILLed while its instance stays up (`kill`); sometimes systemd
restarts it inside the rejoin grace (`back_at`), else it stays dead. The invariant
(`overdue`): no instance runs on without a live agent past the controller's graces (from its
launch to join, from its agent's death to rejoin, and from a new controller's first tick for
each, as a restarted controller gives) and `OVERDUE_TICKS` ticks more.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from orchestrator.controller.outcomes import TrainingOutcome
from orchestrator.controller.training_gate import Patience
from orchestrator.market.catalog import Catalog
from orchestrator.store import JobRecord, Store, StoreError
from orchestrator.units import SECONDS_PER_HOUR

#: A job of W GPU-hours of work trains W times this many iterations.
ITERATIONS_PER_GPU_HOUR = 100
#: An instance without a live agent may still run this many controller ticks past its grace
#: (the tick that first sees it gone, and the one that releases it).
OVERDUE_TICKS = 3
DEFAULT_SIGMA_S = 240.0


@dataclass
class _Agent:
    job_id: str
    instance_type: str
    launched_at: float
    dead_since: float | None = None
    back_at: float | None = None  # systemd restarts it then (None: it stays dead)
    member_once: bool = False
    ticks_overdue: int = 0  # controller ticks seen past its graces while it ran without one

    def alive(self, now_s: float) -> bool:
        if self.dead_since is None:
            return True
        if self.back_at is not None and now_s >= self.back_at:
            self.dead_since = self.back_at = None
            return True
        return False


@dataclass
class SimulatedTraining:
    """The soak's jobs' training (a `JobTraining`) and their instances' agents."""

    store: Store
    patience: Patience
    catalog: Catalog = field(default_factory=Catalog.load)
    agents: dict[str, _Agent] = field(default_factory=dict)  # instance id -> its agent
    trained_gpu_h: dict[str, float] = field(default_factory=dict)
    saved: set[str] = field(default_factory=set)  # jobs whose final weights were kept
    restarts: Counter[str] = field(default_factory=Counter)
    sigma_s: dict[str, float] = field(default_factory=dict)  # job -> σ
    overdue: set[str] = field(default_factory=set)  # instances that broke the invariant
    released_s: list[float] = field(default_factory=list)  # agent death -> instance gone
    running: frozenset[str] = frozenset()  # running in EC2 at the last `advance`
    now_s: float = 0.0

    # -- the world ------------------------------------------------------------------------

    def advance(
        self, running: Mapping[str, tuple[str, str, float]], now_s: float, dt: float
    ) -> None:
        """EC2 runs `running` (instance -> (job, type, launch time)) at `now_s`, `dt` after
        the last call: new instances get agents, members train for `dt`."""
        self.now_s = now_s
        for iid, (job_id, itype, launched) in running.items():
            self.agents.setdefault(iid, _Agent(job_id, itype, launched))
        for iid, agent in list(self.agents.items()):
            if iid not in running:
                if agent.dead_since is not None:
                    self.released_s.append(now_s - agent.dead_since)
                del self.agents[iid]  # the instance is gone, its agent with it
        self.running = frozenset(running)
        for agent in self.agents.values():
            if self._member(agent, now_s):
                work = self.catalog.work_rate(agent.instance_type) * max(dt, 0.0)
                trained = self.trained_gpu_h.get(agent.job_id, 0.0)
                self.trained_gpu_h[agent.job_id] = trained + work / SECONDS_PER_HOUR

    def kill(self, rng: random.Random, now_s: float, tick_s: float) -> str | None:
        """SIGKILL a live agent (its instance stays up); a third come back before the rejoin
        grace ends. The instance, or None when no agent lives."""
        live = sorted(i for i, a in self.agents.items() if a.alive(now_s))
        if not live:
            return None
        iid = rng.choice(live)
        agent = self.agents[iid]
        agent.dead_since = now_s
        if rng.random() < 1 / 3:
            latest = max(self.patience.rejoin_grace_s - tick_s, tick_s)
            agent.back_at = now_s + rng.uniform(tick_s, latest)
        return iid

    def ticked(self, now_s: float, born_s: float, tick_s: float, doomed: set[str]) -> None:
        """A controller ticked at `now_s` (its first tick at `born_s`): count the instances
        still running without a live agent past its graces (`overdue`)."""
        p = self.patience
        for iid, agent in self.agents.items():
            if agent.alive(now_s) or iid in doomed or iid not in self.running:
                continue
            join = max(agent.launched_at, born_s) + p.join_grace_s
            rejoin = max(agent.dead_since or now_s, born_s) + p.rejoin_grace_s + tick_s
            due = max(join, rejoin) if agent.member_once else join
            if now_s <= due:  # inside a grace (a new controller's too): start again
                agent.ticks_overdue = 0
                continue
            agent.ticks_overdue += 1
            if agent.ticks_overdue >= OVERDUE_TICKS:
                self.overdue.add(iid)

    def _member(self, agent: _Agent, now_s: float) -> bool:
        if not agent.alive(now_s):
            return False
        sigma = self._sigma(agent.job_id)
        if now_s - agent.launched_at < sigma:
            return False
        agent.member_once = True
        return True

    def _sigma(self, job_id: str) -> float:
        """σ of the job (its spec never changes: read once)."""
        if job_id not in self.sigma_s:
            try:
                spec = self.store.get_job(job_id).spec
            except StoreError:
                return DEFAULT_SIGMA_S
            self.sigma_s[job_id] = float(spec.get("app", {}).get("add_overhead_s", DEFAULT_SIGMA_S))
        return self.sigma_s[job_id]

    # -- the controller's port (`JobTraining`) -----------------------------------------------

    def tags_for(self, job_id: str) -> Mapping[str, str]:
        return {}

    def save_final(self, job_id: str) -> None:
        if self._iterations_done(job_id) >= self._iterations(job_id):
            self.saved.add(job_id)

    def outcome(self, job: JobRecord) -> TrainingOutcome | None:
        job_id, now = job.job_id, self.now_s
        iterations = self._iterations(job_id, job)
        done = min(self._iterations_done(job_id), iterations)
        ours = {i: a for i, a in self.agents.items() if a.job_id == job_id}
        members = frozenset(i for i, a in ours.items() if a.alive(now) and a.member_once)
        heard = frozenset(i for i, a in ours.items() if a.member_once)
        return TrainingOutcome(done, iterations, done=done >= iterations, nodes_heard=len(heard),
                               members=members, heard=heard)  # fmt: skip

    def final_weights(self, job_id: str, iterations: int) -> str | None:
        return f"sim://chaos/{job_id}/model.safetensors" if job_id in self.saved else None

    def restart(self, job_id: str) -> None:
        self.restarts[job_id] += 1  # from its newest checkpoint: the soak's is every iteration

    def diagnose(self, job_id: str) -> str:
        members = sum(1 for a in self.agents.values() if a.job_id == job_id and a.alive(self.now_s))
        return f"simulated runtime: {members} live agents"

    def _iterations(self, job_id: str, job: JobRecord | None = None) -> int:
        job = job if job is not None else self.store.get_job(job_id)
        work = float(job.spec.get("work_gpu_hours", 0.0))
        return max(1, math.ceil(work * ITERATIONS_PER_GPU_HOUR))

    def _iterations_done(self, job_id: str) -> int:
        return math.floor(self.trained_gpu_h.get(job_id, 0.0) * ITERATIONS_PER_GPU_HOUR)
