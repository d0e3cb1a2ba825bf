"""`python -m framework.bench cost experiment=NAME`: what a recipe's training costs in GPU-hours, from its composed
config. Samples seen = trainer.max_steps x the global batch; the throughput per GPU is either given
(`samples_per_s=`, e.g. a row of `python -m framework.bench gpu` on the GPU the job will run on) or estimated from
the model's counted training FLOPs per sample (forward + backward, at the data's latent size, on a meta-device
build: framework/bench/harness.py flops_per_sample) at an MFU (`mfu=`) of the GPU's dense peak. Prints GPU-hours,
days on `gpus` GPUs (default: the global batch over the per-GPU batch, as with no gradient accumulation; the
samples per step are what the run plan gives on that many GPUs, framework/training/plan.py) and, with
`price_per_gpu_hour=`, the price; one JSON row per phase and one for the total go to `out`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from framework.bench.harness import PEAK_BF16_FLOPS, compose_training, flops_per_sample
from framework.training.plan import resolve


@dataclass
class CostBench:
    """Arguments of `python -m framework.bench cost`."""

    experiment: list[str] = field(default_factory=list)
    """One experiment, or the phases of a recipe in order (experiment=[sd2_base_mosaic,sd2_base_mosaic_512])."""
    overrides: list[str] = field(default_factory=list)
    """Overrides for every phase, e.g. [data.global_batch_size=1024]."""
    gpu: str = "a100"
    """The GPU whose dense bf16 / fp16 peak the FLOPs estimate divides by (one of harness.PEAK_BF16_FLOPS)."""
    gpus: int | None = None
    """GPUs of the job; null: each phase's global batch over its per-GPU batch."""
    samples_per_s: list[float] = field(default_factory=list)
    """Measured training samples/s per GPU, one per phase; empty: estimated from the FLOPs and `mfu`."""
    mfu: float = 0.4
    """Model FLOPs utilisation assumed by the FLOPs estimate."""
    latent_size: list[int] = field(default_factory=list)
    """Latent side per phase (32 for 256 px through an 8x VAE); empty: each phase's model preset's own (made_for)."""
    text_len: int = 77
    """Caption tokens per sample for the FLOPs count."""
    price_per_gpu_hour: float | None = None
    """Dollars per GPU-hour, for a price."""
    out: str = "bench_cost.json"


def compose_phase(experiment: str, overrides: list[str]):
    """The typed training config of `experiment` with `overrides`, composed as framework.train would; the paths a
    recipe leaves to the user (data.path, init_from, a growth source) are placeholders: only the run reads them."""
    from omegaconf import OmegaConf

    import plugins  # noqa: F401  (registers the plugins a recipe names)
    from framework import config as config_lib

    dcfg = compose_training([f"experiment={experiment}", *overrides])
    for key in OmegaConf.missing_keys(dcfg):  # paths the recipe needs at run time (a growth source, ...)
        OmegaConf.update(dcfg, key, "unused")
    for key in ("data.path", "init_from"):
        if OmegaConf.select(dcfg, key) is None:
            OmegaConf.update(dcfg, key, "unused")
    return config_lib.to_object(dcfg)


def phase_cost(cfg, *, samples_per_s: float | None, mfu: float, peak: float, latent_size: int | None,
               text_len: int, gpus: int | None) -> dict[str, Any]:
    """One phase's samples, throughput per GPU, GPU-hours and GPUs."""
    from dataclasses import replace

    model = cfg.model.filled()
    if latent_size is not None:
        model = replace(model, sample_size=latent_size, sample_width=None)
    asked, sp = cfg.data.global_batch_size, cfg.strategy.sequence_parallel
    n = gpus or (max(1, asked // cfg.data.batch_size) if asked else 1) * sp
    global_batch = resolve(cfg, n).global_batch  # samples a step, as the run on n GPUs plans it
    samples = cfg.trainer.max_steps * global_batch
    flops = flops_per_sample(model, text_len)
    per_gpu = samples_per_s if samples_per_s is not None else mfu * peak / flops
    gpu_hours = samples / per_gpu / 3600
    return {"experiment": cfg.name, "model": model.name, "latent_size": model.sample_size, "steps": cfg.trainer.max_steps,
            "global_batch": global_batch, "samples": samples, "train_flops_per_sample": flops,
            "samples_per_s_per_gpu": per_gpu, "throughput": "given" if samples_per_s is not None else f"mfu {mfu}",
            "gpu_hours": gpu_hours, "gpus": n, "days": gpu_hours / n / 24}


def run(cfg: CostBench) -> list[dict[str, Any]]:
    if not cfg.experiment:
        raise SystemExit("framework.bench cost: give experiment=NAME (or experiment=[PHASE_1,PHASE_2,...])")
    phases = list(cfg.experiment)
    for name, given in (("samples_per_s", cfg.samples_per_s), ("latent_size", cfg.latent_size)):
        if given and len(given) != len(phases):
            raise SystemExit(f"framework.bench cost: {name}={list(given)} needs one value per phase "
                             f"({len(phases)}: {phases})")
    if cfg.gpu not in PEAK_BF16_FLOPS:
        raise SystemExit(f"framework.bench cost: gpu={cfg.gpu!r} is not one of {sorted(PEAK_BF16_FLOPS)}")
    if not 0 < cfg.mfu <= 1:
        raise SystemExit(f"framework.bench cost: mfu={cfg.mfu} must be in (0, 1]")
    rows = []
    for i, name in enumerate(phases):
        row = phase_cost(compose_phase(name, list(cfg.overrides)),
                         samples_per_s=cfg.samples_per_s[i] if cfg.samples_per_s else None, mfu=cfg.mfu,
                         peak=PEAK_BF16_FLOPS[cfg.gpu], latent_size=cfg.latent_size[i] if cfg.latent_size else None,
                         text_len=cfg.text_len, gpus=cfg.gpus)
        rows.append({**row, "gpu": cfg.gpu})
    total = {"experiment": "total", "gpu": cfg.gpu, "samples": sum(r["samples"] for r in rows),
             "gpu_hours": sum(r["gpu_hours"] for r in rows), "days": sum(r["days"] for r in rows)}
    if cfg.price_per_gpu_hour is not None:
        for r in (*rows, total):
            r["price"] = r["gpu_hours"] * cfg.price_per_gpu_hour
    rows.append(total)
    print(f"{'phase':<22} {'latent':>6} {'steps':>9} {'batch':>6} {'GFLOP/sample':>13} {'samples/s/GPU':>14} "
          f"{'GPU-hours':>10} {'GPUs':>5} {'days':>6}" + ("  price" if cfg.price_per_gpu_hour is not None else ""))
    for r in rows:
        last = r["experiment"] == "total"
        print(f"{r['experiment']:<22} {'' if last else r['latent_size']:>6} {'' if last else r['steps']:>9} "
              f"{'' if last else r['global_batch']:>6} "
              f"{'' if last else format(r['train_flops_per_sample'] / 1e9, '.1f'):>13} "
              f"{'' if last else format(r['samples_per_s_per_gpu'], '.1f'):>14} {r['gpu_hours']:>10,.0f} "
              f"{'' if last else r['gpus']:>5} {r['days']:>6.2f}" + (f"  ${r['price']:,.0f}" if "price" in r else ""))
    Path(cfg.out).write_text(json.dumps(rows, indent=2))
    return rows
