"""Issue #33's check: while `orchestrator train` trains a user's job on 4 nodes (the installed
console script), every TCP port its processes listen on gets unauthenticated hostile frames of
the classes that once killed a server (nesting 100,000 deep, 5,000-digit integers, a bool for
the sequence number, random bytes, a forged tag), over both ZMQ socket kinds that can reach
it; the run still trains every iteration, and its weights classify held-out data."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from orchestrator.agileml import wire

JOB = Path(__file__).parents[1] / "support" / "jobs" / "bn_rmsprop"  # evaluates held-out data
ITERATIONS = 100  # the job's OneCycleLR runs 100 steps
HOSTILE = [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"seq":' + b"9" * 5000 + b"}",
    b'{"seq":true,"v":3,"kind":"hello","job_id":"x","sender":"y","tensors":[]}',
]


def _tree(root: int) -> set[int]:
    """`root` and its descendants, from /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, grew = {root}, True
    while grew:
        grew = False
        for pid, ppid in parents.items():
            if ppid in tree and pid not in tree:
                tree.add(pid)
                grew = True
    return tree


def _listening_ports(pids: set[int]) -> set[int]:
    """The TCP ports the processes `pids` listen on (IPv4), from /proc."""
    listening: dict[str, int] = {}  # socket inode -> port
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A":  # LISTEN
            listening[fields[9]] = int(fields[1].split(":")[1], 16)
    ports = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            match = re.fullmatch(r"socket:\[(\d+)\]", link)
            if match and match[1] in listening:
                ports.add(listening[match[1]])
    return ports


def _attack(ctx: zmq.Context[Any], port: int, rng: random.Random) -> int:
    """Hostile frames to one port over a DEALER (ROUTER servers) and a PUSH (inboxes)."""
    sent = 0
    for kind in (zmq.DEALER, zmq.PUSH):
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, 200)
        sock.connect(f"tcp://127.0.0.1:{port}")
        try:
            for raw in [*HOSTILE, rng.randbytes(rng.randint(1, 512))]:
                for frames in ([raw], [b"\0" * wire.AUTH_BYTES, raw], [raw, raw, raw]):
                    sock.send_multipart(frames)
                    sent += 1
        except zmq.Again:
            pass
        finally:
            sock.close()
    return sent


@pytest.mark.slow
def test_train_finishes_with_right_weights_while_every_port_gets_hostile_frames(
    tmp_path: Path,
) -> None:
    script = shutil.which("orchestrator")
    assert script is not None, "the console script is installed (pip install -e .)"
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [script, "train", str(JOB), "--nodes", "4", "--iterations", str(ITERATIONS),
         "--global-batch", "64", "--out", str(out)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    ctx: zmq.Context[Any] = zmq.Context()
    rng = random.Random(33)
    attacked: set[int] = set()
    sent = 0
    try:
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:
            for port in _listening_ports(_tree(proc.pid)):
                sent += _attack(ctx, port, rng)
                attacked.add(port)
            time.sleep(0.5)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        ctx.term()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"] == ITERATIONS
    assert summary["evaluation"]["held_out_accuracy"] >= 0.9, summary["evaluation"]
    assert len(attacked) >= 4, attacked  # the nodes' servers and the elasticity controller
    print(f"hostile frames: {sent} to {len(attacked)} ports {sorted(attacked)}; "
          f"held-out accuracy {summary['evaluation']['held_out_accuracy']}")  # fmt: skip
