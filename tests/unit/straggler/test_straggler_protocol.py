"""RapidReassignment as pure code: Algorithm 1, the helpee side (`OwnWork`), the helper side
(`HelpDesk`, Algorithm 2), the messages, and an exhaustive model check of every message order
between a helpee and a helper (plus seeded random interleavings with two helpers).

Everything is deterministic: no sockets, no sleeping, times are passed as `now`.
"""

from __future__ import annotations

import copy
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from pydantic import ValidationError

from orchestrator.straggler.protocol import (
    PEER_MESSAGE,
    TRANSITIONS,
    Assignment,
    AssignmentState,
    Begun,
    Cancel,
    Completed,
    DoThis,
    HelpDecision,
    HelpDesk,
    OwnWork,
    PeerMessage,
    Progress,
    progress_difference,
)
from orchestrator.straggler.spec import StragglerSpec

SPEC = StragglerSpec()  # Table 3.1: 2.5% initial, 5% follow-up, 20% trigger, 75% checkpoint
CLOCK = 5


def own_work(
    rows: int = 200,
    *,
    spec: StragglerSpec = SPEC,
    clock: int = CLOCK,
    started_at: float = 0.0,
    avg: float | None = 10.0,
    first_assignment: int = 0,
) -> OwnWork:
    return OwnWork(
        spec,
        clock=clock,
        rows=rows,
        started_at=started_at,
        avg_iteration_s=avg,
        first_assignment=first_assignment,
    )


def far_ahead(clock: int = CLOCK, timer: float = 100.0) -> Progress:
    """A report that puts a fresh helpee (fraction 0) 0.75 iterations behind, at now=timer."""
    return Progress(clock=clock, timer=timer)


def offer_to(own: OwnWork, helper: str, now: float = 100.0) -> DoThis:
    offer = own.on_progress(helper, far_ahead(own.clock, now), now)
    assert offer is not None
    return offer


def begun(own: OwnWork, helper: str, offer: DoThis, now: float = 101.0) -> DoThis | None:
    return own.on_begun(helper, Begun(clock=offer.clock, assignment=offer.assignment), now)


def completed(offer: DoThis, done_end: int | None = None) -> Completed:
    return Completed(
        clock=offer.clock,
        assignment=offer.assignment,
        start=offer.start,
        end=offer.end,
        done_end=offer.end if done_end is None else done_end,
        roster_version=offer.roster_version,
    )


def drain(own: OwnWork, max_rows: int = 10_000) -> list[tuple[int, int]]:
    """Every chunk `next_chunk` hands out until it has none."""
    spans = []
    while (span := own.next_chunk(max_rows)) is not None:
        spans.append(span)
        own.record_done(span[1] - span[0])
    return spans


def rows_of(spans: list[tuple[int, int]]) -> list[int]:
    return sorted(r for start, end in spans for r in range(start, end))


# -- 1. Algorithm 1 -------------------------------------------------------------------------


def test_progress_difference_adds_completion_difference_and_time_since_report() -> None:
    # reporter at 75% of clock 3 two seconds ago; we are at 50% of clock 3; 10 s iterations
    behind = progress_difference(
        Progress(clock=3, timer=100.0),
        clock=3,
        fraction=0.5,
        checkpoint=0.75,
        now=102.0,
        avg_iteration_s=10.0,
    )
    assert behind == pytest.approx(0.25 + 0.2)


def test_progress_difference_counts_whole_iterations_between_clocks() -> None:
    # reporter at 4.75, we are at 3.9, report just arrived: 0.85 iterations behind
    behind = progress_difference(
        Progress(clock=4, timer=50.0),
        clock=3,
        fraction=0.9,
        checkpoint=0.75,
        now=50.0,
        avg_iteration_s=5.0,
    )
    assert behind == pytest.approx(0.85)


def test_progress_difference_is_negative_when_the_reporter_is_behind() -> None:
    behind = progress_difference(
        Progress(clock=2, timer=10.0),
        clock=3,
        fraction=0.1,
        checkpoint=0.75,
        now=11.0,
        avg_iteration_s=4.0,
    )
    assert behind == pytest.approx((2.75 - 3.1) + 0.25)


def test_progress_difference_time_term_is_scaled_by_the_average_iteration() -> None:
    kwargs = dict(clock=0, fraction=0.75, checkpoint=0.75, now=13.0)
    report = Progress(clock=0, timer=10.0)
    assert progress_difference(report, avg_iteration_s=6.0, **kwargs) == pytest.approx(0.5)
    assert progress_difference(report, avg_iteration_s=30.0, **kwargs) == pytest.approx(0.1)


# -- 2. OwnWork: the helpee -----------------------------------------------------------------

EXACT = StragglerSpec(trigger_threshold=0.25)  # exact in binary: tests the boundary exactly


def test_helpee_exactly_at_the_trigger_threshold_offers_nothing() -> None:
    own = own_work(200, spec=EXACT)
    own.record_done(100)  # fraction 0.5: reporter at 0.75 -> exactly 0.25 behind
    assert own.on_progress("f", Progress(clock=CLOCK, timer=50.0), 50.0) is None
    assert own.assignments == {} and own.tail == 200


def test_helpee_below_the_trigger_threshold_offers_nothing() -> None:
    own = own_work(200)
    own.record_done(120)  # 0.15 behind
    assert own.on_progress("f", Progress(clock=CLOCK, timer=50.0), 50.0) is None
    own2 = own_work(200)  # and a reporter behind us
    assert own2.on_progress("f", Progress(clock=CLOCK - 1, timer=50.0), 50.0) is None


def test_helpee_behind_by_more_than_threshold_offers_tail_of_its_rows() -> None:
    own = own_work(200, spec=EXACT, first_assignment=7)
    own.record_done(98)  # fraction 0.49 -> 0.26 behind
    offer = own.on_progress("f", Progress(clock=CLOCK, timer=50.0), 50.0)
    assert offer == DoThis(clock=CLOCK, assignment=7, start=195, end=200, rows=200, timer=50.0)
    assert own.tail == 195
    a = own.assignments[7]
    assert (a.helper, a.start, a.end, a.state, a.sent_at) == (
        "f",
        195,
        200,
        AssignmentState.SENT,
        50.0,
    )
    assert own.next_id == 8


def test_helpee_at_same_completion_but_stale_report_offers_because_of_time_difference() -> None:
    own = own_work(200, avg=10.0)
    own.record_done(150)  # fraction 0.75 == reporter's checkpoint: completion diff 0
    report = Progress(clock=CLOCK, timer=100.0)
    assert own.on_progress("f", report, now=101.0) is None  # 0.1 behind
    assert own.on_progress("f", report, now=103.0) is not None  # 0.3 behind


@pytest.mark.parametrize(
    ("rows", "size"), [(200, 5), (400, 10), (40, 1), (10, 1), (1000, 25), (60, 2)]
)
def test_initial_offer_is_round_of_initial_assignment_times_rows_at_least_one(
    rows: int, size: int
) -> None:
    own = own_work(rows)
    offer = offer_to(own, "f")
    assert (offer.start, offer.end, offer.rows) == (rows - size, rows, rows)


def test_helpee_keeps_one_unanswered_offer_per_helper() -> None:
    own = own_work(200)
    first = offer_to(own, "f")
    assert own.on_progress("f", far_ahead(), 100.0) is None  # f has not answered yet
    other = offer_to(own, "g")  # another helper gets its own offer, cut next to the first
    assert (other.start, other.end) == (190, 195)
    assert other.assignment == first.assignment + 1
    follow = begun(own, "f", first)
    assert follow is not None  # f's follow-up is now its unanswered offer: still no new one
    assert own.on_progress("f", far_ahead(), 100.0) is None


def test_begun_marks_assignment_begun_and_returns_follow_up_from_the_end() -> None:
    own = own_work(200)
    first = offer_to(own, "f")
    follow = begun(own, "f", first, now=123.0)
    a = own.assignments[first.assignment]
    assert a.state is AssignmentState.BEGUN and a.begun_at == 123.0
    assert follow is not None
    assert (follow.start, follow.end) == (185, 195)  # twice the initial size, next from the end
    assert follow.assignment == first.assignment + 1 and follow.timer == 123.0
    follow2 = begun(own, "f", follow)
    assert follow2 is not None and (follow2.start, follow2.end) == (175, 185)
    assert own.tail == 175


def test_follow_up_size_follows_the_spec() -> None:
    spec = StragglerSpec(initial_assignment=0.05, follow_up_assignment=0.15)
    own = own_work(100, spec=spec)
    first = offer_to(own, "f")
    follow = begun(own, "f", first)
    assert (first.start, first.end) == (95, 100)
    assert follow is not None and (follow.start, follow.end) == (80, 95)


def test_no_initial_offer_when_fewer_than_twice_its_size_rows_remain_unassigned() -> None:
    own = own_work(200)
    assert own.next_chunk(191) == (0, 191)  # 9 rows left: fewer than 2 x 5
    assert own.on_progress("f", far_ahead(), 100.0) is None
    own2 = own_work(200)
    assert own2.next_chunk(190) == (0, 190)  # exactly 10 rows left: still offered
    offer = own2.on_progress("f", far_ahead(), 100.0)
    assert offer is not None and (offer.start, offer.end) == (195, 200)


def test_no_follow_up_when_fewer_than_twice_its_size_rows_remain_unassigned() -> None:
    own = own_work(200)
    first = offer_to(own, "f")  # tail 195
    own.next_chunk(176)  # front 176: 19 < 2 x 10 unassigned
    assert begun(own, "f", first) is None
    assert own.assignments[first.assignment].state is AssignmentState.BEGUN
    own2 = own_work(200)
    first2 = offer_to(own2, "f")
    own2.next_chunk(175)  # exactly 20 left
    follow = begun(own2, "f", first2)
    assert follow is not None and (follow.start, follow.end) == (185, 195)


def test_first_iteration_estimates_average_from_elapsed_over_fraction() -> None:
    # fraction 0.6 -> completion diff 0.15; report 6 s old. With 10 s elapsed the estimate is
    # 10/0.6 = 16.7 s (0.51 behind: offer); with 1000 s elapsed it is 1667 s (0.154: none).
    report = Progress(clock=CLOCK, timer=4.0)
    fast = own_work(200, avg=None, started_at=0.0)
    fast.record_done(120)
    assert fast.on_progress("f", report, now=10.0) is not None
    slow = own_work(200, avg=None, started_at=-990.0)
    slow.record_done(120)
    assert slow.on_progress("f", report, now=10.0) is None


def test_first_iteration_without_progress_or_elapsed_time_offers_nothing() -> None:
    nothing_done = own_work(200, avg=None, started_at=0.0)
    assert nothing_done.on_progress("f", far_ahead(timer=0.0), now=50.0) is None
    no_time = own_work(200, avg=None, started_at=50.0)
    no_time.record_done(10)
    assert no_time.on_progress("f", far_ahead(timer=0.0), now=50.0) is None


def test_progress_due_fires_once_at_the_checkpoint() -> None:
    own = own_work(100)
    own.record_done(74)
    assert not own.progress_due()
    own.record_done(1)
    assert own.progress_due()
    assert not own.progress_due()
    own.record_done(25)
    assert not own.progress_due()


def test_progress_due_counts_rows_given_to_helpers() -> None:
    own = own_work(100)
    offer_to(own, "f")  # round(0.025 * 100) == 2 rows given away
    assert own.assignments[0].rows == 2
    own.record_done(72)
    assert not own.progress_due()  # 74%
    own.record_done(1)
    assert own.progress_due()  # 73 done + 2 given = 75%


def test_cancel_unbegun_withdraws_only_sent_offers_one_cancel_per_helper() -> None:
    own = own_work(200)
    a1 = offer_to(own, "a")  # [195, 200)
    a2 = begun(own, "a", a1)  # a1 begun; follow-up a2 [185, 195) sent
    b1 = offer_to(own, "b")  # [180, 185) sent
    c1 = offer_to(own, "c")  # [175, 180)
    c2 = begun(own, "c", c1)  # c1 begun; c2 [165, 175) sent
    assert a2 is not None and c2 is not None
    assert drain(own) == [(0, 165)]

    cancels = own.cancel_unbegun(now=500.0)

    assert cancels == {
        "a": Cancel(clock=CLOCK, timer=500.0, assignments=(a2.assignment,)),
        "b": Cancel(clock=CLOCK, timer=500.0, assignments=(b1.assignment,)),
        "c": Cancel(clock=CLOCK, timer=500.0, assignments=(c2.assignment,)),
    }
    state = {i: a.state for i, a in own.assignments.items()}
    assert state == {
        a1.assignment: AssignmentState.BEGUN,
        a2.assignment: AssignmentState.CANCELLED,
        b1.assignment: AssignmentState.CANCELLED,
        c1.assignment: AssignmentState.BEGUN,
        c2.assignment: AssignmentState.CANCELLED,
    }
    # the withdrawn ranges come back to this worker, the begun ones do not
    assert rows_of(drain(own, 3)) == list(range(165, 175)) + list(range(180, 195))
    assert own.waiting_on() == {"a", "c"}
    assert not own.finished()


def test_cancel_unbegun_without_offers_returns_nothing_and_stops_new_offers() -> None:
    own = own_work(200)
    first = offer_to(own, "f")
    follow = begun(own, "f", first)
    assert follow is not None
    drain(own)
    assert own.cancel_unbegun(now=1.0) == {
        "f": Cancel(clock=CLOCK, timer=1.0, assignments=(follow.assignment,))
    }
    assert own.cancel_unbegun(now=2.0) == {}  # nothing sent any more
    assert own.on_progress("g", far_ahead(), 100.0) is None  # cancelled: no new offers
    assert own.cancelled


def test_begun_after_cancel_unbegun_gives_no_follow_up() -> None:
    own = own_work(200)
    first = offer_to(own, "f")
    own.cancel_unbegun(now=1.0)  # before f's begun arrives: withdrawn
    assert begun(own, "f", first) is None
    assert own.assignments[first.assignment].state is AssignmentState.CANCELLED
    assert own.dropped == 1


def test_taken_back_ranges_are_handed_out_in_chunks_of_at_most_max_rows() -> None:
    own = own_work(200)
    follow = begun(own, "f", offer_to(own, "f"))  # [195, 200) begun, [185, 195) sent
    assert follow is not None
    drain(own)
    own.cancel_unbegun(now=1.0)  # the follow-up comes back
    chunks = [own.next_chunk(3) for _ in range(5)]
    assert chunks == [(185, 188), (188, 191), (191, 194), (194, 195), None]


def test_completed_accepted_only_for_begun_assignment_with_matching_range() -> None:
    own = own_work(200)
    offer = offer_to(own, "f")
    assert not own.on_completed("f", completed(offer))  # not begun yet
    assert own.assignments[offer.assignment].state is AssignmentState.SENT
    begun(own, "f", offer)
    wrong = Completed(clock=CLOCK, assignment=offer.assignment, start=194, end=200, done_end=200)
    assert not own.on_completed("f", wrong)
    assert own.dropped == 2

    assert own.on_completed("f", completed(offer))

    assert own.assignments[offer.assignment].state is AssignmentState.COMPLETED
    assert own.helped_rows == 5
    assert not own.on_completed("f", completed(offer))  # a duplicate
    assert own.helped_rows == 5 and own.dropped == 3


def test_partial_completion_from_leaving_helper_returns_rest_of_the_range() -> None:
    own = own_work(200)
    offer = offer_to(own, "f")  # [195, 200)
    begun(own, "f", offer)
    assert own.on_completed("f", completed(offer, done_end=197))
    assert own.helped_rows == 2
    assert own.assignments[offer.assignment].state is AssignmentState.COMPLETED
    spans = drain(own, 1000)
    # own rows up to the follow-up's start, then the cancelled follow-up is not yet back
    assert (197, 200) in spans
    own.cancel_unbegun(now=1.0)
    spans += drain(own, 1000)
    assert rows_of(spans) == list(range(0, 195)) + [197, 198, 199]
    assert own.finished()


def test_partial_completion_with_nothing_done_returns_the_whole_range() -> None:
    own = own_work(200)
    offer = offer_to(own, "f")
    begun(own, "f", offer)
    assert own.on_completed("f", completed(offer, done_end=195))
    assert own.helped_rows == 0
    assert own.taken_back == [(195, 200)]


@pytest.mark.parametrize(
    "case", ["cancelled", "reclaimed", "unknown", "other_helper", "other_clock", "duplicate"]
)
def test_late_or_foreign_begun_and_completed_are_dropped(case: str) -> None:
    own = own_work(200)
    offer = offer_to(own, "f")
    helper, clock, assignment = "f", CLOCK, offer.assignment
    if case == "cancelled":
        own.cancel_unbegun(now=1.0)
    elif case == "reclaimed":
        begun(own, "f", offer)
        own.reclaim(now=102.0, alive=set())
    elif case == "unknown":
        assignment = 99
    elif case == "other_helper":
        helper = "g"
    elif case == "other_clock":
        clock = CLOCK + 1
    elif case == "duplicate":  # begun and completed already
        begun(own, "f", offer)
        assert own.on_completed("f", completed(offer))
    before = own.dropped
    state = own.assignments[offer.assignment].state
    tail, helped = own.tail, own.helped_rows

    follow = own.on_begun(helper, Begun(clock=clock, assignment=assignment), 103.0)
    accepted = own.on_completed(
        helper,
        Completed(clock=clock, assignment=assignment, start=195, end=200, done_end=200),
    )

    assert follow is None and not accepted
    assert own.dropped == before + 2
    assert own.assignments[offer.assignment].state is state
    assert (own.tail, own.helped_rows) == (tail, helped)


def test_reclaim_takes_back_begun_assignment_of_helper_no_longer_alive() -> None:
    own = own_work(200)
    f_offer = offer_to(own, "f")
    g_offer = offer_to(own, "g")
    begun(own, "f", f_offer, now=100.0)
    begun(own, "g", g_offer, now=100.0)
    taken = own.reclaim(now=100.5, alive={"g"})
    assert [a.id for a in taken] == [f_offer.assignment]
    assert own.assignments[f_offer.assignment].state is AssignmentState.RECLAIMED
    assert own.assignments[g_offer.assignment].state is AssignmentState.BEGUN
    assert own.taken_back == [(195, 200)]
    assert own.reclaim(now=100.5, alive={"g"}) == []  # only once


def test_reclaim_leaves_sent_offers_alone() -> None:
    own = own_work(200)
    offer_to(own, "f")
    assert own.reclaim(now=10_000.0, alive=set()) == []
    assert own.assignments[0].state is AssignmentState.SENT


@pytest.mark.parametrize(
    ("avg", "timeout"),
    [
        (10.0, 20.0),  # help_timeout_iterations (2) x avg
        (0.1, 1.0),  # at least help_timeout_min_s
    ],
)
def test_reclaim_overdue_after_max_of_min_timeout_and_iterations_times_average(
    avg: float, timeout: float
) -> None:
    own = own_work(200, avg=avg)
    offer = offer_to(own, "f")
    begun(own, "f", offer, now=100.0)
    assert own.reclaim(now=100.0 + timeout, alive={"f"}) == []  # not past the deadline
    assert own.reclaim(now=100.0 + timeout * 1.001, alive={"f"}) != []


def test_reclaim_in_first_iteration_takes_back_assignment_of_departed_helper() -> None:
    own = own_work(200, avg=None, started_at=0.0)
    own.record_done(100)
    offer = offer_to(own, "f", now=100.0)
    begun(own, "f", offer, now=100.0)
    assert own.reclaim(now=101.0, alive={"f"}) == []
    assert [a.id for a in own.reclaim(now=101.0, alive=set())] == [offer.assignment]


def test_reclaim_in_first_iteration_takes_back_overdue_assignment_eventually() -> None:
    own = own_work(200, avg=None, started_at=0.0)
    own.record_done(100)  # 100 rows in 100 s: an iteration takes about 200 s
    offer = offer_to(own, "f", now=100.0)
    begun(own, "f", offer, now=100.0)
    assert own.reclaim(now=101.0, alive={"f"}) == []
    # a day later the helper (still in the roster) has not completed 5 rows
    assert own.reclaim(now=100.0 + 86_400.0, alive={"f"}) != []


def test_fraction_does_not_count_rows_returned_by_a_leaving_helper_as_given() -> None:
    own = own_work(200)
    offer = offer_to(own, "f")  # [195, 200)
    begun(own, "f", offer)  # follow-up [185, 195) sent
    assert own.on_completed("f", completed(offer, done_end=195))  # nothing done: all returned
    own.record_done(own.next_chunk(185)[1])  # type: ignore[index]
    # done: 185 own rows; given and outstanding: the follow-up's 10; [195, 200) not done
    assert own.fraction() == pytest.approx(195 / 200)


def test_finished_only_when_every_row_is_accounted_for() -> None:
    own = own_work(200)
    assert not own.finished()
    offer = offer_to(own, "f")
    drain(own)
    assert not own.finished()  # an offer is still out
    begun(own, "f", offer)  # no follow-up: own range is done
    assert not own.finished()  # begun: waiting on f
    own.on_completed("f", completed(offer, done_end=197))
    assert not own.finished()  # the returned tail is not done yet
    assert own.next_chunk(10) == (197, 200)
    own.record_done(3)
    assert own.finished()
    assert own.done_rows + own.helped_rows == 200


def test_finished_needs_cancelled_offers_redone() -> None:
    own = own_work(200)
    offer_to(own, "f")
    drain(own)
    own.cancel_unbegun(now=1.0)
    assert not own.finished()
    assert drain(own) == [(195, 200)]
    assert own.finished()


def test_assignment_state_transitions_cover_every_state() -> None:
    assert set(TRANSITIONS) == set(AssignmentState)
    terminal = {s for s, to in TRANSITIONS.items() if not to}
    assert terminal == {
        AssignmentState.CANCELLED,
        AssignmentState.COMPLETED,
        AssignmentState.RECLAIMED,
    }


@pytest.mark.parametrize("src", list(AssignmentState))
@pytest.mark.parametrize("dst", list(AssignmentState))
def test_assignment_moves_only_along_transitions(
    src: AssignmentState, dst: AssignmentState
) -> None:
    a = Assignment(id=1, helper="f", start=0, end=1, sent_at=0.0, state=src)
    if dst in TRANSITIONS[src]:
        a.move(dst)
        assert a.state is dst
    else:
        with pytest.raises(ValueError, match="illegal move"):
            a.move(dst)
        assert a.state is src


def test_own_work_needs_at_least_one_row() -> None:
    with pytest.raises(ValueError):
        own_work(0)


def test_assignment_ids_continue_from_first_assignment() -> None:
    own = own_work(200, first_assignment=41)
    assert offer_to(own, "f").assignment == 41
    assert offer_to(own, "g").assignment == 42
    assert own.next_id == 43


# -- 3. HelpDesk: Algorithm 2 ---------------------------------------------------------------


def do_this(clock: int = CLOCK, assignment: int = 0, start: int = 0, end: int = 5) -> DoThis:
    return DoThis(clock=clock, assignment=assignment, start=start, end=end, rows=200, timer=1.0)


def cancel(clock: int = CLOCK, *ids: int) -> Cancel:
    return Cancel(clock=clock, timer=2.0, assignments=ids)


def test_helper_discards_offer_withdrawn_by_a_cancel_naming_it() -> None:
    desk = HelpDesk()
    desk.on_cancel("s", cancel(CLOCK, 3))
    assert desk.on_do_this("s", do_this(assignment=3), clock=CLOCK, own_done=True) is (
        HelpDecision.DISCARD
    )
    # another assignment of the same clock, and the same id from another helpee, are fine
    assert desk.on_do_this("s", do_this(assignment=4), clock=CLOCK, own_done=True) is (
        HelpDecision.HELP_NOW
    )
    assert desk.on_do_this("t", do_this(assignment=3), clock=CLOCK, own_done=True) is (
        HelpDecision.HELP_NOW
    )
    assert desk.take_saved() == []


def test_helper_discards_offer_for_a_clock_ahead_of_its_own() -> None:
    desk = HelpDesk()
    for own_done in (False, True):
        decision = desk.on_do_this("s", do_this(CLOCK + 1), clock=CLOCK, own_done=own_done)
        assert decision is HelpDecision.DISCARD
    assert desk.take_saved() == []


def test_helper_helps_now_with_an_offer_of_an_older_clock_even_mid_own_rows() -> None:
    desk = HelpDesk()
    decision = desk.on_do_this("s", do_this(CLOCK - 1), clock=CLOCK, own_done=False)
    assert decision is HelpDecision.HELP_NOW
    assert desk.take_saved() == []


def test_helper_helps_now_with_same_clock_offer_once_its_own_rows_are_done() -> None:
    desk = HelpDesk()
    assert desk.on_do_this("s", do_this(), clock=CLOCK, own_done=True) is HelpDecision.HELP_NOW
    assert desk.take_saved() == []


def test_helper_saves_same_clock_offer_while_its_own_rows_are_not_done() -> None:
    desk = HelpDesk()
    first, second = do_this(assignment=1), do_this(assignment=2)
    assert desk.on_do_this("s", first, clock=CLOCK, own_done=False) is HelpDecision.SAVE
    assert desk.on_do_this("t", second, clock=CLOCK, own_done=False) is HelpDecision.SAVE
    assert desk.take_saved() == [("s", first), ("t", second)]  # oldest first
    assert desk.take_saved() == []  # only once


def test_take_saved_leaves_out_offers_cancelled_while_saved() -> None:
    desk = HelpDesk()
    kept, withdrawn = do_this(assignment=1), do_this(assignment=2)
    desk.on_do_this("s", kept, clock=CLOCK, own_done=False)
    desk.on_do_this("s", withdrawn, clock=CLOCK, own_done=False)
    desk.on_cancel("s", cancel(CLOCK, 2))
    assert desk.take_saved() == [("s", kept)]
    assert not desk.wanted("s", withdrawn) and desk.wanted("s", kept)


def test_cancels_of_one_clock_accumulate() -> None:
    desk = HelpDesk()
    desk.on_cancel("s", cancel(CLOCK, 1))
    desk.on_cancel("s", cancel(CLOCK, 2, 3))
    assert [desk.wanted("s", do_this(assignment=i)) for i in range(5)] == [
        True,
        False,
        False,
        False,
        True,
    ]


def test_cancel_for_a_later_clock_settles_every_older_offer() -> None:
    desk = HelpDesk()
    desk.on_cancel("s", cancel(CLOCK, 1))
    older = do_this(CLOCK, assignment=7)  # never named, but its clock is over
    desk.on_do_this("s", older, clock=CLOCK, own_done=False)  # saved
    assert desk.wanted("s", older)
    desk.on_cancel("s", cancel(CLOCK + 1, 8))
    assert not desk.wanted("s", older)
    assert not desk.wanted("s", do_this(CLOCK, assignment=1))
    assert desk.wanted("s", do_this(CLOCK + 1, assignment=9))
    assert not desk.wanted("s", do_this(CLOCK + 1, assignment=8))
    assert desk.wanted("s", do_this(CLOCK + 2, assignment=8))  # a later clock: a new offer
    assert desk.take_saved() == []


def test_a_late_cancel_of_an_older_clock_changes_nothing() -> None:
    desk = HelpDesk()
    desk.on_cancel("s", cancel(CLOCK, 1))
    desk.on_cancel("s", cancel(CLOCK - 1, 2))
    assert not desk.wanted("s", do_this(CLOCK, assignment=1))
    assert desk.wanted("s", do_this(CLOCK, assignment=2))


def test_forget_clears_cancellations_and_saved_offers() -> None:
    desk = HelpDesk()
    desk.on_cancel("s", cancel(CLOCK + 1, 1))
    desk.on_do_this("t", do_this(assignment=4), clock=CLOCK, own_done=False)
    desk.forget()
    assert desk.take_saved() == []
    assert desk.wanted("s", do_this(CLOCK + 1, assignment=1))
    assert desk.wanted("s", do_this(CLOCK, assignment=1))


# -- 4. messages ----------------------------------------------------------------------------


@pytest.mark.parametrize(("start", "end", "rows"), [(5, 5, 10), (6, 5, 10), (0, 11, 10)])
def test_do_this_needs_start_before_end_within_rows(start: int, end: int, rows: int) -> None:
    with pytest.raises(ValidationError, match="start < end <= rows"):
        DoThis(clock=0, assignment=0, start=start, end=end, rows=rows, timer=0.0)


def test_do_this_may_end_at_the_last_row() -> None:
    assert DoThis(clock=0, assignment=0, start=9, end=10, rows=10, timer=0.0).end == 10


@pytest.mark.parametrize("done_end", [4, 11])
def test_completed_needs_done_end_within_the_range(done_end: int) -> None:
    with pytest.raises(ValidationError, match="done_end"):
        Completed(clock=0, assignment=0, start=5, end=10, done_end=done_end)


@pytest.mark.parametrize("done_end", [5, 7, 10])
def test_completed_accepts_done_end_from_start_to_end(done_end: int) -> None:
    assert Completed(clock=0, assignment=0, start=5, end=10, done_end=done_end).done_end == done_end


@pytest.mark.parametrize(
    ("cls", "data"),
    [
        (Progress, {"type": "progress", "clock": 3, "timer": 1.5}),
        (
            DoThis,
            {
                "type": "do_this",
                "clock": 3,
                "assignment": 4,
                "start": 1,
                "end": 2,
                "rows": 9,
                "timer": 1.5,
            },
        ),
        (Begun, {"type": "begun", "clock": 3, "assignment": 4}),
        (Cancel, {"type": "cancel", "clock": 3, "timer": 1.5, "assignments": [4, 5]}),
        (
            Completed,
            {
                "type": "completed",
                "clock": 3,
                "assignment": 4,
                "start": 1,
                "end": 2,
                "done_end": 2,
                "loss_sum": 0.5,
            },
        ),
    ],
)
def test_peer_message_parses_each_type_by_its_type_field(
    cls: type, data: dict[str, object]
) -> None:
    msg = PEER_MESSAGE.validate_python(data)
    assert type(msg) is cls
    assert PEER_MESSAGE.validate_python(msg.model_dump()) == msg
    assert PEER_MESSAGE.validate_json(PEER_MESSAGE.dump_json(msg)) == msg
    with pytest.raises(ValidationError, match="extra"):
        PEER_MESSAGE.validate_python({**data, "surprise": 1})


@pytest.mark.parametrize(
    "data",
    [
        {"type": "help_me", "clock": 1},
        {"clock": 1, "timer": 1.0},
        {"type": "progress", "clock": -1, "timer": 1.0},
        {"type": "begun", "clock": 1, "assignment": -1},
        {"type": "cancel", "clock": 1, "timer": 1.0, "assignments": [-2]},
    ],
)
def test_peer_message_rejects_unknown_type_missing_type_and_negatives(
    data: dict[str, object],
) -> None:
    with pytest.raises(ValidationError):
        PEER_MESSAGE.validate_python(data)


def test_messages_are_frozen() -> None:
    msg = Begun(clock=1, assignment=2)
    with pytest.raises(ValidationError):
        msg.assignment = 3  # type: ignore[misc]


# -- 5. every message order: a model check -------------------------------------------------
#
# One helpee H (an `OwnWork`) and helpers (a `HelpDesk` each) exchange messages over FIFO
# channels, as the runtime (`agileml.reassign.Reassigner`) drives them. Each atomic step below
# is one thing a side can do next; the exhaustive test explores every interleaving of them,
# the random test samples interleavings of a bigger world.

HELPEE = "H"
HELPEE_NOW = 5.0  # every time H passes: reports (timer 1.0) are 4 average iterations old
REPORT_TIMER = 1.0


@dataclass
class Helper:
    name: str
    clock: int  # the helper's own clock (H is at clock 0): >0 makes H's offers "older"
    desk: HelpDesk = field(default_factory=HelpDesk)
    inbox: deque[PeerMessage] = field(default_factory=deque)  # H -> helper
    outbox: deque[PeerMessage] = field(default_factory=deque)  # helper -> H
    progress_sent: bool = False
    own_done: bool = False
    pending: list[DoThis] = field(default_factory=list)  # help-now offers, oldest first
    helping: DoThis | None = None
    done_end: int = 0  # rows [helping.start, done_end) computed
    leaving: bool = False  # drops offers, returns the rest of its current help
    silent: bool = False  # gone without a word (dead or stuck): takes no step any more

    def summary(self) -> tuple[object, ...]:
        cancelled = tuple(
            sorted((h, c, tuple(sorted(ids))) for h, (c, ids) in self.desk._cancelled.items())
        )
        saved = tuple(m.assignment for _, m in self.desk._saved)
        return (
            self.clock,
            cancelled,
            saved,
            tuple(self.inbox),
            tuple(self.outbox),
            self.progress_sent,
            self.own_done,
            tuple(m.assignment for m in self.pending),
            None if self.helping is None else self.helping.assignment,
            self.done_end,
            self.leaving,
            self.silent,
        )


@dataclass
class World:
    own: OwnWork
    helpers: list[Helper]
    computed: list[int]  # per row: how often H computed it itself
    accepted: list[tuple[int, int]] = field(default_factory=list)  # helpers' accepted updates
    events: set[str] = field(default_factory=set)  # races seen on the way (not state)
    may_leave: bool = False
    may_go_silent: bool = False

    def summary(self) -> tuple[object, ...]:
        own = self.own
        assignments = tuple(
            (a.id, a.helper, a.start, a.end, a.state) for a in own.assignments.values()
        )
        return (
            own.front,
            own.tail,
            tuple(own.taken_back),
            assignments,
            own.cancelled,
            own.done_rows,
            tuple(self.computed),
            tuple(sorted(self.accepted)),
            tuple(h.summary() for h in self.helpers),
        )

    def clone(self) -> World:
        memo: dict[int, object] = {id(self.own.spec): self.own.spec}
        return copy.deepcopy(self, memo)

    # -- the steps --------------------------------------------------------------------------

    def steps(self) -> list[tuple[str, Callable[[World], None]]]:
        """The enabled steps, as (label, function applying it to a world)."""
        own = self.own
        out: list[tuple[str, Callable[[World], None]]] = []
        if own.front < own.tail or own.taken_back:
            out.append(("H chunk", World.h_chunk))
        if own.own_range_done and not own.cancelled:
            out.append(("H cancel", World.h_cancel))
        if self.may_go_silent and own.cancelled and not own.taken_back:
            waiting = own.waiting_on()
            if any(h.silent for h in self.helpers if h.name in waiting):
                out.append(("H reclaim departed", World.h_reclaim_departed))
            if waiting:
                out.append(("H reclaim overdue", World.h_reclaim_overdue))
        for i, h in enumerate(self.helpers):
            if h.outbox:
                out.append((f"H receive from {h.name}", _at(World.h_receive, i)))
            if h.silent:
                continue
            if not h.progress_sent:
                out.append((f"{h.name} progress", _at(World.f_progress, i)))
            if h.inbox:
                out.append((f"{h.name} receive", _at(World.f_receive, i)))
            if not h.own_done:
                out.append((f"{h.name} own rows done", _at(World.f_own_done, i)))
            if h.helping is None and h.pending:
                out.append((f"{h.name} start help", _at(World.f_start, i)))
            if h.helping is not None and h.done_end < h.helping.end and not h.leaving:
                out.append((f"{h.name} help row", _at(World.f_row, i)))
            if h.helping is not None and (h.done_end == h.helping.end or h.leaving):
                out.append((f"{h.name} complete", _at(World.f_complete, i)))
            if self.may_leave and not h.leaving:
                out.append((f"{h.name} leaves", _at(World.f_leave, i)))
            if self.may_go_silent and h.helping is not None:
                out.append((f"{h.name} goes silent", _at(World.f_silent, i)))
        return out

    def helper(self, name: str) -> Helper:
        return next(h for h in self.helpers if h.name == name)

    def h_chunk(self) -> None:
        span = self.own.next_chunk(1)
        assert span is not None
        for row in range(*span):
            self.computed[row] += 1
        self.own.record_done(span[1] - span[0])

    def h_cancel(self) -> None:
        for name, msg in self.own.cancel_unbegun(HELPEE_NOW).items():
            self.helper(name).inbox.append(msg)

    def h_reclaim_departed(self) -> None:
        alive = {h.name for h in self.helpers if not h.silent}
        assert self.own.reclaim(HELPEE_NOW, alive)
        self.events.add("reclaimed departed helper")

    def h_reclaim_overdue(self) -> None:
        late = HELPEE_NOW + 1_000.0  # way past max(help_timeout_min_s, 2 x avg)
        assert self.own.reclaim(late, {h.name for h in self.helpers})
        self.events.add("reclaimed overdue helper")

    def h_receive(self, i: int) -> None:
        h = self.helpers[i]
        msg = h.outbox.popleft()
        own = self.own
        if isinstance(msg, Progress):
            offer = own.on_progress(h.name, msg, HELPEE_NOW)
            if offer is not None:
                h.inbox.append(offer)
                self.events.add("offered")
        elif isinstance(msg, Begun):
            before = own.assignments[msg.assignment].state
            follow = own.on_begun(h.name, msg, HELPEE_NOW)
            if before is AssignmentState.CANCELLED:
                assert follow is None
                self.events.add("begun crossed cancel")
            if follow is not None:
                h.inbox.append(follow)
                self.events.add("follow-up")
        elif isinstance(msg, Completed):
            if own.on_completed(h.name, msg):
                self.accepted.append((msg.start, msg.done_end))
                if msg.done_end < msg.end:
                    self.events.add("tail returned")
            else:
                state = own.assignments[msg.assignment].state
                self.events.add(f"completed dropped ({state})")
        else:
            raise AssertionError(f"H got {msg}")

    def f_progress(self, i: int) -> None:
        h = self.helpers[i]
        h.progress_sent = True
        h.outbox.append(Progress(clock=h.clock, timer=REPORT_TIMER))

    def f_receive(self, i: int) -> None:
        h = self.helpers[i]
        msg = h.inbox.popleft()
        if isinstance(msg, DoThis):
            if h.leaving:
                self.events.add("leaving helper dropped offer")
                return
            decision = h.desk.on_do_this(HELPEE, msg, clock=h.clock, own_done=h.own_done)
            self.events.add(f"decision {decision}")
            if decision is HelpDecision.HELP_NOW:
                h.pending.append(msg)
        elif isinstance(msg, Cancel):
            h.desk.on_cancel(HELPEE, msg)
            if h.helping is not None and not h.desk.wanted(HELPEE, h.helping):
                h.helping = None  # abort: nothing is sent
                self.events.add("helper aborted on cancel")
        else:
            raise AssertionError(f"{h.name} got {msg}")

    def f_own_done(self, i: int) -> None:
        h = self.helpers[i]
        h.own_done = True
        saved = [m for _, m in h.desk.take_saved()]
        h.pending.extend(saved)
        if saved:
            self.events.add("saved offer taken")

    def f_start(self, i: int) -> None:
        h = self.helpers[i]
        offer = h.pending.pop(0)
        if not h.desk.wanted(HELPEE, offer):
            self.events.add("pending offer skipped")
            return
        h.outbox.append(Begun(clock=offer.clock, assignment=offer.assignment))
        h.helping, h.done_end = offer, offer.start

    def f_row(self, i: int) -> None:
        self.helpers[i].done_end += 1

    def f_complete(self, i: int) -> None:
        h = self.helpers[i]
        assert h.helping is not None
        h.outbox.append(completed(h.helping, h.done_end))
        h.helping = None

    def f_leave(self, i: int) -> None:
        self.helpers[i].leaving = True

    def f_silent(self, i: int) -> None:
        h = self.helpers[i]
        h.silent = True
        h.inbox.clear()  # never read

    # -- the invariants -------------------------------------------------------------------

    def check_terminal(self) -> None:
        """No step is enabled: H must be finished and every row done exactly once."""
        own = self.own
        assert own.finished(), f"H stuck: {self.summary()}"
        coverage = list(self.computed)
        for start, end in self.accepted:
            for row in range(start, end):
                coverage[row] += 1
        twice = [r for r, n in enumerate(coverage) if n > 1]
        missing = [r for r, n in enumerate(coverage) if n == 0]
        assert not twice and not missing, f"twice {twice}, missing {missing}"
        assert own.done_rows == sum(self.computed)
        assert own.helped_rows == sum(end - start for start, end in self.accepted)
        for h in self.helpers:
            assert not h.outbox
            if not h.silent:
                assert h.helping is None and not h.pending and not h.inbox


def _at(step: Callable[[World, int], None], i: int) -> Callable[[World], None]:
    return lambda world: step(world, i)


MODEL_ROWS = 12
# 1-row initial and 2-row follow-up assignments of a 12-row share
MODEL_SPEC = StragglerSpec(initial_assignment=1 / 12, follow_up_assignment=2 / 12)


def model_world(
    helpers: list[Helper],
    *,
    rows: int = MODEL_ROWS,
    spec: StragglerSpec = MODEL_SPEC,
    avg: float | None = 1.0,
    may_leave: bool = False,
    may_go_silent: bool = False,
) -> World:
    own = OwnWork(spec, clock=0, rows=rows, started_at=0.0, avg_iteration_s=avg)
    return World(own, helpers, [0] * rows, may_leave=may_leave, may_go_silent=may_go_silent)


@dataclass
class Exploration:
    terminal: set[tuple[object, ...]] = field(default_factory=set)
    seen: dict[tuple[object, ...], int] = field(default_factory=dict)  # state -> interleavings
    events: set[str] = field(default_factory=set)

    def explore(self, world: World) -> int:
        """Every interleaving from `world` (depth first); returns how many there are."""
        key = world.summary()
        if key in self.seen:
            return self.seen[key]
        steps = world.steps()
        if not steps:
            world.check_terminal()
            self.terminal.add(key)
            count = 1
        else:
            count = 0
            for _, step in steps:
                nxt = world.clone()
                step(nxt)
                self.events |= nxt.events
                nxt.events = set()
                count += self.explore(nxt)
        self.seen[key] = count
        return count


def assert_seen(events: set[str], expected: set[str]) -> None:
    """The exploration went through every `expected` event (so it covers those races)."""
    missing = expected - events
    assert not missing, f"never seen: {sorted(missing)}"


RACES = {
    "begun crossed cancel",  # (a)
    "completed dropped (cancelled)",  # (b) F completed rows that H redid itself
    "helper aborted on cancel",  # (c)
}


def test_every_message_order_between_helpee_and_helper_loses_and_duplicates_no_row() -> None:
    ex = Exploration()
    interleavings = ex.explore(model_world([Helper("F", clock=0)]))
    print(f"\n{len(ex.terminal)} terminal states, {len(ex.seen)} states, {interleavings} orders")
    assert_seen(ex.events, RACES)
    assert_seen(
        ex.events,
        {
            "offered",
            "follow-up",
            "decision save",
            "decision help_now",
            "saved offer taken",
            "pending offer skipped",
        },
    )
    assert len(ex.terminal) > 20 and interleavings > 10_000


def test_every_message_order_with_a_leaving_helper_returns_its_tail_exactly_once() -> None:
    ex = Exploration()
    interleavings = ex.explore(model_world([Helper("F", clock=0)], may_leave=True))
    print(f"\n{len(ex.terminal)} terminal states, {len(ex.seen)} states, {interleavings} orders")
    assert_seen(ex.events, RACES | {"tail returned", "leaving helper dropped offer"})
    assert len(ex.terminal) > 40


def test_every_message_order_with_a_helper_of_a_later_clock_helps_at_once() -> None:
    ex = Exploration()
    interleavings = ex.explore(model_world([Helper("F", clock=1)]))
    print(f"\n{len(ex.terminal)} terminal states, {len(ex.seen)} states, {interleavings} orders")
    assert_seen(ex.events, RACES)
    assert "decision save" not in ex.events  # H's offers are older than F's clock


def test_every_message_order_with_a_helper_going_silent_mid_help_is_reclaimed() -> None:
    ex = Exploration()
    ex.explore(model_world([Helper("F", clock=0)], may_go_silent=True))
    print(f"\n{len(ex.terminal)} terminal states, {len(ex.seen)} states")
    assert_seen(
        ex.events,
        {"reclaimed departed helper", "reclaimed overdue helper", "completed dropped (reclaimed)"},
    )


def run_random(
    world: World, rng: random.Random, speed: dict[str, float], max_steps: int = 20_000
) -> list[str]:
    """One random interleaving; a side's steps are chosen in proportion to its `speed`."""
    trace = []
    for _ in range(max_steps):
        steps = world.steps()
        if not steps:
            world.check_terminal()
            return trace
        weights = [speed[label.split()[0]] for label, _ in steps]
        label, step = rng.choices(steps, weights)[0]
        trace.append(label)
        step(world)
    raise AssertionError(f"no end after {max_steps} steps: {trace[-50:]}")


def test_random_interleavings_with_two_helpers_do_every_row_exactly_once() -> None:
    events: set[str] = set()
    for seed in range(2000):
        rng = random.Random(seed)
        helpers = [Helper(name, clock=rng.choice([0, 0, 1])) for name in ("F1", "F2")]
        world = model_world(
            helpers,
            rows=40,
            spec=SPEC,  # defaults: 1-row initial and 2-row follow-up assignments of 40
            avg=rng.choice([1.0, None]),
            may_leave=rng.random() < 0.3,
            may_go_silent=rng.random() < 0.3,
        )
        speed = {actor: rng.choice([0.2, 1.0, 5.0]) for actor in ("H", "F1", "F2")}
        try:
            run_random(world, rng, speed)
        except AssertionError as exc:
            raise AssertionError(f"seed {seed}: {exc}") from exc
        events |= world.events
    assert_seen(
        events,
        RACES
        | {
            "tail returned",
            "reclaimed departed helper",
            "reclaimed overdue helper",
            "completed dropped (reclaimed)",
            "decision save",
            "decision help_now",
        },
    )


def test_helper_silent_mid_help_is_reclaimed_at_deadline_and_its_late_completion_dropped() -> None:
    world = model_world([Helper("F", clock=0)])  # avg 1 s: deadline max(1 s, 2 x 1 s) = 2 s
    own, f = world.own, world.helpers[0]
    world.f_progress(0)
    world.h_receive(0)  # H is behind: offer [11, 12)
    world.f_own_done(0)
    world.f_receive(0)  # help now
    world.f_start(0)  # begun
    world.h_receive(0)  # H marks it begun at 5.0 and sends the follow-up [9, 11)
    world.f_row(0)  # F computes row 11, then says nothing for a long time
    assert f.done_end == 12 and own.waiting_on() == {"F"}
    while not own.own_range_done:
        world.h_chunk()
    world.h_cancel()  # withdraws the follow-up: H redoes [9, 11)
    while own.taken_back:
        world.h_chunk()
    assert not own.finished()  # still waiting on F's begun [11, 12)

    assert own.reclaim(HELPEE_NOW + 2.0, alive={"F"}) == []  # not past the deadline yet
    taken = own.reclaim(HELPEE_NOW + 2.01, alive={"F"})
    assert [(a.start, a.end, a.state) for a in taken] == [(11, 12, AssignmentState.RECLAIMED)]
    while own.taken_back:
        world.h_chunk()

    world.f_complete(0)  # F wakes up and completes: too late
    world.h_receive(0)
    assert "completed dropped (reclaimed)" in world.events
    world.f_receive(0)
    world.f_receive(0)  # the follow-up offer and its cancel
    world.f_start(0)  # skips the withdrawn follow-up
    assert own.finished() and own.helped_rows == 0
    world.check_terminal()  # every row once, all by H
    assert world.computed == [1] * MODEL_ROWS


def test_completion_of_rows_cut_by_another_roster_is_dropped() -> None:
    """A helper that computed the helpee's rows by another roster computed other rows (the
    shares moved): the helpee must not add that gradient."""
    own = OwnWork(SPEC, clock=CLOCK, rows=200, started_at=0.0, avg_iteration_s=10.0,
                  roster_version=3)  # fmt: skip
    offer = offer_to(own, "f")
    assert offer.roster_version == 3
    begun(own, "f", offer)
    stale = completed(offer).model_copy(update={"roster_version": 2})
    assert not own.on_completed("f", stale)
    assert own.dropped == 1 and own.helped_rows == 0
    assert own.on_completed("f", completed(offer))
