"""`MarketAvailability`: which markets EC2 just refused, and until when to leave them alone.

When a launch fails with a capacity error the controller marks the market, and BidBrain skips
unavailable markets until their cooldown ends. The table is pure: the caller passes `now_s`
(epoch seconds, or any monotonic clock in seconds) to every call, so the simulator, the live
controller and the tests drive it with their own clocks.

Example (region us-east-1, clock in seconds)::

    t=0     g4dn.xlarge@us-east-1a InsufficientInstanceCapacity -> that market out until t=600
    t=30    c5.xlarge@us-east-1b MaxSpotInstanceCountExceeded  -> every us-east-1 market out
                                                                  until t=1830
    t=1830  all of us-east-1 available again (`expire(1830)` drops both marks)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import TypeVar

from orchestrator.market.prices import Market

K = TypeVar("K")


class Scope(StrEnum):
    """What a mark covers."""

    MARKET = "market"  # the one (type, zone) that failed
    REGION = "region"  # every market of the failed market's region


@dataclass(frozen=True, slots=True)
class Cooldown:
    """How long, and how widely, an error code makes markets unavailable."""

    seconds: float
    scope: Scope


#: Error code -> cooldown; None (or a code not listed) means "not a market problem: no mark".
COOLDOWNS: Mapping[str, Cooldown | None] = MappingProxyType(
    {
        # EC2 has no spare capacity of the type in the zone; it usually comes back within minutes.
        "InsufficientInstanceCapacity": Cooldown(600.0, Scope.MARKET),
        # The account's spot instance (vCPU) limit for the region is reached: no spot market of
        # the region can launch until instances are released or the limit is raised.
        "MaxSpotInstanceCountExceeded": Cooldown(1800.0, Scope.REGION),
        # Our max price is below the market's current spot price; prices move every few minutes.
        "SpotMaxPriceTooLow": Cooldown(300.0, Scope.MARKET),
        # The type is not offered in that zone: retrying will not help for a long time (a day).
        "Unsupported": Cooldown(86400.0, Scope.MARKET),
        # Throttling of our API calls says nothing about the market: retry on a later tick.
        "RequestLimitExceeded": None,
        # On-demand account limits hit the reliable tier, not spot markets; marking the region
        # would also hide its spot markets. The controller reports them instead.
        "InstanceLimitExceeded": None,
        "VcpuLimitExceeded": None,
    }
)


@dataclass(frozen=True, slots=True)
class Mark:
    """Why a market (or a whole region) is unavailable, and on what interval.

    `market` is the market whose launch failed (for a region-wide mark too); the mark covers
    `[since_s, until_s)`.
    """

    market: Market
    code: str
    since_s: float
    until_s: float
    scope: Scope

    @property
    def region(self) -> str:
        return self.market.region

    def active(self, now_s: float) -> bool:
        return self.since_s <= now_s < self.until_s


class MarketAvailability:
    """Markets that are unavailable until a time, keyed by the error that made them so.

    A market is unavailable while a mark of its own or a region-wide mark of its region is
    active. Marking a market that is already marked keeps whichever mark ends later.
    """

    def __init__(self, cooldowns: Mapping[str, Cooldown | None] = COOLDOWNS) -> None:
        self._cooldowns = cooldowns
        self._markets: dict[Market, Mark] = {}
        self._regions: dict[str, Mark] = {}

    def mark(self, market: Market, code: str, now_s: float) -> Mark | None:
        """Record that launching in `market` failed with `code` at `now_s`.

        Returns the mark now in force for that market's key (the new one, or an existing one
        that ends later), or None when the code is not a market problem (e.g. throttling).
        """
        cooldown = self._cooldowns.get(code)
        if cooldown is None:
            return None
        new = Mark(market, code, now_s, now_s + cooldown.seconds, cooldown.scope)
        if cooldown.scope is Scope.REGION:
            return _keep_later(self._regions, market.region, new)
        return _keep_later(self._markets, market, new)

    def mark_for(self, market: Market, now_s: float) -> Mark | None:
        """The active mark that makes `market` unavailable (the later-ending one), or None."""
        candidates = [
            m
            for m in (self._markets.get(market), self._regions.get(market.region))
            if m is not None and m.active(now_s)
        ]
        return max(candidates, key=lambda m: m.until_s, default=None)

    def is_available(self, market: Market, now_s: float) -> bool:
        return self.mark_for(market, now_s) is None

    def unavailable(self, now_s: float, markets: Iterable[Market] = ()) -> frozenset[Market]:
        """Markets unavailable at `now_s`: every market marked on its own, plus those of
        `markets` (the known markets) that lie in a region marked region-wide."""
        result = {m for m, mark in self._markets.items() if mark.active(now_s)}
        result.update(m for m in markets if not self.is_available(m, now_s))
        return frozenset(result)

    def unavailable_regions(self, now_s: float) -> frozenset[str]:
        """Regions whose every market is unavailable at `now_s`."""
        return frozenset(r for r, mark in self._regions.items() if mark.active(now_s))

    def expire(self, now_s: float) -> tuple[Mark, ...]:
        """Drop marks that have ended by `now_s`; return them (oldest first), e.g. to log."""
        expired = _pop_ended(self._markets, now_s) + _pop_ended(self._regions, now_s)
        return tuple(sorted(expired, key=lambda m: (m.since_s, str(m.market))))

    def marks(self) -> tuple[Mark, ...]:
        """Every mark held until `expire` drops it: market marks, then region-wide ones."""
        return tuple(self._markets.values()) + tuple(self._regions.values())


def _keep_later(table: dict[K, Mark], key: K, new: Mark) -> Mark:
    old = table.get(key)
    if old is not None and old.until_s >= new.until_s:
        return old
    table[key] = new
    return new


def _pop_ended(table: dict[K, Mark], now_s: float) -> list[Mark]:
    ended = [key for key, mark in table.items() if mark.until_s <= now_s]
    return [table.pop(key) for key in ended]
