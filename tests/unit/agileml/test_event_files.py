"""TensorBoard event files written without TensorBoard (`event_files`): the record format's
CRCs, a round trip, and, where TensorBoard is installed, its own reader."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.agileml.event_files import crc32c, read_scalars, record, write_scalars


def test_crc32c_is_castagnolis() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the standard check value
    assert crc32c(b"") == 0


def test_scalars_round_trip_with_every_crc_checked(tmp_path: Path) -> None:
    scalars = [("train/loss", 1, 2.5), ("train/loss", 2, 1.25), ("eval/" + "m" * 200, 300, 0.5)]
    path = write_scalars(tmp_path / "tb", scalars, wall_time=1_700_000_000.0)
    assert path.name.startswith("events.out.tfevents.1700000000.")
    assert read_scalars(path) == scalars
    data = bytearray(path.read_bytes())
    data[-5] ^= 1  # a flipped bit in the last record's data
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="bad data CRC"):
        read_scalars(path)


def test_a_record_frames_its_data_with_length_and_masked_crcs() -> None:
    framed = record(b"abc")
    assert len(framed) == 8 + 4 + 3 + 4 and framed[:8] == (3).to_bytes(8, "little")


def test_tensorboard_reads_them(tmp_path: Path) -> None:
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    write_scalars(tmp_path, [("train/loss", 1, 2.5), ("train/loss", 2, 1.25)])
    acc = accumulator.EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 2.5), (2, 1.25)]


def test_a_value_past_float32s_range_is_an_infinity_and_files_do_not_overwrite(
    tmp_path: Path,
) -> None:
    first = write_scalars(tmp_path, [("eval/perplexity", 1, 1e39)], wall_time=5.0)
    second = write_scalars(tmp_path, [("eval/perplexity", 1, -1e39)], wall_time=5.0)
    assert first != second  # the same second, the same process: both kept
    assert read_scalars(first) == [("eval/perplexity", 1, float("inf"))]
    assert read_scalars(second) == [("eval/perplexity", 1, float("-inf"))]
