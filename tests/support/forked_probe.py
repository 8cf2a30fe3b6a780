"""A module for `forked`'s tests to fork (`tests/integration/agileml/test_forked.py`):
`main(args)` reports what the child got, sleeps, raises, waits for its parent to go, reads
a line of its stdin, registers an exit handler, says which of some modules it has, or holds
a semaphore."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time


def main(args: list[str]) -> int:
    if args[0] == "sleep":
        time.sleep(float(args[1]))
        return 0
    if args[0] == "raise":
        raise RuntimeError("the probe failed")
    if args[0] == "read":  # what its stdin says first, and where its temporary files go
        print(json.dumps({"line": sys.stdin.readline(), "tmp": tempfile.gettempdir()}))
        return 0
    if args[0] == "atexit":  # writes its argument's file at exit
        import atexit
        from pathlib import Path

        atexit.register(Path(args[1]).write_text, "ran")
        return 0
    if args[0] == "modules":  # which of these modules the child has imported
        print(json.dumps([m for m in args[1:] if m in sys.modules]))
        return 0
    if args[0] == "semaphore":  # a named semaphore (the resource tracker's), then sleeps
        import multiprocessing

        held = multiprocessing.get_context("spawn").Semaphore()
        print(os.getpid(), flush=True)
        time.sleep(600)
        del held
        return 0
    if args[0] == "orphan":
        from orchestrator.lifecycle import exit_with_parent

        exit_with_parent(poll_s=0.2)
        print(os.getpid(), flush=True)
        time.sleep(600)
        return 0
    import torch

    report = {
        "args": args,
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "env": os.environ.get("PROBE_ENV"),
        "leaked": os.environ.get("PROBE_LEAK"),
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(report))
    print("to stderr", file=sys.stderr)
    return int(args[1])
