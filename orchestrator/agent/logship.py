"""An instance agent's log, shipped to the job's artifact store (`JobArtifacts.logs`), so that
`orchestrator logs JOB_ID` reads it through the API, also once the instance is gone.

`LogShipper` is a logging handler on the agent process's root logger: the agent's records and
its AgileML node's (joined, ready, hand-offs, errors with their tracebacks, how it ended), as
the agent writes them to stderr, not the storage libraries' own (botocore logs every client it
makes: shipping them would change the log it ships). It keeps the last `MAX_LOG_BYTES` and a
thread of its own writes them to `<store>/<job>/logs/<instance>.log` every `SHIP_INTERVAL_S`
while they change, and once more when the agent stops (waiting at most `FINAL_SHIP_WAIT_S`):
a slow or unreachable store never holds the agent's loop. The store is the one the job's
training spec names (`code_store`, set by the controller); before the node has joined, the log
waits in memory.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from orchestrator.artifacts.folders import Folder
from orchestrator.artifacts.jobs import MAX_LOG_BYTES, JobArtifacts
from orchestrator.logfmt import FieldsFormatter

log = logging.getLogger(__name__)

#: Seconds between two writes of a changing log to the store.
SHIP_INTERVAL_S = 5.0
#: The most seconds a stopping agent waits for its log's last write.
FINAL_SHIP_WAIT_S = 10.0
#: Loggers whose records are not shipped (the store's own client libraries).
NOT_SHIPPED = ("botocore", "boto3", "s3transfer", "urllib3")


class LogShipper(logging.Handler):
    """See the module docstring. `ship` is called from the agent's loop; `emit` from any
    thread that logs."""

    def __init__(self, instance_id: str, job_id: str, name: str) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(FieldsFormatter(f"%(asctime)s %(levelname)s {name} %(message)s"))
        self.instance_id = instance_id
        self.job_id = job_id
        self._lines: deque[str] = deque()
        self._bytes = 0
        self._lock_lines = threading.Lock()
        self._changed = False
        self._shipped_at = 0.0
        self.failures = 0  # writes to the store that failed (logged once each, not raised)
        self._folder: tuple[str, Folder] | None = None  # the store's logs folder, made once
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, store: Callable[[], str | None]) -> None:
        """Ship from a thread of its own every SHIP_INTERVAL_S, to `store()` (None: not
        known yet)."""

        def run() -> None:
            while not self._stop.wait(SHIP_INTERVAL_S):
                self.ship(store(), force=True)
            self.ship(store(), force=True)

        self._thread = threading.Thread(target=run, name="log-ship", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ship once more and stop (waiting at most FINAL_SHIP_WAIT_S)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(FINAL_SHIP_WAIT_S)

    def emit(self, record: logging.LogRecord) -> None:
        if (record.name or "").split(".", 1)[0] in NOT_SHIPPED:
            return
        try:
            line = self.format(record) + "\n"
        except Exception:  # noqa: BLE001 - logging must not fail the caller
            self.handleError(record)
            return
        with self._lock_lines:
            self._lines.append(line)
            self._bytes += len(line)
            while self._bytes > MAX_LOG_BYTES and len(self._lines) > 1:
                self._bytes -= len(self._lines.popleft())
            self._changed = True

    def text(self) -> str:
        """The log kept so far."""
        with self._lock_lines:
            return "".join(self._lines)

    def ship(self, store: str | None, *, now: float | None = None, force: bool = False) -> bool:
        """Write the log to `store` if it changed (at most every SHIP_INTERVAL_S unless
        `force`); returns whether it wrote. A store that fails is counted, not raised: the
        agent goes on."""
        now = time.monotonic() if now is None else now
        if store is None or not self._changed:
            return False
        if not force and now - self._shipped_at < SHIP_INTERVAL_S:
            return False
        with self._lock_lines:
            text, self._changed = "".join(self._lines), False
        self._shipped_at = now
        try:
            if self._folder is None or self._folder[0] != store:
                self._folder = (store, JobArtifacts(store, self.job_id).logs)
            self._folder[1].write_bytes(f"{self.instance_id}.log", text.encode())
        except Exception as exc:  # noqa: BLE001 - S3 or disk: the log waits for the next try
            self.failures += 1
            self._changed = True
            log.debug("could not ship the log", extra={"error": str(exc)})
            return False
        return True
