"""`python -m framework.bench roles`: each role's peak memory in decoupled video generation (`decode_ranks`), at a
real clip size (Wan 2.1 T2V-1.3B at 480x832, 81 frames, by default), each role in a fresh process:

  denoise   a denoising rank: the denoiser and one guided step (the conditional and unconditional halves in one
            batch), whose peak every step repeats; it never loads the VAE
  decode    a decoding rank: the video VAE decoding one clip (in `vae_tile`-pixel tiles), as framework/inference/
            decoupled.py's decoding ranks do; it never builds the denoiser

On a GPU the peak is torch's allocated peak; on a CPU the process's peak resident memory (about 1 GiB of it the
libraries). `denoise_layers=L` builds L of the preset's blocks: a CPU cannot run all 30 of Wan 1.3B on 32,760 tokens in
minutes, and sampling holds one block's activations at a time, so the other blocks add their weights only, which are
counted (`full_peak_gib`). The VAE is a random one of Wan 2.1's architecture (diffusers' AutoencoderKLWan defaults)
unless `vae=` names a local folder.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from framework.cli import print_table

ROLES = ("denoise", "decode")


@dataclass
class RolesBench:
    """Arguments of `python -m framework.bench roles`."""

    preset: str = "wan21_t2v_1_3b"
    """A video preset (conf/model/); its latent shape is replaced by the clip's."""
    num_frames: int = 81
    """Frames of the clip (1 + 4k for Wan's VAE: 81 -> 21 latent frames)."""
    height: int = 480
    width: int = 832
    vae: str | None = None
    """A local video VAE folder; null: a random VAE of Wan 2.1's architecture."""
    vae_tile: int | None = 256
    """The decoding rank's tile side in pixels (null: whole frames)."""
    downsample: int = 8
    """The VAE's spatial factor (Wan's: 8; its temporal one is 4): the denoise role's latent size, checked against
    the VAE by the decode role."""
    denoise_layers: int | None = None
    """Blocks built for the denoise role (null: all); the others' weights are added by count."""
    dtype: str = "bf16"
    """Weights and computation of both roles: bf16, fp16 or fp32."""
    device: str = "auto"
    """auto (cuda when present), cuda or cpu."""
    roles: list[str] = field(default_factory=lambda: list(ROLES))
    out: str = "bench_roles.json"

    def __post_init__(self) -> None:
        unknown = set(self.roles) - set(ROLES)
        if unknown:
            raise ValueError(f"roles={self.roles}: {sorted(unknown)} unknown; choose from {', '.join(ROLES)}")
        if (self.num_frames - 1) % 4:
            raise ValueError(f"num_frames={self.num_frames}: 1 + 4k frames (Wan's VAE: 81 -> 21 latent frames)")
        if self.height % self.downsample or self.width % self.downsample:
            raise ValueError(f"height={self.height}, width={self.width}: multiples of downsample={self.downsample}")


def _latent_shape(cfg: RolesBench) -> tuple[int, int, int]:
    return 1 + (cfg.num_frames - 1) // 4, cfg.height // cfg.downsample, cfg.width // cfg.downsample


def _denoise(cfg: RolesBench, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    from framework.models.backbones import build_denoiser, load_preset
    from framework.models.blocks import blocks

    frames, h, w = _latent_shape(cfg)
    full = load_preset(cfg.preset)
    layers = cfg.denoise_layers or full.num_layers
    if not 1 <= layers <= full.num_layers:
        raise ValueError(f"denoise_layers={layers}: between 1 and model.{cfg.preset}'s {full.num_layers} blocks")
    mcfg = load_preset(cfg.preset, num_layers=layers, num_frames=frames, sample_size=h, sample_width=w)
    torch.manual_seed(0)
    model = build_denoiser(mcfg).to(device, dtype).eval()
    block = blocks(model)[0]
    block_bytes = sum(p.numel() * p.element_size() for p in block.parameters())
    x = torch.randn(2, mcfg.in_channels, frames, h, w, device=device, dtype=dtype)  # guided: both halves at once
    text = torch.randn(2, mcfg.text_len or 77, mcfg.text_dim, device=device, dtype=dtype)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model(x, torch.full((2,), 500.0, device=device), text, torch.ones(2, text.shape[1], dtype=torch.bool,
                                                                           device=device))
    seconds = time.perf_counter() - t0
    tokens = frames * (h // mcfg.patch_size) * (w // mcfg.patch_size)
    return {"layers": layers, "of_layers": full.num_layers, "tokens": tokens, "seconds": seconds,
            "params": sum(p.numel() for p in model.parameters()), "block_bytes": block_bytes,
            "blocks_added_bytes": block_bytes * (full.num_layers - layers)}


def _decode(cfg: RolesBench, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    import contextlib
    import tempfile

    from data_prep.encoders import load_image_codec

    # vae=null: a random one, saved and loaded as a local folder is; the folder is gone once it is loaded
    with contextlib.nullcontext(cfg.vae) if cfg.vae is not None else tempfile.TemporaryDirectory(prefix="lf-roles-vae-") as vae:
        if cfg.vae is None:
            from diffusers import AutoencoderKLWan

            torch.manual_seed(0)
            AutoencoderKLWan().save_pretrained(vae)
        codec = load_image_codec(vae, str(device), dtype, tile=cfg.vae_tile)
    if (codec.downsample, codec.temporal_compression) != (cfg.downsample, 4):
        raise ValueError(f"vae={vae} downsamples {codec.downsample}x in space and {codec.temporal_compression}x in time; "
                         f"set downsample={codec.downsample} (a temporal factor of 4 is assumed)")
    frames, h, w = _latent_shape(cfg)
    z = torch.randn(1, codec.latent_channels, frames, h, w)
    t0 = time.perf_counter()
    clip = codec.decode(z)
    return {"seconds": time.perf_counter() - t0, "clip": list(clip.shape), "tile": codec.tile,
            "params": sum(p.numel() for p in codec.vae.parameters()), "blocks_added_bytes": 0}


def _role(cfg: RolesBench, role: str, out: str) -> None:
    """One role in its own (spawned) process: run it, write its row with the process's peak."""
    import json

    from data_prep.encoders import resolve_dtype
    from framework.bench.harness import bench_device, peak_memory_bytes
    from framework.training.memory import GIB

    device = bench_device(cfg.device)
    dtype = resolve_dtype(device, cfg.dtype)
    row = (_denoise if role == "denoise" else _decode)(cfg, device, dtype)
    peak = peak_memory_bytes(device)
    row.update({"role": role, "preset": cfg.preset, "frames": cfg.num_frames, "size": f"{cfg.height}x{cfg.width}",
                "dtype": cfg.dtype, "device": str(device), "peak_gib": peak / GIB,
                "full_peak_gib": (peak + row["blocks_added_bytes"]) / GIB})
    Path(out).write_text(json.dumps(row))


def run(cfg: RolesBench) -> list[dict[str, Any]]:
    from framework.bench.fresh import in_fresh_processes

    rows = in_fresh_processes(_role, cfg, cfg.roles, "lf-roles-")  # each role a fresh process: the peak is per process
    print_table(rows, ["role", "preset", "frames", "size", "dtype", "seconds", "peak_gib", "full_peak_gib", "device"])
    return rows
