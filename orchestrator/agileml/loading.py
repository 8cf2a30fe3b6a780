"""Rows fetched ahead (`TrainingSpec.loader_workers`): while a node's worker computes its share
of one clock, a `torch.utils.data.DataLoader` with `loader_workers` processes reads the items of
its share of the next clock (a dataset that decodes images or reads files then costs the
computation nothing), and the node collates them on a thread of its own.

The rows are the runtime's: the worker names the shares it will want next (`AHEAD` of them)
by (clock, roster version) and their row numbers (`prefetch`); `take_prefetched` returns a
share's batch, waiting for it if it is on its way (the loader's processes read in parallel,
faster than the worker alone), and None when it was not asked for (a roster change made the
guess wrong) or the loader is still starting (a node waits for it to start while it loads,
`wait_started`): the worker then takes the rows itself, as without a loader. Either way the
same rows, so exactly-once is unchanged. An error of the job's dataset or collate function in
the loader turns the loader off: the worker then meets it taking the rows itself, and it stops
the run as any error of the job's code does.

The loader's processes start from a fork server (never a fork of the node's process, whose
threads could hold a lock the child then waits on for good) and build the job's dataset from
its spec themselves (the dataset object of the job's module cannot be pickled into them).
Each request is one pass of the DataLoader over the share's rows in `workers` parts, one per
process; the processes persist between passes. A loader that fails (a process gone, no answer
within `TIMEOUT_S`) is turned off too, and the worker goes on taking its rows itself.

Only for a job's own map-style dataset whose rows are read item by item (`DatasetRows` that
is not a plain TensorDataset, which is indexed at once, faster than any prefetch).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from orchestrator.agileml.batches import Batch, DatasetRows, map_tensors, micro_batches
from orchestrator.agileml.forked import release_server_liveness

log = logging.getLogger(__name__)

#: Seconds a loader process may take over its part of a share before the loader is given up.
TIMEOUT_S = 120.0
#: Shares a worker asks for ahead of the one it computes.
AHEAD = 2
#: The longest `close` waits for the loader's processes to stop.
CLOSE_S = 10.0
#: How often a loader process checks that its node is still there.
WATCH_S = 1.0
#: What the fork server imports once, so that each loader process starts without it.
_PRELOAD = ["torch", "orchestrator.agileml.loading"]


class JobDataset(Dataset[Any]):
    """The job's dataset as a loader process reads it: built there, from the job's spec, on
    the first item it is asked for (only the spec is pickled into the process)."""

    def __init__(self, spec_json: str, length: int) -> None:
        self.spec_json = spec_json
        self.length = length
        self._dataset: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"spec_json": self.spec_json, "length": self.length, "_dataset": None}

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        if self._dataset is None:
            from orchestrator.agileml.control import TrainingSpec
            from orchestrator.agileml.jobcode import code_path, dataset_rows, load_job_code

            spec = TrainingSpec.model_validate_json(self.spec_json)
            code = load_job_code(code_path(spec), iterations=spec.iterations)
            self._dataset = dataset_rows(code).dataset
        return self._dataset[i]


def _items(items: list[Any]) -> list[Any]:
    """The loader's collate function: the items, their tensors copied (a view of a large
    tensor would carry all of it to the node), for the node to collate with the job's own
    function (which cannot be pickled into a loader process)."""
    return [map_tensors(item, torch.Tensor.clone) for item in items]


def _watch_node(node_pid: int, worker_id: int) -> None:
    """A loader process's start (`worker_init_fn`): it exits once the node is gone (torch's
    own check watches the fork server, which waits for its children: a SIGKILLed node would
    leave both behind), and lets go of the fork server's liveness pipe."""
    del worker_id
    release_server_liveness()

    def watch() -> None:
        while True:
            time.sleep(WATCH_S)
            try:
                os.kill(node_pid, 0)
            except ProcessLookupError:
                os._exit(0)
            except PermissionError:  # alive, another user's
                continue

    threading.Thread(target=watch, name="node-watch", daemon=True).start()


class _Plan:
    """The DataLoader's batch sampler: the parts of the share being fetched."""

    def __init__(self) -> None:
        self.parts: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.parts)

    def __len__(self) -> int:
        return len(self.parts)


class LoaderRows:
    """A `RowSource` whose shares can be fetched ahead (see the module docstring)."""

    def __init__(self, rows: DatasetRows, spec_json: str, workers: int) -> None:
        if workers < 1:
            raise ValueError("a loader needs at least one process")
        self.rows = rows
        self.workers = workers
        self._plan = _Plan()
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(_PRELOAD)
        self._loader: DataLoader[Any] = DataLoader(
            JobDataset(spec_json, len(rows)),
            batch_sampler=self._plan,
            num_workers=workers,
            collate_fn=_items,
            persistent_workers=True,
            multiprocessing_context=context,
            timeout=TIMEOUT_S,
            worker_init_fn=functools.partial(_watch_node, os.getpid()),
            generator=torch.Generator(),  # not torch's global one, which other threads seed
        )
        self._requests: queue.Queue[Any] = queue.Queue()
        # shares asked for and not taken, oldest first
        self._pending: dict[Hashable, concurrent.futures.Future[Batch]] = {}
        self._lock = threading.Lock()
        self._started = threading.Event()  # the processes are up: an ask is worth a wait
        # a daemon: a fetch stuck in a loader process never holds the node's exit up
        self._thread = threading.Thread(target=self._serve, name="rows-loader", daemon=True)
        self._thread.start()
        self.failed: str | None = None  # why the loader was turned off
        self._closed = False
        self.prefetched = 0  # shares the computation took from the loader
        self.missed = 0  # shares it took itself (none ready for them)

    def __len__(self) -> int:
        return len(self.rows)

    def wait_started(self, timeout_s: float, stopping: Callable[[], bool] = lambda: False) -> bool:
        """Wait until the loader's processes are up, it failed, `stopping()` or `timeout_s`
        passed; whether they are up. A node waits while it loads: a loader that starts while
        the job trains reads nothing ahead until it is up (seconds on a busy machine)."""
        deadline = time.monotonic() + timeout_s
        while not self._started.wait(0.1):
            if self.failed is not None or stopping() or time.monotonic() > deadline:
                return False
        return True

    def take(self, rows: torch.Tensor) -> Batch:
        """The rows, taken here and now (as `DatasetRows.take`)."""
        return self.rows.take(rows)

    def prefetch(self, key: Hashable, rows: torch.Tensor) -> None:
        """Fetch `rows` in the background, for `take_prefetched(key)` (asks in the order the
        shares will be taken)."""
        with self._lock:
            if self._closed or self.failed is not None or key in self._pending:
                return
            future: concurrent.futures.Future[Batch] = concurrent.futures.Future()
            self._pending[key] = future
            self._requests.put(([int(i) for i in rows.tolist()], future))

    def take_prefetched(self, key: Hashable) -> Batch | None:
        """The batch fetched for `key`, waited for if it is on its way; None if it was not
        asked for, the loader is still starting, or it failed (the caller takes the rows
        itself). The shares asked for before `key` are dropped."""
        with self._lock:
            keys = list(self._pending)
            for older in keys[: keys.index(key)] if key in self._pending else []:
                self._pending.pop(older).cancel()  # a roster change made them wrong guesses
            future = self._pending.pop(key, None)
            if future is None or not (future.done() or self._started.is_set()):
                if future is not None:
                    future.cancel()  # asked while the loader starts: read here instead
                self.missed += 1
                return None
        try:
            batch = future.result(timeout=TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the caller meets a job's error itself
            self._turn_off(f"{type(exc).__name__}: {exc}")
            self.missed += 1
            return None
        self.prefetched += 1
        return batch

    def _serve(self) -> None:
        """The loader's thread: its processes started at once (while the node loads and
        joins), then each request in turn, its result into its future."""
        started = time.monotonic()
        try:
            self._fetch([0] * self.workers)
            took = round(time.monotonic() - started, 2)
            log.info("rows loader started", extra={"processes": self.workers, "seconds": took})
            self._started.set()
        except Exception as exc:  # noqa: BLE001 - no loader then; the worker reads itself
            self._turn_off(f"{type(exc).__name__}: {exc}")
        try:
            self._serve_requests()
        finally:  # here, not in `close`: the loader's iterator is this thread's
            iterator = getattr(self._loader, "_iterator", None)
            if iterator is not None:
                iterator._shutdown_workers()  # the DataLoader's own way (its processes join)

    def _serve_requests(self) -> None:
        while True:
            request = self._requests.get()
            if request is None:
                return
            rows, future = request
            if not future.set_running_or_notify_cancel():
                continue  # dropped: not wanted any more
            try:
                future.set_result(self._fetch(rows))
            except BaseException as exc:  # noqa: BLE001 - handed to `take_prefetched`
                future.set_exception(exc)

    def _fetch(self, rows: list[int]) -> Batch:
        """The share's items through the loader's processes, collated here."""
        self._plan.parts = [rows[a:b] for a, b in micro_batches(len(rows), self.workers)]
        items: list[Any] = []
        for part in self._loader:
            items.extend(part)
        batch = self.rows.collate(items)
        if not isinstance(batch, tuple | list) or len(batch) != 2:
            raise ValueError("a collated batch must be an (inputs, targets) pair")
        return batch[0], batch[1]

    def _turn_off(self, why: str) -> None:
        with self._lock:
            if self.failed is None:
                self.failed = why
                log.warning("the rows loader failed; the worker takes its rows itself",
                            extra={"error": why})  # fmt: skip

    def close(self, timeout_s: float = CLOSE_S) -> None:
        """Stop the loader: its thread shuts its processes down once the fetch in flight (if
        any, or their start) is over; waits for that at most `timeout_s` (the processes also
        exit once the node is gone, but one still starting would then log an error)."""
        with self._lock:
            self._closed = True
            for future in self._pending.values():
                future.cancel()
            self._pending.clear()
        self._requests.put(None)
        self._thread.join(timeout_s)
