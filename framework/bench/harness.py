"""What the benchmark suites share: peak FLOPs per device, a step timer, synthetic batches and a timed
Lightning fit of the real training module (the table printer and JSON rows are framework.cli's).

Depends on the core only (tests/test_layers.py), so a suite about a plugin imports the plugin and
this file, and nothing here knows any plugin.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any, Sequence

import lightning.pytorch as pl
import torch

from framework.bench.fresh import peak_rss_bytes
from framework.models.backbones import ModelConfig, build_denoiser
from framework.models.flops import count_train_flops_per_sample
from framework.training.module import DiffusionModule
from framework.models.objectives import ObjectiveConfig
from framework.training.optim import OptimizerConfig

def compose_training(overrides: list[str]) -> Any:
    """conf/config.yaml composed with `overrides` as `python -m framework.train` composes it (its schema registered;
    a Hydra already set up in this process, a bench command's own, is cleared first)."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from framework import config as config_lib

    config_lib.register()  # the schema conf/config.yaml names (framework.train registers it when imported)
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(Path(__file__).resolve().parents[2] / "conf"), version_base="1.3"):
        return compose("config", overrides=overrides)


# --------------------------------------------------------------------------------------------
# Devices
# --------------------------------------------------------------------------------------------

# Dense bf16 tensor-core peaks (vendor datasheets, without sparsity), matched on the device name.
PEAK_BF16_FLOPS = {"h200": 989e12, "h100 pcie": 756e12, "h100": 989e12, "a100": 312e12}


def peak_flops(device: torch.device) -> float | None:
    """The dense bf16 peak of a known GPU, for MFU; None on a CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def bench_device(name: str) -> torch.device:
    """A bench's `device=`: auto (cuda when present, else cpu), cuda or cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def peak_memory_bytes(device: torch.device) -> int:
    """Peak GPU memory allocated since timed_fit reset it; on a CPU the process's peak resident memory so far."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return peak_rss_bytes()


# --------------------------------------------------------------------------------------------
# A timed fit of the training module on synthetic batches
# --------------------------------------------------------------------------------------------


class StepTimer(pl.Callback):
    """Wall time of each optimizer step after the first `warmup`, synchronised with the GPU so queued
    work is counted. Callbacks listed before it run inside the timed step."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self._t0 = warmup, 0.0
        self.times: list[float] = []

    def _sync(self, pl_module: pl.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._sync(pl_module)
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._sync(pl_module)
        if batch_idx >= self.warmup:
            self.times.append(time.perf_counter() - self._t0)


class SyntheticBatches(torch.utils.data.Dataset):
    """Samples shaped exactly like the data module's (latents + padded text), or raw images/tokens for
    online encoding (`online`: {"downsample": f, "vocab": V})."""

    def __init__(self, n: int, shape: tuple[int, ...], D: int, L: int, num_classes: int | None, online: dict | None) -> None:
        # shape: one sample's latents, (C, h, w) or a clip's (C, F, h, w)
        self.n, self.shape, self.D, self.L, self.k, self.online = n, tuple(shape), D, L, num_classes, online

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        item = {"text_mask": torch.ones(self.L, dtype=torch.bool), "label": torch.tensor(i % (self.k or 1))}
        if self.online:
            f = self.online["downsample"]
            h, w = self.shape[-2:]
            item["pixels"] = torch.rand(3, h * f, w * f, generator=g) * 2 - 1
            item["input_ids"] = torch.randint(0, self.online["vocab"], (self.L,), generator=g)
        else:
            item["latents"] = torch.randn(self.shape, generator=g)  # (C, h, w) or (C, F, h, w)
            item["text_embeds"] = torch.randn(self.L, self.D, generator=g)  # (L, D)
        return item


def synthetic_batches(model_cfg: ModelConfig, n: int, text_len: int, online: dict | None = None) -> SyntheticBatches:
    """`n` samples that fit `model_cfg` (its latent channels, frames and size, text dim and classes)."""
    m = model_cfg
    return SyntheticBatches(n, (m.in_channels, *m.latent_shape), m.text_dim or 1, text_len, m.num_classes, online)


def bench_optimizer(name: str = "adamw") -> OptimizerConfig:
    """The benchmarks' optimizer settings: lr 1e-4, two betas for AdamW, three for CAME (registered by plugins.came,
    which the suite that names it imports)."""
    return OptimizerConfig(name=name, lr=1e-4, betas=[0.9, 0.999] if name == "adamw" else [0.9, 0.999, 0.9999])


def bench_module(model_cfg: ModelConfig, module_class: type[DiffusionModule] = DiffusionModule,
                 optimizer: str = "adamw") -> DiffusionModule:
    """The real training module (flow objective, `optimizer`) with an all-zero empty caption instead of a dataset's."""
    module = module_class(model_cfg, ObjectiveConfig(name="flow"), bench_optimizer(optimizer), max_steps=10**6)
    module.empty_text = torch.zeros(1, model_cfg.text_dim or 1)
    return module


def timed_fit(module: pl.LightningModule, data: torch.utils.data.Dataset, *, batch_size: int, warmup: int, steps: int,
              device: torch.device, precision: str = "32-true", callbacks: Sequence[pl.Callback] = (),
              num_workers: int = 0) -> list[float]:
    """Lightning `fit` of `module` for warmup + steps optimizer steps on one device; seconds of each timed step.

    `callbacks` run before the timer's end hook, so their per-step work is inside the timed step.
    On a GPU the peak-memory counter is reset first (read it with peak_memory_bytes).
    """
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    if num_workers:
        from framework.data.datamodule import check_socket_room

        check_socket_room()
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, num_workers=num_workers, pin_memory=on_gpu)
    timer = StepTimer(warmup)
    trainer = pl.Trainer(
        accelerator="gpu" if on_gpu else "cpu", devices=1, precision=precision, max_steps=warmup + steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[*callbacks, timer], default_root_dir=tempfile.mkdtemp(prefix="lf-bench-"),
    )
    trainer.fit(module, train_dataloaders=loader)
    return timer.times


def flops_per_sample(model_cfg: ModelConfig, text_len: int = 77) -> int:
    """Forward + backward FLOPs of one training sample, counted on a meta-device build of the model: shapes only,
    so a real-size model costs about a second and no memory (count_train_flops_per_sample gives the count of real
    tensors there, fused attention included)."""
    example = next(iter(torch.utils.data.DataLoader(synthetic_batches(model_cfg, 2, text_len), batch_size=2)))
    with torch.device("meta"):
        net = build_denoiser(model_cfg)
    return count_train_flops_per_sample(net, {k: v.to("meta") for k, v in example.items()})


def measure_fit(module: DiffusionModule, model_cfg: ModelConfig, *, batch_size: int, warmup: int, steps: int,
                device: torch.device, precision: str, text_len: int = 77, online: dict | None = None,
                callbacks: Sequence[pl.Callback] = ()) -> dict[str, Any]:
    """A timed fit of `module` on synthetic batches: samples/s, step time (median, IQR), counted FLOPs per sample,
    TFLOP/s, MFU (bf16 runs on a known GPU), peak memory (peak_memory_bytes)."""
    flops = flops_per_sample(model_cfg, text_len)
    module.flops_per_batch = flops * batch_size  # counted on latents; online encoders are not model FLOPs
    data = synthetic_batches(model_cfg, (warmup + steps) * batch_size, text_len, online)
    on_gpu = device.type == "cuda"
    times = timed_fit(module, data, batch_size=batch_size, warmup=warmup, steps=steps, device=device,
                      precision=precision, callbacks=callbacks, num_workers=2 if on_gpu else 0)
    med = statistics.median(times)
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [med, med, med]
    sps = batch_size / med
    peak = peak_flops(device)
    return {
        "precision": precision,
        "batch_size": batch_size,
        "samples_per_s": sps,
        "step_ms_median": med * 1e3,
        "step_ms_iqr": (q[2] - q[0]) * 1e3,
        "flops_per_sample": flops,
        "tflops": flops * sps / 1e12,
        "mfu": None if peak is None or "bf16" not in precision else flops * sps / peak,
        "peak_mem_bytes": peak_memory_bytes(device),
        "device": device_name(device),
    }
