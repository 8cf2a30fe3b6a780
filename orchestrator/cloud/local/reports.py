"""What the offline world's instance agents report, and where: the protocol between the agents
(`orchestrator.agent`, one process per instance) and the `LocalFleet` that sums their work.

Training runs at the speed of this machine while the world's clock may run many times faster,
so each agent also accounts for the work its instance would do on that clock (`WorkMeter`) and
writes, in one Redis transaction every report interval,

    {ns}:job:{job_id}:agent-work       hash  instance_id -> cumulative GPU-hours (a float)
    {ns}:job:{job_id}:agent-heartbeat  hash  instance_id -> `AgentHeartbeat` JSON

Each agent writes only its own field; the fleet sums the hash into the job's progress (one
writer), because the store's progress is an absolute value.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

#: Real seconds between two reports (heartbeat + work).
REPORT_INTERVAL_SECONDS = 0.5
#: σ: simulated seconds from an agent's start until it does useful work (`AppParams`).
DEFAULT_READY_AFTER_SIM_SECONDS = 240.0
#: Real seconds between metadata polls: at 600x speed, 0.2 s is 2 simulated minutes -- the
#: notice lead -- so a faster clock needs a proportionally shorter poll.
DEFAULT_NOTICE_POLL_SECONDS = 0.2


def agent_work_key(namespace: str, job_id: str) -> str:
    """The hash of the job's agents' cumulative work (field: instance id)."""
    return f"{namespace}:job:{job_id}:agent-work"


def agent_heartbeat_key(namespace: str, job_id: str) -> str:
    """The hash of the job's agents' last heartbeats (field: instance id)."""
    return f"{namespace}:job:{job_id}:agent-heartbeat"


@dataclass(frozen=True, slots=True)
class AgentHeartbeat:
    """An agent's last report: when (sim epoch seconds), its cumulative work, its pid, and
    the simulated seconds it worked for that work (0 from agents older than the field)."""

    sim_s: float
    work_gpu_hours: float
    pid: int
    worked_s: float = 0.0

    def to_json(self) -> str:
        return json.dumps(
            {
                "sim_s": self.sim_s,
                "work_gpu_hours": self.work_gpu_hours,
                "pid": self.pid,
                "worked_s": self.worked_s,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> AgentHeartbeat:
        """Parse a heartbeat value.

        Raises:
            ValueError: not the JSON object `to_json` writes.
        """
        try:
            data = json.loads(text)
            return cls(
                float(data["sim_s"]),
                float(data["work_gpu_hours"]),
                int(data["pid"]),
                float(data.get("worked_s", 0.0)),
            )
        except (TypeError, KeyError, AttributeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not an agent heartbeat: {text[:200]!r}") from exc
