"""`plugins=[low_precision_norm]`: normalization layers computed in the autocast dtype.

Under bf16/fp16 autocast PyTorch runs layer_norm and group_norm in fp32 (they are on autocast's
fp32 list), and diffusers' RMSNorm upcasts to fp32 by hand: each norm reads and writes fp32
activations and adds cast kernels around itself. MosaicML's low-precision LayerNorm/GroupNorm
(Composer's LPLayerNorm, LPGroupNorm) run them in the autocast dtype instead; the kernels still
accumulate their statistics in fp32 internally, only their inputs and outputs are half precision.

The swap changes each norm module's class in place (the subclasses below add no state), so the
module, its Parameters (same objects, same dtype) and the state-dict keys stay what they were:
checkpoints load either way, and an optimizer built later sees exactly the same tensors. It runs
in the callback's setup() hook, before configure_model shards the model and before
configure_optimizers. Outside autocast every swapped norm runs its parent's forward unchanged,
and in a run without mixed precision the plugin warns and changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from framework.training.registry import register_plugin

MIXED_PRECISIONS = ("bf16-mixed", "16-mixed")  # Lightning precisions that run under autocast

# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


@dataclass
class LowPrecisionNormConfig:
    """Fields of `plugins.low_precision_norm.*`."""

    layer_norm: bool = True
    """Swap torch.nn.LayerNorm."""
    group_norm: bool = True
    """Swap torch.nn.GroupNorm (the UNet's ResNet and attention blocks)."""
    rms_norm: bool = True
    """Swap diffusers' RMSNorm (SANA) and torch.nn.RMSNorm."""


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype active for x's device, or None outside autocast."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


# --------------------------------------------------------------------------------------------
# The low-precision norms (subclasses with no extra state, so a class swap is enough)
# --------------------------------------------------------------------------------------------


class LPLayerNorm(nn.LayerNorm):
    """LayerNorm in the autocast dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _autocast_dtype(x)
        if dtype is None:
            return super().forward(x)
        with torch.autocast(x.device.type, enabled=False):  # else autocast re-casts to fp32
            return F.layer_norm(x.to(dtype), self.normalized_shape, _cast(self.weight, dtype), _cast(self.bias, dtype), self.eps)


class LPGroupNorm(nn.GroupNorm):
    """GroupNorm in the autocast dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _autocast_dtype(x)
        if dtype is None:
            return super().forward(x)
        with torch.autocast(x.device.type, enabled=False):
            return F.group_norm(x.to(dtype), self.num_groups, _cast(self.weight, dtype), _cast(self.bias, dtype), self.eps)


class LPDiffusersRMSNorm(DiffusersRMSNorm):
    """diffusers' RMSNorm (normalized over the last dim, optional bias) in the autocast dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _autocast_dtype(x)
        if dtype is None:
            return super().forward(x)
        with torch.autocast(x.device.type, enabled=False):
            y = F.rms_norm(x.to(dtype), x.shape[-1:], _cast(self.weight, dtype), self.eps)  # (..., D)
            return y if self.bias is None else y + self.bias.to(dtype)


class LPRMSNorm(nn.RMSNorm):
    """torch.nn.RMSNorm in the autocast dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _autocast_dtype(x)
        if dtype is None:
            return super().forward(x)
        with torch.autocast(x.device.type, enabled=False):
            return F.rms_norm(x.to(dtype), self.normalized_shape, _cast(self.weight, dtype), self.eps)


SWAPS: dict[str, dict[type, type]] = {
    "layer_norm": {nn.LayerNorm: LPLayerNorm},
    "group_norm": {nn.GroupNorm: LPGroupNorm},
    "rms_norm": {DiffusersRMSNorm: LPDiffusersRMSNorm, nn.RMSNorm: LPRMSNorm},
}


def apply_low_precision_norms(model: nn.Module, layer_norm: bool = True, group_norm: bool = True,
                              rms_norm: bool = True) -> dict[str, int]:
    """Swap the norm classes of `model` in place; returns how many of each kind were swapped.

    Only exact classes are swapped: a subclass (a model's own norm) may compute something else.
    """
    enabled = {"layer_norm": layer_norm, "group_norm": group_norm, "rms_norm": rms_norm}
    table = {src: dst for kind, pairs in SWAPS.items() if enabled[kind] for src, dst in pairs.items()}
    counts = {kind: 0 for kind in SWAPS}
    for m in model.modules():
        dst = table.get(type(m))
        if dst is not None:
            m.__class__ = dst
            counts[next(k for k, pairs in SWAPS.items() if dst in pairs.values())] += 1
    return counts


# --------------------------------------------------------------------------------------------
# The callback
# --------------------------------------------------------------------------------------------


class LowPrecisionNorm(pl.Callback):
    """Swaps the denoiser's norms in setup(): before sharding and before the optimizer is built."""

    def __init__(self, cfg: LowPrecisionNormConfig) -> None:
        self.cfg = cfg
        self.swapped: dict[str, int] = {}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        precision = str(trainer.precision)
        if precision not in MIXED_PRECISIONS:
            rank_zero_warn(f"plugins=[low_precision_norm] does nothing with trainer.precision={precision}: it only"
                           f" changes norms under autocast ({' or '.join(MIXED_PRECISIONS)}); the model is unchanged.")
            return
        c = self.cfg
        self.swapped = apply_low_precision_norms(pl_module.model, c.layer_norm, c.group_norm, c.rms_norm)


def build(cfg: LowPrecisionNormConfig, run_cfg: Any) -> LowPrecisionNorm:
    return LowPrecisionNorm(cfg)


register_plugin("low_precision_norm", LowPrecisionNormConfig, build)
