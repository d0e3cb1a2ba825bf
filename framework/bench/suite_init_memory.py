"""`python -m framework.bench init_memory`: peak host memory of each rank while building and sharding a
preset under fsdp, the meta-device path (framework/distributed/fsdp.py) versus every rank building the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from framework.cli import print_table
from framework.distributed.env import leave
from framework.distributed.fsdp import build_meta, materialize, shard
from framework.models.backbones import build_denoiser, load_preset

@dataclass
class InitMemoryBench:
    """Arguments of `python -m framework.bench init_memory`: peak host memory per rank of the fsdp set-up."""

    model: str = "sana_1600m_1024"
    world_size: int = 2
    paths: list[str] = field(default_factory=lambda: ["whole", "meta"])
    """whole: every rank builds the full model then shards it (the ordinary path); meta: this module."""
    out: str = "bench_init_memory.json"

    def __post_init__(self) -> None:
        unknown = set(self.paths) - {"whole", "meta"}
        if unknown:
            raise ValueError(f"paths={self.paths}: {sorted(unknown)} unknown; choose from whole and meta.")


def _peak_rss_gb() -> float:
    """Peak resident memory of this process (fresh.peak_rss_bytes: a spawned rank's own, not its parent's)."""
    from framework.bench.fresh import peak_rss_bytes

    return peak_rss_bytes() / 1e9


def _init_memory_rank(rank: int, cfg: InitMemoryBench, path: str, store: str, out: str) -> None:
    """One rank in its own (spawned) process: gloo group, build + shard as `path` says, report peak RSS."""
    import json
    import resource
    import time

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh


    after_imports = _peak_rss_gb()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=cfg.world_size)
    mesh = init_device_mesh("cpu", (cfg.world_size,))
    mcfg = load_preset(cfg.model)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    if path == "whole":
        model = shard(build_denoiser(mcfg), mesh, "SHARD_GRAD_OP", param_dtype=None)
    else:
        rng_state = torch.get_rng_state()
        model = shard(build_meta(mcfg), mesh, "SHARD_GRAD_OP", param_dtype=None)
        materialize(model, rng_state, torch.device("cpu"))
    seconds = time.perf_counter() - t0
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    row = {"model": cfg.model, "path": path, "rank": rank, "world_size": cfg.world_size,
           "params": sum(p.numel() for p in model.parameters()), "local_param_gb": local / 1e9,
           "rss_after_imports_gb": after_imports, "peak_rss_gb": _peak_rss_gb(), "seconds": seconds,
           # ru_maxrss as well (KiB on Linux); it may include the parent's memory at fork, hence VmHWM above.
           "ru_maxrss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9}
    Path(out, f"{path}_rank{rank}.json").write_text(json.dumps(row))
    dist.barrier()
    leave()


def run(cfg: InitMemoryBench) -> list[dict[str, Any]]:
    import json
    import tempfile

    import torch.multiprocessing as mp

    rows = []
    for path in cfg.paths:  # one path at a time, each rank a fresh process (peak RSS is per process)
        with tempfile.TemporaryDirectory(prefix="lf-init-mem-") as tmp:
            mp.start_processes(_init_memory_rank, args=(cfg, path, f"{tmp}/store", tmp), nprocs=cfg.world_size,
                               start_method="spawn")
            rows += [json.loads(Path(tmp, f"{path}_rank{r}.json").read_text()) for r in range(cfg.world_size)]
    print_table(rows, list(rows[0]))
    return rows


