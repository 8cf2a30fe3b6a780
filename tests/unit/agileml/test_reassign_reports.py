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


def test_no_report_to_a_helpee_that_reads_none_until_it_says_it_does() -> None:
    from orchestrator.straggler.protocol import Listening

    r, link = _reassigner()
    r._handle(None, "b", Listening(clock=3, listens=False), {})  # type: ignore[arg-type]
    r._report_progress(7)
    assert _reported_to(link) == {"c", "d"}
    link.sent.clear()
    smaller = Roster.starting(list(PEERS)).without({"d"}, 5)  # b's share grows from clock 5
    r.update_view(epoch=0, roster=smaller, peers=PEERS)
    r._report_progress(7)  # what b said held for the old members only
    assert "b" in _reported_to(link)
    r.update_view(epoch=0, roster=Roster.starting(list(PEERS)), peers=PEERS)
    link.sent.clear()
    r._handle(None, "b", Listening(clock=8, listens=True), {})  # type: ignore[arg-type]
    r._report_progress(8)
    assert _reported_to(link) == {"b", "c", "d"}
    r._handle(None, "b", Listening(clock=9, listens=False), {})  # type: ignore[arg-type]
    r.update_view(epoch=1, roster=Roster.starting(list(PEERS)), peers=PEERS)
    link.sent.clear()
    r._report_progress(9)  # a roll-back: what it said in the voided run is forgotten
    assert _reported_to(link) == {"b", "c", "d"}


def test_a_worker_tells_its_helpers_whether_it_listens_only_when_that_changes() -> None:
    from orchestrator.straggler.protocol import Listening

    r, link = _reassigner()
    r._min_chunk_rows = 10

    def told() -> dict[str, bool]:
        names = {e.progress: w for w, e in PEERS.items()}  # it goes with the reports
        return {names[e]: m.listens for e, m in link.sent if isinstance(m, Listening)}

    r._tell_listening(
        1, rows=8, micro_batches=1
    )  # one chunk of 8 rows: it reads no report mid-share
    assert told() == {"b": False, "c": False, "d": False}
    link.sent.clear()
    r._tell_listening(2, rows=8, micro_batches=1)
    assert told() == {}  # nothing changed: nothing sent
    r._tell_listening(
        3, rows=40, micro_batches=1
    )  # a bigger share: 4 chunks, reports can be acted on
    assert told() == {"b": True, "c": True, "d": True}


def test_no_chunk_is_smaller_than_the_calibrated_minimum_not_even_the_last() -> None:
    r, _ = _reassigner()
    r._min_chunk_rows = 100
    assert r._chunk_rows(128, 1) == 128  # not 100 + a 28-row remainder paying the whole fixed cost
    r._min_chunk_rows = 60
    assert r._chunk_rows(128, 1) == 64
    r._min_chunk_rows = 1
    assert r._chunk_rows(1000, 1) == 10  # checks_per_iteration = 100 equal chunks
    assert r._chunk_rows(7, 1) == 1


def test_accumulating_no_chunk_is_larger_than_one_of_the_shares_micro_batches() -> None:
    """Gradient accumulation bounds what one backward holds: FlexRR's chunks, own or helped,
    never exceed a micro-batch of the share, and a share in several micro-batches is read
    between them (it listens)."""
    r, _ = _reassigner()
    r._min_chunk_rows = 100
    assert r._chunk_rows(128, 4) == 32
    assert r._chunk_rows(130, 4) == 33  # the largest of the near-equal micro-batches
    r._min_chunk_rows = 1
    assert r._chunk_rows(1000, 4) == 10  # FlexRR's own chunks are smaller still
