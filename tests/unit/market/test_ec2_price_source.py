"""EC2PriceSource against moto and against botocore's Stubber fed with real responses."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber
from moto import mock_aws

from orchestrator.errors import OrchestratorError, UserError
from orchestrator.market.ec2_source import EC2PriceSource, PriceFetchError
from orchestrator.market.errors import MarketError, PriceDataError
from orchestrator.market.prices import Market, PriceHistory, to_epoch_seconds
from orchestrator.market.trace_source import TracePriceSource

REGION = "us-east-1"
TRACE_FILE = Path(
    str(
        resources.files("orchestrator.market")
        / "data"
        / "spot-prices-2020"
        / REGION
        / "2020-03-23.p3.2xlarge.json"
    )
)
P3_ZONES = ["us-east-1b", "us-east-1c", "us-east-1d", "us-east-1f"]
MOTO_PRICE = 0.00001


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SECURITY_TOKEN": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": REGION,
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)


@pytest.fixture
def moto_source(aws_env: None) -> Iterator[EC2PriceSource]:
    with mock_aws():
        yield EC2PriceSource(REGION)


WINDOW = (datetime(2024, 5, 1, tzinfo=UTC), datetime(2024, 5, 2, tzinfo=UTC))


# --- moto -------------------------------------------------------------------------------------


def moto_zones_for(instance_type: str) -> set[str]:
    """The zones moto's own catalog offers the type in (raw API call, no filters of ours)."""
    client = boto3.client("ec2", region_name=REGION)
    records = client.describe_spot_price_history(InstanceTypes=[instance_type])["SpotPriceHistory"]
    return {r["AvailabilityZone"] for r in records}


@pytest.mark.parametrize("instance_type", ["g4dn.xlarge", "c5.large"])
def test_moto_prices_all_zones_of_region(moto_source: EC2PriceSource, instance_type: str) -> None:
    history = moto_source.history(*WINDOW, instance_types=[instance_type])
    expected_zones = moto_zones_for(instance_type)
    assert len(expected_zones) >= 4
    assert set(history.zones()) == expected_zones
    assert all(z.startswith(REGION) for z in history.zones())
    assert history.instance_types() == [instance_type]
    end_s = to_epoch_seconds(WINDOW[1])
    for market in history:
        series = history[market]
        assert series.prices_usd_per_hour.tolist() == [MOTO_PRICE]
        assert series.price_at(to_epoch_seconds(WINDOW[0])) == MOTO_PRICE
        assert series.end_s == end_s
    assert history.end_s == end_s


def test_moto_type_filter_respected(moto_source: EC2PriceSource) -> None:
    history = moto_source.history(*WINDOW, instance_types=["c5.large", "g4dn.xlarge"])
    assert history.instance_types() == ["c5.large", "g4dn.xlarge"]
    assert len(history) == len(moto_zones_for("c5.large")) + len(moto_zones_for("g4dn.xlarge"))


def test_moto_zone_filter(moto_source: EC2PriceSource) -> None:
    history = moto_source.history(
        *WINDOW, instance_types=["c5.large"], zones=["us-east-1a", "us-east-1c", "eu-west-1a"]
    )
    assert list(history) == [Market("c5.large", "us-east-1a"), Market("c5.large", "us-east-1c")]


def test_moto_unfiltered_keeps_region_only(moto_source: EC2PriceSource) -> None:
    history = moto_source.history(*WINDOW)
    assert len(history.instance_types()) > 100
    assert {m.region for m in history} == {REGION}


def test_moto_type_not_offered(moto_source: EC2PriceSource) -> None:
    # moto's spot catalog has no p3 types: an empty answer, not a crash
    with pytest.raises(PriceDataError) as exc:
        moto_source.history(*WINDOW, instance_types=["p3.2xlarge"])
    assert "p3.2xlarge" in str(exc.value)
    assert REGION in str(exc.value)


def test_moto_zones_of_other_region(moto_source: EC2PriceSource) -> None:
    with pytest.raises(PriceDataError) as exc:
        moto_source.history(*WINDOW, zones=["eu-west-1a"])
    assert exc.value.field == "zones"


# --- Stubber with the real DescribeSpotPriceHistory response of the trace ---------------------


def load_trace_records() -> list[dict[str, Any]]:
    return json.loads(TRACE_FILE.read_text())["SpotPriceHistory"]


def as_botocore_returns(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Stubber accepts ISO strings for timestamps (its validator only checks they parse),
    but hands them back unparsed; a real client returns aware datetimes. Return those."""
    out = copy.deepcopy(records)
    for r in out:
        r["Timestamp"] = datetime.fromisoformat(r["Timestamp"].replace("Z", "+00:00"))
    return out


def records_as_ec2_returns(
    records: list[dict[str, Any]], start_s: float, end_s: float
) -> list[dict[str, Any]]:
    """What DescribeSpotPriceHistory answers for [start, end]: every record inside the window
    plus, per market, the one in effect at start."""

    def t(r: dict[str, Any]) -> float:
        return to_epoch_seconds(r["Timestamp"])

    inside = [r for r in records if start_s < t(r) <= end_s]
    in_effect: dict[tuple[str, str], dict[str, Any]] = {}
    for r in records:
        key = (r["InstanceType"], r["AvailabilityZone"])
        if t(r) <= start_s and (key not in in_effect or t(r) > t(in_effect[key])):
            in_effect[key] = r
    return sorted(inside + list(in_effect.values()), key=t, reverse=True)


def stub_pages(
    stubber: Stubber, records: list[dict[str, Any]], params: dict[str, Any] | None
) -> None:
    half = len(records) // 2
    stubber.add_response(
        "describe_spot_price_history",
        {"SpotPriceHistory": records[:half], "NextToken": "page-2"},
        expected_params=params,
    )
    stubber.add_response(
        "describe_spot_price_history",
        {"SpotPriceHistory": records[half:], "NextToken": ""},
        expected_params=None if params is None else {**params, "NextToken": "page-2"},
    )


def assert_same_history(got: PriceHistory, want: PriceHistory) -> None:
    assert list(got) == list(want)
    for market in want:
        assert got[market].times_s.tolist() == want[market].times_s.tolist()
        assert got[market].prices_usd_per_hour.tolist() == want[market].prices_usd_per_hour.tolist()
        assert got[market].end_s == want[market].end_s


def stubbed_client() -> Any:
    return boto3.client(
        "ec2", region_name=REGION, aws_access_key_id="testing", aws_secret_access_key="testing"
    )


def trace_span() -> tuple[datetime, datetime]:
    stamps = sorted(to_epoch_seconds(r["Timestamp"]) for r in load_trace_records())
    return datetime.fromtimestamp(stamps[0], UTC), datetime.fromtimestamp(stamps[-1], UTC)


WINDOWS = {
    "whole-file": trace_span,
    "mid-window": lambda: (
        datetime(2020, 3, 16, 12, tzinfo=UTC),
        datetime(2020, 3, 21, 6, 30, tzinfo=UTC),
    ),
}


@pytest.mark.parametrize("window", sorted(WINDOWS))
def test_stubbed_real_response_matches_trace_source(window: str) -> None:
    start, end = WINDOWS[window]()
    start_s, end_s = to_epoch_seconds(start), to_epoch_seconds(end)
    records = as_botocore_returns(records_as_ec2_returns(load_trace_records(), start_s, end_s))
    assert len(records) > 20
    client = stubbed_client()
    expected = {
        "StartTime": start,
        "EndTime": end,
        "ProductDescriptions": ["Linux/UNIX"],
        "InstanceTypes": ["p3.2xlarge"],
        "Filters": [{"Name": "availability-zone", "Values": P3_ZONES}],
    }
    with Stubber(client) as stubber:
        stub_pages(stubber, records, expected)
        got = EC2PriceSource(REGION, client=client).history(
            start, end, instance_types=["p3.2xlarge"], zones=P3_ZONES
        )
        stubber.assert_no_pending_responses()
    want = TracePriceSource([TRACE_FILE]).history(
        start, end, instance_types=["p3.2xlarge"], zones=P3_ZONES
    )
    assert len(want) == 4
    assert_same_history(got, want)
    for market in got:  # (over the whole file, some zones' first record is after start)
        price = got[market].price_at(max(start_s, got[market].start_s))
        assert price is not None and 0.9 < price < 1.2


def test_stubbed_superset_response_is_trimmed_to_window() -> None:
    """Records outside the window (beyond the one in effect at start) do not leak through."""
    start, end = WINDOWS["mid-window"]()
    client = stubbed_client()
    with Stubber(client) as stubber:
        stub_pages(stubber, as_botocore_returns(load_trace_records()), None)
        got = EC2PriceSource(REGION, client=client).history(start, end)
    want = TracePriceSource([TRACE_FILE]).history(start, end)
    assert_same_history(got, want)


def test_request_without_filters() -> None:
    start, end = WINDOWS["mid-window"]()
    client = stubbed_client()
    records = as_botocore_returns(load_trace_records())
    with Stubber(client) as stubber:
        stubber.add_response(
            "describe_spot_price_history",
            {"SpotPriceHistory": records},
            expected_params={
                "StartTime": start,
                "EndTime": end,
                "ProductDescriptions": ["Linux/UNIX"],
            },
        )
        got = EC2PriceSource(REGION, client=client).history(start, end)
    assert set(got.zones()) == set(P3_ZONES)


def test_epoch_seconds_accepted() -> None:
    start, end = WINDOWS["mid-window"]()
    client = stubbed_client()
    with Stubber(client) as stubber:
        stubber.add_response(
            "describe_spot_price_history",
            {"SpotPriceHistory": as_botocore_returns(load_trace_records())},
            expected_params={
                "StartTime": start,
                "EndTime": end,
                "ProductDescriptions": ["Linux/UNIX"],
                "InstanceTypes": ["p3.2xlarge"],
            },
        )
        got = EC2PriceSource(REGION, client=client).history(
            start.timestamp(), end.timestamp(), instance_types=["p3.2xlarge"]
        )
    assert len(got) == 4


# --- errors -----------------------------------------------------------------------------------


def test_empty_response() -> None:
    start, end = WINDOWS["mid-window"]()
    client = stubbed_client()
    with Stubber(client) as stubber:
        stubber.add_response(
            "describe_spot_price_history", {"SpotPriceHistory": [], "NextToken": ""}
        )
        with pytest.raises(PriceDataError) as exc:
            EC2PriceSource(REGION, client=client).history(start, end, instance_types=["p3.2xlarge"])
    text = str(exc.value)
    assert isinstance(exc.value, UserError) and exc.value.exit_code == 2
    assert REGION in text and "p3.2xlarge" in text
    assert "2020-03-16" in text and "2020-03-21" in text
    assert "offered" in exc.value.fix and REGION in exc.value.fix


@pytest.mark.parametrize("delta_s", [0, -3600])
def test_end_not_after_start(delta_s: int) -> None:
    client = stubbed_client()
    start = datetime(2020, 3, 16, tzinfo=UTC)
    # no response queued: a call would fail with a StubResponseError, not PriceDataError
    with Stubber(client), pytest.raises(PriceDataError) as exc:
        EC2PriceSource(REGION, client=client).history(start, start.timestamp() + delta_s)
    assert exc.value.field == "end"


def test_empty_type_list_rejected() -> None:
    client = stubbed_client()
    with Stubber(client), pytest.raises(PriceDataError) as exc:
        EC2PriceSource(REGION, client=client).history(*WINDOWS["mid-window"](), instance_types=[])
    assert exc.value.field == "instance_types"


def test_client_error_wrapped() -> None:
    client = stubbed_client()
    with Stubber(client) as stubber:
        stubber.add_client_error(
            "describe_spot_price_history",
            service_error_code="UnauthorizedOperation",
            service_message="You are not authorized to perform this operation.",
            http_status_code=403,
        )
        with pytest.raises(PriceFetchError) as exc:
            EC2PriceSource(REGION, client=client).history(*WINDOWS["mid-window"]())
    err = exc.value
    assert isinstance(err, MarketError) and isinstance(err, OrchestratorError)
    assert not isinstance(err, UserError)
    assert err.code == "UnauthorizedOperation"
    assert err.region == REGION
    assert "UnauthorizedOperation" in str(err) and "not authorized" in str(err)


def test_client_error_on_second_page_fails_whole_call() -> None:
    client = stubbed_client()
    records = as_botocore_returns(load_trace_records())
    with Stubber(client) as stubber:
        stubber.add_response(
            "describe_spot_price_history", {"SpotPriceHistory": records[:10], "NextToken": "page-2"}
        )
        stubber.add_client_error(
            "describe_spot_price_history", service_error_code="InternalError", http_status_code=500
        )
        with pytest.raises(PriceFetchError) as exc:
            EC2PriceSource(REGION, client=client).history(*WINDOWS["mid-window"]())
    assert exc.value.code == "InternalError"


def test_no_credentials_wrapped(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_SECURITY_TOKEN",
        "AWS_PROFILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    source = EC2PriceSource(REGION, session=boto3.Session())
    with pytest.raises(PriceFetchError) as exc:
        source.history(*WINDOWS["mid-window"]())
    assert exc.value.code == "NoCredentialsError"


def test_default_client_uses_the_orchestrators_retry_policy(aws_env: None) -> None:
    source = EC2PriceSource("us-west-2")
    assert source.client.meta.region_name == "us-west-2"
    retries = source.client.meta.config.retries
    assert retries["mode"] == "adaptive"
    # botocore reads max_attempts=8 as 8 retries after the first try
    assert retries["total_max_attempts"] == 9


def test_client_of_other_region_rejected() -> None:
    with pytest.raises(ValueError, match="us-west-2"):
        EC2PriceSource(REGION, client=boto3.client("ec2", region_name="us-west-2"))
