"""Pipeline-parallel training (PipeDream, seed 001 §3): profile a layer chain, plan its stages.

`profiler` (per-layer forward/backward ms, activation and parameter bytes; PROFILE.json) and
`planner` (PipeDream's hierarchical DP: stages, replicas per stage, NOAM). Nothing here imports
torch until `profile_sequential` runs.
"""

from orchestrator.agileml.pipeline.planner import Plan, PlanError, PlannedStage, plan, stage_time_ms
from orchestrator.agileml.pipeline.profiler import (
    LayerProfile,
    ModelProfile,
    ProfileError,
    profile_sequential,
)

__all__ = [
    "LayerProfile",
    "ModelProfile",
    "Plan",
    "PlanError",
    "ProfileError",
    "PlannedStage",
    "plan",
    "profile_sequential",
    "stage_time_ms",
]
