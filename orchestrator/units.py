"""Unit constants, one home for the whole package (names carry the unit)."""

from __future__ import annotations

SECONDS_PER_HOUR = 3600.0
SECONDS_PER_DAY = 86400.0
#: The largest integer stored or sent (Redis, JSON readers, Prometheus take 64-bit ones).
INT64_MAX = 2**63 - 1
#: A GPU's work rate, in reference GPUs (V100s): none does more than this.
MAX_WORK_RATE = 1_000.0
#: The largest random seed (numpy's generators take 32-bit ones).
MAX_SEED = 2**32 - 1
#: The most devices (GPUs) an AgileML node trains on: an instance has at most 16.
MAX_DEVICES = 16
#: A setting measured in seconds no job reaches (a leap year).
MAX_SETTING_S = 366 * SECONDS_PER_DAY
