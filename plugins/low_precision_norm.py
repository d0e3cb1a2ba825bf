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

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from framework.cli import resolve_device
from framework.registry import register_plugin, register_suite

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


# --------------------------------------------------------------------------------------------
# Benchmark: step time and peak memory with and without the swap
# --------------------------------------------------------------------------------------------


def _fit(preset: str, swap: bool, device: torch.device, precision: str, steps: int, warmup: int,
         batch_size: int, sample_size: int | None) -> dict[str, Any]:
    """One Lightning fit of the real training module on synthetic batches; median step time, peak memory."""
    import tempfile

    from framework.bench import _bench_module, _StepTimer, _SyntheticBatches
    from framework.models import load_preset

    mcfg = load_preset(preset, **({} if sample_size is None else {"sample_size": sample_size}))
    torch.manual_seed(0)
    module = _bench_module(mcfg, None)
    C, S, D = mcfg.in_channels, mcfg.sample_size, mcfg.text_dim or 1
    data = _SyntheticBatches((warmup + steps) * batch_size, C, S, D, 77, mcfg.num_classes, None)
    timer = _StepTimer(warmup)
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    cbs = [LowPrecisionNorm(LowPrecisionNormConfig())] if swap else []
    trainer = pl.Trainer(accelerator="gpu" if on_gpu else "cpu", devices=1, precision=precision,
                         max_steps=warmup + steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[*cbs, timer],
                         default_root_dir=tempfile.mkdtemp(prefix="lf-lpn-bench-"))
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=batch_size))
    return {"preset": preset, "low_precision_norm": swap, "precision": precision, "batch_size": batch_size,
            "step_ms_median": statistics.median(timer.times) * 1e3,
            "peak_mem_bytes": torch.cuda.max_memory_allocated(device) if on_gpu else None,
            "swapped": cbs[0].swapped if cbs else {},
            "device": torch.cuda.get_device_name(device) if on_gpu else "cpu"}


def norm_effect_report(presets: tuple[str, ...] = ("sd2_base", "pixart_xl_2_256"), steps: int = 20, warmup: int = 5,
                       batch_size: int = 8, precision: str = "bf16-mixed", device: str = "auto",
                       sample_size: int | None = None, out: str | None = None) -> list[dict[str, Any]]:
    """Per preset: step time and peak GPU memory without and with the plugin, and their ratios.

    Meant for a GPU (peak memory is torch.cuda.max_memory_allocated). On a CPU it still runs under
    bf16 autocast (use a debug preset) and reports step times only.
    """
    import json

    dev = torch.device(resolve_device(device))
    rows = []
    for preset in presets:
        base = _fit(preset, False, dev, precision, steps, warmup, batch_size, sample_size)
        lp = _fit(preset, True, dev, precision, steps, warmup, batch_size, sample_size)
        lp["step_time_vs_fp32_norms"] = lp["step_ms_median"] / base["step_ms_median"]
        if base["peak_mem_bytes"]:
            lp["peak_mem_vs_fp32_norms"] = lp["peak_mem_bytes"] / base["peak_mem_bytes"]
        rows += [base, lp]
    if out is not None:
        Path(out).write_text(json.dumps(rows, indent=2))
    return rows


def format_norm_effect_report(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'preset':<18}{'norms':<7}{'precision':<12}{'ms/step':>10}{'peak MiB':>10}{'time x':>8}{'mem x':>8}  device"]
    for r in rows:
        mem = "-" if r["peak_mem_bytes"] is None else f"{r['peak_mem_bytes'] / 2**20:.0f}"
        tx, mx = r.get("step_time_vs_fp32_norms"), r.get("peak_mem_vs_fp32_norms")
        lines.append(f"{r['preset']:<18}{'lp' if r['low_precision_norm'] else 'fp32':<7}{r['precision']:<12}"
                     f"{r['step_ms_median']:>10.2f}{mem:>10}{'-' if tx is None else format(tx, '.3f'):>8}"
                     f"{'-' if mx is None else format(mx, '.3f'):>8}  {r['device']}")
    return "\n".join(lines)


# `python -m framework.bench norm`
@dataclass
class NormBench:
    """Arguments of `python -m framework.bench norm` (meant for a GPU; on a CPU pass debug presets)."""

    presets: list[str] = field(default_factory=lambda: ["sd2_base", "pixart_xl_2_256"])
    steps: int = 20
    warmup: int = 5
    batch_size: int = 8
    precision: str = "bf16-mixed"
    device: str = "auto"
    sample_size: int | None = None
    out: str = "bench_norm.json"


def _bench_norm(cfg: NormBench) -> list[dict[str, Any]]:
    rows = norm_effect_report(tuple(cfg.presets), cfg.steps, cfg.warmup, cfg.batch_size, cfg.precision, cfg.device, cfg.sample_size)
    print(format_norm_effect_report(rows))
    return [{"mode": "lp_norm" if r["low_precision_norm"] else "fp32_norm", "mfu": None, **r} for r in rows]


register_suite("norm", NormBench, _bench_norm)


if __name__ == "__main__":  # python -m plugins.low_precision_norm: the report on this machine
    import sys

    presets = tuple(sys.argv[1:]) or (("sd2_base", "pixart_xl_2_256") if torch.cuda.is_available() else ("sd2_unet_debug", "pixart_debug"))
    print(format_norm_effect_report(norm_effect_report(presets)))
