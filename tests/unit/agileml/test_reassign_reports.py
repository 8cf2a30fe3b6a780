"""FlexRR's progress reports when nobody straggles: none to a helpee that reported reaching its
own checkpoint of the clock first; all again after a roll-back or a redo."""

from __future__ import annotations

from typing import Any

from orchestrator.agileml.peers import PeerInboxes
from orchestrator.agileml.reassign import Reassigner
from orchestrator.agileml.roster import Roster
from orchestrator.straggler.protocol import Progress
from orchestrator.straggler.spec import StragglerSpec

PEERS = {
    w: PeerInboxes(work=f"tcp://127.0.0.1:{5000 + i}", progress=f"tcp://127.0.0.1:{6000 + i}")
    for i, w in enumerate(["a", "b", "c", "d"])
}


class _Link:
    """Records what the reassigner sends (the real PeerLink's interface it uses)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Any]] = []
        self.inbox = None

    def send(self, endpoint: str, message: Any, *, epoch: int, tensors: Any = None) -> bool:
        self.sent.append((endpoint, message))
        return True

    def forget_except(self, endpoints: set[str]) -> None:
        pass


def _reassigner() -> tuple[Reassigner, _Link]:
    link = _Link()
    r = Reassigner(StragglerSpec(), worker_id="a", link=link, now=lambda: 0.0)  # type: ignore[arg-type]
    r.update_view(epoch=0, roster=Roster.starting(list(PEERS)), peers=PEERS)
    return r, link


def _reported_to(link: _Link) -> set[str]:
    names = {e.progress: w for w, e in PEERS.items()}  # reports go to the progress inbox
    return {names[e] for e, m in link.sent if isinstance(m, Progress)}


def test_a_helpee_that_reported_first_is_not_sent_our_report() -> None:
    r, link = _reassigner()
    r._note_ahead("b", 7)
    r._note_ahead("c", 6)  # an older clock says nothing about clock 7
    r._report_progress(7)
    assert _reported_to(link) == {"c", "d"} and r.stats.progress_skipped == 1
    link.sent.clear()
    r._report_progress(8)  # a new clock: everyone again
    assert _reported_to(link) == {"b", "c", "d"}


def test_a_roll_back_forgets_who_was_ahead() -> None:
    r, link = _reassigner()
    r._note_ahead("b", 7)
    r.update_view(epoch=1, roster=Roster.starting(list(PEERS)), peers=PEERS)
    r._report_progress(7)
    assert _reported_to(link) == {"b", "c", "d"}


def test_only_a_report_of_the_current_clock_can_bring_an_offer() -> None:
    """A report of an earlier clock was sent before this worker's last pull (it waited in the
    progress inbox): the helper has waited on the servers since, so it says nothing about who
    is behind now."""
    from orchestrator.straggler.protocol import DoThis, OwnWork

    r, link = _reassigner()
    r._now = lambda: 0.5
    # sent 0.6 s ago at 7.75: by Algorithm 1 alone "0.35 iterations ahead", an offer
    for clock, timer, offers in ((7, -0.1, 0), (8, 0.5, 1)):
        link.sent.clear()
        r._own = OwnWork(StragglerSpec(), clock=8, rows=100, started_at=0.0, avg_iteration_s=1.0)
        r._handle(None, "b", Progress(clock=clock, timer=timer), {})  # type: ignore[arg-type]
        assert sum(isinstance(m, DoThis) for _, m in link.sent) == offers, clock
