"""`python -m framework.bench SUITE key=value ...`: benchmarks. They measure; tests assert behaviour.

Suites:
  train      the real training step (Lightning fit of DiffusionModule) for a preset: samples/s, step
             time, counted FLOPs, TFLOP/s, MFU, peak memory; comparisons precomputed vs online
             encoders, fp32 vs bf16-mixed, SDPA vs xformers, torch.compile, activation checkpointing
  data       the Streaming data module's samples/s from local shards, and bytes per sample
  memory     per-rank parameter + gradient + optimizer bytes under single / fsdp (framework/strategy.py)
  init_memory  peak host memory per rank building + sharding a preset under fsdp: meta path vs whole
             builds (framework/fsdp.py)
  optimizer  optimizer-state bytes per parameter, AdamW vs CAME vs CAME-8bit (plugins/came.py)
  ema        EMA cost per step before and after its start (plugins/ema.py)
  norm       low-precision norms' effect on step time and peak memory (plugins/low_precision_norm.py)
Each prints a table and writes one JSON row per configuration to `out`.
"""

from __future__ import annotations

import json
import resource
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from framework.cli import quiet_hydra, resolve_device
from framework.registry import BENCH_SUITES, register_suite

# Dense bf16 tensor-core peaks (vendor datasheets, without sparsity), matched on the device name.
PEAK_BF16_FLOPS = {"h200": 989e12, "h100 pcie": 756e12, "h100": 989e12, "a100": 312e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def print_table(rows: list[dict[str, Any]], cols: list[str]) -> None:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "-" if v is None else str(v)

    cells = [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def write_json(rows: list[dict[str, Any]], out: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(rows, indent=2))
    print(f"wrote {out}")


# --------------------------------------------------------------------------------------------
# train: the real training step
# --------------------------------------------------------------------------------------------


@dataclass
class TrainBench:
    """Arguments of `python -m framework.bench train`."""

    model: str = "pixart_debug"
    """Model preset (conf/model/NAME.yaml)."""
    sample_size: int | None = None
    """Latent side; null: the preset's (e.g. 32 for 256 px through an 8x VAE)."""
    text_len: int = 77
    """Caption tokens per sample."""
    batch_size: int = 8
    """Micro-batch per step."""
    precision: str | None = None
    """Baseline precision; null: bf16-mixed on a GPU, 32-true on a CPU."""
    warmup: int = 3
    """Untimed steps first (allocation, autotuning, compilation)."""
    steps: int = 10
    """Timed steps."""
    modes: list[str] = field(default_factory=lambda: ["precomputed", "online", "fp32", "bf16", "xformers", "compile", "act_ckpt"])
    """Which configurations to run; the first is the baseline of the printed ratios."""
    online_vae: str = "sd"
    """online mode: VAE architecture run on every batch (random weights): sd (SD/PixArt 8x, 4 ch)."""
    online_text_encoder: str = "clip_l"
    """online mode: text encoder architecture run on every batch (random weights): clip_l or t5_base."""
    device: str = "auto"
    out: str = "bench_train.json"


class _StepTimer(pl.Callback):
    """Wall time of each optimizer step, synchronised with the GPU so queued work is counted."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.times, self._t0 = warmup, [], 0.0

    def _sync(self, pl_module: pl.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._sync(pl_module)
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._sync(pl_module)
        if batch_idx >= self.warmup:
            self.times.append(time.perf_counter() - self._t0)


class _SyntheticBatches(torch.utils.data.Dataset):
    """Batches shaped exactly like the data module's (latents + padded text), or raw images/tokens for online mode."""

    def __init__(self, n: int, C: int, S: int, D: int, L: int, num_classes: int | None, online: dict | None) -> None:
        self.n, self.C, self.S, self.D, self.L, self.k, self.online = n, C, S, D, L, num_classes, online

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        item = {"text_mask": torch.ones(self.L, dtype=torch.bool), "label": torch.tensor(i % (self.k or 1))}
        if self.online:
            f = self.online["downsample"]
            item["pixels"] = torch.rand(3, self.S * f, self.S * f, generator=g) * 2 - 1
            item["input_ids"] = torch.randint(0, self.online["vocab"], (self.L,), generator=g)
        else:
            item["latents"] = torch.randn(self.C, self.S, self.S, generator=g)
            item["text_embeds"] = torch.randn(self.L, self.D, generator=g)
        return item


def _online_encoders(vae: str, text: str, C: int, D: int) -> tuple[torch.nn.Module, torch.nn.Module, dict]:
    """Random-weight encoders with the real architectures, projected to the model's C and D."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    if vae != "sd":
        raise ValueError(f"online_vae={vae!r}: only sd is built in")
    # Stable Diffusion's VAE (also PixArt-alpha's): 4 levels 128..512, 8x downsampling, 4 channels.
    ae = AutoencoderKL(
        block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    )
    if text == "clip_l":
        enc = CLIPTextModel(CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12))
    elif text == "t5_base":
        enc = T5EncoderModel(T5Config(d_model=768, d_ff=3072, num_layers=12, num_heads=12))
    else:
        raise ValueError(f"online_text_encoder={text!r}: choose clip_l or t5_base")
    # What the trainer would see is the model's C x D; a fixed projection keeps the shapes honest.
    enc.proj_to_model = torch.nn.Linear(enc.config.hidden_size, D, bias=False)
    ae.proj_to_model = torch.nn.Conv2d(4, C, 1, bias=False)
    return ae.requires_grad_(False), enc.requires_grad_(False), {"downsample": 8, "vocab": enc.config.vocab_size}


def _bench_module(model_cfg: Any, online: tuple | None) -> pl.LightningModule:
    from framework.module import DiffusionModule
    from framework.objectives import ObjectiveConfig
    from framework.optim import OptimizerConfig

    class BenchModule(DiffusionModule):
        """The training module, with the VAE and text encoder run per batch in online mode."""

        def __init__(self) -> None:
            super().__init__(model_cfg, ObjectiveConfig(name="flow"), OptimizerConfig(lr=1e-4), max_steps=10**6)
            self.empty_text = torch.zeros(1, model_cfg.text_dim or 1)
            self.vae, self.text_encoder = online[:2] if online else (None, None)

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            if self.vae is not None:
                with torch.no_grad():
                    z = self.vae.encode(batch.pop("pixels")).latent_dist.mean  # (B, 4, S, S)
                    batch["latents"] = self.vae.proj_to_model(z)
                    h = self.text_encoder(input_ids=batch.pop("input_ids")).last_hidden_state  # (B, L, H)
                    batch["text_embeds"] = self.text_encoder.proj_to_model(h)
            return super().training_step(batch, batch_idx)

    return BenchModule()


def _prepare(module: pl.LightningModule, mode: str) -> None:
    from framework.strategy import prepare_blocks

    if mode == "xformers":
        from framework.models import apply_attention_backend

        apply_attention_backend(module.model.net, "xformers")
    prepare_blocks(module.model, activation_checkpointing=mode == "act_ckpt", compile=mode == "compile")


def run_train_mode(cfg: TrainBench, mode: str, device: torch.device) -> dict[str, Any]:
    from framework.flops import count_train_flops_per_sample
    from framework.models import load_preset

    overrides = {} if cfg.sample_size is None else {"sample_size": cfg.sample_size}
    mcfg = load_preset(cfg.model, **overrides)
    on_gpu = device.type == "cuda"
    base = cfg.precision or ("bf16-mixed" if on_gpu else "32-true")
    precision = {"fp32": "32-true", "bf16": "bf16-mixed"}.get(mode, base)
    online = _online_encoders(cfg.online_vae, cfg.online_text_encoder, mcfg.in_channels, mcfg.text_dim or 1) if mode == "online" else None
    module = _bench_module(mcfg, online)
    _prepare(module, mode)
    C, S, D = mcfg.in_channels, mcfg.sample_size, mcfg.text_dim or 1
    data = _SyntheticBatches((cfg.warmup + cfg.steps) * cfg.batch_size, C, S, D, cfg.text_len, mcfg.num_classes, online[2] if online else None)
    loader = torch.utils.data.DataLoader(data, batch_size=cfg.batch_size, num_workers=2 if on_gpu else 0, pin_memory=on_gpu)
    example = next(iter(torch.utils.data.DataLoader(_SyntheticBatches(2, C, S, D, cfg.text_len, mcfg.num_classes, None), batch_size=2)))
    flops = count_train_flops_per_sample(module.model, example)
    module.flops_per_batch = flops * cfg.batch_size  # counted on latents; online encoders are not model FLOPs
    timer = _StepTimer(cfg.warmup)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    trainer = pl.Trainer(
        accelerator="gpu" if on_gpu else "cpu", devices=1, precision=precision, max_steps=cfg.warmup + cfg.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[timer], default_root_dir=tempfile.mkdtemp(prefix="lf-bench-"),
    )
    trainer.fit(module, train_dataloaders=loader)
    med = statistics.median(timer.times)
    q = statistics.quantiles(timer.times, n=4) if len(timer.times) >= 2 else [med, med, med]
    sps = cfg.batch_size / med
    peak = peak_flops(device)
    achieved = flops * sps
    return {
        "mode": mode,
        "model": cfg.model,
        "precision": precision,
        "batch_size": cfg.batch_size,
        "samples_per_s": sps,
        "step_ms_median": med * 1e3,
        "step_ms_iqr": (q[2] - q[0]) * 1e3,
        "flops_per_sample": flops,
        "tflops": achieved / 1e12,
        "mfu": None if peak is None or "bf16" not in precision else achieved / peak,
        "peak_mem_bytes": torch.cuda.max_memory_allocated(device) if on_gpu else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
    }


def bench_train(cfg: TrainBench) -> list[dict[str, Any]]:
    device = torch.device(resolve_device(cfg.device))
    rows = []
    for mode in cfg.modes:
        try:
            rows.append(run_train_mode(cfg, mode, device))
        except (RuntimeError, ValueError) as e:  # e.g. xformers without a GPU: say so, keep going
            print(f"[bench train] {mode}: skipped ({str(e).splitlines()[0]})")
    base = rows[0]["samples_per_s"] if rows else None
    for r in rows:
        r["vs_first"] = r["samples_per_s"] / base
    print_table(rows, ["mode", "precision", "samples_per_s", "step_ms_median", "step_ms_iqr", "tflops", "mfu", "peak_mem_bytes", "vs_first"])
    if device.type == "cpu":
        print("(CPU: no MFU; peak_mem_bytes is the process's peak resident memory so far)")
    return rows


# --------------------------------------------------------------------------------------------
# data: the Streaming data module
# --------------------------------------------------------------------------------------------


@dataclass
class DataBench:
    """Arguments of `python -m framework.bench data`."""

    path: str = "data/digits"
    """A local dataset written by data_prep.precompute."""
    batch_size: int = 64
    num_batches: int = 200
    workers: list[int] = field(default_factory=lambda: [0, 2])
    out: str = "bench_data.json"


def bench_data(cfg: DataBench) -> list[dict[str, Any]]:
    from framework.data import dataset_bytes_per_sample, measure_loader_throughput

    size = dataset_bytes_per_sample(cfg.path)
    rows = []
    for nw in cfg.workers:
        cache = tempfile.mkdtemp(prefix="lf-bench-cache-")
        r = measure_loader_throughput(cfg.path, batch_size=cfg.batch_size, num_workers=nw, num_batches=cfg.num_batches, local=cache)
        shutil.rmtree(cache, ignore_errors=True)  # loader workers may still be closing files in it
        rows.append({"mode": f"workers={nw}", **(r if isinstance(r, dict) else {"samples_per_s": r}), **size, "mfu": None, "peak_mem_bytes": None})
    print_table(rows, [k for k in rows[0] if k not in ("mfu", "peak_mem_bytes")])
    return rows


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------

register_suite("train", TrainBench, bench_train)
register_suite("data", DataBench, bench_data)


def main() -> None:
    import framework.fsdp  # noqa: F401  (registers the init_memory suite)
    import framework.strategy  # noqa: F401  (registers the memory suite)
    import plugins  # noqa: F401  (plugins register their suites)

    if len(sys.argv) < 2 or sys.argv[1] not in BENCH_SUITES:
        raise SystemExit(f"usage: python -m framework.bench SUITE [key=value ...]; SUITE is one of {sorted(BENCH_SUITES)}")
    suite = sys.argv.pop(1)
    config, run = BENCH_SUITES[suite]
    ConfigStore.instance().store(name=f"bench_{suite}", node=config)
    quiet_hydra()

    @hydra.main(version_base="1.3", config_path=None, config_name=f"bench_{suite}")
    def _run(cfg: Any) -> None:
        obj = OmegaConf.to_object(cfg)
        rows = run(obj)
        write_json(rows, obj.out)

    _run()


if __name__ == "__main__":
    main()
