"""How the controller's ticks go, as the API reports them when the controller runs in its
process (`controller start`): `/healthz` turns degraded after `DEGRADED_AFTER_FAILURES` failed
ticks in a row, saying why, says `standby` while another process holds the fleet's lease, and
`/metrics` counts ticks and failures and says which process leads."""

from __future__ import annotations

from dataclasses import dataclass

#: Ticks failed in a row after which the controller reports itself degraded.
DEGRADED_AFTER_FAILURES = 3


@dataclass(frozen=True)
class TickHealth:
    """How the service's ticks went: counts, failures in a row, the last error."""

    ticks: int
    failures: int
    failing_in_a_row: int
    last_error: str | None
    standby: str | None = None  # another process holds the fleet's lease: who

    @property
    def leader(self) -> bool:
        return self.standby is None

    @property
    def degraded(self) -> bool:
        return self.failing_in_a_row >= DEGRADED_AFTER_FAILURES

    def reason(self) -> str:
        return f"{self.failing_in_a_row} controller ticks failed in a row: {self.last_error}"
