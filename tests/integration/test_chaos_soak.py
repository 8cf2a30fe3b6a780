"""The chaos soak's short version (`python -m benchmarks.chaos_soak --short`): the control plane
and the AgileML runtime through random faults, every invariant held."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks.chaos_soak import soak


@pytest.mark.slow
def test_a_short_chaos_soak_keeps_every_invariant() -> None:
    result = soak(faults=66, runtime_faults=6, seed=1, max_wall_s=300.0, jobs=3)
    print({k: result[k] for k in ("faults", "by_kind", "recovery_s_p50", "recovery_s_p99")})
    assert result["faults"] >= 66
    world, runtime = result["control_plane"], result["runtime"]
    # the kinds the soak is about all happened
    kinds = set(result["by_kind"])
    assert {"controller_killed", "redis_restart", "agent_killed", "second_controller",
            "controller_rewound", "long_lag"} <= kinds, kinds  # fmt: skip
    assert any(k.startswith("ec2_") for k in kinds) and any(k.startswith("notice") for k in kinds)
    assert world["tick_errors_unexpected"] == 0, world["tick_errors"]
    if result["hung"] or result["unexpected_aborts"]:  # whole, where pytest's message is cut
        found = {"runtime": {k: runtime.get(k) for k in ("hung_details", "abort_reasons")},
                 "control_plane": world.get("hung")}  # fmt: skip
        print(json.dumps(found, default=str, indent=1), file=sys.stderr)
    for invariant in ("lost_updates", "double_applied", "orphans", "unbilled_or_double_billed",
                      "hung", "ended_without_reason", "unexpected_aborts", "paid_without_agent",
                      "acted_without_lease", "other_id_admitted", "slow_takeovers", "no_leader",
                      "clock_ran_back", "spend_went_down"):  # fmt: skip
        # the parts' details first: pytest cuts a long message, and these say what went wrong
        details = {k: runtime.get(k) for k in ("hung_details", "abort_reasons", "jobs")}
        assert result[invariant] == 0, (invariant, details, world.get("hung"), result)
    assert result["over_budget_usd"] == 0.0, (world["overran_after"], result)
    assert world["takeover_s"]["n"] > 0, world["takeover_s"]  # the standby took over
    assert runtime["succeeded"] + runtime["aborted_with_reason"] == runtime["jobs"], runtime
    assert runtime["inexact_jobs"] == 0, runtime
