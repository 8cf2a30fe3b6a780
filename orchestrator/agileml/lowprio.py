"""Work that a node does at the lowest CPU priority: what a joining node does before it can
compute (importing torch and the runtime, building its model and rows). On a cluster a joining
node is another machine and this costs nothing; on one machine (`orchestrator train`, the
benchmarks, the offline world) the joiner shares the cores of the running job's workers, and
at normal priority its start-up slows their iterations (the join "blip").

Linux keeps a nice value per thread, so the work runs on a thread of its own at nice 19 while
the calling thread keeps its priority (lowering it back would need a privilege the node does
not have). Threads the work starts inherit nice 19: run only work that starts none.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

LOADING_NICENESS = 19


def at_low_priority(work: Callable[[], T]) -> T:
    """`work()` on a thread at nice `LOADING_NICENESS`; its result, or its exception."""
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        # not Linux, or not allowed: at normal priority
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOADING_NICENESS)
        try:
            result.append(work())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            failure.append(exc)

    thread = threading.Thread(target=run, name="low-priority", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]
