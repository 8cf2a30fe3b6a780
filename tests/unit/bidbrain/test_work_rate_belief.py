"""The posterior over a job's work rates (`bidbrain.rates`): worked out by hand."""

from __future__ import annotations

import math

import pytest

from orchestrator.bidbrain.rates import (
    MIN_OBSERVATION_HOURS,
    OBSERVATION_SIGMA,
    PRIOR_SIGMA,
    RateBelief,
)

CATALOG = {"V100": 1.0, "K80": 0.2}


def test_the_prior_is_the_catalog_exactly():
    belief = RateBelief.from_catalog(CATALOG)
    assert belief.rates() == CATALOG
    assert belief.learned() == {}


def test_a_measurement_that_agrees_with_the_prior_leaves_the_rate_exactly_as_it_was():
    belief = RateBelief.from_catalog(CATALOG)
    for _ in range(5):
        belief = belief.observe("K80", gpu_count=8, hours=0.5, work_gpu_hours=0.2 * 8 * 0.5)
    assert belief.rates()["K80"] == 0.2
    assert belief.learned()["K80"].observed_hours == pytest.approx(2.5)


def test_an_hour_of_measurement_outweighs_the_prior_by_its_precision():
    belief = RateBelief.from_catalog(CATALOG).observe(
        "K80", gpu_count=1, hours=1.0, work_gpu_hours=0.1
    )
    data, prior = 1.0 / OBSERVATION_SIGMA**2, 1.0 / PRIOR_SIGMA**2
    weight = data / (data + prior)  # 16 / 20 with the defaults
    assert belief.rates()["K80"] == pytest.approx(0.2 * 0.5**weight)
    assert belief.rates()["V100"] == 1.0  # other models keep their prior
    low, high = belief.estimates["K80"].interval
    prior_low, prior_high = RateBelief.from_catalog(CATALOG).estimates["K80"].interval
    assert low < belief.rates()["K80"] < high
    assert high / low < prior_high / prior_low


def test_many_hours_converge_on_the_measured_rate_and_narrow_the_interval():
    belief = RateBelief.from_catalog(CATALOG)
    widths = []
    for _ in range(20):
        belief = belief.observe("V100", gpu_count=4, hours=1.0, work_gpu_hours=4 * 0.6)
        low, high = belief.estimates["V100"].interval
        widths.append(high / low)
    assert belief.rates()["V100"] == pytest.approx(0.6, rel=0.01)
    assert widths == sorted(widths, reverse=True)


def test_a_longer_measurement_weighs_more():
    prior = RateBelief.from_catalog(CATALOG)
    short = prior.observe("K80", gpu_count=1, hours=0.1, work_gpu_hours=0.01)
    long = prior.observe("K80", gpu_count=1, hours=2.0, work_gpu_hours=0.2)
    assert 0.1 < long.rates()["K80"] < short.rates()["K80"] < 0.2


def test_measurements_of_nothing_change_nothing():
    prior = RateBelief.from_catalog(CATALOG)
    assert prior.observe("K80", gpu_count=1, hours=MIN_OBSERVATION_HOURS / 2,
                         work_gpu_hours=1.0) is prior  # fmt: skip
    assert prior.observe("K80", gpu_count=1, hours=1.0, work_gpu_hours=0.0) is prior


@pytest.mark.parametrize(
    "kwargs",
    [
        {"gpu_count": 0, "hours": 1.0, "work_gpu_hours": 1.0},
        {"gpu_count": 1, "hours": -1.0, "work_gpu_hours": 1.0},
        {"gpu_count": 1, "hours": math.inf, "work_gpu_hours": 1.0},
        {"gpu_count": 1, "hours": 1.0, "work_gpu_hours": math.nan},
    ],
)
def test_bad_measurements_are_refused(kwargs):
    with pytest.raises(ValueError):
        RateBelief.from_catalog(CATALOG).observe("K80", **kwargs)


def test_a_model_without_a_prior_and_bad_priors_are_refused():
    with pytest.raises(KeyError):
        RateBelief.from_catalog(CATALOG).observe("T4", gpu_count=1, hours=1, work_gpu_hours=1)
    with pytest.raises(ValueError, match="K80"):
        RateBelief.from_catalog({"K80": 0.0})
    with pytest.raises(ValueError):
        RateBelief.from_catalog(CATALOG, prior_sigma=0.0)


def test_a_measurement_far_off_counts_as_twenty_times_off_at_most():
    prior = RateBelief.from_catalog(CATALOG)
    wild = prior.observe("K80", gpu_count=1, hours=1.0, work_gpu_hours=1e300)
    twenty = prior.observe("K80", gpu_count=1, hours=1.0, work_gpu_hours=0.2 * 20)
    assert math.isfinite(wild.rates()["K80"])
    assert wild.rates()["K80"] == pytest.approx(twenty.rates()["K80"])


def test_a_node_on_one_of_an_instances_gpus_measures_that_gpus_rate():
    from orchestrator.bidbrain.rates import WorkMeasurement
    from orchestrator.market.catalog import Catalog

    catalog = Catalog.load()
    prior = RateBelief.from_catalog(CATALOG)
    # a p2.8xlarge (8 K80s) whose one training process did a K80's catalog work
    one = prior.measured(catalog, WorkMeasurement("p2.8xlarge", 1.0, 0.2, gpus=1))
    assert one.rates()["K80"] == 0.2
    every = prior.measured(catalog, WorkMeasurement("p2.8xlarge", 1.0, 0.2))
    assert every.rates()["K80"] < 0.1  # read as eight GPUs' work: an eighth each
