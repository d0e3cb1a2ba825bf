"""`python -m tests.workers.ema_dist_train [train overrides]`: framework.train plus a probe of the EMA, for 2-process tests.

Lightning's launcher re-runs this same command for the other ranks, so every rank gets the probe.
When training ends each rank writes run.dir/ema_probe_rank<r>.json: for every EMA tensor whether
it is a DTensor, its local and global element counts, and the bytes the EMA holds on this rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl

from tests.workers.dist_train import main_with_probe


class EMAProbe(pl.Callback):
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from torch.distributed.tensor import DTensor

        from plugins.ema import EMA

        ema = next(cb for cb in trainer.callbacks if isinstance(cb, EMA)).ema or {}
        local = {n: (t.to_local() if isinstance(t, DTensor) else t) for n, t in ema.items()}
        out = {
            "world_size": trainer.world_size,
            "tensors": {n: {"dtensor": isinstance(t, DTensor), "local_numel": local[n].numel(), "numel": t.numel()}
                        for n, t in ema.items()},
            "local_bytes": sum(t.numel() * t.element_size() for t in local.values()),
        }
        (self.run_dir / f"ema_probe_rank{trainer.global_rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main_with_probe(EMAProbe)
