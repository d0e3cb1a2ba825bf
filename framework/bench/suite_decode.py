"""`torchrun --standalone --nproc_per_node=2 -m framework.bench decode`: decoupled vs plain generation.

A transformer denoiser (a preset, random weights, 4 latent channels) and a VAE decoder with the
Stable Diffusion VAE's architecture (random weights: the cost is the architecture's) turn a batch of
MiniLM-encoded prompts into images three ways, every rank taking part in each:
  one_rank    rank 0 alone, plain sampling (the others wait)
  split       every rank denoises and decodes its share of the prompts (Pipeline.generate split_ranks)
  decoupled   the last `decode_ranks` ranks decode while the others denoise (decode_ranks, framework/inference/decoupled.py)
Each is timed `repeats` times after a warm-up; the best is kept. Rank 0 prints the table.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from framework.bench.harness import print_table


@dataclass
class DecodeBench:
    """Arguments of `python -m framework.bench decode` (under torchrun)."""

    preset: str = "pixart_debug"
    """Denoiser preset (random weights, 4 latent channels, text width of MiniLM)."""
    latent_size: int = 32
    """Latent side: 32 -> 256x256 images through the SD VAE's 8x upsampling."""
    images: int = 16
    batch_size: int = 4
    steps: int = 20
    decode_ranks: int = 1
    repeats: int = 2
    out: str = "bench_decode.json"


def sd_vae(folder: Path) -> Path:
    """A random AutoencoderKL with the SD (1.x / 2.x) VAE's architecture, saved as a diffusers folder."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(128, 256, 512, 512),
                  layers_per_block=2, down_block_types=("DownEncoderBlock2D",) * 4,
                  up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=32, sample_size=512,
                  scaling_factor=0.18215).save_pretrained(folder)
    return folder


def run(cfg: DecodeBench) -> list[dict[str, Any]]:
    from framework.distributed.env import init_from_env
    from framework.models.backbones import build_denoiser, load_preset
    from framework.models.objectives import Objective, ObjectiveConfig
    from framework.inference.pipeline import Pipeline

    world = init_from_env()
    if world < 2:
        raise SystemExit("framework.bench decode compares ways of sharing generation between ranks: run it under "
                         "torchrun --standalone --nproc_per_node=2 (or more)")
    rank = dist.get_rank()
    vae = sd_vae(Path(tempfile.mkdtemp(prefix=f"sd_vae_r{rank}_")))
    torch.manual_seed(0)
    model = build_denoiser(load_preset(cfg.preset, in_channels=4, text_dim=384, sample_size=cfg.latent_size,
                                       learned_sigma=False))
    info = {"image_codec": str(vae), "text_encoder": "minilm", "scaling_factor": 0.18215, "shift_factor": 0.0,
            "image_mode": "RGB"}
    pipe = Pipeline(model.eval(), Objective(ObjectiveConfig()), torch.zeros(1, 384), info)
    prompts = [f"a handwritten {i % 10}" for i in range(cfg.images)]
    ways = {
        "one_rank": lambda: pipe.generate(prompts, cfg.steps, batch_size=cfg.batch_size) if rank == 0 else None,
        "split": lambda: pipe.generate(prompts, cfg.steps, batch_size=cfg.batch_size, split_ranks=True),
        "decoupled": lambda: pipe.generate(prompts, cfg.steps, batch_size=cfg.batch_size, decode_ranks=cfg.decode_ranks),
    }
    best: dict[str, float] = {}
    images: dict[str, torch.Tensor | None] = {}
    for r in range(cfg.repeats + 1):  # round 0 warms up
        for name, way in ways.items():
            dist.barrier()
            t0 = time.perf_counter()
            images[name] = way()
            dist.barrier()
            if r:
                best[name] = min(best.get(name, math.inf), time.perf_counter() - t0)
    rows = []
    if rank == 0:
        same = {name: bool(torch.equal(images[name], images["one_rank"])) for name in ways}
        rows = [{"way": name, "ranks": 1 if name == "one_rank" else world,
                 "decode_ranks": cfg.decode_ranks if name == "decoupled" else 0, "images_per_s": cfg.images / best[name],
                 "seconds": best[name], "same_images_as_one_rank": same[name], "images": cfg.images,
                 "image_size": list(images["one_rank"].shape[-2:]), "preset": cfg.preset, "steps": cfg.steps,
                 "batch_size": cfg.batch_size, "device": str(pipe.device)} for name in ways]
        print_table(rows, ["way", "ranks", "decode_ranks", "seconds", "images_per_s", "same_images_as_one_rank"])
    return rows
