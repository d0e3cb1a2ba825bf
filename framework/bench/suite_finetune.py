"""`python -m framework.bench finetune`: peak memory and samples/s of fine-tuning a preset whole, with a LoRA on its
frozen weights, and with a LoRA on a frozen base held in bf16, in int8 (torchao), or in bf16 with its blocks offloaded
to the host (framework/models/adapters.py), each arm a fresh process; beside each measured peak, the prediction
framework.train prints before the first step (framework/training/memory.py).

On a GPU the peak is torch's allocated peak (the prediction without its process part); on a CPU the process's peak
resident memory (the whole prediction; offloading saves nothing there, the host being the device). Every arm computes
in bf16-mixed on a GPU; on a CPU the fp32 and int8 arms run 32-true (the CPU default) and the bf16-base arms
bf16-mixed, which their base needs. The offload arm checkpoints activations, which offloading needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from framework.cli import print_table

ARMS = {  # arm -> (adapter kind, base dtype, blocks offloaded)
    "full": ("none", "fp32", False),
    "lora": ("lora", "fp32", False),
    "lora_bf16": ("lora", "bf16", False),
    "lora_int8": ("lora", "int8", False),
    "lora_bf16_offload": ("lora", "bf16", True),
}


@dataclass
class FinetuneBench:
    """Arguments of `python -m framework.bench finetune`."""

    model: str = "pixart_xl_2_256"
    """A preset (conf/model/)."""
    arms: list[str] = field(default_factory=lambda: list(ARMS))
    """full (every weight trains, AdamW), lora (rank `rank` on the family's default targets), lora_bf16 (the same on
    a bf16 base), lora_int8 (on an int8 base), lora_bf16_offload (on a bf16 base whose blocks live on the host)."""
    rank: int = 16
    batch_size: int = 1
    warmup: int = 1
    steps: int = 2
    activation_checkpointing: bool = False
    device: str = "auto"
    """auto (cuda when present), cuda or cpu."""
    out: str = "bench_finetune.json"

    def __post_init__(self) -> None:
        unknown = set(self.arms) - set(ARMS)
        if unknown:
            raise ValueError(f"arms={self.arms}: {sorted(unknown)} unknown; choose from {', '.join(ARMS)}")


def _arm(cfg: FinetuneBench, arm: str, out: str) -> None:
    """One arm in its own (spawned) process: build, predict, time a fit, write the row."""
    import json

    from framework.bench.harness import bench_device, bench_optimizer, measure_fit
    from framework.distributed.fsdp import prepare_blocks, shard_units
    from framework.models.adapters import AdapterConfig, frozen_bytes_per_param
    from framework.models.backbones import load_preset
    from framework.models.objectives import ObjectiveConfig
    from framework.training.memory import GIB, PROCESS_BYTES, predict_model
    from framework.training.module import DiffusionModule

    device = bench_device(cfg.device)
    kind, base_dtype, offload = ARMS[arm]
    precision = "bf16-mixed" if device.type == "cuda" or base_dtype == "bf16" else "32-true"
    checkpointing = cfg.activation_checkpointing or offload
    model_cfg = load_preset(cfg.model)
    torch.manual_seed(0)
    adapter = AdapterConfig(kind=kind, rank=cfg.rank, base_dtype=base_dtype, offload_blocks=offload)
    module = DiffusionModule(model_cfg, ObjectiveConfig(name="flow"), bench_optimizer(), max_steps=10**6, adapter=adapter)
    module.empty_text = torch.zeros(1, model_cfg.text_dim or 1)
    prepare_blocks(module.model, checkpointing, False)
    params = sum(p.numel() for p in module.model.parameters())
    trainable = sum(p.numel() for p in module.model.parameters() if p.requires_grad)
    plan = predict_model(model_cfg, params, trainable, optimizer="adamw", ema=False, shards=1, batch=cfg.batch_size,
                         checkpointing=checkpointing, precision=precision,
                         frozen_bytes=frozen_bytes_per_param(module.model, adapter, shard_units(module.model),
                                                             device.type == "cuda") if kind != "none" else 4.0)
    row = measure_fit(module, model_cfg, batch_size=cfg.batch_size, warmup=cfg.warmup, steps=cfg.steps, device=device,
                      precision=precision)
    predicted = plan.total - (PROCESS_BYTES if device.type == "cuda" else 0.0)
    row.update({"model": cfg.model, "arm": arm, "params": params, "trainable": trainable,
                "activation_checkpointing": checkpointing, "peak_gib": row["peak_mem_bytes"] / GIB,
                "predicted_gib": predicted / GIB, "measured_over_predicted": row["peak_mem_bytes"] / predicted})
    Path(out).write_text(json.dumps(row))


def run(cfg: FinetuneBench) -> list[dict[str, Any]]:
    from framework.bench.fresh import in_fresh_processes

    rows = in_fresh_processes(_arm, cfg, cfg.arms, "lf-finetune-")  # each arm a fresh process: the peak is per process
    print_table(rows, ["model", "arm", "precision", "trainable", "samples_per_s", "step_ms_median", "peak_gib",
                       "predicted_gib", "measured_over_predicted", "device"])
    return rows
