"""A joining node's loading runs at the lowest CPU priority on a thread of its own; the caller
keeps its priority and gets the result or the exception."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from orchestrator.agileml.lowprio import LOADING_NICENESS, at_low_priority


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_the_work_runs_at_nice_19_and_the_caller_keeps_its_priority() -> None:
    before = _nice()
    assert at_low_priority(_nice) == LOADING_NICENESS
    assert _nice() == before


def test_the_works_exception_reaches_the_caller() -> None:
    with pytest.raises(ZeroDivisionError):
        at_low_priority(lambda: 1 / 0)
