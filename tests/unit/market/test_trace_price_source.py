"""TracePriceSource: the bundled traces and every kind of bad input."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from orchestrator.errors import UserError
from orchestrator.market.errors import PriceDataError
from orchestrator.market.prices import Market, to_epoch_seconds
from orchestrator.market.trace_source import TracePriceSource, bundled_prices_dir

US_EAST_1_ZONES = {"us-east-1b", "us-east-1c", "us-east-1d", "us-east-1f"}


def record(
    zone: str = "us-east-1a",
    itype: str = "p3.2xlarge",
    price: object = "1.0",
    ts: str = "2020-03-01T00:00:00.000Z",
) -> dict:
    return {
        "AvailabilityZone": zone,
        "InstanceType": itype,
        "ProductDescription": "Linux/UNIX",
        "SpotPrice": price,
        "Timestamp": ts,
    }


def write(path: Path, body: object) -> Path:
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    return path


@pytest.fixture(scope="module")
def bundled() -> TracePriceSource:
    return TracePriceSource([bundled_prices_dir("us-east-1")])


def test_bundled_us_east_1_p3_2xlarge_prices(bundled: TracePriceSource) -> None:
    history = bundled.all().restrict(["p3.2xlarge"])
    assert set(history.zones()) == US_EAST_1_ZONES
    for market in history:
        series = history[market]
        assert market.region == "us-east-1"
        assert len(series) > 100
        # the p3.2xlarge on-demand price is $3.06/h; spot sat at roughly a third of it
        assert series.prices_usd_per_hour.min() > 0.9
        assert series.prices_usd_per_hour.max() < 1.25
        assert (series.times_s[1:] > series.times_s[:-1]).all()


def test_history_includes_record_in_effect_at_start(bundled: TracePriceSource) -> None:
    start = datetime(2020, 2, 1, tzinfo=UTC)
    end = datetime(2020, 2, 8, tzinfo=UTC)
    start_s, end_s = to_epoch_seconds(start), to_epoch_seconds(end)
    history = bundled.history(start, end, instance_types=["p3.2xlarge"], zones=["us-east-1c"])
    assert list(history) == [Market("p3.2xlarge", "us-east-1c")]
    full = bundled.all()[Market("p3.2xlarge", "us-east-1c")]
    series = history[Market("p3.2xlarge", "us-east-1c")]
    # the first point predates start and is the one in effect then
    assert series.start_s <= start_s
    assert series.start_s == full.times_s[full.index_at(start_s)]
    assert series.price_at(start_s) == full.price_at(start_s)
    assert series.times_s[-1] <= end_s
    assert series.end_s == end_s
    inside = full.times_s[(full.times_s > start_s) & (full.times_s <= end_s)]
    assert series.times_s[1:].tolist() == inside.tolist()


def test_history_filters_and_empty_range(bundled: TracePriceSource) -> None:
    start, end = datetime(2020, 3, 1, tzinfo=UTC), datetime(2020, 3, 2, tzinfo=UTC)
    history = bundled.history(start, end, instance_types=["p2.xlarge", "p3.8xlarge"])
    assert set(history.instance_types()) == {"p2.xlarge", "p3.8xlarge"}
    with pytest.raises(PriceDataError) as info:
        bundled.history(end, start)
    assert info.value.field == "end"
    with pytest.raises(PriceDataError):
        bundled.history(start, end, instance_types=["c5.large"])


def assert_names(exc: pytest.ExceptionInfo[PriceDataError], path: Path) -> None:
    assert isinstance(exc.value, UserError)
    assert exc.value.exit_code == 2
    assert str(path) in str(exc.value)


def test_empty_file(tmp_path: Path) -> None:
    bad = write(tmp_path / "empty.json", "  \n")
    with pytest.raises(PriceDataError) as exc:
        TracePriceSource([bad])
    assert_names(exc, bad)
    assert "empty" in str(exc.value)


def test_invalid_json_names_file_and_line(tmp_path: Path) -> None:
    bad = write(tmp_path / "broken.json", '{\n  "SpotPriceHistory": [\n    {,\n  ]\n}\n')
    with pytest.raises(PriceDataError) as exc:
        TracePriceSource([bad])
    assert_names(exc, bad)
    assert "line 3" in str(exc.value)


@pytest.mark.parametrize("body", [{"NextToken": ""}, [record()], {"SpotPriceHistory": {}}])
def test_missing_spot_price_history(tmp_path: Path, body: object) -> None:
    bad = write(tmp_path / "shape.json", body)
    with pytest.raises(PriceDataError) as exc:
        TracePriceSource([bad])
    assert_names(exc, bad)
    assert exc.value.field == "SpotPriceHistory"


def test_record_missing_timestamp(tmp_path: Path) -> None:
    rec = record()
    del rec["Timestamp"]
    bad = write(tmp_path / "nots.json", {"SpotPriceHistory": [record(), rec]})
    with pytest.raises(PriceDataError) as exc:
        TracePriceSource([bad])
    assert_names(exc, bad)
    assert exc.value.field == "SpotPriceHistory[1].Timestamp"
    assert "Timestamp" in str(exc.value)


def test_non_numeric_spot_price(tmp_path: Path) -> None:
    bad = write(tmp_path / "price.json", {"SpotPriceHistory": [record(price="cheap")]})
    with pytest.raises(PriceDataError) as exc:
        TracePriceSource([bad])
    assert_names(exc, bad)
    assert exc.value.field == "SpotPriceHistory[0].SpotPrice"
    assert "'cheap'" in str(exc.value)


def test_bad_timestamp(tmp_path: Path) -> None:
    bad = write(tmp_path / "ts.json", {"SpotPriceHistory": [record(ts="yesterday")]})
    with pytest.raises(PriceDataError) as exc:
        TracePriceSource([bad])
    assert_names(exc, bad)
    assert exc.value.field == "SpotPriceHistory[0].Timestamp"


def test_no_linux_records(tmp_path: Path) -> None:
    rec = {**record(), "ProductDescription": "Windows"}
    bad = write(tmp_path / "win.json", {"SpotPriceHistory": [rec]})
    with pytest.raises(PriceDataError) as exc:
        TracePriceSource([bad])
    assert_names(exc, bad)


def test_missing_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(PriceDataError) as exc:
        TracePriceSource([missing])
    assert_names(exc, missing)
    assert exc.value.field == "--prices"


def test_directory_without_json(tmp_path: Path) -> None:
    (tmp_path / "README.txt").write_text("no prices here")
    with pytest.raises(PriceDataError) as exc:
        TracePriceSource([tmp_path])
    assert_names(exc, tmp_path)


def test_no_paths() -> None:
    with pytest.raises(PriceDataError) as exc:
        TracePriceSource([])
    assert exc.value.field == "--prices"


def test_overlapping_files_merge(tmp_path: Path) -> None:
    a = write(
        tmp_path / "a.json",
        {
            "SpotPriceHistory": [
                record(price="1.0", ts="2020-03-01T00:00:00Z"),
                record(price="2.0", ts="2020-03-02T00:00:00Z"),
            ]
        },
    )
    b = write(
        tmp_path / "b.json",
        {
            "SpotPriceHistory": [
                record(price="2.0", ts="2020-03-02T00:00:00Z"),
                record(price="3.0", ts="2020-03-03T00:00:00Z"),
            ]
        },
    )
    series = TracePriceSource([a, b]).all()[Market("p3.2xlarge", "us-east-1a")]
    assert series.prices_usd_per_hour.tolist() == [1.0, 2.0, 3.0]
    assert series.end_s == to_epoch_seconds("2020-03-03T00:00:00Z")
