"""Unit constants, one home for the whole package (names carry the unit)."""

from __future__ import annotations

SECONDS_PER_HOUR = 3600.0
SECONDS_PER_DAY = 86400.0
#: A GPU's work rate, in reference GPUs (V100s): none does more than this.
MAX_WORK_RATE = 1_000.0
