"""`python -m framework.bench optimizer`: optimizer-state bytes per parameter of real presets (built on
the meta device) for AdamW, CAME and CAME-8bit (plugins/came.py), and their CPU step-time ratio.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from framework.cli import print_table
from framework.bench.harness import bench_optimizer
from framework.models.backbones import build_denoiser, load_preset
from framework.training.optim import OPTIMIZERS
from plugins.came import is_8bit

BENCH_OPTIMIZERS = ("adamw", "came", "came8bit")


@dataclass
class OptimizerBench:
    """Arguments of `python -m framework.bench optimizer`."""

    presets: list[str] = field(default_factory=lambda: ["pixart_xl_2_256", "sana_1600m_1024"])
    """Presets whose optimizer state is measured (built on the meta device: any size works)."""
    timing_preset: str = "pixart_debug"
    """Preset whose optimizer step is timed on the CPU."""
    timing_steps: int = 20
    """Timed steps per optimizer."""
    out: str = "bench_optimizer.json"
    """JSON rows."""


def _state_bytes_per_param(preset: str) -> dict[str, Any]:
    """Bytes of optimizer state per parameter, from the tensors each optimizer really allocates.

    The model is built on the meta device (no memory, so the 1.6B SANA fits anywhere) and every
    optimizer takes one step on zero gradients, which allocates its state as meta tensors.
    """
    with torch.device("meta"):
        net = build_denoiser(load_preset(preset))
    params = [p for p in net.parameters() if p.requires_grad]
    eligible = {p for p in params if is_8bit(p.shape, bench_optimizer("came8bit").settings.min_8bit_size)}
    n_all, n_elig = sum(p.numel() for p in params), sum(p.numel() for p in eligible)
    row: dict[str, Any] = {"preset": preset, "params": n_all, "eligible_params": n_elig}
    for name in BENCH_OPTIMIZERS:
        for p in params:
            p.grad = torch.zeros_like(p)
        opt = OPTIMIZERS[name](params, bench_optimizer(name))
        opt.step()
        nbytes = {p: sum(v.numel() * v.element_size() for v in opt.state[p].values() if torch.is_tensor(v))
                  for p in params}
        row[name] = {
            "bytes_per_param": sum(nbytes.values()) / n_all,
            "bytes_per_eligible_param": sum(nbytes[p] for p in eligible) / max(n_elig, 1),
        }
        del opt
    for name in ("came", "came8bit"):
        row[name]["fraction_of_adamw"] = row[name]["bytes_per_param"] / row["adamw"]["bytes_per_param"]
    return row


def _step_seconds(preset: str, steps: int) -> dict[str, float]:
    """Median CPU seconds per optimizer step on a real (debug) model with fixed gradients.

    The optimizers take turns step by step, so a load change on a shared machine hits all of them.
    """
    torch.manual_seed(0)
    net = build_denoiser(load_preset(preset))
    params = [p for p in net.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opts = {name: OPTIMIZERS[name](params, bench_optimizer(name)) for name in BENCH_OPTIMIZERS}
    times: dict[str, list[float]] = {name: [] for name in opts}
    for i in range(steps + 1):
        for name, opt in opts.items():
            start = time.perf_counter()
            opt.step()
            if i > 0:  # the first step allocates the state
                times[name].append(time.perf_counter() - start)
    out = {name: statistics.median(t) for name, t in times.items()}
    min_8bit = bench_optimizer("came8bit").settings.min_8bit_size
    eligible = sum(p.numel() for p in params if is_8bit(p.shape, min_8bit))
    out["quantized_param_fraction"] = eligible / sum(p.numel() for p in params)
    return out


def optimizer_state_report(
    presets: Iterable[str] = ("pixart_xl_2_256", "sana_1600m_1024"),
    timing_preset: str = "pixart_debug",
    timing_steps: int = 20,
) -> dict[str, Any]:
    """State bytes per parameter (AdamW fp32, CAME, CAME-8bit) per preset and the CPU step-time ratios."""
    timing = _step_seconds(timing_preset, timing_steps)
    return {
        "state": [_state_bytes_per_param(p) for p in presets],
        "step_time": {"preset": timing_preset, "steps": timing_steps, "device": "cpu", **timing,
                      "came_over_adamw": timing["came"] / timing["adamw"],
                      "came8bit_over_adamw": timing["came8bit"] / timing["adamw"]},
    }


def run(cfg: OptimizerBench) -> list[dict[str, Any]]:
    """One row per preset and optimizer: state bytes per parameter, and CPU step time on timing_preset."""
    report = optimizer_state_report(cfg.presets, cfg.timing_preset, cfg.timing_steps)
    t = report["step_time"]
    rows = []
    for r in report["state"]:
        for name in BENCH_OPTIMIZERS:
            rows.append({"preset": r["preset"], "optimizer": name, "bytes_per_param": r[name]["bytes_per_param"],
                         "bytes_per_eligible_param": r[name]["bytes_per_eligible_param"],
                         "fraction_of_adamw": r[name].get("fraction_of_adamw", 1.0), "params": r["params"],
                         "eligible_params": r["eligible_params"]})
    for name in BENCH_OPTIMIZERS:
        rows.append({"preset": t["preset"], "optimizer": name, "cpu_step_ms": 1e3 * t[name],
                     "step_time_vs_adamw": t[name] / t["adamw"],
                     "quantized_param_fraction": t["quantized_param_fraction"]})
    print_table(rows[:-3], ["preset", "optimizer", "bytes_per_param", "bytes_per_eligible_param", "fraction_of_adamw"])
    print_table(rows[-3:], ["preset", "optimizer", "cpu_step_ms", "step_time_vs_adamw", "quantized_param_fraction"])
    return rows
