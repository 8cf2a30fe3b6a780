"""FlexRR's two inboxes over real sockets: progress reports never make the `work` inbox
readable (a waiting worker polls only that one), and a check handles both."""

from __future__ import annotations

import time

from orchestrator.agileml.peers import PeerLink
from orchestrator.straggler.protocol import Cancel, Progress

TOKEN = b"k" * 32


def _wait_for(link: PeerLink, *, progress: bool, seconds: float = 5.0) -> object:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = link.receive(50, progress=progress)
        if got is not None:
            return got
    raise AssertionError("nothing arrived")


def test_progress_reports_and_work_messages_land_in_their_own_inboxes() -> None:
    a = PeerLink("a", job_id="j", token=TOKEN)
    b = PeerLink("b", job_id="j", token=TOKEN)
    try:
        assert a.endpoints.work != a.endpoints.progress
        assert b.send(a.endpoints.progress, Progress(clock=4, timer=1.0), epoch=1)
        sender, epoch, message, _ = _wait_for(a, progress=True)  # type: ignore[misc]
        assert (sender, epoch, message) == ("b", 1, Progress(clock=4, timer=1.0))
        assert b.send(a.endpoints.progress, Progress(clock=5, timer=2.0), epoch=1)
        time.sleep(0.2)
        assert not a.inbox.poll(0)  # a waiting worker is not woken by a report
        assert b.send(a.endpoints.work, Cancel(clock=5, timer=3.0, assignments=(0,)), epoch=1)
        assert _wait_for(a, progress=False)[2] == Cancel(clock=5, timer=3.0, assignments=(0,))  # type: ignore[index]
        assert _wait_for(a, progress=True)[2] == Progress(clock=5, timer=2.0)  # type: ignore[index]
    finally:
        a.close()
        b.close()
