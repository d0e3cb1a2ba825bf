"""`python -m framework.bench train`: the real training step (Lightning fit of DiffusionModule) for a
preset: samples/s, step time, counted FLOPs, TFLOP/s, MFU, peak memory; comparisons precomputed vs
online encoders, fp32 vs bf16-mixed, SDPA vs xformers, torch.compile, activation checkpointing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from framework.bench.harness import bench_module, measure_fit
from framework.cli import print_table, resolve_device
from framework.models.backbones import ModelConfig, apply_attention_backend, load_preset
from framework.training.module import DiffusionModule
from framework.distributed.fsdp import prepare_blocks


@dataclass
class TrainBench:
    """Arguments of `python -m framework.bench train`."""

    model: str = "pixart_debug"
    """Model preset (conf/model/NAME.yaml)."""
    sample_size: int | None = None
    """Latent side; null: the preset's (e.g. 32 for 256 px through an 8x VAE)."""
    num_frames: int | None = None
    """Video presets: latent frames per clip; null: the preset's (e.g. 21 for Wan's 81 frames)."""
    text_len: int = 77
    """Caption tokens per sample (at most a wan model's own text_len)."""
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


# --------------------------------------------------------------------------------------------
# online mode: encoders run on every batch
# --------------------------------------------------------------------------------------------


def online_encoders(vae: str, text: str, C: int, D: int) -> tuple[torch.nn.Module, torch.nn.Module, dict]:
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


class OnlineModule(DiffusionModule):
    """The training module with a VAE and a text encoder run on every batch (set `vae`, `text_encoder`)."""

    vae: torch.nn.Module
    text_encoder: torch.nn.Module

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        with torch.no_grad():
            z = self.vae.encode(batch.pop("pixels")).latent_dist.mean  # (B, 4, S, S)
            batch["latents"] = self.vae.proj_to_model(z)
            h = self.text_encoder(input_ids=batch.pop("input_ids")).last_hidden_state  # (B, L, H)
            batch["text_embeds"] = self.text_encoder.proj_to_model(h)
        return super().training_step(batch, batch_idx)


# --------------------------------------------------------------------------------------------
# One mode
# --------------------------------------------------------------------------------------------


def _module(cfg: TrainBench, mcfg: ModelConfig, mode: str) -> tuple[DiffusionModule, dict | None]:
    """The module for `mode`, its blocks prepared as strategy.* would; the online batch layout or None."""
    online = None
    if mode == "online":
        vae, text_encoder, online = online_encoders(cfg.online_vae, cfg.online_text_encoder, mcfg.in_channels,
                                                    mcfg.text_dim or 1)
        module = bench_module(mcfg, OnlineModule)
        module.vae, module.text_encoder = vae, text_encoder
    else:
        module = bench_module(mcfg)
    if mode == "xformers":
        apply_attention_backend(module.model.net, "xformers")
    prepare_blocks(module.model, activation_checkpointing=mode == "act_ckpt", compile=mode == "compile")
    return module, online


def run_train_mode(cfg: TrainBench, mode: str, device: torch.device) -> dict[str, Any]:
    sizes = {k: v for k, v in (("sample_size", cfg.sample_size), ("num_frames", cfg.num_frames)) if v is not None}
    if cfg.sample_size is not None:
        sizes["sample_width"] = None  # a square latent of that side
    mcfg = load_preset(cfg.model, **sizes)
    on_gpu = device.type == "cuda"
    base = cfg.precision or ("bf16-mixed" if on_gpu else "32-true")
    precision = {"fp32": "32-true", "bf16": "bf16-mixed"}.get(mode, base)
    module, online = _module(cfg, mcfg, mode)
    text_len = min(cfg.text_len, mcfg.text_len or cfg.text_len)  # wan pads every caption to its own text_len
    row = measure_fit(module, mcfg, batch_size=cfg.batch_size, warmup=cfg.warmup, steps=cfg.steps, device=device,
                      precision=precision, text_len=text_len, online=online)
    return {"mode": mode, "model": cfg.model, **row}


def run(cfg: TrainBench) -> list[dict[str, Any]]:
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
    print_table(rows, ["mode", "precision", "samples_per_s", "step_ms_median", "step_ms_iqr", "tflops", "mfu",
                       "peak_mem_bytes", "vs_first"])
    if device.type == "cpu":
        print("(CPU: no MFU; peak_mem_bytes is the process's peak resident memory so far)")
    return rows
