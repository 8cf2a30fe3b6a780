"""Eviction models: price crossings, capacity hazard from an availability trace, and both."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from orchestrator.errors import UserError
from orchestrator.market.eviction import (
    DEFAULT_BID_DELTAS_USD,
    AvailabilityTrace,
    CapacityHazardModel,
    CombinedEvictionModel,
    EvictionEstimate,
    PriceCrossingModel,
    crossing_hazards,
)
from orchestrator.market.prices import Market, PriceHistory, PriceSeries

MARKET = Market("p3.2xlarge", "us-east-1a")
OTHER = Market("p3.2xlarge", "us-east-1b")
H = 3600.0
DELTAS = np.array([0.01, 0.04, 0.0499, 0.05, 0.06, 0.1])


def flat_series(market: Market = MARKET) -> PriceSeries:
    return PriceSeries(market, np.array([0.0, H, 2 * H]), np.array([1.0, 1.0, 1.0]), end_s=3 * H)


def rising_series(market: Market = MARKET) -> PriceSeries:
    """$1.00 for an hour, then $1.05 for an hour: one rise of $0.05."""
    return PriceSeries(market, np.array([0.0, H]), np.array([1.00, 1.05]), end_s=2 * H)


@pytest.fixture(scope="module")
def bundled() -> AvailabilityTrace:
    return AvailabilityTrace.bundled()


# -- crossing_hazards -------------------------------------------------------------------------


def test_flat_series_has_zero_crossing_hazard_at_every_delta() -> None:
    rates = crossing_hazards(flat_series(), np.array(DEFAULT_BID_DELTAS_USD))
    assert rates.shape == (len(DEFAULT_BID_DELTAS_USD),)
    assert np.all(rates == 0.0)


def test_single_rise_has_hazard_only_for_deltas_below_the_rise() -> None:
    rates = crossing_hazards(rising_series(), DELTAS)
    below = DELTAS < 0.05
    assert np.all(rates[below] > 0.0)
    assert np.all(rates[~below] == 0.0)


def test_single_rise_hazard_is_crossings_over_exposure() -> None:
    # starts in [0, H) all cross at H: crossings H, exposure H·H/2; starts in [H, 2H) are
    # censored at 2H: exposure H·H/2. Rate = H / (H·H) = 1/H.
    rates = crossing_hazards(rising_series(), np.array([0.01]))
    assert rates[0] == pytest.approx(1.0 / H)


def test_crossing_hazard_is_non_increasing_in_the_bid_delta() -> None:
    rng = np.random.default_rng(7)
    n = 400
    times = np.cumsum(rng.uniform(60.0, 1800.0, n))
    prices = np.clip(0.9 + np.cumsum(rng.normal(0.0, 0.01, n)), 0.3, None)
    series = PriceSeries(MARKET, times, prices, end_s=float(times[-1]) + H)
    deltas = np.geomspace(1e-4, 0.5, 30)
    rates = crossing_hazards(series, deltas)
    assert np.all(rates >= 0.0)
    assert rates[0] > 0.0
    assert np.all(np.diff(rates) <= 1e-15)


def test_fit_until_ignores_later_records() -> None:
    spiked = PriceSeries(MARKET, np.array([0.0, H, 2 * H]), np.array([1.0, 1.0, 2.0]), end_s=3 * H)
    truncated = PriceSeries(MARKET, np.array([0.0, H]), np.array([1.0, 1.0]), end_s=2 * H)
    deltas = np.array(DEFAULT_BID_DELTAS_USD)
    assert np.all(crossing_hazards(spiked, deltas) > 0.0)
    fitted = crossing_hazards(spiked, deltas, until_s=2 * H)
    np.testing.assert_array_equal(fitted, crossing_hazards(truncated, deltas))
    assert np.all(fitted == 0.0)
    model = PriceCrossingModel(PriceHistory([spiked]), fit_until_s=2 * H)
    assert np.all(model.hazards_for(MARKET) == 0.0)


# -- PriceCrossingModel -----------------------------------------------------------------------


def test_price_crossing_estimate_gives_beta_in_unit_interval_and_median_ln2_over_hazard() -> None:
    model = PriceCrossingModel(PriceHistory([rising_series()]), bid_deltas_usd=DELTAS)
    est = model.estimate(MARKET, 0.01, 2 * H)
    assert isinstance(est, EvictionEstimate)
    assert est.hazard_per_s == pytest.approx(1.0 / H)
    assert 0.0 <= est.beta <= 1.0
    assert est.beta == pytest.approx(1.0 - math.exp(-2.0))
    assert est.median_s == pytest.approx(math.log(2.0) / est.hazard_per_s)


def test_price_crossing_estimate_above_the_rise_never_evicts() -> None:
    model = PriceCrossingModel(PriceHistory([rising_series()]), bid_deltas_usd=DELTAS)
    est = model.estimate(MARKET, 0.1, 2 * H)
    assert est.hazard_per_s == 0.0
    assert est.beta == 0.0
    assert est.median_s == math.inf


def test_price_crossing_uses_nearest_lower_grid_delta() -> None:
    model = PriceCrossingModel(PriceHistory([rising_series()]), bid_deltas_usd=[0.01, 0.05])
    assert model.hazard_per_s(MARKET, 0.049) == model.hazard_per_s(MARKET, 0.01) > 0.0
    assert model.hazard_per_s(MARKET, 0.001) == model.hazard_per_s(MARKET, 0.01)  # below grid
    assert model.hazard_per_s(MARKET, 0.05) == 0.0


def test_price_crossing_unknown_market_or_uncapped_bid_has_zero_hazard() -> None:
    model = PriceCrossingModel(PriceHistory([rising_series()]), bid_deltas_usd=DELTAS)
    assert model.hazard_per_s(OTHER, 0.01) == 0.0
    assert model.hazard_per_s(MARKET, math.inf) == 0.0
    assert np.all(model.hazards_for(OTHER) == 0.0)


# -- AvailabilityTrace ------------------------------------------------------------------------


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text(text)
    return path


def test_availability_trace_parses_events_sorted_by_time(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "0,add,node1\n0,add,node2\n\n7200000,remove,node2\n3600000,remove,node1\n",
    )
    trace = AvailabilityTrace.read(path)
    assert trace.events == (
        (0, "add", "node1"),
        (0, "add", "node2"),
        (3600000, "remove", "node1"),
        (7200000, "remove", "node2"),
    )
    assert trace.source == str(path)
    assert trace.duration_s == 7200.0
    assert trace.node_hours_and_removals() == (pytest.approx(3.0), 2)
    times, probs = trace.removal_schedule()
    np.testing.assert_allclose(times, [3600.0, 7200.0])
    np.testing.assert_allclose(probs, [0.5, 1.0])


def test_availability_trace_bad_operation_raises_naming_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "0,add,node1\n\n5,explode,node1\n")
    with pytest.raises(UserError) as info:
        AvailabilityTrace.read(path)
    assert f"{path}:3" in str(info.value)
    assert info.value.path == str(path)


def test_availability_trace_wrong_field_count_raises_naming_file_and_line(
    tmp_path: Path,
) -> None:
    path = write(tmp_path, "0,add,node1\n10,remove\n")
    with pytest.raises(UserError, match=r":2: "):
        AvailabilityTrace.read(path)


def test_availability_trace_non_integer_time_raises_naming_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "0,add,node1\n1.5,remove,node1\n")
    with pytest.raises(UserError) as info:
        AvailabilityTrace.read(path)
    assert f"{path}:2" in str(info.value)


def test_availability_trace_without_removals_raises(tmp_path: Path) -> None:
    path = write(tmp_path, "0,add,node1\n1000,add,node2\n")
    with pytest.raises(UserError, match="no remove events"):
        AvailabilityTrace.read(path)


def test_missing_availability_trace_raises_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="cannot read"):
        AvailabilityTrace.read(tmp_path / "absent.csv")


def test_bundled_trace_has_167_removals_at_about_061_per_node_hour(
    bundled: AvailabilityTrace,
) -> None:
    node_hours, removals = bundled.node_hours_and_removals()
    assert removals == 167
    assert removals / node_hours == pytest.approx(0.61, abs=0.01)


def test_bundled_removal_schedule_probabilities_are_in_unit_interval(
    bundled: AvailabilityTrace,
) -> None:
    times, probs = bundled.removal_schedule()
    assert len(times) == len(probs) > 0
    assert np.all(np.diff(times) > 0)
    assert np.all((probs > 0.0) & (probs <= 1.0))


# -- CapacityHazardModel ----------------------------------------------------------------------


def test_capacity_prior_rate_comes_from_the_bundled_trace(bundled: AvailabilityTrace) -> None:
    node_hours, removals = bundled.node_hours_and_removals()
    model = CapacityHazardModel.from_trace(bundled)
    assert model.prior_rate_per_hour == pytest.approx(removals / node_hours)
    assert model.hazard_per_s(MARKET, 0.0) == pytest.approx(removals / node_hours / H)
    assert model.hazard_per_s(OTHER, math.inf) == model.hazard_per_s(MARKET, 0.0)


def test_observed_evictions_raise_only_that_markets_capacity_hazard(
    bundled: AvailabilityTrace,
) -> None:
    model = CapacityHazardModel.from_trace(bundled)
    prior = model.hazard_per_s(MARKET, 0.0)
    model.observe(MARKET, 20, H)
    raised = model.hazard_per_s(MARKET, 0.0)
    assert raised > prior
    rate = model.prior_rate_per_hour
    w = model.prior_weight_hours
    assert raised == pytest.approx((rate * w + 20) / (w + 1.0) / H)
    assert model.hazard_per_s(OTHER, 0.0) == prior


def test_long_exposure_without_evictions_lowers_capacity_hazard(
    bundled: AvailabilityTrace,
) -> None:
    model = CapacityHazardModel.from_trace(bundled)
    prior = model.hazard_per_s(MARKET, 0.0)
    model.observe(MARKET, 0, 500 * H)
    assert 0.0 < model.hazard_per_s(MARKET, 0.0) < prior / 5
    assert model.hazard_per_s(OTHER, 0.0) == prior


def test_capacity_hazard_is_zero_for_types_it_does_not_apply_to() -> None:
    model = CapacityHazardModel(prior_rate_per_hour=0.6, applies_to=("p3.2xlarge",))
    assert model.hazard_per_s(MARKET, 0.0) == pytest.approx(0.6 / H)
    assert model.hazard_per_s(Market("c5.xlarge", "us-east-1a"), 0.0) == 0.0


def test_capacity_from_trace_without_node_hours_raises() -> None:
    trace = AvailabilityTrace(((0, "add", "node1"), (0, "remove", "node1")), "t.csv")
    with pytest.raises(UserError, match="no node-hours"):
        CapacityHazardModel.from_trace(trace)


# -- CombinedEvictionModel --------------------------------------------------------------------


def test_combined_model_adds_component_hazards() -> None:
    crossing = PriceCrossingModel(PriceHistory([rising_series()]), bid_deltas_usd=DELTAS)
    capacity = CapacityHazardModel(prior_rate_per_hour=0.6)
    combined = CombinedEvictionModel([crossing, capacity])
    for delta in (0.01, 0.1, math.inf):
        assert combined.hazard_per_s(MARKET, delta) == pytest.approx(
            crossing.hazard_per_s(MARKET, delta) + capacity.hazard_per_s(MARKET, delta)
        )
    est = combined.estimate(MARKET, 0.01, H)
    assert est.hazard_per_s == pytest.approx(1.0 / H + 0.6 / H)


def test_combined_model_passes_observations_to_components() -> None:
    capacity = CapacityHazardModel(prior_rate_per_hour=0.6)
    combined = CombinedEvictionModel([capacity])
    before = combined.hazard_per_s(MARKET, 0.0)
    combined.observe(MARKET, 10, H)
    assert combined.hazard_per_s(MARKET, 0.0) == capacity.hazard_per_s(MARKET, 0.0) > before
