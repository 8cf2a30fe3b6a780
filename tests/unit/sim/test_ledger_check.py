"""`verify_ledger`: recompute a simulation ledger's bill from prices, independently."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from orchestrator.errors import UserError
from orchestrator.market.billing import EndReason, HourlyRefundBilling, PerSecondBilling
from orchestrator.market.catalog import Catalog
from orchestrator.market.prices import Market, PriceHistory, PriceSeries
from orchestrator.sim.ledger import REQUIRED_FIELDS, recompute_billed_s, verify_ledger

MARKET = Market("p3.2xlarge", "us-east-1a")
H = 3600.0


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return Catalog.load()


@pytest.fixture
def history() -> PriceHistory:
    """$0.90 on [0, 1800), $1.20 on [1800, 5400), $0.60 from 5400 (until 20000)."""
    return PriceHistory(
        [
            PriceSeries(
                MARKET,
                np.array([0.0, 1800.0, 5400.0]),
                np.array([0.90, 1.20, 0.60]),
                end_s=20000.0,
            )
        ]
    )


def line(
    strategy: str,
    start: float,
    end: float,
    price: float,
    *,
    billed: float | None = None,
    market: str = "spot",
    reason: str = "released",
    count: float = 1.0,
) -> dict[str, Any]:
    billed = end - start if billed is None else billed
    return {
        "strategy": strategy,
        "instance_type": MARKET.instance_type,
        "zone": MARKET.zone,
        "market": market,
        "count": count,
        "start_s": start,
        "end_s": end,
        "price_usd_per_hour": price,
        "billed_s": billed,
        "charged_usd": price * billed / H * count,
        "reason": reason,
    }


def per_second_lines(on_demand_price: float) -> list[dict[str, Any]]:
    return [
        line("proteus", 600.0, 1800.0, 0.90, reason="price-change"),
        line("proteus", 1800.0, 5400.0, 1.20, reason="price-change"),
        line("proteus", 5400.0, 6000.0, 0.60, reason="evicted"),
        line("on-demand", 0.0, 5400.0, on_demand_price, market="on-demand", reason="job-finished"),
        line("oracle", 1800.0, 2400.0, 1.20, market="oracle", reason="job-finished", count=2.5),
    ]


def write_ledger(path: Path, rows: list[dict[str, Any]]) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if path.suffix == ".gz":
        with gzip.open(path, "wt") as fh:
            fh.write(text)
    else:
        path.write_text(text)
    return path


def od_price(catalog: Catalog) -> float:
    return catalog.get(MARKET.instance_type).on_demand_price(MARKET.region)


def test_ledger_lines_carry_every_required_field() -> None:
    assert set(REQUIRED_FIELDS) <= set(line("s", 0.0, 1.0, 1.0))


def test_verify_ledger_recomputes_the_charged_totals(
    tmp_path: Path, history: PriceHistory, catalog: Catalog
) -> None:
    rows = per_second_lines(od_price(catalog))
    path = write_ledger(tmp_path / "ledger.jsonl", rows)
    check = verify_ledger(path, history, billing="per-second", catalog=catalog)
    assert check.lines == len(rows)
    assert check.price_mismatches == 0
    assert set(check.recomputed_usd) == {"proteus", "on-demand", "oracle"}
    for name, total in check.ledger_usd.items():
        assert check.recomputed_usd[name] == pytest.approx(total, rel=1e-12)
    assert check.recomputed_usd["proteus"] == pytest.approx(history[MARKET].cost_usd(600.0, 6000.0))
    assert check.recomputed_usd["oracle"] == pytest.approx(1.20 * 600 / H * 2.5)
    assert check.max_relative_error < 1e-9
    assert "max relative error" in check.render()


def test_verify_ledger_compares_against_reported_totals(
    tmp_path: Path, history: PriceHistory, catalog: Catalog
) -> None:
    rows = per_second_lines(od_price(catalog))
    path = write_ledger(tmp_path / "ledger.jsonl", rows)
    proteus = sum(r["charged_usd"] for r in rows if r["strategy"] == "proteus")
    good = {"strategies": {"proteus": {"cost_usd_total": proteus}, "x": {}}}
    check = verify_ledger(path, history, report=good, catalog=catalog)
    assert check.reported_usd == {"proteus": pytest.approx(proteus)}
    assert check.max_relative_error < 1e-9
    bad = {"strategies": {"proteus": {"cost_usd_total": proteus * 1.05}}}
    assert verify_ledger(path, history, report=bad, catalog=catalog).max_relative_error > 0.001


def test_tampered_charge_shows_as_relative_error(
    tmp_path: Path, history: PriceHistory, catalog: Catalog
) -> None:
    rows = per_second_lines(od_price(catalog))
    rows[1]["charged_usd"] *= 1.01
    path = write_ledger(tmp_path / "ledger.jsonl", rows)
    check = verify_ledger(path, history, catalog=catalog)
    assert check.max_relative_error > 0.001
    assert check.price_mismatches == 0


def test_wrong_price_counts_as_price_mismatch(
    tmp_path: Path, history: PriceHistory, catalog: Catalog
) -> None:
    rows = per_second_lines(od_price(catalog))
    rows[0] = line("proteus", 600.0, 1800.0, 1.20, reason="price-change")  # market was $0.90
    rows[3] = line("on-demand", 0.0, 60.0, 9.99, market="on-demand")  # catalog says otherwise
    path = write_ledger(tmp_path / "ledger.jsonl", rows)
    check = verify_ledger(path, history, catalog=catalog)
    assert check.price_mismatches == 2
    assert check.max_relative_error > 0.001


def test_hourly_refund_ledger_from_the_billing_model_verifies(
    tmp_path: Path, history: PriceHistory, catalog: Catalog
) -> None:
    series = history[MARKET]
    billing = HourlyRefundBilling()
    rows = []
    for start, end, reason in [
        (600.0, 600.0 + 2 * H + 1200, EndReason.EVICTED),
        (0.0, H + 900, EndReason.RELEASED),
        (1000.0, 1000.0 + H + 300, EndReason.JOB_FINISHED),
    ]:
        for iv in billing.bill_spot(series, start, end, reason):
            rows.append(
                line("hourly", iv.start_s, iv.end_s, iv.price_usd_per_hour,
                     billed=iv.billed_s, reason=str(iv.reason))
            )  # fmt: skip
    path = write_ledger(tmp_path / "ledger.jsonl", rows)
    check = verify_ledger(path, history, billing="hourly-refund", catalog=catalog)
    assert check.price_mismatches == 0
    assert check.recomputed_usd["hourly"] == pytest.approx(check.ledger_usd["hourly"], rel=1e-12)
    # the same ledger checked under per-second billing does not add up
    assert verify_ledger(path, history, catalog=catalog).max_relative_error > 0.001


def test_per_second_ledger_from_the_billing_model_verifies(
    tmp_path: Path, history: PriceHistory, catalog: Catalog
) -> None:
    rows = [
        line("ps", iv.start_s, iv.end_s, iv.price_usd_per_hour, reason=str(iv.reason))
        for iv in PerSecondBilling().bill_spot(history[MARKET], 100.0, 9000.0, EndReason.EVICTED)
    ]
    path = write_ledger(tmp_path / "ledger.jsonl", rows)
    check = verify_ledger(path, history, catalog=catalog)
    assert check.lines == 3
    assert check.max_relative_error < 1e-9


@pytest.mark.parametrize(
    ("billing", "start", "end", "reason", "billed"),
    [
        ("per-second", 0.0, 1200.0, "evicted", 1200.0),
        ("hourly-refund", 0.0, H, "hour-complete", H),
        ("hourly-refund", 0.0, 1200.0, "evicted", 0.0),
        ("hourly-refund", 0.0, 1200.0, "job-finished", 1200.0),
        ("hourly-refund", 0.0, 1200.0, "released", H),
    ],
)
def test_recompute_billed_seconds_follows_the_billing_rule(
    billing: str, start: float, end: float, reason: str, billed: float
) -> None:
    assert recompute_billed_s(billing, start, end, reason) == billed


def test_malformed_line_raises_user_error_naming_path_and_line(
    tmp_path: Path, history: PriceHistory, catalog: Catalog
) -> None:
    path = tmp_path / "ledger.jsonl"
    good = json.dumps(line("proteus", 600.0, 1800.0, 0.90))
    path.write_text(f"{good}\n\n{{not json\n")
    with pytest.raises(UserError) as info:
        verify_ledger(path, history, catalog=catalog)
    assert f"{path}:3" in str(info.value)


def test_line_missing_a_field_raises_user_error_naming_field(
    tmp_path: Path, history: PriceHistory, catalog: Catalog
) -> None:
    row = line("proteus", 600.0, 1800.0, 0.90)
    del row["charged_usd"]
    path = write_ledger(tmp_path / "ledger.jsonl", [row])
    with pytest.raises(UserError, match=r":1: missing charged_usd"):
        verify_ledger(path, history, catalog=catalog)


def test_spot_line_for_unknown_market_raises_user_error(
    tmp_path: Path, history: PriceHistory, catalog: Catalog
) -> None:
    row = line("proteus", 600.0, 1800.0, 0.90)
    row["zone"] = "us-east-1f"
    path = write_ledger(tmp_path / "ledger.jsonl", [row])
    with pytest.raises(UserError) as info:
        verify_ledger(path, history, catalog=catalog)
    assert f"{path}:1" in str(info.value)
    assert "us-east-1f" in str(info.value)


def test_missing_ledger_raises_user_error(tmp_path: Path, history: PriceHistory) -> None:
    with pytest.raises(UserError, match="cannot read ledger"):
        verify_ledger(tmp_path / "absent.jsonl", history)


def test_gzip_ledger_is_read(tmp_path: Path, history: PriceHistory, catalog: Catalog) -> None:
    rows = per_second_lines(od_price(catalog))
    plain = verify_ledger(write_ledger(tmp_path / "l.jsonl", rows), history, catalog=catalog)
    packed = verify_ledger(write_ledger(tmp_path / "l.jsonl.gz", rows), history, catalog=catalog)
    assert packed.lines == plain.lines == len(rows)
    assert packed.recomputed_usd == plain.recomputed_usd
    assert packed.ledger_usd == plain.ledger_usd
    assert packed.max_relative_error < 1e-9
