"""Read back what an offline W&B run wrote: the records of its `run-<id>.wandb` transaction log.

wandb keeps no Python reader for this file since its core moved to a separate service, so the
tests parse it here. The layout is LevelDB's log format after a 7-byte header (":W&B", 0xBEE1,
version): 32 KiB blocks of chunks, each `crc32 (4) | length (2, little endian) | type (1) | data`,
type 1 a whole record and 2/3/4 the first, middle and last piece of a longer one. Each record is
a protobuf `wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any, Iterator

BLOCK, CHUNK_HEADER, FILE_HEADER = 32768, 7, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str | Path) -> Iterator[Any]:
    """Every Record in a .wandb file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, pieces = FILE_HEADER, b""
    while pos + CHUNK_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:  # the tail of a block too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        if kind == 0 and length == 0:  # zero padding up to the next block
            pos += left
            continue
        chunk = data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        pieces = chunk if kind in (FULL, FIRST) else pieces + chunk
        if kind in (FULL, LAST):
            rec = pb.Record()
            rec.ParseFromString(pieces)
            yield rec


def wait_for_exit(path: str | Path, timeout: float = 60.0) -> None:
    """W&B's service writes the log asynchronously: wait until the run's exit record is on disk."""
    deadline = time.time() + timeout
    while not any(r.WhichOneof("record_type") == "exit" for r in records(path)):
        assert time.time() < deadline, f"{path} has no exit record after {timeout} s"
        time.sleep(0.5)


def history(path: str | Path) -> list[dict[str, Any]]:
    """The logged rows (wandb.log calls), each as {key: value}."""
    rows = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
    return rows


def run_ids(path: str | Path) -> list[str]:
    return [rec.run.run_id for rec in records(path) if rec.WhichOneof("record_type") == "run"]


def run_record(path: str | Path) -> Any:
    """The first run record: the run's id, display name, group and tags as W&B received them."""
    return next(rec.run for rec in records(path) if rec.WhichOneof("record_type") == "run")


def config(path: str | Path) -> dict[str, Any]:
    """The run's config: the run record's and every later config update, merged (top-level keys)."""
    out: dict[str, Any] = {}
    for rec in records(path):
        kind = rec.WhichOneof("record_type")
        items = rec.run.config.update if kind == "run" else rec.config.update if kind == "config" else []
        for i in items:
            out[i.key or "/".join(i.nested_key)] = json.loads(i.value_json)
    return out
