"""Spot price history: markets, price series, and the `PriceSource` interface.

A *market* is one (instance type, availability zone) pair. Its price history is a step function:
a price holds from its timestamp until the next one. Records come in the exact shape of EC2's
DescribeSpotPriceHistory response, whether they were read from trace files or fetched live.
"""

from __future__ import annotations

import abc
import bisect
import math
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import NamedTuple

import numpy as np

from orchestrator.market.errors import PriceDataError
from orchestrator.units import SECONDS_PER_HOUR

LINUX_PRODUCT = "Linux/UNIX"
#: EC2-Classic's name for the same product; moto still labels its records with it.
PRODUCT_ALIASES = {"Linux/UNIX (Amazon VPC)": LINUX_PRODUCT}
REQUIRED_RECORD_FIELDS = ("AvailabilityZone", "InstanceType", "SpotPrice", "Timestamp")


class Market(NamedTuple):
    """One spot market: an instance type in an availability zone (a tuple: cheap to hash)."""

    instance_type: str
    zone: str

    @property
    def region(self) -> str:
        return region_of_zone(self.zone)

    def __str__(self) -> str:
        return f"{self.instance_type}@{self.zone}"


def region_of_zone(zone: str) -> str:
    """`us-east-1a` -> `us-east-1` (and `us-east-1-bos-1a` style local zones to their parent)."""
    base = zone.rstrip("abcdefghijklmnopqrstuvwxyz")
    parts = base.split("-")
    return "-".join(parts[:3]) if len(parts) >= 3 else base


def to_epoch_seconds(value: datetime | str | float | int) -> float:
    """Accept a datetime (naive means UTC), an ISO-8601 string or epoch seconds."""
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        value = datetime.fromisoformat(value.replace("Z", "+00:00"))
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.timestamp()


def to_datetime(epoch_s: float) -> datetime:
    return datetime.fromtimestamp(epoch_s, tz=UTC)


class PriceSeries:
    """The price history of one market as a step function over epoch seconds.

    `times_s` is strictly increasing; `prices_usd_per_hour[i]` holds on
    `[times_s[i], times_s[i+1])`. The last price holds until the series' `end_s`.
    """

    __slots__ = ("market", "times_s", "prices_usd_per_hour", "end_s", "_times_list", "_suffix_max")

    def __init__(
        self, market: Market, times_s: np.ndarray, prices: np.ndarray, end_s: float | None = None
    ) -> None:
        if len(times_s) == 0:
            raise ValueError(f"empty price series for {market}")
        self.market = market
        self.times_s = np.asarray(times_s, dtype=np.float64)
        self.prices_usd_per_hour = np.asarray(prices, dtype=np.float64)
        self.end_s = float(end_s if end_s is not None else self.times_s[-1])
        self._times_list: list[float] = self.times_s.tolist()
        # highest price from each record on, so a bid above it answers "never" at once
        self._suffix_max: list[float] = np.maximum.accumulate(self.prices_usd_per_hour[::-1])[
            ::-1
        ].tolist()

    @property
    def start_s(self) -> float:
        return float(self.times_s[0])

    def index_at(self, t_s: float) -> int:
        """Index of the price in effect at `t_s`, or -1 before the first record."""
        return bisect.bisect_right(self._times_list, t_s) - 1

    def price_at(self, t_s: float) -> float | None:
        """The price in effect at `t_s`; None before the first record."""
        i = self.index_at(t_s)
        return None if i < 0 else float(self.prices_usd_per_hour[i])

    def next_change_after(self, t_s: float) -> float | None:
        """Time of the first record strictly after `t_s`, or None."""
        i = self.index_at(t_s) + 1
        return self._times_list[i] if i < len(self._times_list) else None

    def first_time_above(self, t_s: float, threshold: float) -> float | None:
        """First time >= t_s at which the price is strictly above `threshold` (None if never)."""
        i = max(self.index_at(t_s), 0)
        if self._suffix_max[i] <= threshold:
            return None
        above = np.flatnonzero(self.prices_usd_per_hour[i:] > threshold)
        if len(above) == 0:
            return None
        return max(t_s, self._times_list[i + int(above[0])])

    def cost_usd(self, start_s: float, end_s: float) -> float:
        """Integral of price over [start_s, end_s] in dollars (per-second billing at market)."""
        if end_s <= start_s:
            return 0.0
        i = max(self.index_at(start_s), 0)
        total = 0.0
        t = start_s
        n = len(self._times_list)
        while t < end_s:
            nxt = self._times_list[i + 1] if i + 1 < n else end_s
            seg_end = min(nxt, end_s)
            total += float(self.prices_usd_per_hour[i]) * (seg_end - t) / SECONDS_PER_HOUR
            t = seg_end
            i += 1
            if i >= n:
                i = n - 1
        return total

    def window(self, start_s: float, end_s: float) -> PriceSeries | None:
        """This series cut to the record in effect at `start_s` through the last one at or
        before `end_s`, ending at `end_s`; None when it has no record by `end_s`."""
        first = max(self.index_at(start_s), 0)
        last = self.index_at(end_s)
        if last < first:
            return None
        return PriceSeries(
            self.market,
            self.times_s[first : last + 1],
            self.prices_usd_per_hour[first : last + 1],
            end_s=end_s,
        )

    def __len__(self) -> int:
        return len(self._times_list)


class PriceHistory(Mapping[Market, PriceSeries]):
    """Price series for a set of markets, as one `PriceSource` returned them."""

    def __init__(self, series: Iterable[PriceSeries]) -> None:
        self._series = {s.market: s for s in series}
        if not self._series:
            raise PriceDataError(
                "no markets with prices were selected",
                fix="check the instance types and zones against the price data",
            )

    def __getitem__(self, market: Market) -> PriceSeries:
        return self._series[market]

    def __iter__(self) -> Iterator[Market]:
        return iter(sorted(self._series))

    def __len__(self) -> int:
        return len(self._series)

    @property
    def start_s(self) -> float:
        """Latest first record: from here on every market has a known price."""
        return max(s.start_s for s in self._series.values())

    @property
    def end_s(self) -> float:
        return min(s.end_s for s in self._series.values())

    def instance_types(self) -> list[str]:
        return sorted({m.instance_type for m in self._series})

    def zones(self) -> list[str]:
        return sorted({m.zone for m in self._series})

    def restrict(self, instance_types: Sequence[str] | None = None) -> PriceHistory:
        keep = set(instance_types) if instance_types is not None else None
        return PriceHistory(
            s for m, s in self._series.items() if keep is None or m.instance_type in keep
        )


def series_from_records(
    records: Iterable[Mapping[str, object]],
    *,
    source: str,
    end_s: float | None = None,
    product_description: str = LINUX_PRODUCT,
) -> list[PriceSeries]:
    """Build one `PriceSeries` per market from DescribeSpotPriceHistory records.

    `source` names the file or API call, for error messages. Records of other product
    descriptions are skipped; duplicate (market, timestamp) records keep the last one.

    Raises:
        PriceDataError: a record misses a field or has an unparsable price or timestamp.
    """
    points: dict[Market, dict[float, float]] = defaultdict(dict)
    for index, record in enumerate(records):
        if not isinstance(record, Mapping):
            raise PriceDataError(
                f"{source}: SpotPriceHistory[{index}] is not an object",
                path=source,
                field=f"SpotPriceHistory[{index}]",
            )
        missing = [f for f in REQUIRED_RECORD_FIELDS if f not in record]
        if missing:
            raise PriceDataError(
                f"{source}: SpotPriceHistory[{index}] has no {', '.join(missing)}",
                path=source,
                field=f"SpotPriceHistory[{index}].{missing[0]}",
            )
        product = record.get("ProductDescription", product_description)
        if PRODUCT_ALIASES.get(str(product), product) != product_description:
            continue
        try:
            price = float(str(record["SpotPrice"]))
        except ValueError:
            raise PriceDataError(
                f"{source}: SpotPriceHistory[{index}].SpotPrice={record['SpotPrice']!r} "
                "is not a number",
                path=source,
                field=f"SpotPriceHistory[{index}].SpotPrice",
            ) from None
        if not (math.isfinite(price) and price > 0):
            raise PriceDataError(
                f"{source}: SpotPriceHistory[{index}].SpotPrice={price} is not positive",
                path=source,
                field=f"SpotPriceHistory[{index}].SpotPrice",
            )
        stamp = record["Timestamp"]
        try:
            t = to_epoch_seconds(stamp if isinstance(stamp, datetime) else str(stamp))
        except ValueError:
            raise PriceDataError(
                f"{source}: SpotPriceHistory[{index}].Timestamp={stamp!r} is not ISO-8601",
                path=source,
                field=f"SpotPriceHistory[{index}].Timestamp",
            ) from None
        market = Market(str(record["InstanceType"]), str(record["AvailabilityZone"]))
        points[market][t] = price
    result = []
    for market, by_time in points.items():
        times = np.array(sorted(by_time), dtype=np.float64)
        prices = np.array([by_time[t] for t in times.tolist()], dtype=np.float64)
        result.append(PriceSeries(market, times, prices, end_s=end_s))
    return result


def merge_series(parts: Iterable[PriceSeries]) -> list[PriceSeries]:
    """Merge several series of the same markets (e.g. overlapping trace files) into one each."""
    by_market: dict[Market, dict[float, float]] = defaultdict(dict)
    ends: dict[Market, float] = {}
    for s in parts:
        by_market[s.market].update(
            zip(s.times_s.tolist(), s.prices_usd_per_hour.tolist(), strict=True)
        )
        ends[s.market] = max(ends.get(s.market, s.end_s), s.end_s)
    merged = []
    for market, by_time in by_market.items():
        times = np.array(sorted(by_time), dtype=np.float64)
        prices = np.array([by_time[t] for t in times.tolist()], dtype=np.float64)
        merged.append(PriceSeries(market, times, prices, end_s=ends[market]))
    return merged


class PriceSource(abc.ABC):
    """Where spot price history comes from: trace files offline, EC2 live."""

    @abc.abstractmethod
    def history(
        self,
        start: datetime | float,
        end: datetime | float,
        *,
        instance_types: Sequence[str] | None = None,
        zones: Sequence[str] | None = None,
    ) -> PriceHistory:
        """Price series for every matching market over [start, end].

        Each series includes the record in effect at `start` (as DescribeSpotPriceHistory does),
        so the price at `start` is known. A series ends at `end`.

        Raises:
            PriceDataError: the source holds no usable prices for the request.
        """
