"""`python -m tests.workers.fsdp_init CASES_JSON OUT_DIR`: the fsdp set-up of several models, 2 ranks, gloo, CPU.

For each case ({"model": preset, "seed": N, "init_from": path or null}) it seeds like framework.train
(`pl.seed_everything`), draws 3 numbers (as tests/test_fsdp_init.py's reference does), builds the real DiffusionModule
with strategy=fsdp and lets a Lightning
Trainer (the real FSDPStrategy, max_steps=0) run set-up: configure_model shards the meta model and
materialises it, then Lightning's own set-up. At on_fit_start, before any step, every rank writes
OUT_DIR/case<i>_rank<r>.pt: the gathered parameters (full_tensor), every buffer as that rank holds
it, and the number of parameter elements the rank holds locally.

Lightning's launcher starts rank 1 by re-running this command at the first fit; the later fits
reuse the same two processes and process group.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

from framework.distributed.config import StrategyConfig
from framework.models.backbones import load_preset
from framework.training.module import DiffusionModule
from framework.models.objectives import ObjectiveConfig
from framework.training.optim import OptimizerConfig
from framework.distributed.strategy import build_strategy


class Gather(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from torch.distributed.tensor import DTensor

        model = pl_module.model
        params = {n: p.full_tensor().detach() for n, p in model.named_parameters()}  # collective, same order on each rank
        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
        torch.save({"params": params, "buffers": {n: b.detach() for n, b in model.named_buffers()}, "local_numel": local,
                    "dtensor": all(isinstance(p, DTensor) for p in model.parameters())},
                   self.out.with_name(f"{self.out.name}_rank{trainer.global_rank}.pt"))


def main(cases_json: str, out_dir: str) -> None:
    strategy_cfg = StrategyConfig(name="fsdp")
    for i, case in enumerate(json.loads(Path(cases_json).read_text())):
        pl.seed_everything(case["seed"], workers=True, verbose=False)
        torch.rand(3)  # the RNG state at construction is then not the bare seed's (which set-up re-seeds to)
        module = DiffusionModule(load_preset(case["model"]), ObjectiveConfig(), OptimizerConfig(), max_steps=0,
                                 seed=case["seed"], strategy=strategy_cfg, init_from=case["init_from"])
        trainer = pl.Trainer(strategy=build_strategy(strategy_cfg, "32-true"), accelerator="cpu", devices=2, max_steps=0,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[Gather(Path(out_dir) / f"case{i}")],
                             default_root_dir=out_dir)
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([{"x": torch.zeros(1)}]))


if __name__ == "__main__":
    main(*sys.argv[1:3])
