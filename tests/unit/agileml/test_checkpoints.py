"""Checkpoints in a local folder and in S3 (moto): complete only with every partition and the
manifest, read back as written, the newest found, old and torn ones pruned, and a schedule by
clocks and by time."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from moto import mock_aws

from orchestrator.agileml import checkpoints
from orchestrator.agileml.checkpoints import CheckpointSchedule
from orchestrator.agileml.errors import AgileMLError
from orchestrator.artifacts import Folder, LocalFolder, S3Folder, folder_at
from orchestrator.artifacts.folders import s3_client


@pytest.fixture(params=["local", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Folder]:
    if request.param == "local":
        yield LocalFolder(tmp_path)
        return
    with mock_aws():
        s3_client().create_bucket(Bucket="ckpts")
        yield S3Folder("ckpts", "job-1/checkpoints")


def _write(root: Folder, clock: int, parts: int = 3, *, finish: bool = True) -> Folder:
    directory = checkpoints.checkpoint_dir(root, clock)
    for p in range(parts):
        values = torch.full((4,), float(clock * 10 + p))
        checkpoints.write_part(directory, p, clock=clock, values=values, rule_state=bytes([p, 7]))
    if finish:
        checkpoints.complete(directory, job_id="j", clock=clock, num_partitions=parts)
    return directory


def test_a_checkpoint_reads_back_values_and_optimizer_states(root: Folder) -> None:
    directory = _write(root, 9)
    ckpt = checkpoints.read(directory, 3)
    assert (ckpt.clock, ckpt.job_id) == (9, "j")
    assert [float(v[0]) for v in ckpt.values] == [90.0, 91.0, 92.0]
    assert ckpt.rule_states == [bytes([0, 7]), bytes([1, 7]), bytes([2, 7])]
    manifest = json.loads(directory.read_bytes(checkpoints.MANIFEST))
    assert manifest["iterations_done"] == 10
    # written whole (locally under a temporary name, then renamed): nothing else is left
    assert directory.names() == [checkpoints.MANIFEST] + [
        f"part-{p:04d}.safetensors" for p in range(3)
    ]
    assert folder_at(directory.location) == directory  # the location string opens it again


def test_a_checkpoint_missing_a_partition_is_not_completed(root: Folder) -> None:
    directory = _write(root, 5, parts=2, finish=False)
    with pytest.raises(AgileMLError, match=r"partitions \[2\] were not written"):
        checkpoints.complete(directory, job_id="j", clock=5, num_partitions=3)
    assert checkpoints.latest(root) is None
    with pytest.raises(AgileMLError, match="is not a complete checkpoint"):
        checkpoints.read(directory, 3)


def test_reading_with_another_partitioning_is_refused(root: Folder) -> None:
    directory = _write(root, 5)
    with pytest.raises(AgileMLError, match="has 3 partitions, the job 4"):
        checkpoints.read(directory, 4)


def test_latest_is_the_newest_complete_one_and_prune_keeps_two(root: Folder) -> None:
    for clock in (9, 19, 29):
        _write(root, clock)
    torn = _write(root, 15, finish=False)  # a writer died before the manifest
    _write(root, 39, finish=False)  # being written now
    assert checkpoints.latest(root) == checkpoints.checkpoint_dir(root, 29)
    checkpoints.prune(root, spare=checkpoints.checkpoint_dir(root, 9).location)
    assert root.names() == ["ckpt-00000009", "ckpt-00000019", "ckpt-00000029", "ckpt-00000039"]
    assert torn.names() == []
    checkpoints.prune(root)
    assert root.names() == ["ckpt-00000019", "ckpt-00000029", "ckpt-00000039"]


def test_the_schedule_counts_clocks_and_seconds_from_the_last_checkpoint() -> None:
    by_clock = CheckpointSchedule(every=10, every_s=0.0, last_clock=-1, last_s=0.0)
    assert not by_clock.due(8, 1e9) and by_clock.due(9, 0.0)
    by_clock.taken(12, 5.0)
    assert not by_clock.due(12, 99.0) and not by_clock.due(21, 99.0) and by_clock.due(22, 6.0)
    by_time = CheckpointSchedule(every=0, every_s=60.0, last_clock=-1, last_s=100.0)
    assert not by_time.due(500, 159.0) and by_time.due(500, 160.0)
    assert not by_time.due(-1, 1e9)  # nothing new since the last one
    never = CheckpointSchedule(every=0, every_s=0.0, last_clock=-1, last_s=0.0)
    assert not never.due(10**6, 1e9)
