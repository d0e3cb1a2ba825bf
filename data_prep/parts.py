"""The parts of a precompute output: one per input shard of the source, and which rank encodes which.

    out/parts.json               the source's input shards, in order (a resume over other inputs is refused)
    out/part_000000/             input shard 0's MDS folder; with buckets, out/bucket_<h>x<w>/part_000000/ instead
    out/done/part_000000.json    written once part 0's writers have closed: its stats, and the round and world
                                 size of the run that encoded it. A part without it is unfinished.

The ranks of a run share nothing but `out` (a folder, or a bucket's prefix: data_prep/location.py): no process
group, no messages. Each one works out from the done markers which parts are its own (`deal`), encodes them, and rank
0 waits for every marker before merging the parts' index.json files in part order, so the merged dataset is the same
whatever the number of ranks. With a remote `out` the markers in the bucket are the truth, so a resume on another
machine (a fresh staging folder) sees what is done.
"""
from __future__ import annotations

import json
import posixpath
import re
import shutil
import time
from typing import Any

from data_prep.location import Location

PARTS_FILE = "parts.json"
DONE_DIR = "done"
MARKER = re.compile(rf"{DONE_DIR}/part_(\d+)\.json")  # not the *.json.tmp<pid> a killed writer may have left


def part_name(index: int) -> str:
    return f"part_{index:06d}"


def done_name(index: int) -> str:
    return f"{DONE_DIR}/{part_name(index)}.json"


# ---------------------------------------------------------------------------------------------
# The input shards and what is already done
# ---------------------------------------------------------------------------------------------


def check_parts(out: Location, shards: list[Any]) -> None:
    """Record the source's input shards in out/parts.json, or, when a run left one, refuse other shards: part i
    must mean the same inputs in every run that adds to this folder."""
    shards = json.loads(json.dumps(shards))  # tuples as lists, as they read back
    if not out.exists(PARTS_FILE):
        out.write_json(PARTS_FILE, {"parts": shards})  # every rank writes the same content
        return
    before = out.read_json(PARTS_FILE)["parts"]
    if before != shards:
        changed = next((i for i, (a, b) in enumerate(zip(before, shards)) if a != b), min(len(before), len(shards)))
        raise FileExistsError(
            f"out={out} holds parts of other input shards: {len(before)} parts then, {len(shards)} now, the first "
            f"difference at part {changed} ({before[changed] if changed < len(before) else None} then, "
            f"{shards[changed] if changed < len(shards) else None} now). The source or records_per_part changed since "
            "the run that began this folder; rerun with those, or use a new out=.")


def read_done(out: Location) -> dict[int, dict]:
    """The done markers there are now: {part index: its marker}."""
    found = {int(m.group(1)): name for name in out.names(DONE_DIR) if (m := MARKER.fullmatch(name))}
    return dict(zip(found, out.read_jsons(list(found.values()))))


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


def my_parts(out: Location, num_parts: int, rank: int, world: int) -> tuple[int, list[int], int]:
    """(round, the unfinished parts this rank encodes in order, how many parts are done already)."""
    done = read_done(out)
    round_, dealt = deal(done, num_parts, world)
    return round_, [i for p, i in enumerate(dealt) if p % world == rank and i not in done], len(done)


def part_folders(index: int, buckets: list[tuple[int, int]] | None) -> list[str]:
    """The names of part `index`'s MDS folders: part_<index>, or with buckets one in each bucket's folder."""
    from data_prep.buckets import bucket_dir

    return [part_name(index)] if buckets is None else [f"{bucket_dir(b)}/{part_name(index)}" for b in buckets]


def part_indexes(index: int, buckets: list[tuple[int, int]] | None, bucket_rows: dict[str, int]) -> list[str]:
    """The index.json names of those of part `index`'s MDS folders that hold rows (its marker's `bucket_rows`: the
    rows per bucket, -1 without buckets)."""
    folders = part_folders(index, buckets)
    rows = [bucket_rows.get("-1", 0)] if buckets is None else [bucket_rows.get(str(b), 0) for b in range(len(buckets))]
    return [f"{folder}/index.json" for folder, n in zip(folders, rows) if n]


def remove_partial(out: Location, index: int, buckets: list[tuple[int, int]] | None) -> None:
    """Delete what an interrupted run left of part `index` on this machine (its MDS folder, or one per bucket) before
    encoding it. What it left in a bucket is overwritten: the part's shards get the same names again."""
    for folder in part_folders(index, buckets):
        shutil.rmtree(out.local(folder), ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Rank 0: wait for every part, then merge
# ---------------------------------------------------------------------------------------------


def wait_for_parts(out: Location, num_parts: int, timeout: float) -> list[dict]:
    """Every part's marker, in part order, once all are there."""
    deadline = time.monotonic() + timeout
    wanted = {done_name(i) for i in range(num_parts)}
    while True:
        missing = wanted - set(out.names(DONE_DIR))
        if not missing:
            return out.read_jsons([done_name(i) for i in range(num_parts)])
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{len(missing)} of {num_parts} parts were not finished within merge_timeout_s={timeout} (e.g. "
                f"{sorted(missing)[:3]} in {out}): a rank encoding them may have died. Run the same command again, on "
                "any number of ranks: the finished parts are kept and the others encoded.")
        time.sleep(1.0)


def merge(out: Location, root: str, indices: list[int]) -> None:
    """out/root/index.json (root: "" or a bucket's folder) from the index.json of parts `indices` (those that hold rows
    there), in that order. Each part's index.json is fetched to this machine first (a no-op for a local out), where
    it stays for the size count in dataset.json (precompute.finish)."""
    from streaming.base.util import merge_index

    names = [posixpath.join(root, part_name(i), "index.json") for i in indices]
    present = set(out.names(root))
    lost = [part_name(i) for i, name in zip(indices, names) if name not in present]
    if lost:
        raise FileNotFoundError(f"{out.join(root)}: no index.json in {lost[:3]} although those parts are marked done. "
                                f"Delete their markers ({DONE_DIR}/<part>.json in the dataset folder) and run the same "
                                "command again to encode them anew.")
    merged = posixpath.join(root, "index.json")
    out.local(merged).unlink(missing_ok=True)  # a stale merge from an interrupted run; merge_index won't overwrite
    parts = [out.fetch(name) for name in names]
    merge_index([str(p) for p in parts], str(out.local(root)))
    out.push(merged)
