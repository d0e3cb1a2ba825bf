"""`python -m framework.bench gpu`: in one run, the figures of the README's GPU table. Per family at its real size
(batch filled to the GPU unless given): samples/s, MFU and peak memory of the real bf16 training step; then, on
one preset at that batch, what each switch costs or saves: EMA, CAME-8bit instead of AdamW, low-precision norms,
torch.compile per block, activation checkpointing. SANA-1600M at 1024 px also runs with CAME-8bit and activation
checkpointing together (the setting meant to fit one 80 GB GPU).

Writes the rows as JSON (`out`), the table as Markdown (`markdown`), and replaces the block between
`<!-- gpu-bench:begin -->` and `<!-- gpu-bench:end -->` of `readme`. `render=ROWS.json` only renders the table of
an earlier run (e.g. one made on a GPU machine and copied back). Meant for a GPU; on a CPU pass debug presets
and batch sizes (launch/gpu_check.sh runs it with the GPU tier).
"""

from __future__ import annotations

import datetime
import gc
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import plugins.came  # noqa: F401  (registers optimizer=came8bit)
from framework.bench.harness import bench_module, measure_fit
from framework.cli import print_table, resolve_device
from framework.distributed.fsdp import prepare_blocks
from framework.models.backbones import load_preset
from plugins.ema import EMA, EMAConfig
from plugins.low_precision_norm import LowPrecisionNorm, LowPrecisionNormConfig

FAMILIES = ["pixart_xl_2_256", "sana_1600m_1024", "dit_xl_2_256", "sd2_base", "wan21_t2v_1_3b"]
# Presets measured with switches of their own instead of the plain step: Wan 2.1's 81 frames at 480x832 are 32,760
# tokens a clip, whose activations (about 2 GB a block in bf16, 30 blocks) with 23 GB of fp32 weights, gradients and
# AdamW state exceed an 80 GB GPU at one clip: it trains with activation checkpointing, as Wan's own code does.
FAMILY_SWITCHES: dict[str, dict[str, Any]] = {"wan21_t2v_1_3b": {"label": "act_ckpt", "act_ckpt": True}}
# The switches measured on `switches_preset`, each against that preset's plain row: label -> Variant fields.
SWITCHES: dict[str, dict[str, Any]] = {
    "ema": {"ema": True},
    "came8bit": {"optimizer": "came8bit"},
    "lp_norm": {"lp_norm": True},
    "compile": {"compile": True},
    "act_ckpt": {"act_ckpt": True},
}
BEGIN, END = "<!-- gpu-bench:begin -->", "<!-- gpu-bench:end -->"


@dataclass
class GPUBench:
    """Arguments of `python -m framework.bench gpu`."""

    families: list[str] = field(default_factory=lambda: list(FAMILIES))
    """One preset per family, at its real size."""
    switches_preset: str = "pixart_xl_2_256"
    """The preset each switch (EMA, CAME-8bit, low-precision norms, compile, activation checkpointing) is measured on."""
    switches: list[str] = field(default_factory=lambda: list(SWITCHES))
    """Which switches to measure (a subset of ema, came8bit, lp_norm, compile, act_ckpt)."""
    batch_size: int | None = None
    """Micro-batch of every preset; null: per preset, the largest power of two whose step fits in `fill` of the
    GPU's memory (on a CPU: 8)."""
    fill: float = 0.9
    """Fraction of the GPU's memory a filled batch may peak at."""
    max_batch: int = 1024
    """The largest batch tried when filling."""
    warmup: int = 5
    """Untimed steps first (allocation, autotuning, compilation)."""
    steps: int = 20
    """Timed steps."""
    precision: str = "bf16-mixed"
    device: str = "auto"
    out: str = "bench_gpu.json"
    markdown: str | None = None
    """Also write the table as Markdown here."""
    readme: str | None = None
    """Replace this file's gpu-bench block (README.md) with the table."""
    render: str | None = None
    """Rows from an earlier run (its `out`): render them only, measure nothing."""


@dataclass
class Variant:
    """One configuration of the training step."""

    preset: str
    label: str = "plain"
    optimizer: str = "adamw"
    ema: bool = False
    lp_norm: bool = False
    compile: bool = False
    act_ckpt: bool = False


def _clear(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(v: Variant, batch_size: int, device: torch.device, precision: str, warmup: int, steps: int) -> dict[str, Any]:
    """The real training module for `v`, timed on synthetic batches (framework.bench.harness.measure_fit)."""
    mcfg = load_preset(v.preset)
    torch.manual_seed(0)
    with torch.device(device):  # built where it trains: initialising a real-size model on the host takes long
        module = bench_module(mcfg, optimizer=v.optimizer)
    prepare_blocks(module.model, activation_checkpointing=v.act_ckpt, compile=v.compile)
    params = sum(p.numel() for p in module.model.parameters())
    callbacks = ([EMA(EMAConfig(start=0))] if v.ema else []) + ([LowPrecisionNorm(LowPrecisionNormConfig())] if v.lp_norm else [])
    try:
        row = measure_fit(module, mcfg, batch_size=batch_size, warmup=warmup, steps=steps, device=device,
                          precision=precision, callbacks=callbacks)
    finally:
        del module, callbacks
        _clear(device)
    return {"label": v.label, "preset": v.preset, "optimizer": v.optimizer, "ema": v.ema, "lp_norm": v.lp_norm,
            "compile": v.compile, "act_ckpt": v.act_ckpt, "params": params, **row}


class DoesNotFit(RuntimeError):
    """Not even one sample's training step fits in the GPU's memory."""


def fill_batch(v: Variant, device: torch.device, precision: str, fill: float, max_batch: int) -> int:
    """The largest power-of-two batch whose training step peaks within `fill` of the GPU's memory; 8 on a CPU.

    Two short fits (batch 8 and 16) give the memory that does not grow with the batch and the memory per sample;
    the batch they predict is then run, and halved while it does not fit."""
    if device.type != "cuda":
        return 8
    total = torch.cuda.get_device_properties(device).total_memory
    budget = fill * total

    def peak(batch: int) -> float | None:
        try:
            got = measure(v, batch, device, precision, warmup=1, steps=1)["peak_mem_bytes"]
        except torch.cuda.OutOfMemoryError:
            _clear(device)
            return None
        print(f"[bench gpu] {v.preset} {v.label}: batch {batch} peaks at {got / 2**30:.1f} GiB of {total / 2**30:.0f}")
        return got

    p8, p16 = peak(8), peak(16)
    if p8 is None or p8 > budget:
        batch = 4
    elif p16 is None or p16 > budget:
        return 8
    else:
        per_sample = max((p16 - p8) / 8, 1.0)
        fixed = p8 - 8 * per_sample
        batch = 2 ** int(math.log2(max((budget - fixed) / per_sample, 16)))
    batch = min(batch, max_batch)
    while batch >= 1:
        got = peak(batch)
        if got is not None and got <= budget:
            return batch
        batch //= 2
    raise DoesNotFit(f"{v.preset} ({v.label}): even batch 1 does not fit in {fill:.0%} of the GPU's memory")


def run_rows(cfg: GPUBench) -> list[dict[str, Any]]:
    device = torch.device(resolve_device(cfg.device))
    unknown = set(cfg.switches) - set(SWITCHES)
    if unknown:
        raise ValueError(f"switches={sorted(unknown)}: choose from {sorted(SWITCHES)}")
    variants = [Variant(p, **FAMILY_SWITCHES.get(p, {})) for p in cfg.families]
    if "sana_1600m_1024" in cfg.families:
        variants.append(Variant("sana_1600m_1024", "came8bit+act_ckpt", optimizer="came8bit", act_ckpt=True))
    variants += [Variant(cfg.switches_preset, s, **SWITCHES[s]) for s in cfg.switches]
    batches: dict[str, int] = {v.preset: cfg.batch_size for v in variants if cfg.batch_size is not None}
    rows, plain = [], {}
    for v in variants:
        try:
            if v.preset not in batches:
                batches[v.preset] = fill_batch(v, device, cfg.precision, cfg.fill, cfg.max_batch)
            row = measure(v, batches[v.preset], device, cfg.precision, cfg.warmup, cfg.steps)
        except (torch.cuda.OutOfMemoryError, DoesNotFit) as e:  # a step that does not fit at all: say so, go on
            _clear(device)
            row = {"label": v.label, "preset": v.preset, "batch_size": batches.get(v.preset),
                   "error": f"out of memory: {e}"[:200] if isinstance(e, torch.cuda.OutOfMemoryError) else str(e)[:200]}
        if v.label == "plain":
            plain[v.preset] = row
        base = plain.get(v.preset)
        if base is not None and row is not base and "samples_per_s" in row and "samples_per_s" in base:
            row["speed_vs_plain"] = row["samples_per_s"] / base["samples_per_s"]
            row["memory_vs_plain"] = row["peak_mem_bytes"] / base["peak_mem_bytes"]
        rows.append(row)
        print(f"[bench gpu] {v.preset} {v.label}: {row.get('samples_per_s', 0):.1f} samples/s")
    stamp = {"date": datetime.date.today().isoformat(), "torch": torch.__version__}
    return [{**r, **stamp} for r in rows]


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The rows as the README's Markdown table, with the device and the date."""
    if not rows:
        return "No rows."
    first = rows[0]
    lines = [f"Measured {first.get('date', '?')} on {first.get('device', '?')} (torch {first.get('torch', '?')}), "
             f"`python -m framework.bench gpu`, {first.get('precision', '?')}:", "",
             "| preset | configuration | batch | samples/s | MFU | peak memory | vs plain (speed, memory) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['preset']} | {r['label']} | {r['batch_size']} | {r['error']} | | | |")
            continue
        mfu = "-" if r.get("mfu") is None else f"{r['mfu']:.1%}"
        vs = "" if "speed_vs_plain" not in r else f"{r['speed_vs_plain']:.2f}x, {r['memory_vs_plain']:.2f}x"
        lines.append(f"| {r['preset']} | {r['label']} | {r['batch_size']} | {r['samples_per_s']:.1f} | {mfu} | "
                     f"{r['peak_mem_bytes'] / 2**30:.1f} GiB | {vs} |")
    return "\n".join(lines)


def splice(path: str | Path, table: str) -> None:
    """Replace the text between the gpu-bench markers of `path` with `table`."""
    path = Path(path)
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"readme={path}: no {BEGIN} ... {END} block to replace")
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    path.write_text(pattern.sub(lambda _: f"{BEGIN}\n{table}\n{END}", text, count=1))
    print(f"updated {path}")


def run(cfg: GPUBench) -> list[dict[str, Any]]:
    rows = json.loads(Path(cfg.render).read_text()) if cfg.render else run_rows(cfg)
    print_table(rows, ["preset", "label", "batch_size", "samples_per_s", "mfu", "peak_mem_bytes", "speed_vs_plain",
                       "memory_vs_plain"])
    table = markdown_table(rows)
    if cfg.markdown:
        Path(cfg.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.markdown).write_text(table + "\n")
    if cfg.readme:
        splice(cfg.readme, table)
    return rows
