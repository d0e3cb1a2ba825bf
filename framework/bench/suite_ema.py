"""`python -m framework.bench ema`: what plugins=[ema] (plugins/ema.py) costs per training step before
its start and after it, and the memory it holds.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch

from framework.bench.harness import bench_module, synthetic_batches, timed_fit
from framework.distributed.dtensor import local_tensor
from framework.models.backbones import load_preset
from framework.training.module import DiffusionModule
from plugins.ema import EMA, EMAConfig


@dataclass
class EMABench:
    """Arguments of `python -m framework.bench ema`."""

    preset: str = "pixart_debug"
    steps: int = 20
    warmup: int = 3
    batch_size: int = 8
    rounds: int = 2
    out: str = "bench_ema.json"


def _fit(preset: str, callbacks: list[pl.Callback], steps: int, warmup: int,
         batch_size: int) -> tuple[list[float], DiffusionModule]:
    """Seconds per optimizer step of the real training module (CPU, fp32, synthetic batches), and the module."""
    mcfg = load_preset(preset)
    torch.manual_seed(0)
    module = bench_module(mcfg)
    data = synthetic_batches(mcfg, (warmup + steps) * batch_size, text_len=16)
    times = timed_fit(module, data, batch_size=batch_size, warmup=warmup, steps=steps, device=torch.device("cpu"),
                      callbacks=callbacks)
    return times, module


def ema_cost_report(preset: str = "pixart_debug", steps: int = 20, warmup: int = 3, batch_size: int = 8,
                    rounds: int = 2) -> dict[str, Any]:
    """Median step time without the plugin, with it before its start, and after it (update every step).

    The EMA callback runs before the step timer's end hook, so its update is inside the timed step.
    The three fits take turns for `rounds` rounds and each keeps its best median (a shared machine's
    load swings more than the EMA costs). Also: bytes the EMA holds before and after the start, the
    per-step hook before the start alone, and one update alone (medians of 200 and 20 calls).
    """
    total = warmup + steps
    make = {"no_ema": lambda: [], "before_start": lambda: [EMA(EMAConfig(start=10 * total))],
            "after_start": lambda: [EMA(EMAConfig(start=0))]}
    report: dict[str, Any] = {"preset": preset, "device": "cpu", "steps": steps, "batch_size": batch_size,
                              "rounds": rounds}
    last: dict[str, tuple[list[EMA], DiffusionModule]] = {}
    for _ in range(rounds):
        for name, cbs_of in make.items():
            cbs = cbs_of()
            times, module = _fit(preset, cbs, steps, warmup, batch_size)
            last[name] = cbs, module
            ms = statistics.median(times) * 1e3
            report[f"{name}_step_ms"] = min(ms, report.get(f"{name}_step_ms", ms))
            if cbs:
                ema = cbs[0].ema or {}
                report[f"{name}_ema_bytes"] = sum(local_tensor(t).numel() * t.element_size() for t in ema.values())
    (idle,), module = last["before_start"]
    hook_times = []
    for _ in range(200):
        t0 = time.perf_counter()
        idle.maybe_update(module.trainer, module)
        hook_times.append(time.perf_counter() - t0)
    report["before_start_hook_us"] = statistics.median(hook_times) * 1e6
    (ema,), module = last["after_start"]
    model = module.model
    report["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    update_times = []
    for _ in range(20):
        t0 = time.perf_counter()
        ema.update(model, ema.last_step + 1)
        update_times.append(time.perf_counter() - t0)
    report["update_ms"] = statistics.median(update_times) * 1e3
    report["before_start_overhead"] = report["before_start_step_ms"] / report["no_ema_step_ms"] - 1
    report["after_start_overhead"] = report["after_start_step_ms"] / report["no_ema_step_ms"] - 1
    return report


def format_ema_cost_report(r: dict[str, Any]) -> str:
    """The report as a few plain lines."""
    return "\n".join([
        f"EMA cost, {r['preset']} on {r['device']}, batch {r['batch_size']}, median of {r['steps']} steps:",
        f"  no plugin          {r['no_ema_step_ms']:8.2f} ms/step",
        f"  before start       {r['before_start_step_ms']:8.2f} ms/step ({r['before_start_overhead']:+.1%}),"
        f" EMA bytes {r['before_start_ema_bytes']}",
        f"  after start        {r['after_start_step_ms']:8.2f} ms/step ({r['after_start_overhead']:+.1%}),"
        f" EMA bytes {r['after_start_ema_bytes']} (trainable params {r['param_bytes']} bytes)",
        f"  one update alone   {r['update_ms']:8.3f} ms; the hook before the start alone {r['before_start_hook_us']:.2f} us",
    ])


def run(cfg: EMABench) -> list[dict[str, Any]]:
    r = ema_cost_report(cfg.preset, cfg.steps, cfg.warmup, cfg.batch_size, cfg.rounds)
    print(format_ema_cost_report(r))
    return [{"mode": "ema_cost", "mfu": None, "peak_mem_bytes": None, **r}]
