"""MarketAvailability: per-code cooldowns, region-wide marks, expiry (plain-float clock)."""

from __future__ import annotations

import pytest

from orchestrator.cloud.availability import COOLDOWNS, MarketAvailability, Scope
from orchestrator.market.prices import Market

G4_A = Market("g4dn.xlarge", "us-east-1a")
G4_B = Market("g4dn.xlarge", "us-east-1b")
C5_A = Market("c5.xlarge", "us-east-1a")
C5_WEST = Market("c5.xlarge", "us-west-2a")
KNOWN = [G4_A, G4_B, C5_A, C5_WEST]


@pytest.mark.parametrize(
    ("code", "cooldown_s"),
    [
        ("InsufficientInstanceCapacity", 600.0),
        ("SpotMaxPriceTooLow", 300.0),
        ("Unsupported", 86400.0),
    ],
)
def test_market_mark_lasts_its_cooldown_and_covers_only_that_market(
    code: str, cooldown_s: float
) -> None:
    table = MarketAvailability()
    mark = table.mark(G4_A, code, 100.0)
    assert mark is not None
    assert (mark.code, mark.since_s, mark.until_s, mark.scope) == (
        code,
        100.0,
        100.0 + cooldown_s,
        Scope.MARKET,
    )
    assert not table.is_available(G4_A, 100.0)
    assert not table.is_available(G4_A, 100.0 + cooldown_s - 1)
    assert table.is_available(G4_A, 100.0 + cooldown_s)
    assert table.unavailable(100.0 + cooldown_s - 1, KNOWN) == {G4_A}
    assert table.unavailable(100.0 + cooldown_s, KNOWN) == frozenset()


def test_spot_count_limit_marks_every_market_of_the_region() -> None:
    table = MarketAvailability()
    mark = table.mark(C5_A, "MaxSpotInstanceCountExceeded", 0.0)
    assert mark is not None and mark.scope is Scope.REGION and mark.until_s == 1800.0
    assert table.unavailable(10.0, KNOWN) == {G4_A, G4_B, C5_A}
    assert table.unavailable_regions(10.0) == {"us-east-1"}
    assert table.is_available(C5_WEST, 10.0)
    assert not table.is_available(Market("p3.2xlarge", "us-east-1f"), 1799.0)
    assert table.unavailable(1800.0, KNOWN) == frozenset()


@pytest.mark.parametrize("code", ["RequestLimitExceeded", "InstanceLimitExceeded", "NoSuchCode"])
def test_throttling_and_unknown_codes_mark_nothing(code: str) -> None:
    table = MarketAvailability()
    assert table.mark(G4_A, code, 0.0) is None
    assert table.is_available(G4_A, 0.0)
    assert table.marks() == ()


def test_every_listed_code_has_a_cooldown_or_none() -> None:
    assert COOLDOWNS["RequestLimitExceeded"] is None
    assert COOLDOWNS["MaxSpotInstanceCountExceeded"] is not None


def test_remark_keeps_the_later_ending_mark() -> None:
    table = MarketAvailability()
    table.mark(G4_A, "Unsupported", 0.0)
    kept = table.mark(G4_A, "SpotMaxPriceTooLow", 10.0)
    assert kept is not None and kept.code == "Unsupported" and kept.until_s == 86400.0
    table2 = MarketAvailability()
    table2.mark(G4_A, "SpotMaxPriceTooLow", 0.0)
    newer = table2.mark(G4_A, "InsufficientInstanceCapacity", 10.0)
    assert newer is not None and (newer.since_s, newer.until_s) == (10.0, 610.0)
    assert [m.code for m in table2.marks()] == ["InsufficientInstanceCapacity"]


def test_mark_for_reports_the_reason_that_ends_later() -> None:
    table = MarketAvailability()
    table.mark(G4_A, "InsufficientInstanceCapacity", 0.0)
    table.mark(G4_B, "MaxSpotInstanceCountExceeded", 0.0)
    reason = table.mark_for(G4_A, 1.0)
    assert reason is not None and reason.code == "MaxSpotInstanceCountExceeded"
    assert reason.market == G4_B and reason.region == "us-east-1"
    reason = table.mark_for(G4_A, 1800.0)
    assert reason is None


def test_expire_drops_ended_marks_and_returns_them() -> None:
    table = MarketAvailability()
    table.mark(G4_A, "SpotMaxPriceTooLow", 0.0)  # until 300
    table.mark(G4_B, "InsufficientInstanceCapacity", 0.0)  # until 600
    table.mark(C5_WEST, "MaxSpotInstanceCountExceeded", 50.0)  # us-west-2 until 1850
    assert table.expire(299.0) == ()
    expired = table.expire(600.0)
    assert [(m.market, m.code) for m in expired] == [
        (G4_A, "SpotMaxPriceTooLow"),
        (G4_B, "InsufficientInstanceCapacity"),
    ]
    assert [m.code for m in table.marks()] == ["MaxSpotInstanceCountExceeded"]
    assert [m.market for m in table.expire(1850.0)] == [C5_WEST]
    assert table.marks() == ()
