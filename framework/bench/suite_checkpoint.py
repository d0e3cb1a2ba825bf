"""`python -m framework.bench checkpoint model=sana_1600m_1024 world_size=2`: what a sharded save costs.

Each of `world_size` CPU ranks (gloo) holds its FSDP2 shards of the preset and of its optimizer's state (one
step taken, so every state tensor exists) and, with `ema`, an fp32 EMA of the weights, takes the state dict as the trainer does
(torch.distributed.checkpoint.state_dict, as Lightning's ModelParallelStrategy) and writes `saves`
checkpoints through framework.distributed.strategy.ShardedSaver, synchronously and with async_save. Reported per
save: the seconds the training loop is blocked (sync: the whole write; async: the copy to host memory),
the seconds until the checkpoint is complete on disk, and its bytes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from framework.cli import print_table
from framework.distributed.env import leave


@dataclass
class CheckpointBench:
    """Arguments of `python -m framework.bench checkpoint`."""

    model: str = "sana_1600m_1024"
    world_size: int = 2
    optimizer: str = "came8bit"
    """adamw or came8bit (SANA's optimizer; its 8-bit state keeps a 1.6B model within a small host's memory)."""
    ema: bool = True
    """Save an fp32 EMA of the weights beside them (plugins.ema, as the trainer's checkpoints hold it)."""
    modes: list[str] = field(default_factory=lambda: ["sync", "async"])
    """sync, async or both: an async save stages a copy of every rank's state in host memory first, which a small host
    may not hold beside a 1.6B model's weights, EMA and optimizer state."""
    saves: int = 3
    dir: str | None = None
    """Where the checkpoints are written (removed afterwards); null: a temporary folder."""
    out: str = "bench_checkpoint.json"

    def __post_init__(self) -> None:
        if not self.modes or set(self.modes) - {"sync", "async"}:
            raise ValueError(f"modes={list(self.modes)}: give sync, async or both, e.g. modes=[sync]")


def _rank(rank: int, cfg: CheckpointBench, port: int, folder: str, results: Any) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from framework.distributed.fsdp import build_meta, shard
    from framework.models.backbones import load_preset
    from framework.training.optim import OptimizerConfig, build_optimizer
    from framework.distributed.strategy import ShardedSaver
    from framework.training.checkpointing import checkpoint_bytes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // cfg.world_size))
    dist.init_process_group("gloo", rank=rank, world_size=cfg.world_size)
    model = build_meta(load_preset(cfg.model))
    shard(model, init_device_mesh("cpu", (cfg.world_size,)), "SHARD_GRAD_OP", param_dtype=None)
    model.to_empty(device="cpu")  # the values do not matter to a save, only the bytes
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    import plugins  # noqa: F401  (registers came8bit)

    opt = build_optimizer(list(model.parameters()), OptimizerConfig(name=cfg.optimizer, betas=[0.9, 0.999] + (
        [0.9999] if cfg.optimizer.startswith("came") else [])))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # every state tensor exists now, as after the first training step
    for p in model.parameters():
        p.grad = None  # a save happens between steps, with the gradients freed
    # The EMA: an fp32 copy of each (sharded) weight, saved into the model's state as the trainer does.
    ema = {f"ema.{n}": p.detach().clone() for n, p in model.named_parameters()} if cfg.ema else {}
    rows = []
    for mode in cfg.modes:
        saver = ShardedSaver(rank, dist.barrier, async_save=mode == "async")
        for i in range(cfg.saves):
            path = Path(folder) / f"{mode}_{i}.ckpt"
            dist.barrier()
            t0 = time.perf_counter()
            model_state, optim_state = get_state_dict(model, opt)
            model_state.update(ema)
            saver.save({"state_dict": model_state, "optimizer_0": optim_state}, {"global_step": i}, path)
            blocked = time.perf_counter() - t0
            saver.finish()
            done = time.perf_counter() - t0
            if rank == 0:
                size = checkpoint_bytes(path)
                rows.append({"mode": mode, "save": i, "blocked_s": blocked, "complete_s": done, "bytes": size})
                shutil.rmtree(path)  # one at a time on disk
    if rank == 0:
        results.put(rows)
    leave()


def run(cfg: CheckpointBench) -> list[dict[str, Any]]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:  # a free port for the ranks' rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    folder = tempfile.mkdtemp(prefix="bench_ckpt_", dir=cfg.dir)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, cfg, port, folder, results)) for r in range(cfg.world_size)]
    try:
        for p in procs:
            p.start()
        rows = results.get()
        for p in procs:
            p.join()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        shutil.rmtree(folder, ignore_errors=True)
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    for row in rows:
        row.update(model=cfg.model, world_size=cfg.world_size, optimizer=cfg.optimizer, ema=cfg.ema,
                   gib=row["bytes"] / 2**30)
    state = cfg.optimizer + (" + EMA" if cfg.ema else "")
    print(f"{cfg.model}, {cfg.world_size} CPU ranks, {state}: seconds per save (blocked = the training loop waits; "
          "complete = on disk)")
    print_table(rows, ["mode", "save", "blocked_s", "complete_s", "gib"])
    return rows
