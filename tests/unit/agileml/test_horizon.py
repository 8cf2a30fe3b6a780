"""The horizon's span follows the iteration rate: a few heartbeats of work, never fewer clocks
than the job's `horizon_clocks`."""

from __future__ import annotations

import pytest

from orchestrator.agileml.horizon import HEARTBEATS_AHEAD, MAX_SPAN_CLOCKS, HorizonSpan


def test_slow_iterations_keep_the_minimum_span() -> None:
    span = HorizonSpan(8, heartbeat_s=0.1)
    assert span.clocks == 8  # nothing measured yet
    for second in range(5):
        span.observe(second, float(second))  # one clock per second
    assert span.clocks == 8


def test_fast_iterations_widen_the_span_to_a_few_heartbeats_of_work() -> None:
    span = HorizonSpan(8, heartbeat_s=0.1)
    for step in range(30):
        span.observe(step * 5, step * 0.1)  # 50 clocks per second
    assert span.clocks == round(50 * HEARTBEATS_AHEAD * 0.1)


def test_clocks_heard_within_a_heartbeat_do_not_make_a_rate() -> None:
    span = HorizonSpan(8, heartbeat_s=0.1)
    span.observe(0, 0.0)
    span.observe(40, 0.01)  # a burst of heartbeats: not 4000 clocks per second
    assert span.clocks_per_s is None and span.clocks == 8


def test_a_roll_back_restarts_the_measurement_and_keeps_the_rate() -> None:
    span = HorizonSpan(8, heartbeat_s=0.1)
    for step in range(10):
        span.observe(step * 5, step * 0.1)
    rate = span.clocks_per_s
    span.observe(3, 1.0)  # rolled back to clock 3
    assert span.clocks_per_s == rate
    span.observe(8, 1.1)
    assert span.clocks_per_s == pytest.approx(rate)  # 5 clocks in 0.1 s: the same rate again


def test_the_span_is_bounded() -> None:
    span = HorizonSpan(8, heartbeat_s=10.0)
    for step in range(5):
        span.observe(step * 100_000, step * 10.0)  # 10,000 clocks per second
    assert span.clocks == MAX_SPAN_CLOCKS
