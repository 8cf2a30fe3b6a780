"""Pay only for work, end to end: in the offline world (Redis, moto, real agents training the
demo's job with AgileML), one spot instance's agent is SIGKILLed while its instance stays up.
The controller releases that instance once its node has left the job's training, says why,
buys a working one, and the job trains on with a node on it (`benchmarks.killed_agent`; the
run ends there: the demo's tests train the job to its end through evictions)."""

from __future__ import annotations

import pytest

from benchmarks.killed_agent import run_once


@pytest.mark.slow
@pytest.mark.ci
def test_an_instance_whose_agent_was_killed_is_released_and_replaced() -> None:
    # killed early in a long run: the job must outlast the release (tens of real seconds on a
    # busy machine), since its reliable node trains on meanwhile. The killed node may be one
    # still loading the job (a replacement after an eviction): it is released all the same
    run = run_once(kill_at=0.05, seed=1, speed=300.0, timeout_s=280.0, iterations=2000,
                   spare_killed=True, until_replaced=True)  # fmt: skip
    assert run["state"] == "running", run  # neither failed nor ended before the replacement
    killed = run["killed"]
    assert killed["replaced_with"], run  # a node of an instance bought after the kill trains
    assert 0.05 <= run["work_done_fraction"] < 1.0, run
    assert killed["end_reason"] == "released", run
    assert "left the job's training" in killed["why"][0], run
    # released a few real seconds after its node left (the offline world's 5 s rejoin grace,
    # at 300x), with a minute to spare for a busy machine
    assert killed["ended_at_s"] - killed["at_s"] < 65 * 300.0, run
    assert run["instances_launched"] >= 3, run  # a working instance bought in its place
