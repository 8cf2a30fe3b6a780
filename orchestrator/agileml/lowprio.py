"""Work that a node process does at the lowest CPU priority: importing torch and the runtime,
the CPU-heavy part of a join, and (`AgileMLNode(low_priority_load=True)`) a built-in model's
data and parameters and the warm-up. On a cluster a joining node is another machine and this
costs nothing; on one machine (the benchmarks, `LocalJob`) the joiner shares the cores of the
running job's workers, and at normal priority its start-up slows their iterations (the join
"blip").

Linux keeps a nice value per thread, so the work runs on a thread of its own at nice 19 while
the calling thread keeps its priority (lowering it back would need a privilege the node does
not have). Threads the work starts inherit nice 19, so the user's job code (which may start
threads, install signal handlers or set torch's thread-local defaults) builds on the node's
main thread, not here; only the warm-up's forward/backward of the user's model runs here (if
it fails here, the first clock does it on the main thread).
"""

from __future__ import annotations

import contextlib
import os
import sys
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
        try:
            if sys.platform.startswith("linux"):  # per-thread nice; elsewhere: normal priority
                with contextlib.suppress(OSError):  # not allowed: normal priority
                    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOADING_NICENESS)
            result.append(work())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            failure.append(exc)

    thread = threading.Thread(target=run, name="low-priority", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]
