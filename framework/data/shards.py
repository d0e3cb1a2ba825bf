"""Start-up checks of MDS shard files: a corrupt or truncated shard fails before training, naming the file.

Streaming trusts the shard files it finds on disk. It decompresses `shard.NNNNN.mds.zstd` into
`shard.NNNNN.mds` beside it (in the dataset folder when a local dataset is read in place, in the
`data.local` cache otherwise) and from then on reads that `.mds` without looking at it again, so a
damaged file only surfaces mid-epoch, as an IndexError or a decode error from deep inside Streaming.
Its own `validate_hash` checks a file only while downloading or decompressing it. This module fills
that gap: before the StreamingDataset is built, every shard file present on disk, compressed or not,
in the dataset folder and in the cache, is compared with what index.json records for it. MDSWriter
records the size of both files of a shard (`raw_data`: the .mds, `zip_data`: the .mds.zstd) and, with
`hashes=["xxh64"]` as data_prep.precompute writes them, an xxh64 of each.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

INDEX_FILE = "index.json"
VALIDATE_MODES = ("auto", "hash", "size", "none")

# validate=auto hashes every present shard file while together they hold at most this many bytes:
# xxh64 runs at several GB/s, so that costs seconds at most. Above it (TB-scale datasets) hashing at
# every start, resumes included, would take minutes, and auto checks sizes and .mds headers instead.
AUTO_HASH_LIMIT = 4 * 2**30

REBUILD = "Re-run `python -m data_prep.precompute` into a new folder (or restore this file from a copy)"


@dataclass
class ShardFile:
    """One shard file on disk, what index.json says about it, and what to do when it is bad."""

    file: Path
    entry: dict  # index.json's raw_data or zip_data entry: basename, bytes, hashes
    samples: Optional[int]  # for an .mds file (not its .zstd): the sample count its header must hold
    fix: str


# ---------------------------------------------------------------------------------------------
# The three checks of one file, cheapest first; each returns the problem in words, or None
# ---------------------------------------------------------------------------------------------


def _size_problem(f: ShardFile, index_file: Path) -> Optional[str]:
    size = f.file.stat().st_size
    if size != f.entry["bytes"]:
        return f"{size} bytes on disk, {f.entry['bytes']} expected by {index_file} (truncated or overwritten)"
    return None


def _header_problem(f: ShardFile, index_file: Path) -> Optional[str]:
    """An .mds file starts with its sample count n (uint32), then n + 1 uint32 offsets: where each
    sample starts and, last, where the data ends (= the file size); the writer's config JSON sits
    between the table and the first sample. Layout from Streaming's MDSWriter.encode_joint_shard and
    MDSReader.get_sample_data. Reading it costs 4 (n + 2) bytes and catches a wrong count and an
    offset table that no longer rises to the end of the file; bytes flipped inside sample data, or an
    offset moved by less than a sample's length, only change the hash."""
    with open(f.file, "rb") as fh:
        head = fh.read(4)
        count = int(np.frombuffer(head, np.uint32)[0]) if len(head) == 4 else None
        if count != f.samples:
            return f"its header counts {count} samples, {index_file} {f.samples} (header overwritten)"
        offsets = np.frombuffer(fh.read(4 * (count + 1)), np.uint32).astype(np.int64)
    size = f.file.stat().st_size
    if len(offsets) != count + 1 or offsets[0] < 4 * (count + 2) or (np.diff(offsets) < 0).any():
        return "its table of sample offsets is damaged (offsets out of order or inside the header)"
    if offsets[-1] != size:
        return f"its offset table ends at byte {offsets[-1]} but the file has {size} bytes"
    return None


def _hash_problem(f: ShardFile, index_file: Path) -> Optional[str]:
    hashes = f.entry.get("hashes") or {}
    algo = "xxh64" if "xxh64" in hashes else next(iter(hashes), None)  # xxh64 is the fast one
    if algo is None:
        return None  # the writer recorded no hash: size and header are all there is to check
    if algo.startswith("xxh"):
        import xxhash

        digest = getattr(xxhash, algo)()
    else:
        digest = hashlib.new(algo)
    with open(f.file, "rb") as fh:
        while chunk := fh.read(1 << 24):  # 16 MiB at a time: shards may be larger than memory allows
            digest.update(chunk)
    if digest.hexdigest() != hashes[algo]:
        return f"its {algo} hash differs from the one in {index_file} (bytes changed in place)"
    return None


# ---------------------------------------------------------------------------------------------
# Which files to check
# ---------------------------------------------------------------------------------------------


def read_index(index_file: Path, fix: str = REBUILD) -> dict:
    try:
        return json.loads(index_file.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{index_file} is missing. {fix}.") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{index_file} is corrupt ({err}). {fix}.") from None


def shard_files(index: dict, index_file: Path, dataset: Optional[Path], cache: Optional[Path],
                source: str) -> list[ShardFile]:
    """The shard files present on disk, each shard's compressed file before its .mds.

    The dataset folder must hold the file Streaming takes each shard from: the .mds.zstd (the .mds is
    made from it when first needed) or, for an uncompressed dataset, the .mds. In the cache any file
    may be missing: Streaming fetches what it lacks from `source`, which is also the cure for a bad one.
    """
    files = []
    for shard in index["shards"]:
        raw, packed = shard["raw_data"], shard.get("zip_data")
        samples = shard["samples"] if shard.get("format") == "mds" else None
        if dataset is not None:
            main = dataset / (packed or raw)["basename"]
            unpacked = dataset / raw["basename"] if packed else None
            if not main.is_file():
                # Reading in place, Streaming deletes a .mds whose .zstd is gone and skips the shard.
                note = f" (the {unpacked.name} beside it would be dropped)" if unpacked and unpacked.is_file() else ""
                raise FileNotFoundError(f"shard {main} listed in {index_file} is missing{note}. {REBUILD}.")
            files.append(ShardFile(main, packed or raw, None if packed else samples, REBUILD))
            if unpacked and unpacked.is_file():  # checked after its .zstd, so it can be decompressed again
                files.append(ShardFile(unpacked, raw, samples,
                                       f"Delete it: Streaming decompresses it again from {main.name}"))
        if cache is not None:
            for e in (packed, raw):
                if e and (cache / e["basename"]).is_file():
                    files.append(ShardFile(cache / e["basename"], e, samples if e is raw else None,
                                           f"Delete it: Streaming fetches it again from {source}"))
    return files


def check_same_dataset(index: dict, index_file: Path, cache: Path) -> None:
    """Streaming reads the cache's own index.json whenever one is there and never compares it with the
    dataset's, so a cache left by another dataset would silently serve that dataset's shards."""
    cached_file = cache / INDEX_FILE
    if not cached_file.is_file():
        return
    try:
        cached = json.loads(cached_file.read_text())
    except json.JSONDecodeError:
        cached = None
    if cached != index:
        raise ValueError(f"the cache {cache} (data.local) holds another dataset: {cached_file} differs from "
                         f"{index_file}. Delete {cache}, or set data.local to an empty folder, and Streaming "
                         f"copies this dataset into it.")


def check_shards(dataset: Optional[Path], cache: Optional[Path], source: str, mode: str = "auto",
                 parts: tuple[str, ...] = ("dataset", "cache"), verdicts: bool = False) -> int:
    """Raise one error naming the first missing or corrupt shard file, before Streaming reads any.

    dataset: the dataset folder when it is on this machine (None for a remote dataset);
    cache: the data.local folder, if any; source: data.path, named in the advice for cache files.
    parts: which of the two folders to check (in a job: the dataset once, each node's cache on that node).
    verdicts: reuse and record the verdict of earlier checks (`Verdicts`). Returns the number of files checked.
    """
    if mode == "none":
        return 0
    if dataset is not None:
        # The merged index at the top, which Streaming reads; its basenames are relative to it
        # (part_000000/shard.00000.mds.zstd). The per-part index.json files it was merged from are not read.
        index_file = dataset / INDEX_FILE
        index = read_index(index_file)
        if cache is not None and "cache" in parts:
            check_same_dataset(index, index_file, cache)
    elif cache is not None and (cache / INDEX_FILE).is_file():
        # A remote dataset: its cached index.json is what Streaming will read. (Comparing it with the
        # remote one would cost a download on every rank at every start.)
        index_file = cache / INDEX_FILE
        index = read_index(index_file, f"Delete it: Streaming fetches it again from {source}")
    else:
        return 0  # nothing on disk yet: Streaming downloads it
    files = shard_files(index, index_file, dataset if "dataset" in parts else None,
                        cache if "cache" in parts else None, source)
    hash_all = mode == "hash" or (mode == "auto" and sum(f.entry["bytes"] for f in files) <= AUTO_HASH_LIMIT)
    passed = Verdicts(index_file, mode, parts, [d for d in (dataset, cache) if d is not None]) if verdicts else None
    checked = 0
    for f in files:
        if passed is not None and passed.unchanged(f.file):
            continue
        checked += 1
        problem = (_size_problem(f, index_file)
                   or (f.samples is not None and _header_problem(f, index_file))
                   or (hash_all and _hash_problem(f, index_file)))
        if problem:
            raise ValueError(f"shard {f.file} is corrupt: {problem}. {f.fix}.")
    if passed is not None:
        passed.record([f.file for f in files])
    return checked


class Verdicts:
    """The shard files that passed a check, each with the size, modification and change times and inode it had then,
    so that a later start (a requeue, a resume) of a job on the same shards checks only the files written or changed
    since.

    Kept in `LATENTFORGE_CACHE`/shard-checks/, one file per index.json (its bytes, where it lies and on which host),
    per validate mode and parts: a cache folder on a node's own disk has its own verdict on each node. A shard file
    written again gets a new change time (whatever its modification time is set back to) and is checked again; bytes
    changed by a disk fault, with no write, are found again once LATENTFORGE_CACHE/shard-checks/ is emptied.
    """

    def __init__(self, index_file: Path, mode: str, parts: tuple[str, ...], folders: list[Path]) -> None:
        import socket

        from data_prep.location import cache_dir

        key = hashlib.sha256(index_file.read_bytes())
        key.update(f"{socket.gethostname()}|{mode}|{parts}|{[str(d.resolve()) for d in folders]}".encode())
        self.file = cache_dir() / "shard-checks" / f"{key.hexdigest()[:32]}.json"
        try:
            self.files: dict[str, list[int]] = json.loads(self.file.read_text())["files"]
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            self.files = {}

    @staticmethod
    def _stamp(file: Path) -> list[int]:
        st = file.stat()  # a file written again has a new ctime, whatever its mtime was set back to
        return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]

    def unchanged(self, file: Path) -> bool:
        return self.files.get(str(file)) == self._stamp(file)

    def record(self, files: list[Path]) -> None:
        from data_prep.record import write_json_atomic

        self.files = {str(f): self._stamp(f) for f in files}
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.file, {"checked": time.strftime("%Y-%m-%d %H:%M:%S"), "files": self.files})
        except OSError:  # a read-only cache folder: the next start checks everything again
            pass


def check_shards_once(dataset: Optional[Path], cache: Optional[Path], source: str, mode: str = "auto") -> None:
    """check_shards for a job: the dataset folder (on a shared file system) is checked by rank 0 alone and each
    node's cache folder by that node's first rank; the others wait and receive the verdict, so every rank raises
    the same error (naming the rank and host that found it) or none. Verdicts of earlier starts are reused
    (`Verdicts`). Outside a process group (one process, or ranks started without one) this process checks both."""
    import socket

    import torch.distributed as dist

    if mode == "none":
        return
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        check_shards(dataset, cache, source, mode, verdicts=True)
        return
    rank, leader = dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0")) == 0
    parts = (("dataset",) if rank == 0 else ()) + (("cache",) if leader else ())
    found, start = None, time.perf_counter()
    if parts:
        try:
            checked = check_shards(dataset, cache, source, mode, parts, verdicts=True)
            if rank == 0:
                print(f"shards: {checked} files checked ({mode}) in {time.perf_counter() - start:.1f} s by rank 0, "
                      f"unchanged ones skipped since the last check; every node's first rank checks its cache",
                      flush=True)
        except (FileNotFoundError, ValueError) as err:
            found = (type(err).__name__, str(err), rank, socket.gethostname())
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, found)
    first = next((f for f in everyone if f is not None), None)
    if first is not None:
        kind, message, by, host = first
        error = FileNotFoundError if kind == "FileNotFoundError" else ValueError
        raise error(message if by == rank else f"{message} (found by rank {by} on {host})")


# ---------------------------------------------------------------------------------------------
# Shared memory left behind by dead datasets
# ---------------------------------------------------------------------------------------------

SHM_DIR = Path("/dev/shm")


def remove_orphan_shared_memory(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink Streaming segments `NNNNNN_<name>` whose `NNNNNN_locals` is gone; returns their names.

    A StreamingDataset registers its prefix by creating `NNNNNN_locals` before any other segment and
    holds it while it lives. A job killed mid-run, or a dataset half-way through being finalised, can
    leave other segments of its prefix behind without it. Streaming takes, over the segment names, the
    largest first-free prefix, so after such leftovers the prefix it picks can already hold one: the
    new dataset then fails to create its barrier there, or shares the dead one's state in a segment
    it creates-or-attaches and can wait on it forever. Live datasets always have their `_locals`, so
    only leftovers are removed. (Streaming's own clean_stale_shared_memory removes every segment,
    live jobs' included, so it is not safe on a shared node.)
    """
    import re

    if not shm_dir.is_dir():
        return []
    names = [p.name for p in shm_dir.iterdir()]
    pattern = re.compile(r"^(\d{6})_\w+$")
    live = {n[:6] for n in names if n.endswith("_locals") and pattern.match(n)}
    removed = []
    for n in names:
        if pattern.match(n) and n[:6] not in live:
            try:
                (shm_dir / n).unlink()
                removed.append(n)
            except (FileNotFoundError, PermissionError):  # another rank was first, or not ours to remove
                pass
    return removed


LOCK_FILE = "latentforge_streaming_prefix.lock"  # beside the segments: one lock per node, whatever TMPDIR says


@contextmanager
def prefix_lock(shm_dir: Path = SHM_DIR, timeout: float = 300.0) -> Iterator[None]:
    """Hold this node's lock on Streaming's shared-memory prefixes while the StreamingDataset is built.

    Streaming picks its prefix as the first one free, on every local rank, then has the local leader create
    `NNNNNN_locals` two barriers later, with no lock across processes: two jobs starting together on a node pick
    the same prefix and the later one fails with FileExistsError on `NNNNNN_locals` (two-rank jobs side by side
    under pytest-xdist did). Here the local leader takes an exclusive flock on a file beside the segments, a
    barrier holds the job's other ranks until it has, the dataset is built (orphan segments removed, prefix
    chosen and registered), a second barrier waits for every rank, and the lock is let go; by then the prefix's
    `_locals` exists, so the next job's search skips it. Only the leader locks, so a job never waits on itself;
    after `timeout` seconds (a multi-node job whose nodes another such job holds in the other order) the leader
    goes on without the lock and says so, rather than wait forever.
    """
    import fcntl
    import logging

    import torch.distributed as dist

    synced = dist.is_available() and dist.is_initialized()
    leader = int(os.environ.get("LOCAL_RANK", "0")) == 0
    fd = None
    if leader:
        folder = shm_dir if shm_dir.is_dir() else Path(tempfile.gettempdir())
        fd = os.open(folder / LOCK_FILE, os.O_RDONLY | os.O_CREAT, 0o666)
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    logging.getLogger(__name__).warning(
                        "waited %.0f s for %s (another job on this node is opening its dataset); going on without it",
                        timeout, folder / LOCK_FILE)
                    os.close(fd)
                    fd = None
                    break
                time.sleep(0.05)
    try:
        if synced:
            dist.barrier()  # the job's other ranks start their prefix search once their leader holds the lock
        yield
        if synced:
            dist.barrier()  # every rank has its prefix
    finally:
        if fd is not None:
            os.close(fd)  # closing the only descriptor releases the flock


def open_racing_other_jobs(make: Any, attempts: int = 5) -> Any:
    """`make()` a StreamingDataset, again after a short random pause when another job on this node registered the
    same shared-memory prefix between Streaming's choice of it and its creation (FileExistsError on `NNNNNN_locals`:
    Streaming takes the first free prefix without a lock across processes, so two jobs starting together can pick
    the same one). Jobs of this framework take `prefix_lock` and do not race each other; this is for another
    program's Streaming job on the node. The retry picks the next free prefix. Only for a process that is its node's
    only rank: within a job the local ranks agree on the prefix together, and one rank retrying alone would leave
    the others waiting."""
    import logging
    import random

    alone = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) == 1
    for attempt in range(attempts):
        try:
            return make()
        except FileExistsError as err:
            if not alone or "_locals" not in str(err) or attempt == attempts - 1:
                raise
            logging.getLogger(__name__).warning("another job registered Streaming's shared-memory prefix at the same "
                                                "moment (%s); trying the next one", err)
            time.sleep(random.uniform(0.05, 0.5))


def first_free_prefix(streams_local: list[str], streams_remote: list, segment: str, retry: int) -> int:
    """The first prefix free for the segment name `segment`, searched as Streaming's `_check_and_find_retrying` does
    (prefixes with file locks in the temporary folder skipped; a local folder that a live dataset with a remote also
    uses is an error, retried `retry` times a TICK apart), with one change: each segment looked at is closed again.
    Streaming attaches with its SharedMemory's default `auto_cleanup`, which hands the handle to `atexit`, so every
    dataset opened kept two descriptors (the file and its map) on every segment of every prefix before it until the
    process exited: the count grew with the square of the datasets a process opened, and a single test worker
    reached its limit of 20,000."""
    from streaming.base.constant import TICK

    failures = 0
    while True:
        try:
            return _first_free_prefix_once(streams_local, streams_remote, segment)
        except ValueError:
            failures += 1
            if failures > retry:
                raise
            time.sleep(TICK)  # a dataset being dropped may still be letting its folders go


def _first_free_prefix_once(streams_local: list[str], streams_remote: list, segment: str) -> int:
    from streaming.base import constant
    from streaming.base.shared import prefix as shm

    for found in shm._each_prefix_int():
        locks = [shm._get_path(found, lock) for lock in (constant.BARRIER_FILELOCK, constant.CACHE_FILELOCK)]
        try:
            if any(os.path.exists(os.path.join(tempfile.gettempdir(), lock)) for lock in locks):
                continue
            memory = shm.SharedMemory(shm._get_path(found, segment), False, auto_cleanup=False)
        except PermissionError:
            continue
        except FileNotFoundError:
            return found
        try:
            if segment == constant.LOCALS and any(streams_remote):
                theirs, _ = shm._unpack_locals(bytes(memory.buf))
                if any(remote is not None and local in theirs for local, remote in zip(streams_local, streams_remote)):
                    raise ValueError(f"Reused local directory: {streams_local} vs {theirs}. Give each dataset with a "
                                     "remote its own local folder.")
        finally:
            memory.cleanup()  # an attached segment: closed, not removed
    raise AssertionError("the prefixes are endless")


def agreed_shm_prefix(streams_local: list[str], streams_remote: list, world: Any, retry: int = 100) -> tuple[int, Any]:
    """Streaming's get_shm_prefix (streaming/base/shared/prefix.py) with one change: a node's ranks take the prefix
    their local leader found, instead of each searching on its own. Each rank's search ran at its own moment, so a
    segment another process freed in between (a finished run's, a collected dataset's) made the ranks disagree, and a
    non-leader failed with "prefix=N was not registered by local leader" (CI saw it on a two-rank job). The rest is as
    Streaming does it: the leader registers `NNNNNN_locals` with its folders, the others check they match."""
    import torch.distributed as dist
    from streaming.base.shared import prefix as shm

    shm._check_self(streams_local)
    found = -1
    if world.is_local_leader:
        found = max(first_free_prefix(streams_local, streams_remote, name, retry) for name in shm.SHM_TO_CLEAN)
    synced = dist.is_available() and dist.is_initialized()
    if synced:
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, found)
        found = every[world.rank - world.rank_of_node]  # the local leader's (a node's ranks are consecutive)
    name = shm._get_path(found, shm.LOCALS)
    if world.is_local_leader:
        data = shm._pack_locals(streams_local, found)
        memory = shm.SharedMemory(name, True, len(data))
        memory.buf[:len(data)] = data
    if synced:
        dist.barrier()
    if not world.is_local_leader:
        memory = shm.SharedMemory(name, False)
        theirs, their_prefix = shm._unpack_locals(bytes(memory.buf))
        if theirs != streams_local or their_prefix != found:
            raise RuntimeError(f"Streaming's shared-memory prefix {found}: the local leader registered {theirs} "
                               f"(prefix {their_prefix}), this rank reads {streams_local}; every rank of a node must "
                               "give the same data.local")
    return found, memory


def open_streaming(make: Any) -> Any:
    """`make()` a StreamingDataset the way every dataset of this project is opened: under this node's prefix lock,
    after removing the segments dead datasets left behind, retried if another program's job took its prefix, its
    ranks agreeing on the prefix (agreed_shm_prefix). The data module, the overhead bench's hand loop and the tests'
    own readers all open theirs through it."""
    import logging

    import streaming.base.dataset

    streaming.base.dataset.get_shm_prefix = agreed_shm_prefix  # StreamingDataset's own reference to it
    with prefix_lock():  # no other job on this node chooses a prefix meanwhile
        removed = remove_orphan_shared_memory()  # a killed job's leftovers would stall this dataset
        if removed:
            logging.getLogger(__name__).warning("removed %d shared-memory segments left by a dead Streaming dataset: "
                                                "%s", len(removed), ", ".join(removed[:6]))
        return open_racing_other_jobs(make)


# ---------------------------------------------------------------------------------------------
# Streaming's background threads: stopped with their epoch, their failures raised
# ---------------------------------------------------------------------------------------------

DATASET_CLASS = "ShardDataset"


def __getattr__(name: str):
    """framework.data.shards.ShardDataset, built on first use: importing Streaming here would make this module
    as slow to import as Streaming is. (Pickle finds the class by the same name, so spawned DataLoader
    workers get it too.)"""
    if name != DATASET_CLASS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    cls = _shard_dataset_class()
    globals()[name] = cls
    return cls


def _shard_dataset_class() -> type:
    import threading

    from streaming import StreamingDataset
    from streaming.base.constant import TICK
    from streaming.base.dataset import _ShardState

    class ShardDataset(StreamingDataset):
        """A StreamingDataset whose epoch never ends early in silence, and whose threads end with their epoch.

        Each epoch (each __iter__) Streaming starts two threads in the reading process: one prepares the
        shards ahead of the batches (copies them into the cache, decompresses .mds.zstd into .mds), the
        other waits for them. Streaming has three gaps here, closed below:
        - A loader dropped mid-epoch (`next(iter(loader))`, a run stopped at max_steps) closes the epoch's
          generator, but Streaming stops its threads only when the next epoch of the same dataset starts
          or the epoch ends, so they ran for the rest of the process and kept preparing shards: a .mds
          deleted meanwhile was decompressed again, into the same `.tmp` name as by the next dataset over
          that folder, and one of the two failed. Now they are stopped when the epoch is dropped.
        - When a thread fails, Streaming logs the error ("exception calling callback") and ends the epoch
          as if it had no more samples: a short or empty epoch, no error. Now the epoch raises it.
        - A failed preparation leaves its shard PREPARING, so a reader that waits for that shard (the
          main thread, in get_item) waited forever. Now the shard goes back to REMOTE (to be prepared again).
        """

        def prepare_shard(self, shard_id: int, blocking: bool = True) -> None:
            try:
                super().prepare_shard(shard_id, blocking)
            except BaseException:
                # Only a preparation that set PREPARING itself raises after doing so (the waiting branch
                # does not raise), so the shard is ours to release.
                if self._shard_states[shard_id] == _ShardState.PREPARING:
                    self._shard_states[shard_id] = _ShardState.REMOTE
                raise

        def on_exception(self, future) -> None:
            if future.exception() is not None and getattr(self, "_thread_error", None) is None:
                self._thread_error = future.exception()  # before Streaming sets the event: readers see both
            super().on_exception(future)

        def __iter__(self):
            before = getattr(self, "_iterator", None)
            inner = super().__iter__()
            mine = None  # this epoch's _Iterator (Streaming's handle on its two threads)
            try:
                for sample in inner:
                    if mine is None:
                        mine = self._iterator  # set by this epoch before its first sample
                    yield sample
            except GeneratorExit:  # the loader was dropped mid-epoch
                inner.close()
                if mine is not None:
                    self._stop_threads(mine)
                raise
            except Exception as err:
                mine = mine or getattr(self, "_iterator", None)
                if mine is not None and mine is not before:
                    mine.non_blocking_exit()  # the epoch is over: its threads need not prepare more shards
                if getattr(self, "_thread_error", None) is not None:
                    raise self._failure() from err
                raise
            if self._event.is_set():  # Streaming's way of ending an epoch whose thread failed
                raise self._failure()

        def _stop_threads(self, it) -> None:
            """Signal the epoch's threads to stop and wait until they have (as Streaming does before a new
            epoch), unless a thread failed (it never reports its exit) or this is one of them."""
            it.non_blocking_exit()
            if threading.current_thread() in getattr(getattr(self, "_executor", None), "_threads", ()):
                return  # the generator was collected inside one of the threads: it cannot wait for itself
            while it._num_exited < it._num_threads_to_exit and not self._event.is_set():
                time.sleep(TICK)

        def _failure(self) -> RuntimeError:
            err = self._thread_error
            stream = self.streams[0]
            source = stream.remote or stream.local
            return RuntimeError(
                f"Streaming failed to prepare a shard of {source} (local folder {stream.local}) in its "
                f"background thread: {type(err).__name__}: {err}. Streaming would have ended the epoch here "
                f"without an error, short or empty. Make sure the shard files that index.json lists are in "
                f"{source} and readable and that {stream.local} is writable, and that no other data module or "
                f"job is writing the same folder at the same time; then start again.")

    ShardDataset.__module__ = __name__
    ShardDataset.__qualname__ = DATASET_CLASS
    return ShardDataset
