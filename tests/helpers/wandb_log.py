"""Read the records of a W&B ``.wandb`` file (a LevelDB-style log of protobuf records), for tests.

wandb 0.31 writes offline runs from its Go core and ships no Python reader for them any more. The
format: a 7-byte header (``:W&B``, magic, version), then 32 KiB blocks of chunks, each with a 7-byte
header (crc32c, length, type: 1 full, 2 first, 3 middle, 4 last)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768


FAKE_KEY = "0123456789abcdef0123456789abcdef01234567"  # 40 characters, like a real key; nowhere valid


def records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", "not a W&B log"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        room = BLOCK - pos % BLOCK
        if room < 7:
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            yield rec
            pending = b""


def history(path: Path) -> list[dict]:
    rows = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
    return rows


def run_config(path: Path) -> dict:
    """The config the run was started with (the ``run`` record)."""
    for rec in records(path):
        if rec.WhichOneof("record_type") == "run":
            return {i.key: json.loads(i.value_json) for i in rec.run.config.update}
    raise AssertionError("no run record")
