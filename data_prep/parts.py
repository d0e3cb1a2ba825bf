"""The parts of a precompute output: one per input shard of the source, and which rank encodes which.

    out/parts.json               the source's input shards, in order (a resume over other inputs is refused)
    out/part_000000/             input shard 0's MDS folder; with buckets, out/bucket_<h>x<w>/part_000000/ instead
    out/done/part_000000.json    written once part 0's writers have closed: its stats, and the round and world
                                 size of the run that encoded it. A part without it is unfinished.

The ranks of a run share nothing but this folder: no process group, no messages. Each one works out from the done
markers which parts are its own (`deal`), encodes them, and rank 0 waits for every marker before merging the parts'
index.json files in part order, so the merged dataset is the same whatever the number of ranks.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from data_prep.record import write_json_atomic

PARTS_FILE = "parts.json"
DONE_DIR = "done"


def part_name(index: int) -> str:
    return f"part_{index:06d}"


def done_file(out: Path, index: int) -> Path:
    return out / DONE_DIR / f"{part_name(index)}.json"


# ---------------------------------------------------------------------------------------------
# The input shards and what is already done
# ---------------------------------------------------------------------------------------------


def check_parts(out: Path, shards: list[Any]) -> None:
    """Record the source's input shards in out/parts.json, or, when a run left one, refuse other shards: part i
    must mean the same inputs in every run that adds to this folder."""
    shards = json.loads(json.dumps(shards))  # tuples as lists, as they read back
    path = out / PARTS_FILE
    if not path.is_file():
        write_json_atomic(path, {"parts": shards})  # every rank writes the same content
        return
    before = json.loads(path.read_text())["parts"]
    if before != shards:
        changed = next((i for i, (a, b) in enumerate(zip(before, shards)) if a != b), min(len(before), len(shards)))
        raise FileExistsError(
            f"out={out} holds parts of other input shards: {len(before)} parts then, {len(shards)} now, the first "
            f"difference at part {changed} ({before[changed] if changed < len(before) else None} then, "
            f"{shards[changed] if changed < len(shards) else None} now). The source or records_per_part changed since "
            "the run that began this folder; rerun with those, or use a new out=.")


def read_done(out: Path) -> dict[int, dict]:
    """The done markers there are now: {part index: its marker}."""
    folder = out / DONE_DIR
    if not folder.is_dir():
        return {}
    markers = {}
    for f in folder.glob("part_*.json"):  # not the *.json.tmp<pid> a killed writer may have left
        markers[int(f.stem.removeprefix("part_"))] = json.loads(f.read_text())
    return markers


def deal(done: dict[int, dict], num_parts: int, world: int) -> tuple[int, list[int]]:
    """(this run's round, the parts it deals out): position p of the list belongs to rank p % world.

    The ranks start at different moments, so a late rank may find markers that a quicker rank of its own run has
    written already; the list must not change with them. Each marker holds the round and world size of the run
    that wrote it. A run with the world size of the latest round joins that round: it deals the parts that were
    undone when the round began (those undone now, plus those the round finished), as every rank of that round did.
    A run on another world size starts a new round over the parts undone now, so the work that is left is spread
    evenly over the new ranks; its quicker ranks' markers then carry the new round and world size, which is how its
    later ranks recognise the round they join. (A resume on the same world size thus keeps the first deal.)
    """
    latest = max((m["round"] for m in done.values()), default=0)
    if any(m["round"] == latest and m["world"] == world for m in done.values()):
        return latest, [i for i in range(num_parts) if i not in done or done[i]["round"] == latest]
    return latest + 1, [i for i in range(num_parts) if i not in done]


def my_parts(out: Path, num_parts: int, rank: int, world: int) -> tuple[int, list[int], int]:
    """(round, the unfinished parts this rank encodes in order, how many parts are done already)."""
    done = read_done(out)
    round_, dealt = deal(done, num_parts, world)
    return round_, [i for p, i in enumerate(dealt) if p % world == rank and i not in done], len(done)


def part_folders(out: Path, index: int, buckets: list[tuple[int, int]] | None) -> list[Path]:
    """Part `index`'s MDS folders: out/part_<index>, or with buckets one in each bucket's folder."""
    from data_prep.buckets import bucket_dir

    return [out / part_name(index)] if buckets is None else [out / bucket_dir(b) / part_name(index) for b in buckets]


def remove_partial(out: Path, index: int, buckets: list[tuple[int, int]] | None) -> None:
    """Delete what an interrupted run left of part `index` (its MDS folder, or one per bucket) before encoding it."""
    for folder in part_folders(out, index, buckets):
        shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Rank 0: wait for every part, then merge
# ---------------------------------------------------------------------------------------------


def wait_for_parts(out: Path, num_parts: int, timeout: float) -> list[dict]:
    """Every part's marker, in part order, once all are there."""
    deadline = time.monotonic() + timeout
    wanted = {f"{part_name(i)}.json" for i in range(num_parts)}
    while True:
        missing = wanted - set(os.listdir(out / DONE_DIR)) if (out / DONE_DIR).is_dir() else wanted
        if not missing:
            return [json.loads(done_file(out, i).read_text()) for i in range(num_parts)]
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{len(missing)} of {num_parts} parts were not finished within merge_timeout_s={timeout} (e.g. "
                f"{sorted(missing)[:3]} in {out / DONE_DIR}): a rank encoding them may have died. Run the same command "
                "again, on any number of ranks: the finished parts are kept and the others encoded.")
        time.sleep(1.0)


def merge(root: Path, indices: list[int]) -> None:
    """root/index.json from the index.json of parts `indices` (those that hold rows here), in that order."""
    from streaming.base.util import merge_index

    (root / "index.json").unlink(missing_ok=True)  # a stale merge from an interrupted run; merge_index won't overwrite
    parts = [root / part_name(i) / "index.json" for i in indices]
    lost = [part_name(i) for i, p in zip(indices, parts) if not p.is_file()]
    if lost:
        raise FileNotFoundError(f"{root}: no index.json in {lost[:3]} although those parts are marked done. Delete "
                                f"their markers ({DONE_DIR}/<part>.json in the dataset folder) and run the same command "
                                "again to encode them anew.")
    merge_index([str(p) for p in parts], str(root))
