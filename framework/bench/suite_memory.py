"""`python -m framework.bench memory`: per-rank parameter + gradient + optimizer bytes under single and
fsdp, measured on the real sharded tensors of a meta-device model on a fake process group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from framework.cli import print_table
from framework.distributed.dtensor import local_tensor
from framework.models.backbones import ModelConfig, build_denoiser, load_preset
from framework.distributed.fsdp import shard, shard_units


@dataclass
class MemoryBench:
    """Arguments of `python -m framework.bench memory`: per-rank bytes from really sharded tensors."""

    model: str = "pixart_xl_2_256"
    world_sizes: list[int] = field(default_factory=lambda: [1, 2, 8])
    out: str = "bench_memory.json"


def sharded_memory_report(model_cfg: ModelConfig, world_size: int, sharding: str = "SHARD_GRAD_OP",
                          param_bytes: int = 4, optimizer_states: int = 2, compute_bytes: int = 2) -> dict[str, Any]:
    """Bytes per rank of parameters, gradients and AdamW state for `model_cfg`.

    world_size 1 is the unsharded model. Otherwise the model is built on the meta device and
    fully_shard'ed (framework.distributed.fsdp.shard) on a fake process group of `world_size` ranks in this
    one process; the numbers are sums of each parameter's local shard (rank 0's, the largest under
    uneven splits). `peak_gathered_params_bytes` is the extra memory for unsharded parameters held
    during a step (in the `compute_bytes` dtype, bf16 under mixed precision): FULL_SHARD gathers one
    block at a time (the largest block, doubled for prefetch of the next one); SHARD_GRAD_OP keeps
    every block gathered from its forward to its backward, so at the forward/backward turn it holds them all.
    """
    with torch.device("meta"):
        model = build_denoiser(model_cfg)
    units = shard_units(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    full = sum(p.numel() for p in trainable)
    unit_sizes = [sum(p.numel() for p in u.parameters()) for u in units]
    if world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
        try:
            shard(model, init_device_mesh("cpu", (world_size,)), sharding, param_dtype=None)
            local = sum(local_tensor(p).numel() for p in model.parameters() if p.requires_grad)
        finally:
            dist.destroy_process_group()
        if sharding == "FULL_SHARD":
            gathered = 2 * max(unit_sizes) + (full - sum(unit_sizes))  # the root's own params stay gathered
        else:
            gathered = full
    else:
        local, gathered = full, 0
    report = {
        "model": getattr(model_cfg, "name", "?"), "world_size": world_size,
        "sharding": sharding if world_size > 1 else "none", "params": full, "local_params": local,
        "param_bytes": local * param_bytes, "grad_bytes": local * param_bytes,
        "optimizer_bytes": local * 4 * optimizer_states,  # AdamW: exp_avg + exp_avg_sq in fp32
        "peak_gathered_params_bytes": gathered * compute_bytes,
    }
    report["total_bytes"] = report["param_bytes"] + report["grad_bytes"] + report["optimizer_bytes"]
    return report


def run(cfg: MemoryBench) -> list[dict[str, Any]]:
    mcfg = load_preset(cfg.model)
    rows = []
    for w in cfg.world_sizes:
        for sharding in ["none"] if w == 1 else ["SHARD_GRAD_OP", "FULL_SHARD"]:
            r = sharded_memory_report(mcfg, w, "SHARD_GRAD_OP" if sharding == "none" else sharding)
            rows.append({"mode": f"{w} rank{'s' * (w > 1)} {sharding}", "mfu": None, **r})
    cols = [c for c in rows[0] if c not in ("mfu",) and not isinstance(rows[0][c], (dict, list))]
    print_table(rows, cols)
    return rows
