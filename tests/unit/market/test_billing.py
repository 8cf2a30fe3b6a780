"""Billing models: per-second, hourly-refund (2016) and on-demand charges, actual and expected."""

from __future__ import annotations

import math

import numpy as np
import pytest

from orchestrator.bidbrain import cost as cost_model
from orchestrator.errors import UserError
from orchestrator.market.billing import (
    BilledInterval,
    EndReason,
    HourlyRefundBilling,
    PerSecondBilling,
    billing_model,
    charged_fraction,
)
from orchestrator.market.prices import Market, PriceSeries
from orchestrator.units import SECONDS_PER_HOUR

MARKET = Market("p3.2xlarge", "us-east-1a")
H = SECONDS_PER_HOUR


@pytest.fixture
def series() -> PriceSeries:
    """$0.90 on [0, 1800), $1.20 on [1800, 5400), $0.60 from 5400 on (until 20000)."""
    return PriceSeries(
        MARKET, np.array([0.0, 1800.0, 5400.0]), np.array([0.90, 1.20, 0.60]), end_s=20000.0
    )


def total(intervals: list[BilledInterval]) -> float:
    return sum(iv.charged_usd for iv in intervals)


# -- per-second -------------------------------------------------------------------------------


def test_per_second_splits_intervals_at_price_changes(series: PriceSeries) -> None:
    bill = PerSecondBilling().bill_spot(series, 600.0, 6000.0, EndReason.RELEASED)
    assert [(iv.start_s, iv.end_s) for iv in bill] == [
        (600.0, 1800.0),
        (1800.0, 5400.0),
        (5400.0, 6000.0),
    ]
    assert [iv.price_usd_per_hour for iv in bill] == [0.90, 1.20, 0.60]


def test_per_second_charges_price_times_seconds(series: PriceSeries) -> None:
    bill = PerSecondBilling().bill_spot(series, 600.0, 6000.0, EndReason.RELEASED)
    for iv in bill:
        assert iv.billed_s == iv.end_s - iv.start_s
        assert iv.charged_usd == pytest.approx(iv.price_usd_per_hour * iv.billed_s / H)
    expected = 0.90 * 1200 / H + 1.20 * 3600 / H + 0.60 * 600 / H
    assert total(bill) == pytest.approx(expected)
    assert total(bill) == pytest.approx(series.cost_usd(600.0, 6000.0))


@pytest.mark.parametrize("reason", [EndReason.EVICTED, EndReason.RELEASED, EndReason.JOB_FINISHED])
def test_per_second_last_interval_carries_end_reason(
    series: PriceSeries, reason: EndReason
) -> None:
    bill = PerSecondBilling().bill_spot(series, 600.0, 6000.0, reason)
    assert [iv.reason for iv in bill[:-1]] == [EndReason.PRICE_CHANGE] * 2
    assert bill[-1].reason is reason


def test_per_second_refunds_nothing_when_evicted(series: PriceSeries) -> None:
    evicted = PerSecondBilling().bill_spot(series, 600.0, 6000.0, EndReason.EVICTED)
    released = PerSecondBilling().bill_spot(series, 600.0, 6000.0, EndReason.RELEASED)
    assert evicted[-1].billed_s == 6000.0 - 5400.0
    assert total(evicted) == pytest.approx(total(released))


def test_per_second_start_on_a_price_change_uses_the_new_price(series: PriceSeries) -> None:
    bill = PerSecondBilling().bill_spot(series, 1800.0, 2000.0, EndReason.JOB_FINISHED)
    assert len(bill) == 1
    assert bill[0].price_usd_per_hour == 1.20
    assert bill[0].reason is EndReason.JOB_FINISHED


def test_per_second_runs_past_the_last_record_at_the_last_price(series: PriceSeries) -> None:
    bill = PerSecondBilling().bill_spot(series, 5000.0, 30000.0, EndReason.RELEASED)
    assert [(iv.start_s, iv.end_s, iv.price_usd_per_hour) for iv in bill] == [
        (5000.0, 5400.0, 1.20),
        (5400.0, 30000.0, 0.60),
    ]


@pytest.mark.parametrize("model", [PerSecondBilling(), HourlyRefundBilling()])
def test_empty_or_negative_run_is_not_billed(series: PriceSeries, model) -> None:
    assert model.bill_spot(series, 600.0, 600.0, EndReason.RELEASED) == []
    assert model.bill_spot(series, 900.0, 600.0, EndReason.RELEASED) == []


# -- hourly-refund ----------------------------------------------------------------------------


def test_hourly_refund_charges_full_hours_at_the_price_at_each_hour_start(
    series: PriceSeries,
) -> None:
    # hours start at 600 ($0.90, although the price rises at 1800) and 4200 ($1.20)
    bill = HourlyRefundBilling().bill_spot(series, 600.0, 600.0 + 2 * H, EndReason.RELEASED)
    assert [(iv.start_s, iv.end_s) for iv in bill] == [(600.0, 4200.0), (4200.0, 7800.0)]
    assert [iv.price_usd_per_hour for iv in bill] == [0.90, 1.20]
    assert [iv.billed_s for iv in bill] == [H, H]
    assert [iv.reason for iv in bill] == [EndReason.HOUR_COMPLETE, EndReason.RELEASED]
    assert total(bill) == pytest.approx(0.90 + 1.20)


def test_evicted_partial_hour_is_free_under_hourly_refund(series: PriceSeries) -> None:
    bill = HourlyRefundBilling().bill_spot(series, 600.0, 600.0 + 2 * H + 1200, EndReason.EVICTED)
    assert len(bill) == 3
    last = bill[-1]
    assert (last.start_s, last.end_s) == (7800.0, 9000.0)
    assert last.reason is EndReason.EVICTED
    assert last.billed_s == 0.0
    assert last.charged_usd == 0.0
    assert total(bill) == pytest.approx(0.90 + 1.20)


def test_instance_evicted_within_its_first_hour_costs_nothing(series: PriceSeries) -> None:
    bill = HourlyRefundBilling().bill_spot(series, 600.0, 3000.0, EndReason.EVICTED)
    assert total(bill) == 0.0


def test_released_partial_hour_costs_a_full_hour_under_hourly_refund(series: PriceSeries) -> None:
    bill = HourlyRefundBilling().bill_spot(series, 600.0, 600.0 + 2 * H + 1200, EndReason.RELEASED)
    last = bill[-1]
    assert last.reason is EndReason.RELEASED
    assert last.billed_s == H
    assert last.price_usd_per_hour == 0.60  # price in effect at 7800
    assert total(bill) == pytest.approx(0.90 + 1.20 + 0.60)


def test_job_finished_partial_hour_is_prorated_under_hourly_refund(series: PriceSeries) -> None:
    bill = HourlyRefundBilling().bill_spot(
        series, 600.0, 600.0 + 2 * H + 1200, EndReason.JOB_FINISHED
    )
    last = bill[-1]
    assert last.reason is EndReason.JOB_FINISHED
    assert last.billed_s == 1200.0
    assert total(bill) == pytest.approx(0.90 + 1.20 + 0.60 * 1200 / H)


def test_hourly_refund_whole_hours_end_with_the_end_reason(series: PriceSeries) -> None:
    bill = HourlyRefundBilling().bill_spot(series, 600.0, 600.0 + 2 * H, EndReason.EVICTED)
    assert [iv.reason for iv in bill] == [EndReason.HOUR_COMPLETE, EndReason.EVICTED]
    assert [iv.billed_s for iv in bill] == [H, H]  # a completed hour is paid even if evicted then


# -- on-demand --------------------------------------------------------------------------------


@pytest.mark.parametrize("model", [PerSecondBilling(), HourlyRefundBilling()])
def test_on_demand_pays_fixed_price_for_run_time_in_both_models(model) -> None:
    bill = model.bill_on_demand(3.06, 1000.0, 1000.0 + 5400.0, EndReason.EVICTED)
    assert len(bill) == 1
    iv = bill[0]
    assert (iv.start_s, iv.end_s, iv.price_usd_per_hour) == (1000.0, 6400.0, 3.06)
    assert iv.billed_s == 5400.0
    assert iv.reason is EndReason.EVICTED
    assert iv.charged_usd == pytest.approx(3.06 * 1.5)


def test_on_demand_negative_run_is_billed_zero() -> None:
    bill = PerSecondBilling().bill_on_demand(3.06, 1000.0, 900.0, EndReason.RELEASED)
    assert sum(iv.charged_usd for iv in bill) == 0.0


# -- registry ---------------------------------------------------------------------------------


def test_billing_model_returns_registered_models() -> None:
    assert isinstance(billing_model("per-second"), PerSecondBilling)
    assert isinstance(billing_model("hourly-refund"), HourlyRefundBilling)


def test_unknown_billing_model_raises_user_error_listing_valid_names() -> None:
    with pytest.raises(UserError) as info:
        billing_model("nope")
    text = str(info.value)
    assert "nope" in text
    assert "per-second" in text and "hourly-refund" in text
    assert info.value.field == "billing"


# -- expected charges -------------------------------------------------------------------------


def test_charged_fraction_is_one_without_hazard() -> None:
    assert charged_fraction(0.0) == 1.0
    assert charged_fraction(-1e-3) == 1.0


def test_charged_fraction_decreases_with_hazard() -> None:
    hazards = [1e-8, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2]
    fractions = [charged_fraction(h) for h in hazards]
    assert all(0.0 < f < 1.0 for f in fractions)
    assert all(a > b for a, b in zip(fractions, fractions[1:], strict=False))
    # small-hazard limit: 1 - hH/2 (half an hour lost per eviction)
    assert charged_fraction(1e-7) == pytest.approx(1 - 1e-7 * H / 2, rel=1e-6)


@pytest.mark.parametrize("hazard", [0.0, 1e-7, 1e-6, 5e-5, 3e-4, 2e-3])
@pytest.mark.parametrize("horizon_s", [600.0, H, 86400.0])
@pytest.mark.parametrize("model", [PerSecondBilling(), HourlyRefundBilling()])
def test_scalar_expected_cost_equals_vectorised_cost_model(
    model, hazard: float, horizon_s: float
) -> None:
    scalar = model.expected_cost_usd(0.90, 3, hazard, horizon_s)
    vector = cost_model.expected_cost_usd(
        model.name, np.array([0.90]), np.array([3]), np.array([hazard]), horizon_s
    )
    assert float(vector[0]) == pytest.approx(scalar, rel=1e-12)


def test_scalar_and_vectorised_charged_fraction_agree() -> None:
    hazards = np.array([0.0, 1e-7, 1e-5, 1e-4, 1e-3, 1e-2])
    vector = charged_fraction(hazards)
    for h, v in zip(hazards, vector, strict=True):
        assert float(v) == pytest.approx(charged_fraction(float(h)), rel=1e-12)


def test_per_second_expected_cost_ignores_hazard() -> None:
    model = PerSecondBilling()
    assert model.expected_cost_usd(0.9, 2, 1e-3, 2 * H) == pytest.approx(0.9 * 2 * 2)
    assert model.expected_cost_usd(0.9, 2, 0.0, 2 * H) == pytest.approx(0.9 * 2 * 2)


@pytest.mark.parametrize("mean_life_h", [2.0, 0.75])
def test_monte_carlo_hourly_refund_charged_fraction_matches_formula(mean_life_h: float) -> None:
    """A slot refilled at once on eviction: instances with Exp(h) lives laid end to end, billed
    by `HourlyRefundBilling.bill_spot` at a flat $1/h; paid hours / run hours ≈ f(h)."""
    rng = np.random.default_rng(20240611)
    hazard = 1.0 / (mean_life_h * H)
    lives = rng.exponential(1.0 / hazard, 20_000)
    flat = PriceSeries(MARKET, np.array([0.0]), np.array([1.0]), end_s=math.inf)
    model = HourlyRefundBilling()
    charged = 0.0
    start = 0.0
    for life in lives.tolist():
        charged += total(model.bill_spot(flat, start, start + life, EndReason.EVICTED))
        start += life
    fraction = charged / (start / H)
    assert fraction == pytest.approx(charged_fraction(hazard), rel=0.02)
    assert model.expected_cost_usd(1.0, 1, hazard, start) == pytest.approx(charged, rel=0.02)
