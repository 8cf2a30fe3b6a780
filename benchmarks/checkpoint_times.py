"""What a checkpoint costs: a job trained by `orchestrator train`'s runtime with a checkpoint
every few iterations, then resumed from its newest one. Prints one JSON object: the seconds each
checkpoint took to write (every partition's values and optimizer state, from the event the
elasticity controller records), its size on disk, the seconds to read it back, and the wall time
of the resumed run against a fresh run of the same iterations.

    python -m benchmarks.checkpoint_times [JOB.py] [--nodes 2] [--iterations 30] [--every 10]
                                          [--s3]

`--s3` writes the checkpoints to a bucket on a local moto server (the S3 path the controller
uses on AWS, over loopback HTTP) instead of a local folder.

The default job is the 5,001,000-parameter MLR with Adam (benchmarks/jobs/wide_linear.py), so
a checkpoint holds ~60 MB. On a small shared machine the figures are noisy.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

from orchestrator.agileml import checkpoints
from orchestrator.agileml.trainrun import TrainPlan, train_locally, train_spec
from orchestrator.artifacts import S3Folder
from orchestrator.artifacts.folders import s3_client
from orchestrator.cloud.local.moto_server import MotoEC2Server
from orchestrator.lifecycle import exit_on_signals

DEFAULT_JOB = Path(__file__).resolve().parent / "jobs" / "wide_linear.py"
_SECONDS = re.compile(r"clock (\d+) in ([0-9.]+) s")


def main() -> None:
    exit_on_signals()  # a SIGTERM unwinds: temporary folders and child processes go
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("job", nargs="?", type=Path, default=DEFAULT_JOB)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--s3", action="store_true", help="checkpoint to moto's S3")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="orchestrator-ckpt-bench-"))
        if args.s3:
            server = stack.enter_context(MotoEC2Server())
            s3_client(server.endpoint_url).create_bucket(Bucket="bench")
            tmp = S3Folder("bench", "checkpoints", endpoint=server.endpoint_url).location
        base = TrainPlan(
            code=str(args.job),
            nodes=args.nodes,
            iterations=args.iterations,
            global_batch=args.global_batch,
        )
        first = train_locally(
            base.model_copy(update={"checkpoint_dir": tmp, "checkpoint_every": args.every})
        )
        writes = [
            float(m.group(2))
            for e in first.events
            if e["kind"] == "checkpointed" and (m := _SECONDS.search(str(e["detail"])))
        ]
        newest = checkpoints.latest(tmp)
        assert newest is not None, "no checkpoint was written"
        size = sum(len(newest.read_bytes(name)) for name in newest.names())
        spec = train_spec(base)
        started = time.monotonic()
        checkpoints.read(newest, spec.num_partitions)
        read_s = time.monotonic() - started
        done = checkpoints.read_manifest(newest).iterations_done
        resumed = train_locally(base.model_copy(update={"resume": newest.location}))
        fresh = train_locally(base.model_copy(update={"iterations": args.iterations - done}))
    print(
        json.dumps(
            {
                "job": str(args.job),
                "store": "s3 (moto, loopback)" if args.s3 else "local folder",
                "parameters_and_state_bytes": size,
                "checkpoints_written": len(writes),
                "write_s_median": round(statistics.median(writes), 3) if writes else None,
                "write_s_max": round(max(writes), 3) if writes else None,
                "read_s": round(read_s, 3),
                "resumed_at_iteration": done,
                "resumed_run_wall_s": round(resumed.wall_seconds, 2),
                "fresh_run_same_iterations_wall_s": round(fresh.wall_seconds, 2),
                "seconds_per_iteration": first.seconds_per_iteration,
            }
        )
    )


if __name__ == "__main__":
    main()
