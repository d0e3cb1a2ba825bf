"""`python -m framework.bench norm`: plugins=[low_precision_norm] (plugins/low_precision_norm.py) against
fp32 norms: step time and peak GPU memory of the real training step. Meant for a GPU; on a CPU pass
debug presets (it still runs under bf16 autocast and reports step times only).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

from framework.bench.harness import bench_module, device_name, peak_memory_bytes, synthetic_batches, timed_fit
from framework.cli import resolve_device
from framework.models.backbones import load_preset
from plugins.low_precision_norm import LowPrecisionNorm, LowPrecisionNormConfig


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


def _fit(preset: str, swap: bool, device: torch.device, precision: str, steps: int, warmup: int,
         batch_size: int, sample_size: int | None) -> dict[str, Any]:
    """One timed fit with or without the plugin; median step time, peak GPU memory, what was swapped."""
    mcfg = load_preset(preset, **({} if sample_size is None else {"sample_size": sample_size}))
    torch.manual_seed(0)
    with torch.device(device):  # built where it trains: initialising a real-size model on the host takes minutes
        module = bench_module(mcfg)
    data = synthetic_batches(mcfg, (warmup + steps) * batch_size, text_len=77)
    cbs = [LowPrecisionNorm(LowPrecisionNormConfig())] if swap else []
    times = timed_fit(module, data, batch_size=batch_size, warmup=warmup, steps=steps, device=device,
                      precision=precision, callbacks=cbs)
    return {"preset": preset, "low_precision_norm": swap, "precision": precision, "batch_size": batch_size,
            "step_ms_median": statistics.median(times) * 1e3,
            "peak_mem_bytes": peak_memory_bytes(device) if device.type == "cuda" else None,
            "swapped": cbs[0].swapped if cbs else {}, "device": device_name(device)}


def norm_effect_report(presets: tuple[str, ...] = ("sd2_base", "pixart_xl_2_256"), steps: int = 20, warmup: int = 5,
                       batch_size: int = 8, precision: str = "bf16-mixed", device: str = "auto",
                       sample_size: int | None = None) -> list[dict[str, Any]]:
    """Per preset: step time and peak GPU memory without and with the plugin, and their ratios."""
    dev = torch.device(resolve_device(device))
    rows = []
    for preset in presets:
        base = _fit(preset, False, dev, precision, steps, warmup, batch_size, sample_size)
        lp = _fit(preset, True, dev, precision, steps, warmup, batch_size, sample_size)
        lp["step_time_vs_fp32_norms"] = lp["step_ms_median"] / base["step_ms_median"]
        if base["peak_mem_bytes"]:
            lp["peak_mem_vs_fp32_norms"] = lp["peak_mem_bytes"] / base["peak_mem_bytes"]
        rows += [base, lp]
    return rows


def format_norm_effect_report(rows: list[dict[str, Any]]) -> str:
    """The rows as a plain table, with the ratios to fp32 norms."""
    lines = [f"{'preset':<18}{'norms':<7}{'precision':<12}{'ms/step':>10}{'peak MiB':>10}{'time x':>8}{'mem x':>8}  device"]
    for r in rows:
        mem = "-" if r["peak_mem_bytes"] is None else f"{r['peak_mem_bytes'] / 2**20:.0f}"
        tx, mx = r.get("step_time_vs_fp32_norms"), r.get("peak_mem_vs_fp32_norms")
        lines.append(f"{r['preset']:<18}{'lp' if r['low_precision_norm'] else 'fp32':<7}{r['precision']:<12}"
                     f"{r['step_ms_median']:>10.2f}{mem:>10}{'-' if tx is None else format(tx, '.3f'):>8}"
                     f"{'-' if mx is None else format(mx, '.3f'):>8}  {r['device']}")
    return "\n".join(lines)


def run(cfg: NormBench) -> list[dict[str, Any]]:
    rows = norm_effect_report(tuple(cfg.presets), cfg.steps, cfg.warmup, cfg.batch_size, cfg.precision, cfg.device,
                              cfg.sample_size)
    print(format_norm_effect_report(rows))
    return [{"mode": "lp_norm" if r["low_precision_norm"] else "fp32_norm", "mfu": None, **r} for r in rows]
