"""`python -m framework.bench startup ranks=[8,32,64]`: what a job's start costs as its rank count grows, on this
machine's CPU ranks (gloo, every rank one process forked from this one).

Per rank count, the slowest rank's time in each step of a start that grows with the ranks:
  rendezvous       joining the process group (torch.distributed's TCP store on rank 0)
  check_every      the shard check as every rank ran it before (framework.data.shards.check_shards on each rank)
  check_once       the job's shard check (check_shards_once): rank 0 reads, the others receive its verdict
  check_requeue    the same at the next start of the job (a requeue): the kept verdict, only changed files read
  index            opening the StreamingDataset (index.json read, partitions, shared memory) on every rank
on a synthetic dataset of `shards` MDS shards (`shard_kib` KiB each, with xxh64 hashes as precompute writes them),
checked with data.validate=`validate`. On one machine the ranks share its cores and page cache, where a cluster's
share a parallel file system's metadata servers: the figures show how each step grows with the ranks, not a
cluster's seconds.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from framework.cli import print_table

PHASES = ("rendezvous", "check_every", "check_once", "check_requeue", "index")


@dataclass
class StartupBench:
    """Arguments of `python -m framework.bench startup`."""

    ranks: list[int] = field(default_factory=lambda: [8, 32, 64])
    shards: int = 400
    shard_kib: int = 256
    validate: str = "hash"
    out: str = "bench_startup.json"


def write_dataset(folder: Path, shards: int, shard_kib: int) -> None:
    """`shards` uncompressed MDS shards of one sample each, hashed as data_prep.precompute hashes them."""
    import numpy as np
    from streaming import MDSWriter

    rng = np.random.default_rng(0)
    with MDSWriter(out=str(folder), columns={"x": "bytes"}, hashes=["xxh64"], size_limit=shard_kib * 1024) as w:
        for _ in range(shards):
            w.write({"x": rng.bytes(shard_kib * 1024 - 64)})


def _rank(rank: int, world: int, port: int, data: str, validate: str, results: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist
    from streaming import StreamingDataset

    from framework.data.shards import check_shards, check_shards_once

    times: dict[str, float] = {}

    def timed(name: str, work: Any) -> None:
        dist.barrier()  # every phase starts together: each is the slowest rank's own time
        start = time.perf_counter()
        work()
        times[name] = time.perf_counter() - start

    start = time.perf_counter()
    dist.init_process_group("gloo")
    times["rendezvous"] = time.perf_counter() - start
    timed("check_every", lambda: check_shards(Path(data), None, data, validate))
    timed("check_once", lambda: check_shards_once(Path(data), None, data, validate))
    timed("check_requeue", lambda: check_shards_once(Path(data), None, data, validate))
    datasets = []
    timed("index", lambda: datasets.append(StreamingDataset(local=data, batch_size=1, shuffle=False)))
    dist.barrier()
    results.put((rank, times))
    datasets.clear()
    dist.destroy_process_group()


def measure(world: int, data: str, validate: str, cache: str) -> dict[str, float]:
    """One start of `world` ranks; the slowest rank's seconds per phase."""
    import socket

    with socket.socket() as sock:  # a port free now, for rank 0's store
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    os.environ["LATENTFORGE_CACHE"] = cache  # a fresh verdict store: check_once is a first start's
    procs = [ctx.Process(target=_rank, args=(r, world, port, data, validate, results)) for r in range(world)]
    start = time.perf_counter()
    for p in procs:
        p.start()
    got = dict(results.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    failed = [p.exitcode for p in procs if p.exitcode]
    if failed:
        raise RuntimeError(f"{len(failed)} of {world} ranks failed (exit codes {sorted(set(failed))})")
    row: dict[str, float] = {name: max(t[name] for t in got.values()) for name in PHASES}
    row["wall_s"] = time.perf_counter() - start
    return row


def run(cfg: StartupBench) -> list[dict[str, Any]]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    with tempfile.TemporaryDirectory(prefix="lf-startup-") as tmp:
        data = Path(tmp) / "data"
        write_dataset(data, cfg.shards, cfg.shard_kib)
        for world in cfg.ranks:
            row = {"ranks": world, "shards": cfg.shards, "validate": cfg.validate,
                   **measure(world, str(data), cfg.validate, tempfile.mkdtemp(dir=tmp))}
            rows.append(row)
            print(f"[startup] {world} ranks: " + ", ".join(f"{k} {row[k]:.2f} s" for k in (*PHASES, "wall_s")),
                  flush=True)
    print_table(rows, ["ranks", "shards", *PHASES, "wall_s"])
    return rows
