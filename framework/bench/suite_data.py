"""`python -m framework.bench data`: samples/s of the Streaming data module from local shards at
several worker counts, and bytes per sample on disk.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from framework.cli import print_table
from framework.data.datamodule import DataConfig, LatentDataModule
from framework.data.shards import INDEX_FILE


@dataclass
class DataBench:
    """Arguments of `python -m framework.bench data`."""

    path: str = "data/digits"
    """A local dataset written by data_prep.precompute."""
    batch_size: int = 64
    num_batches: int = 200
    workers: list[int] = field(default_factory=lambda: [0, 2])
    out: str = "bench_data.json"


def dataset_bytes_per_sample(path: str) -> dict[str, float]:
    """On-disk (compressed) and raw bytes per sample of a local dataset, from its index.json."""
    index = json.loads((Path(path).expanduser() / INDEX_FILE).read_text())
    n = sum(s["samples"] for s in index["shards"])
    disk = sum((s.get("zip_data") or s["raw_data"])["bytes"] for s in index["shards"])
    raw = sum(s["raw_data"]["bytes"] for s in index["shards"])
    return {"dataset_samples": n, "disk_bytes_per_sample": disk / n, "raw_bytes_per_sample": raw / n}


def measure_loader_throughput(path: str, batch_size: int = 64, num_workers: int = 0, num_batches: int = 50,
                              local: Optional[str] = None, warmup: int = 2) -> dict[str, float]:
    """Samples/s one process reads through LatentDataModule (shuffled, collated); first batches excluded."""
    cfg = DataConfig(path=path, local=local, batch_size=batch_size, num_workers=num_workers)
    dm = LatentDataModule(cfg)
    dm.setup("fit")
    loader = dm.train_dataloader()
    seen, start, done = 0, None, 0
    while done < num_batches + warmup:
        for batch in loader:
            done += 1
            if done == warmup:
                start = time.perf_counter()
            elif done > warmup:
                seen += batch["latents"].shape[0]
            if done >= num_batches + warmup:
                break
    seconds = time.perf_counter() - start
    del loader
    return {"samples_per_s": seen / seconds, "samples": seen, "seconds": seconds,
            "batch_size": batch_size, "num_workers": num_workers}


def run(cfg: DataBench) -> list[dict[str, Any]]:
    size = dataset_bytes_per_sample(cfg.path)
    rows = []
    for nw in cfg.workers:
        cache = tempfile.mkdtemp(prefix="lf-bench-cache-")
        r = measure_loader_throughput(cfg.path, batch_size=cfg.batch_size, num_workers=nw, num_batches=cfg.num_batches,
                                      local=cache)
        shutil.rmtree(cache, ignore_errors=True)  # loader workers may still be closing files in it
        rows.append({"mode": f"workers={nw}", **r, **size, "mfu": None, "peak_mem_bytes": None})
    print_table(rows, [k for k in rows[0] if k not in ("mfu", "peak_mem_bytes")])
    return rows
