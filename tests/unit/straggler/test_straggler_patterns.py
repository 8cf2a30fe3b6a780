"""Injected straggler patterns, driven by a fake clock whose sleep only advances time."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter, ValidationError

from orchestrator.straggler.patterns import (
    DisruptedMachine,
    InjectedWork,
    NoStragglers,
    Pacer,
    PowerLaw,
    SlowWorker,
    StragglerPattern,
    UnevenWorkload,
)

NOMINAL_S = 1.0


class FakeClock:
    """`now` and `sleep` for a pacer: sleeping records the duration and advances the clock."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.t += seconds


def pacer(
    pattern: object, *, worker: str = "w0", seed: int = 0, clock: FakeClock | None = None
) -> Pacer:
    work = InjectedWork.model_validate({"pattern": pattern, "row_ms": 2.0, "seed": seed})
    fake = clock or FakeClock()
    return Pacer(work, worker=worker, nominal_iteration_s=NOMINAL_S, now=fake.now, sleep=fake.sleep)


def slow_periods(p: Pacer, clock: FakeClock, iterations: int) -> list[float]:
    """Run `iterations` nominal iterations (10 chunks of 50 rows at 2 ms, 1 s in all); return
    each chunk's multiplier."""
    out = []
    for it in range(iterations):
        for i in range(10):
            span = (i / 10, (i + 1) / 10)
            secs = p.work(50, clock=it, rank=0, workers=1, owner_rank=0, own_fraction=span)
            out.append(secs / 0.1)
    return out


@pytest.mark.parametrize(
    ("model", "kwargs", "field"),
    [
        (PowerLaw, {"alpha": 2}, "alpha"),
        (SlowWorker, {"delay_percent": -1}, "delay_percent"),
        (SlowWorker, {"delay_percent": 50, "probability": 1.5}, "probability"),
        (SlowWorker, {"delay_percent": 50, "points_per_iteration": 0}, "points_per_iteration"),
        (DisruptedMachine, {"delay_percent": 50, "period_s": 0}, "period_s"),
        (DisruptedMachine, {"delay_percent": 50, "machines": 0}, "machines"),
        (UnevenWorkload, {"heavy_share": 0.5}, "heavy_share"),
        (InjectedWork, {"row_ms": 0}, "row_ms"),
        (NoStragglers, {"extra": 1}, "extra"),
    ],
)
def test_invalid_settings_name_the_field(model: type, kwargs: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        model(**kwargs)


def test_power_law_alpha_error_says_mean_is_infinite() -> None:
    with pytest.raises(ValidationError, match="mean iteration time is infinite"):
        PowerLaw(alpha=1.5)


def test_patterns_are_frozen() -> None:
    with pytest.raises(ValidationError):
        SlowWorker(delay_percent=50).delay_percent = 10


def test_union_parses_each_kind_from_a_dict() -> None:
    adapter: TypeAdapter[object] = TypeAdapter(StragglerPattern)
    assert adapter.validate_python({"kind": "none"}) == NoStragglers()
    assert adapter.validate_python({"kind": "slow_worker", "delay_percent": 100}) == SlowWorker(
        delay_percent=100
    )
    assert isinstance(
        adapter.validate_python({"kind": "disrupted_machine", "delay_percent": 1}), DisruptedMachine
    )
    assert adapter.validate_python({"kind": "power_law", "alpha": 11}) == PowerLaw(alpha=11)
    assert adapter.validate_python({"kind": "uneven"}) == UnevenWorkload()
    with pytest.raises(ValidationError, match="kind"):
        adapter.validate_python({"kind": "bogus"})
    assert InjectedWork.model_validate({"pattern": {"kind": "uneven"}}).pattern == UnevenWorkload()


def test_no_stragglers_sleeps_exactly_rows_times_row_ms() -> None:
    clock = FakeClock()
    p = pacer({"kind": "none"}, clock=clock)
    assert p.work(7, clock=0, rank=2, workers=4, owner_rank=1, own_fraction=(0, 0.5)) == 0.014
    assert p.work(3, clock=0, rank=2, workers=4, owner_rank=3) == pytest.approx(0.006)
    assert clock.sleeps == [0.014, pytest.approx(0.006)]
    assert p.busy_s == pytest.approx(0.020)


def test_slow_worker_certain_slowdown_starts_at_first_delay_point() -> None:
    clock = FakeClock()
    p = pacer({"kind": "slow_worker", "delay_percent": 100, "probability": 1.0}, clock=clock)
    start = clock.t
    assert p.multiplier(0, 0, 1) == 1.0
    assert p.work(1, clock=0, rank=0, workers=1, owner_rank=0, own_fraction=(0.0, 0.01)) == 0.004
    assert 0.0 <= p._slow_until - start <= 2.0 * NOMINAL_S
    assert p.multiplier(0, 0, 1) == 2.0
    clock.t = start + 2.0 * NOMINAL_S + 1e-9
    assert p.multiplier(0, 0, 1) == 1.0


def test_slow_worker_with_zero_probability_is_never_slow() -> None:
    clock = FakeClock()
    p = pacer({"kind": "slow_worker", "delay_percent": 100, "probability": 0.0}, clock=clock)
    assert all(m == pytest.approx(1.0) for m in slow_periods(p, clock, 20))


def test_slow_worker_same_seed_replays_and_workers_draw_independently() -> None:
    pattern = {"kind": "slow_worker", "delay_percent": 100, "probability": 0.05}
    runs: dict[tuple[str, int], list[list[float]]] = {}
    for worker, seed in [("w0", 0), ("w0", 0), ("w1", 0), ("w0", 1)]:
        clock = FakeClock()
        runs.setdefault((worker, seed), []).append(
            slow_periods(pacer(pattern, worker=worker, seed=seed, clock=clock), clock, 30)
        )
    first, again = runs[("w0", 0)]
    assert first == again
    assert {round(m, 9) for m in first} == {1.0, 2.0}
    assert runs[("w1", 0)][0] != first
    assert runs[("w0", 1)][0] != first


def test_delay_points_are_crossed_once_each(monkeypatch: pytest.MonkeyPatch) -> None:
    p = pacer({"kind": "slow_worker", "delay_percent": 100, "probability": 0.5})
    crossed: list[tuple[int, int]] = []
    monkeypatch.setattr(p, "_draw_slow_period", lambda _, clock, k: crossed.append((clock, k)))
    kw = {"clock": 0, "rank": 0, "workers": 1, "owner_rank": 0}
    p.work(1, own_fraction=(0.05, 0.15), **kw)
    assert crossed == [(0, 1)]
    p.work(1, own_fraction=(0.0, 0.3), **kw)  # re-covers point 1: not redrawn
    assert crossed == [(0, 1), (0, 0), (0, 2)]
    p.work(1, own_fraction=(0.3, 1.0), **kw)
    assert [k for _, k in crossed] == [1, 0, 2, 3, 4, 5, 6, 7, 8, 9]
    p.work(1, own_fraction=(0.0, 0.1), **{**kw, "clock": 1})  # a new iteration: points again
    assert crossed[-1] == (1, 0)


def test_help_chunks_start_no_period_but_are_slowed_during_one() -> None:
    clock = FakeClock()
    p = pacer({"kind": "slow_worker", "delay_percent": 50, "probability": 1.0}, clock=clock)

    def help_chunk() -> float:
        return p.work(1, clock=0, rank=0, workers=2, owner_rank=1)

    for _ in range(100):
        assert help_chunk() == 0.002
    start = clock.t
    p.work(1, clock=0, rank=0, workers=2, owner_rank=0, own_fraction=(0.0, 0.001))
    clock.t = start  # back to the period's start: it is surely still running
    assert p._slow_until > start
    assert help_chunk() == pytest.approx(0.003)


def test_power_law_is_a_pure_function_of_seed_worker_and_clock() -> None:
    a, b = pacer({"kind": "power_law", "alpha": 3}), pacer({"kind": "power_law", "alpha": 3})
    draws = [a.multiplier(c, 0, 1) for c in range(50)]
    assert all(t >= 1.0 for t in draws)
    assert draws == [b.multiplier(c, 0, 1) for c in reversed(range(50))][::-1]
    other = pacer({"kind": "power_law", "alpha": 3}, worker="w1")
    assert draws != [other.multiplier(c, 0, 1) for c in range(50)]
    assert a.work(10, clock=7, rank=0, workers=1, owner_rank=0) == pytest.approx(0.02 * draws[7])


@pytest.mark.parametrize("alpha", [4.0, 7.0])
def test_power_law_mean_matches_theory(alpha: float) -> None:
    p = pacer({"kind": "power_law", "alpha": alpha}, seed=3)
    n = 20_000
    mean = sum(p.multiplier(c, 0, 1) for c in range(n)) / n
    assert mean == pytest.approx((alpha - 1) / (alpha - 2), rel=0.05)


def test_disrupted_machine_state_is_shared_per_machine_and_window() -> None:
    clock = FakeClock(0.0)
    pattern = {"kind": "disrupted_machine", "delay_percent": 200, "probability": 0.5, "machines": 4}
    p, q = pacer(pattern, worker="a", clock=clock), pacer(pattern, worker="b", clock=clock)
    states = []
    for window in range(40):
        clock.t = window * 20.0 + 3.0
        m0 = p.multiplier(0, 0, 8)
        assert m0 in (1.0, 3.0)
        assert q.multiplier(5, 4, 8) == m0  # rank 4 also lives on machine 0
        clock.t = window * 20.0 + 19.9  # same window, same state
        assert p.multiplier(1, 0, 8) == m0
        states.append(tuple(p.multiplier(0, r, 8) for r in range(4)))
    assert len(set(states)) > 1
    assert {m for s in states for m in s} == {1.0, 3.0}


@pytest.mark.parametrize(("probability", "expected"), [(0.0, 1.0), (1.0, 1.5)])
def test_disrupted_machine_probability_extremes(probability: float, expected: float) -> None:
    clock = FakeClock(0.0)
    pattern = {"kind": "disrupted_machine", "delay_percent": 50, "probability": probability}
    p = pacer(pattern, clock=clock)
    for t in range(0, 400, 7):
        clock.t = float(t)
        assert {p.multiplier(0, r, 8) for r in range(8)} == {expected}


def test_uneven_workload_heavy_half_does_heavy_share() -> None:
    clock = FakeClock()
    p = pacer({"kind": "uneven", "heavy_share": 0.75}, clock=clock)
    costs = [p.work(10, clock=0, rank=5, workers=8, owner_rank=o) for o in range(8)]
    assert sum(costs[:4]) / sum(costs) == pytest.approx(0.75)
    assert sum(costs) / 8 == pytest.approx(0.02)  # mean factor 1
    assert p.work(10, clock=0, rank=0, workers=1, owner_rank=0) == pytest.approx(0.02)


def test_bad_ranks_and_spans_are_refused() -> None:
    p = pacer({"kind": "slow_worker", "delay_percent": 10})
    with pytest.raises(ValueError, match="owner_rank"):
        p.work(1, clock=0, rank=0, workers=2, owner_rank=2)
    with pytest.raises(ValueError, match="rank"):
        p.multiplier(0, 3, 2)
    with pytest.raises(ValueError, match="own_fraction"):
        p.work(1, clock=0, rank=0, workers=1, owner_rank=0, own_fraction=(0.5, 0.2))
    with pytest.raises(ValueError, match="nominal_iteration_s"):
        Pacer(InjectedWork(), worker="w", nominal_iteration_s=0)
