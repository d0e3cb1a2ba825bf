"""`python -m framework.bench checkpoint model=sana_1600m_1024 world_size=2`: what a sharded save costs.

Each of `world_size` CPU ranks (gloo) holds its FSDP2 shards of the preset and of its optimizer's state (one
step taken, so every state tensor exists) and, with `ema`, an fp32 EMA of the weights, takes the state dict as the trainer does
(torch.distributed.checkpoint.state_dict, as Lightning's ModelParallelStrategy) and writes `saves`
checkpoints through framework.distributed.strategy.ShardedSaver in each of `modes`: sync, thread (DCP's
thread-based async save) and process (strategy.async_save=true: staged while the next step runs, written by a
process of its own). `shard_of=N` instead gives one rank what rank 0 of an N-rank FSDP2 job holds (the dim-0 chunk
of every parameter, its two AdamW moments and the fp32 EMA): a model too big for this host, e.g. Wan 14B on 256
ranks, measured by its per-rank shard. Reported per save, from the call: when it returned (the loop may run the
next forward and backward), when the copy to host memory was done (the optimizer step may run), when the
checkpoint was complete on disk, and its bytes; `blocked_s` is what the loop waited for, with `step_s` seconds of a
stand-in forward and backward (matrix products on the rank's cores) between the save and the optimizer step.
`prestage_blocked_s` (process): what the step after the run's first optimizer step waited for, the staging buffers
being allocated and filled once (FSDPStrategy.optimizer_step), so that no save pays for them.
"""

from __future__ import annotations

import math
import os
import queue
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

MODES = {"sync": None, "thread": "thread", "process": "process"}


@dataclass
class CheckpointBench:
    """Arguments of `python -m framework.bench checkpoint`."""

    model: str = "sana_1600m_1024"
    world_size: int = 2
    optimizer: str = "came8bit"
    """adamw or came8bit (SANA's optimizer; its 8-bit state keeps a 1.6B model within a small host's memory)."""
    ema: bool = True
    """Save an fp32 EMA of the weights beside them (plugins.ema, as the trainer's checkpoints hold it)."""
    modes: list[str] = field(default_factory=lambda: ["sync", "thread", "process"])
    """sync, thread, process or any of them: an async save stages a copy of every rank's state in host memory first,
    which a small host may not hold beside a 1.6B model's weights, EMA and optimizer state."""
    shard_of: int = 0
    """>0: each rank holds rank 0's part of a job of this many FSDP2 ranks (AdamW state and the EMA), built from the
    preset's shapes without building the model; world_size ranks write such parts."""
    step_s: float = 1.0
    """Seconds of the stand-in forward and backward between a save and the optimizer step."""
    saves: int = 3
    dir: str | None = None
    """Where the checkpoints are written (removed afterwards); null: a temporary folder."""
    out: str = "bench_checkpoint.json"

    def __post_init__(self) -> None:
        if not self.modes or set(self.modes) - set(MODES):
            raise ValueError(f"modes={list(self.modes)}: give some of {list(MODES)}, e.g. modes=[sync]")
        if self.shard_of < 0 or self.step_s < 0:
            raise ValueError(f"shard_of={self.shard_of} and step_s={self.step_s} must be >= 0")


def _sharded_model(cfg: CheckpointBench) -> tuple[dict[str, Any], dict[str, Any]]:
    """The preset sharded over the ranks with one optimizer step taken: (model state, optimizer state)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    import plugins  # noqa: F401  (registers came8bit)
    from framework.distributed.fsdp import build_meta, shard
    from framework.models.backbones import load_preset
    from framework.training.optim import OptimizerConfig, build_optimizer

    model = build_meta(load_preset(cfg.model))
    shard(model, init_device_mesh("cpu", (cfg.world_size,)), "SHARD_GRAD_OP", param_dtype=None)
    model.to_empty(device="cpu")  # the values do not matter to a save, only the bytes
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    opt = build_optimizer(list(model.parameters()), OptimizerConfig(name=cfg.optimizer, betas=[0.9, 0.999] + (
        [0.9999] if cfg.optimizer.startswith("came") else [])))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # every state tensor exists now, as after the first training step
    for p in model.parameters():
        p.grad = None  # a save happens between steps, with the gradients freed
    model_state, optim_state = get_state_dict(model, opt)
    if cfg.ema:  # an fp32 copy of each (sharded) weight, saved into the model's state as the trainer does
        model_state.update({f"ema.{n}": p.detach().clone() for n, p in model.named_parameters()})
    return model_state, optim_state


def _rank_part(cfg: CheckpointBench, rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Rank 0's part of a `shard_of`-rank job: each parameter's first dim-0 chunk, as fully_shard splits it, with
    AdamW's exp_avg and exp_avg_sq and the fp32 EMA (keys made unique per writing rank)."""
    from framework.distributed.fsdp import build_meta
    from framework.models.backbones import load_preset

    model_state, moments = {}, {}
    for name, p in build_meta(load_preset(cfg.model)).named_parameters():
        rows = math.ceil(p.shape[0] / cfg.shard_of) if p.dim() else 1
        part = torch.empty((rows, *p.shape[1:]), dtype=torch.float32).normal_(0, 0.02)
        key = f"rank{rank}.{name}"
        model_state[key] = part
        if cfg.ema:
            model_state[f"ema.{key}"] = part.clone()
        moments[f"{key}.exp_avg"], moments[f"{key}.exp_avg_sq"] = part.clone(), part.clone()
    return model_state, moments


def _busy(seconds: float) -> None:
    """A stand-in forward and backward: matrix products on this rank's cores for `seconds`."""
    a = torch.randn(512, 512)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def _rank(rank: int, cfg: CheckpointBench, port: int, folder: str, results: Any) -> None:
    from framework.distributed.strategy import ShardedSaver
    from framework.training.checkpointing import checkpoint_bytes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // cfg.world_size))
    dist.init_process_group("gloo", rank=rank, world_size=cfg.world_size)
    model_state, optim_state = _rank_part(cfg, rank) if cfg.shard_of else _sharded_model(cfg)
    rows = []
    for mode in cfg.modes:
        saver = ShardedSaver(rank, dist.barrier, async_save=MODES[mode])
        prestaged = None
        if mode == "process":
            saver.start_writer()  # as FSDPStrategy.setup does, at the start of the run
            # as FSDPStrategy.optimizer_step does after the run's first optimizer step: the buffers allocated
            saver.prestage(lambda: {"state_dict": model_state, "optimizer_0": optim_state})
            _busy(cfg.step_s)
            t1 = time.perf_counter()
            saver.wait_staged()
            prestaged = time.perf_counter() - t1
        for i in range(cfg.saves):
            path = Path(folder) / f"{mode}_{i}.ckpt"
            dist.barrier()
            t0 = time.perf_counter()
            saver.save({"state_dict": model_state, "optimizer_0": optim_state}, {"global_step": i}, path)
            returned = time.perf_counter() - t0
            _busy(cfg.step_s)  # the next step's forward and backward
            t1 = time.perf_counter()
            saver.wait_staged()  # the optimizer step waits for the copy (strategy.FSDPStrategy.optimizer_step)
            waited = time.perf_counter() - t1
            saver.finish()
            done = time.perf_counter() - t0
            if rank == 0:
                size = checkpoint_bytes(path)
                rows.append({"mode": mode, "save": i, "returned_s": returned, "blocked_s": returned + waited,
                             "complete_s": done, "bytes": size, "prestage_blocked_s": prestaged})
                shutil.rmtree(path)  # one at a time on disk
        saver.close()
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
        while True:  # a rank killed (the host's OOM killer) would leave the queue empty for good
            try:
                rows = results.get(timeout=5)
                break
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"a rank failed: exit codes {[p.exitcode for p in procs]} (-9: killed, often "
                                       "for memory: fewer modes, ema=false or a smaller model)") from None
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
        row.update(model=cfg.model, world_size=cfg.world_size, shard_of=cfg.shard_of, step_s=cfg.step_s,
                   optimizer="adamw" if cfg.shard_of else cfg.optimizer, ema=cfg.ema,
                   gib=row["bytes"] / 2**30)
    state = ("AdamW" if cfg.shard_of else cfg.optimizer) + (" + EMA" if cfg.ema else "")
    part = f"rank 0's part of a {cfg.shard_of}-rank job on each of" if cfg.shard_of else "sharded over"
    print(f"{cfg.model}, {part} {cfg.world_size} CPU ranks, {state}: seconds per save from the call (returned: the "
          f"loop runs on; blocked: what it waited for, with a {cfg.step_s} s forward and backward between the save and "
          "the optimizer step; complete: on disk; prestage_blocked: the one wait after the run's first optimizer step "
          "while the staging buffers are allocated)")
    print_table(rows, ["mode", "save", "returned_s", "blocked_s", "complete_s", "gib", "prestage_blocked_s"])
    return rows
