"""What a training run will hold in memory, predicted before its first step, and a refusal when it cannot fit.

The training state dominates at real sizes and is known from the parameters: fp32 weights and gradients
(4 bytes each a parameter), the optimizer's state as the optimizer allocates it for each parameter's shape
(framework.training.optim.OPTIMIZER_STATE; AdamW: two fp32 moments, 8 bytes; CAME: its first moment and factored
second moments, about 4; CAME-8bit: 8-bit first moment with block scales, about 1) and the EMA's fp32
copy (4), each divided over the ranks that shard it under strategy=fsdp; AdamW's step makes one more
parameter-sized temporary (the square root of its second moment). The activations kept for the backward are
estimated from the batch, the tokens and the width (a transformer block keeps about ACTIVATION_FACTOR values a token
and hidden unit, one block's worth under activation checkpointing). docs/training.md "Memory" has the measured
peaks this is checked against.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

GIB = 2**30
ACTIVATION_FACTOR = 40  # values kept a token and hidden unit by one transformer block for its backward (fp32)
PROCESS_BYTES = 1.0 * GIB  # the interpreter, torch, the libraries and the loader: measured at about 0.9 GiB


@dataclass
class MemoryPlan:
    """Predicted bytes by part, for one rank."""

    parts: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def describe(self) -> str:
        return ", ".join(f"{name} {value / GIB:.1f}" for name, value in self.parts.items()) + \
            f" (GiB; total {self.total / GIB:.1f})"


def predict(params: int, trainable: int, *, optimizer: str, ema: bool, shards: int, batch: int, tokens: int,
            width: int, layers: int, checkpointing: bool, precision: str, frozen_bytes: float = 4.0,
            state_bytes: float | None = None) -> MemoryPlan:
    """One rank's predicted peak: the process, the weights (trainable ones fp32, frozen ones `frozen_bytes` each: 2 for
    an adapter's bf16 base), gradients, optimizer state (`state_bytes` for all the trainable parameters; None: AdamW's
    8 bytes each) and EMA of the trainable ones (over `shards` ranks under fsdp, 1 otherwise), AdamW's step temporary,
    and the activations of `batch` samples of `tokens` tokens of `width` through `layers` blocks (bf16 halves them;
    checkpointing keeps one block's and each block's input)."""
    state = 8.0 * trainable if state_bytes is None else state_bytes
    per_value = 2 if precision.startswith("bf16") or precision.startswith("16") else 4
    kept = ACTIVATION_FACTOR + layers if checkpointing else ACTIVATION_FACTOR * layers
    parts = {
        "process": PROCESS_BYTES,
        "weights": (4.0 * trainable + frozen_bytes * (params - trainable)) / shards,
        "gradients": 4.0 * trainable / shards,
        "optimizer": state / shards,
        "ema": 4.0 * trainable / shards if ema else 0.0,
        "optimizer step": 0.0 if optimizer in ("came", "came8bit") else 4.0 * trainable / shards,
        "activations": float(per_value * batch * tokens * width * kept),
    }
    return MemoryPlan({k: v for k, v in parts.items() if v})


def available_bytes(device: Any) -> tuple[float, str]:
    """(bytes, what they are) of the memory a rank trains in: its GPU's, or the host's RAM for a CPU run."""
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory), f"the GPU's ({torch.cuda.get_device_name(device)})"
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "the host's RAM"


LOWER_IT = ("strategy=fsdp over more devices (shards weights, gradients, optimizer state and EMA)",
            "optimizer=came8bit (about 1 byte of state a parameter instead of AdamW's 8)",
            "plugins without ema (4 bytes a parameter)",
            "strategy.activation_checkpointing=true", "a smaller data.batch_size (trainer.accumulate_grad_batches or "
            "data.global_batch_size keep the global batch)", "trainer.precision=bf16-mixed")


def plan_run(cfg: Any, world_size: int, precision: str, on_gpu: bool = False,
             micro_batch: int | None = None) -> MemoryPlan:
    """The prediction for a composed TrainConfig on `world_size` ranks at `precision` (the run's, its default
    resolved), the model built on the meta device to count its parameters; `on_gpu`: whether the ranks train on GPUs
    (adapter.offload_blocks then moves the blocks' frozen weights off the device); `micro_batch`: a device's batch
    (the run plan's; data.batch_size when None)."""
    from framework.distributed.fsdp import build_meta
    from framework.models.backbones import to_model_config
    from framework.training.optim import state_bytes

    model_cfg = to_model_config(cfg.model)
    model = build_meta(model_cfg)
    params = sum(p.numel() for p in model.parameters())
    trainable, frozen_bytes = params, 4.0
    adapter = getattr(cfg, "adapter", None)
    if adapter is not None and adapter.on:  # the adapter trains; the base is held at adapter.base_dtype
        from framework.distributed.fsdp import shard_units
        from framework.models.adapters import add_adapter, frozen_bytes_per_param

        trainable = add_adapter(model, adapter)
        params = sum(p.numel() for p in model.parameters())
        frozen_bytes = frozen_bytes_per_param(model, adapter, shard_units(model), on_gpu)
    devices = cfg.trainer.devices if isinstance(cfg.trainer.devices, int) and cfg.trainer.devices > 0 else world_size
    shards = 1
    if cfg.strategy.name == "fsdp":
        shards = devices if cfg.strategy.sharding == "HYBRID_SHARD" else world_size
    state = state_bytes(cfg.optimizer, (tuple(p.shape) for p in model.parameters() if p.requires_grad))
    return predict_model(model_cfg, params, trainable, optimizer=cfg.optimizer.name, ema="ema" in (cfg.plugins or {}),
                         state_bytes=state, shards=shards, batch=micro_batch or cfg.data.batch_size,
                         checkpointing=cfg.strategy.activation_checkpointing, precision=precision, frozen_bytes=frozen_bytes)


def predict_model(model_cfg: Any, params: int, trainable: int, **kwargs: Any) -> MemoryPlan:
    """predict() for a backbone of `model_cfg` (a ModelConfig): its tokens a sample, width and depth read off the
    config; `kwargs`: predict's others (optimizer, ema, shards, batch, checkpointing, precision, frozen_bytes)."""
    from framework.models.families import family_of

    h, w = model_cfg.latent_hw
    transformer = family_of(model_cfg).estimates_activations  # the UNet's activations are not estimated here
    return predict(params, trainable, tokens=(h // model_cfg.patch_size) * (w // model_cfg.patch_size),
                   width=model_cfg.hidden_size if transformer else 0, layers=model_cfg.num_layers, **kwargs)


def check(plan: MemoryPlan, limit: float, what: str) -> None:
    """Refuse a run whose predicted peak exceeds `limit` bytes, with the prediction and the keys that lower it."""
    if plan.total > limit:
        raise MemoryError(f"this run is predicted to need {plan.total / GIB:.1f} GiB a rank, more than {what} "
                          f"{limit / GIB:.1f} GiB: {plan.describe()}. Lower it with: " + "; ".join(LOWER_IT) +
                          ". trainer.memory_limit_gb sets the limit checked (0: no check).")
