"""How fast AgileML's data path moves a partition: push and pull GB/s through a live
ParamServer on loopback, beside the ceilings of this machine. Prints one JSON object.

For each partition size (float32; 4 MB to 256 MB by default):

* `agileml`: one worker (a DEALER socket in this process, framing as `worker_link` does:
  zero-copy encode, `copy=False` receive) and a `ParamServer` in a child process, as a node's
  server is (its own GIL). A push of a gradient until its ack (the server authenticates it,
  applies it: the clock completes), then a pull of the new values until they are decoded here
  (each round's pull is of a new state, as each iteration's is).
* `raw_zmq`: the same bytes over plain ZMQ (DEALER to ROUTER in a child process, no header, no
  MAC, no tensors): the ceiling of the sockets here.
* `gloo_allreduce`: two processes all-reducing a tensor of the size over gloo on 127.0.0.1
  (DDP's collective; algorithm bandwidth: size / seconds).
* `parts`: where one message's time goes, each in this process: the MAC alone (Poly1305 over the
  frames), `encode` (header, zero-copy framing and the MAC), `decode` (the MAC, parsing and
  tensors over the frames), `apply` (adding a delta to a partition), `copy` (into a tensor
  already used: how the server sums a clock's first push and copies a state for pull replies)
  and `fresh_copy` (a clone: a new tensor is paged in as it is written).

GB/s is 1e9 bytes per second of the partition's bytes, from the median of `--repeats` timed
rounds after one warm-up round. On a shared machine the figures move by a third between runs.

    python -m benchmarks.wire_throughput [--sizes-mb 4,16,64,256] [--repeats 7]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import zmq

from benchmarks.ddp_baseline import run_ranks
from orchestrator.agileml import chunks, wire
from orchestrator.agileml.server import ParamServer
from orchestrator.agileml.wire import MessageKind
from orchestrator.cloud.local.redis_process import free_port

JOB, TOKEN, WORKER = "wire-bench", b"wire-throughput-benchmark-token!", "w0"
MB = 1_000_000
TIMEOUT_MS = 120_000
DIRECTIONS = ("push", "pull")


def _floats(size_mb: int) -> int:
    return size_mb * MB // 4


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else float("inf")


def _median_seconds(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up: sockets connected, pages touched
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# -- the ParamServer path -----------------------------------------------------------------


def _serve_partitions(sizes_mb: list[int], conn: Any, chunk_bytes: int | None) -> None:
    """Child process: a ParamServer owning partition i of sizes_mb[i] floats (zeros), its
    pull replies in chunks of `chunk_bytes` (None: as the runtime chunks them)."""
    torch.set_num_threads(1)  # as a node's process (OMP_NUM_THREADS=1)
    limit = 2 * max(sizes_mb) * MB + wire.MAX_HEADER_BYTES
    server = ParamServer(
        "ps-0", job_id=JOB, token=TOKEN, max_message_bytes=limit, chunk_bytes=chunk_bytes
    )
    for p, size in enumerate(sizes_mb):
        server.add_partition(p, torch.zeros(_floats(size)))
    server.register_workers([WORKER])
    with server:
        conn.send(server.endpoint)
        conn.recv()  # until the parent is done


class _Worker:
    """One worker's DEALER socket to the server, framing as `worker_link` does."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, chunk_bytes: int | None) -> None:
        self.chunk_bytes = chunk_bytes
        self.assembler = chunks.Assembler()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.seq = 0
        self.limit = 2**31 - 1

    def request(
        self, kind: MessageKind, p: int, clock: int, tensors: dict[str, torch.Tensor]
    ) -> tuple[wire.Header, dict[str, torch.Tensor]]:
        self.seq += 1
        fields = {"kind": kind, "job_id": JOB, "sender": WORKER, "seq": self.seq,
                  "partition": p, "clock": clock}  # fmt: skip
        self.assembler.reset()  # the last reply's values are read: its buffer is reused
        message = chunks.message(fields, tensors, TOKEN, chunk_bytes=self.chunk_bytes,
                                 max_message_bytes=self.limit)  # fmt: skip
        chunks.send(self.sock, [], message)
        while True:
            if not self.sock.poll(TIMEOUT_MS):
                raise RuntimeError(f"no reply to {kind} of partition {p}")
            got = self.sock.recv_multipart(copy=False)
            header, out = wire.decode([f.buffer for f in got], TOKEN, max_message_bytes=self.limit)
            whole = self.assembler.add(header.seq, header, out, pool_key=p)
            if whole is not None:
                break
        header, out = whole
        if header.kind is MessageKind.ERROR:
            raise RuntimeError(f"{kind} refused: {header.detail}")
        return header, out


def _push_and_pull(worker: _Worker, p: int, size: int, repeats: int) -> dict[str, float]:
    """Rounds of a push then a pull of the state it made, as an iteration does (every pull
    is of new values); the median of each."""
    delta = torch.ones(_floats(size))
    push_s, pull_s = [], []
    for clock in range(repeats + 1):  # the first is the warm-up
        t0 = time.perf_counter()
        header, _ = worker.request(MessageKind.PUSH, p, clock, {"delta": delta})
        t1 = time.perf_counter()
        assert header.detail == "applied", header.detail
        _, tensors = worker.request(MessageKind.PULL, p, clock, {})
        t2 = time.perf_counter()
        assert tensors["values"].numel() == delta.numel()
        del tensors  # its frames go back before the next round, as a worker's do
        if clock:
            push_s.append(t1 - t0)
            pull_s.append(t2 - t1)
    push, pull, nbytes = statistics.median(push_s), statistics.median(pull_s), size * MB
    return {
        "push_gbps": _gbps(nbytes, push),
        "pull_gbps": _gbps(nbytes, pull),
        "push_ms": round(push * 1000, 1),
        "pull_ms": round(pull * 1000, 1),
    }


@contextlib.contextmanager
def _child(target: Callable[..., None], sizes_mb: list[int], *args: Any) -> Iterator[str]:
    """A spawned process running `target(sizes_mb, conn)`, which sends its endpoint over
    `conn`; yields the endpoint. On exit the child is told "done" over the pipe (or its socket
    was told to stop) and killed if it is still there 30 s later."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(sizes_mb, child, *args), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise RuntimeError(f"{target.__name__} did not start")
        yield parent.recv()
    finally:
        parent.send("done")
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def _agileml(
    sizes_mb: list[int], repeats: int, chunk_bytes: int | None
) -> dict[int, dict[str, float]]:
    zctx = zmq.Context()
    try:
        with _child(_serve_partitions, sizes_mb, chunk_bytes) as endpoint:
            out = {}
            for p, size in enumerate(sizes_mb):
                worker = _Worker(zctx, endpoint, chunk_bytes)
                try:
                    out[size] = _push_and_pull(worker, p, size, repeats)
                finally:
                    worker.sock.close(linger=0)  # frees the last reply's frames
            return out
    finally:
        zctx.term()


# -- the ceilings -------------------------------------------------------------------------


def _echo(sizes_mb: list[int], conn: Any) -> None:
    """Child process: a ROUTER that acks a push and answers a pull with `size` bytes."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    replies = {size: bytearray(size * MB) for size in sizes_mb}
    conn.send(f"tcp://127.0.0.1:{port}")
    while True:
        frames = sock.recv_multipart(copy=False)
        what = bytes(frames[1].buffer)
        if what == b"stop":
            break
        if what == b"push":
            sock.send_multipart([frames[0], b"ack"])
        else:
            sock.send_multipart([frames[0], replies[int(what)]], copy=False)
    sock.close(linger=0)
    ctx.term()


def _raw_zmq(sizes_mb: list[int], repeats: int) -> dict[int, dict[str, float]]:
    zctx = zmq.Context()
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        with _child(_echo, sizes_mb) as endpoint:
            sock.connect(endpoint)
            out = {}
            for size in sizes_mb:
                payload = bytearray(size * MB)

                def push(payload: bytearray = payload) -> None:
                    sock.send_multipart([b"push", payload], copy=False)
                    sock.recv_multipart()

                def pull(size: int = size) -> None:
                    sock.send_multipart([str(size).encode()])
                    sock.recv_multipart(copy=False)

                push_s, pull_s = _median_seconds(push, repeats), _median_seconds(pull, repeats)
                nbytes = size * MB
                out[size] = {"push_gbps": _gbps(nbytes, push_s), "pull_gbps": _gbps(nbytes, pull_s)}
            sock.send_multipart([b"stop"])
            return out
    finally:
        sock.close(linger=0)
        zctx.term()


@dataclass(frozen=True)
class _GlooPlan:
    """What each gloo rank needs (picklable for spawn)."""

    init_method: str
    workers: int
    timeout_s: float
    sizes_mb: tuple[int, ...]
    repeats: int


def _allreduce(rank: int, plan: _GlooPlan) -> dict[int, float]:
    out = {}
    for size in plan.sizes_mb:
        tensor = torch.ones(_floats(size))

        def once(tensor: torch.Tensor = tensor) -> None:
            dist.all_reduce(tensor)

        dist.barrier()
        out[size] = _median_seconds(once, plan.repeats)
    return out


def _gloo(sizes_mb: list[int], repeats: int) -> dict[int, dict[str, float]]:
    plan = _GlooPlan(f"tcp://127.0.0.1:{free_port()}", 2, 600.0, tuple(sizes_mb), repeats)
    seconds = run_ranks(_allreduce, plan, workers=2, timeout_s=plan.timeout_s)[0]
    return {size: {"algbw_gbps": _gbps(size * MB, s)} for size, s in seconds.items()}


def _parts(sizes_mb: list[int], repeats: int) -> dict[int, dict[str, float]]:
    return {size: _parts_one(size, repeats) for size in sizes_mb}


def _parts_one(size: int, repeats: int) -> dict[str, float]:
    values, delta = torch.zeros(_floats(size)), torch.ones(_floats(size))
    used = torch.ones(_floats(size))  # paged in: as a reused sum or reply copy is
    fields = {"kind": MessageKind.PUSH, "job_id": JOB, "sender": WORKER, "seq": 1,
              "partition": 0, "clock": 0}  # fmt: skip
    limit = 2**31 - 1

    def encode() -> list[bytes | memoryview]:
        return wire.encode(fields, {"delta": delta}, TOKEN, zero_copy=True, max_message_bytes=limit)

    frames = encode()
    received = [
        frames[0],
        bytes(frames[1]),
        memoryview(bytearray(frames[2])),
    ]  # as received: writable
    timed: dict[str, Callable[[], object]] = {
        "mac": lambda: wire.compute_tag(b"\0" * wire.NONCE_BYTES, frames[1:], TOKEN),
        "encode": encode,
        "decode": lambda: wire.decode(received, TOKEN, max_message_bytes=limit),
        "apply": lambda: values.add_(delta),
        "copy": lambda: used.copy_(values),
        "fresh_copy": values.clone,
    }
    return {
        f"{name}_gbps": _gbps(size * MB, _median_seconds(run, repeats))
        for name, run in timed.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", default="4,16,64,256",
                        help="partition sizes in MB, comma-separated (1-1024)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds per figure (1-100)")
    parser.add_argument("--chunk-mb", type=float, default=None,
                        help="pushes and pull replies over this many MiB go in chunks of it; "
                             "0: never (one message each, as before chunks); default: as the "
                             "runtime does (over 32 MiB, in 4 MiB chunks)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes_mb.split(",")]
    except ValueError:
        parser.error(f"--sizes-mb: {args.sizes_mb!r} is not comma-separated integers")
    if not sizes or not all(1 <= s <= 1024 for s in sizes):
        parser.error("--sizes-mb: each size must be 1-1024 MB")
    if not 1 <= args.repeats <= 100:
        parser.error("--repeats must be 1-100")
    if args.chunk_mb is not None and not 0 <= args.chunk_mb <= 1024:
        parser.error("--chunk-mb must be 0-1024")
    chunk_bytes = None if args.chunk_mb is None else int(args.chunk_mb * 2**20) or 2**62
    torch.set_num_threads(1)
    result: dict[str, Any] = {"sizes_mb": sizes, "repeats": args.repeats,
                              "chunk_mb": args.chunk_mb}  # fmt: skip
    runs: tuple[tuple[str, Callable[[list[int], int], Any]], ...] = (
        ("agileml", functools.partial(_agileml, chunk_bytes=chunk_bytes)),
        ("raw_zmq", _raw_zmq), ("gloo_allreduce", _gloo), ("parts", _parts),
    )  # fmt: skip
    for name, run in runs:
        print(f"measuring {name}...", file=sys.stderr, flush=True)
        result[name] = run(sizes, args.repeats)
    raw, ours = result["raw_zmq"], result["agileml"]
    result["raw_over_agileml"] = {
        size: {
            d: round(raw[size][f"{d}_gbps"] / ours[size][f"{d}_gbps"], 2) for d in ("push", "pull")
        }
        for size in sizes
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
