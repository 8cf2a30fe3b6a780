"""Process lifecycle: clean up on every exit path, and do not outlive the process that started
you.

* `exit_on_signals()`: SIGTERM and SIGHUP raise `SystemExit` in the main thread (as Ctrl-C
  raises KeyboardInterrupt), so `with` blocks and `finally` clauses run: temporary folders are
  removed and child processes stopped. Python's default for SIGTERM is to die on the spot.
* `keep_logs()`: a failed run's temporary logs are removed too, unless ORCHESTRATOR_KEEP_LOGS=1;
  `remove_run_dir()` applies that rule (and says where kept logs are).
* `exit_with_parent()`: a child process (an AgileML node, a pipeline stage) exits when the
  process that started it is gone, even if that one was SIGKILLed and could not stop it.

A SIGKILLed process itself cannot clean up: its children exit on their own (`exit_with_parent`),
and its temporary folders are its parent's to remove where that one lives on (the local fleet
points its instance agents' TMPDIR at a folder it removes on close); otherwise they stay for
the system's own temp cleaning.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

log = logging.getLogger(__name__)

#: Exit status after SIGTERM, as a shell reports a process it terminated (128 + 15).
SIGTERM_EXIT_STATUS = 128 + signal.SIGTERM
#: Seconds between two checks of the parent.
PARENT_POLL_SECONDS = 0.5
#: Set to 1 to keep a run's temporary logs after it failed (they are removed otherwise).
KEEP_LOGS_ENV = "ORCHESTRATOR_KEEP_LOGS"


def keep_logs() -> bool:
    """Whether a failed run keeps its temporary log folder (`KEEP_LOGS_ENV`)."""
    return os.environ.get(KEEP_LOGS_ENV) == "1"


def remove_run_dir(path: Path, *, failed: bool) -> None:
    """Remove a run's temporary folder (errors ignored); a failed run's (an error, or a signal
    that unwound it) stays with ORCHESTRATOR_KEEP_LOGS=1, and a line on stderr says where (not
    a log record: `orchestrator train` shows only errors)."""
    if failed and keep_logs():
        print(f"{KEEP_LOGS_ENV}=1: the failed run's logs are kept in {path}", file=sys.stderr)
        return
    shutil.rmtree(path, ignore_errors=True)


def exit_on_signals() -> None:
    """Make SIGTERM and SIGHUP raise SystemExit(143) in the main thread (a no-op elsewhere:
    Python delivers signals to the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(SIGTERM_EXIT_STATUS)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


def exit_with_parent(poll_s: float = PARENT_POLL_SECONDS) -> None:
    """Exit this process soon after its parent is gone (re-parented to init or a subreaper).
    Starts a daemon thread; SIGTERM goes to this process first, so its own clean-up runs, and
    it is killed if it is still there a few seconds later."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        log.warning("parent process %d is gone; exiting", parent)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5.0)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
