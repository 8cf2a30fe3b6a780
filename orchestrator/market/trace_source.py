"""`TracePriceSource`: price history replayed from DescribeSpotPriceHistory JSON files."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from importlib import resources
from pathlib import Path

from orchestrator.market.errors import PriceDataError
from orchestrator.market.prices import (
    PriceHistory,
    PriceSeries,
    PriceSource,
    merge_series,
    series_from_records,
    to_epoch_seconds,
)

BUNDLED_PRICE_REGIONS = ("us-east-1", "us-west-2")


def bundled_prices_dir(region: str = "us-east-1") -> Path:
    """The 2019-12..2020-03 p2/p3 spot prices shipped in the package (MIT, see its LICENSE)."""
    if region not in BUNDLED_PRICE_REGIONS:
        raise PriceDataError(
            f"no bundled spot prices for region {region!r}",
            fix=f"use one of {', '.join(BUNDLED_PRICE_REGIONS)} or pass --prices DIR",
            field="region",
        )
    return Path(str(resources.files("orchestrator.market") / "data" / "spot-prices-2020" / region))


def read_price_file(path: Path) -> list[PriceSeries]:
    """Parse one DescribeSpotPriceHistory response saved as JSON.

    Raises:
        PriceDataError: the file is unreadable, not JSON, not in the response format, or empty.
    """
    try:
        text = path.read_text()
    except OSError as exc:
        raise PriceDataError(
            f"cannot read price file {path}: {exc.strerror}", path=str(path)
        ) from None
    except UnicodeDecodeError:
        raise PriceDataError(
            f"price file {path} is not text (a DescribeSpotPriceHistory JSON file is)",
            path=str(path),
        ) from None
    if not text.strip():
        raise PriceDataError(f"price file {path} is empty", path=str(path))
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PriceDataError(
            f"price file {path} is not valid JSON "
            f"(line {exc.lineno}, column {exc.colno}: {exc.msg})",
            path=str(path),
        ) from None
    if not isinstance(body, dict) or not isinstance(body.get("SpotPriceHistory"), list):
        raise PriceDataError(
            f"price file {path} has no SpotPriceHistory list",
            path=str(path),
            field="SpotPriceHistory",
        )
    series = series_from_records(body["SpotPriceHistory"], source=str(path))
    if not series:
        raise PriceDataError(
            f"price file {path} holds no Linux/UNIX prices",
            path=str(path),
            field="SpotPriceHistory",
        )
    return series


class TracePriceSource(PriceSource):
    """Reads every `*.json` file under the given directories (or the files themselves).

    Overlapping files of the same market are merged; each market's series ends at the last
    timestamp seen anywhere in the trace (the end of the recorded window).
    """

    def __init__(self, paths: Sequence[Path | str]) -> None:
        if not paths:
            raise PriceDataError(
                "no price directories given",
                field="--prices",
                fix="pass --prices DIR (a folder of DescribeSpotPriceHistory JSON files)",
            )
        files: list[Path] = []
        for raw in paths:
            p = Path(raw)
            if p.is_dir():
                found = sorted(p.glob("*.json"))
                if not found:
                    raise PriceDataError(
                        f"price directory {p} holds no *.json files", path=str(p), field="--prices"
                    )
                files.extend(found)
            elif p.is_file():
                files.append(p)
            else:
                raise PriceDataError(
                    f"price path {p} does not exist",
                    path=str(p),
                    field="--prices",
                    fix="check the path; pass a folder of price JSON files",
                )
        parts: list[PriceSeries] = []
        for f in files:
            parts.extend(read_price_file(f))
        merged = merge_series(parts)
        trace_end = max(s.end_s for s in merged)
        self._series = [
            PriceSeries(s.market, s.times_s, s.prices_usd_per_hour, end_s=trace_end) for s in merged
        ]
        self.files = files

    def all(self) -> PriceHistory:
        """Every market of the trace over its whole span."""
        return PriceHistory(self._series)

    def history(
        self,
        start: datetime | float,
        end: datetime | float,
        *,
        instance_types: Sequence[str] | None = None,
        zones: Sequence[str] | None = None,
    ) -> PriceHistory:
        start_s, end_s = to_epoch_seconds(start), to_epoch_seconds(end)
        if end_s <= start_s:
            raise PriceDataError(
                f"time range is empty: end {end} is not after start {start}", field="end"
            )
        selected = []
        for s in self._series:
            if instance_types is not None and s.market.instance_type not in instance_types:
                continue
            if zones is not None and s.market.zone not in zones:
                continue
            cut = s.window(start_s, end_s)
            if cut is not None:
                selected.append(cut)
        if not selected:
            raise PriceDataError(
                "the trace holds no prices for "
                f"types={list(instance_types) if instance_types else 'any'} "
                f"zones={list(zones) if zones else 'any'} in the requested range",
                fix="check the instance types, zones and dates against the trace files",
            )
        return PriceHistory(selected)
