"""Drawing a model's initial parameters from a seed without touching the global RNG, one
thread at a time.

Nodes may run as threads of one process (the tests, a local run's controller side), and
torch's global generator is process-wide: two threads seeding it at once would interleave
their draws (a model that depends on another thread's timing), and torch can deadlock there
(a garbage collection inside `get_rng_state`, which holds the generator's mutex, waits for
the GIL that a thread blocked in `manual_seed` holds; seen once, hanging a CI run).

    with seeded(seed):
        model = build()
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_LOCK = threading.Lock()


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """The block runs with torch's global RNG seeded with `seed`, then restored; one thread
    at a time."""
    with _LOCK, torch.random.fork_rng():
        torch.manual_seed(seed)
        yield
