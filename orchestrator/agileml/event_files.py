"""TensorBoard event files without TensorBoard: scalars (the loss per iteration, evaluations)
written in the format TensorBoard reads (`tensorboard --logdir OUT/tensorboard`), so that
writing them needs no extra package.

A file is a sequence of records: the data's length (uint64, little-endian), its masked CRC-32C,
the data, the data's masked CRC-32C. The data is a serialized `tensorflow.Event` protocol
buffer: the first says the file's version, each after it holds one scalar (`Summary.Value` with
a tag and a `simple_value`) at a step.
"""

from __future__ import annotations

import math
import os
import socket
import struct
import time
from collections.abc import Iterable
from pathlib import Path

_FILE_VERSION = b"brain.Event:2"
_FLOAT32_MAX = 3.4028234663852886e38
_CRC32C_POLY = 0x82F63B78  # Castagnoli, reflected


def _crc_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ _CRC32C_POLY if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of `data`."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
    out = bytearray()
    value &= (1 << 64) - 1  # int64 as protobuf encodes a negative one
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int, what: bytes) -> bytes:
    return b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step) + what


def scalar_event(tag: str, value: float, step: int, wall_time: float) -> bytes:
    """The serialized Event of one scalar (a float32: past its range, an infinity)."""
    if math.isfinite(value) and abs(value) > _FLOAT32_MAX:
        value = math.copysign(math.inf, value)
    summary_value = _field(1, tag.encode()) + b"\x15" + struct.pack("<f", value)
    return _event(wall_time, step, _field(5, _field(1, summary_value)))


def record(data: bytes) -> bytes:
    """One record of an event file around serialized `data`."""
    header = struct.pack("<Q", len(data))
    return (
        header
        + struct.pack("<I", _masked(crc32c(header)))
        + data
        + struct.pack("<I", _masked(crc32c(data)))
    )


def write_scalars(
    folder: Path, scalars: Iterable[tuple[str, int, float]], *, wall_time: float | None = None
) -> Path:
    """Write (tag, step, value) scalars to a new event file in `folder` (made if missing);
    returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    now = time.time() if wall_time is None else wall_time
    path = folder / event_file_name(now)
    while path.exists():  # another file of the same second: a run into the same folder
        path = path.with_name(path.name + ".1")
    path.write_bytes(event_file_bytes(scalars, wall_time=now))
    return path


def event_file_name(wall_time: float) -> str:
    """TensorBoard's name for an event file started at `wall_time` by this process."""
    return f"events.out.tfevents.{int(wall_time)}.{socket.gethostname()}.{os.getpid()}"


def event_file_bytes(scalars: Iterable[tuple[str, int, float]], *, wall_time: float) -> bytes:
    """An event file's bytes: its version record, then (tag, step, value) scalars."""
    out = [record(_event(wall_time, 0, _field(3, _FILE_VERSION)))]
    out.extend(
        record(scalar_event(tag, float(value), step, wall_time)) for tag, step, value in scalars
    )
    return b"".join(out)


def read_scalars(path: Path) -> list[tuple[str, int, float]]:
    """The scalars of an event file this module wrote, every CRC checked (for tests).

    Raises:
        ValueError: a record whose length or CRC is wrong.
    """
    data, out, at = path.read_bytes(), [], 0
    while at < len(data):
        (length,) = struct.unpack_from("<Q", data, at)
        (header_crc,) = struct.unpack_from("<I", data, at + 8)
        if header_crc != _masked(crc32c(data[at : at + 8])):
            raise ValueError(f"bad length CRC at byte {at}")
        body = data[at + 12 : at + 12 + length]
        (body_crc,) = struct.unpack_from("<I", data, at + 12 + length)
        if len(body) != length or body_crc != _masked(crc32c(body)):
            raise ValueError(f"bad data CRC at byte {at}")
        at += 16 + length
        scalar = _parse_scalar(body)
        if scalar is not None:
            out.append(scalar)
    return out


def _read_varint(buf: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def _delimited(buf: bytes, at: int) -> tuple[int, bytes, int]:
    """The length-delimited field at `at`: (its number, its payload, where the next starts)."""
    key, at = _read_varint(buf, at)
    length, at = _read_varint(buf, at)
    return key >> 3, buf[at : at + length], at + length


def _parse_scalar(event: bytes) -> tuple[str, int, float] | None:
    """(tag, step, value) of an Event as `scalar_event` builds it; None for another one."""
    if event[9:10] != b"\x10":  # past the wall time: the step
        return None
    step, at = _read_varint(event, 10)
    number, summary, _ = _delimited(event, at)
    if number != 5:
        return None  # the file version
    _, value, _ = _delimited(summary, 0)
    _, tag, at = _delimited(value, 0)
    (scalar,) = struct.unpack_from("<f", value, at + 1)
    return tag.decode(), step, scalar
