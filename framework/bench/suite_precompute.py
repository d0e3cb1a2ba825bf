"""`python -m framework.bench precompute`: where `python -m data_prep.precompute`'s time goes, per number of decode
workers and of ranks.

Each configuration is the real command (`python -m data_prep.precompute`, one process per rank with RANK /
WORLD_SIZE / LOCAL_RANK as torchrun sets them) into a fresh folder; the figures come from the timers every part
records in its done marker (data_prep/precompute.py encode_part), summed over the parts:
  decode_img_s   images one decoding process decodes a second (reading, PIL decode, resize and crop)
  encode_img_s   images a second through the image codec and the text encoder (results copied off the device)
  write_img_s    images a second into the MDS writers (compression and shard files included)
  encoder_busy   the share of the parts' wall time the encoders are busy (the goal on a GPU: 0.9 or more)
  waiting        the share spent waiting for decoded images
  images_per_s   images over the slowest rank's time in its parts (model loading and process start left out; those
                 are in wall_s)
Without `source.path`, `images` synthetic JPEGs of `image_size` px (smooth colour fields with grain, about as costly
to decode as photographs of that size) are written to a temporary folder first. `vae=debug` is a random
AutoencoderKL of debug size built there too, so the encoder costs what a small model costs; on a GPU name a real VAE
folder for the real ratio.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from data_prep.config import SourceConfig
from framework.cli import print_table

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class PrecomputeBench:
    """Arguments of `python -m framework.bench precompute`."""

    source: SourceConfig = field(default_factory=lambda: SourceConfig(name="folder"))
    """The images, as precompute takes them (source=..., source.path=...); source.path null: synthetic JPEGs."""
    images: int = 256
    """Synthetic images to write when source.path is null."""
    image_size: int = 256
    """Their side in pixels."""
    resolution: int = 256
    vae: str = "debug"
    """debug: a random AutoencoderKL of the tests' size (2 levels of 8 / 16 channels, downsample 2, no attention); or
    pixel, or a local VAE folder, as precompute takes them."""
    text_encoder: str = "minilm"
    batch_size: int = 32
    records_per_part: Optional[int] = None
    """null: every rank of the largest `ranks` gets two parts."""
    workers: list[int] = field(default_factory=lambda: [0, 1, 2])
    """decode_workers values to compare."""
    ranks: list[int] = field(default_factory=lambda: [1, 2])
    """Numbers of ranks (processes) to compare; each rank runs with os.cpu_count() // ranks threads."""
    device: Optional[str] = None
    """null: as precompute picks (cuda:<LOCAL_RANK> when a GPU is present, else cpu)."""
    dir: Optional[str] = None
    """Where the images and outputs are written (a temporary folder, removed at the end, when null)."""
    timeout_s: float = 1800.0
    """Per configuration."""
    out: str = "bench_precompute.json"


def synthetic_images(folder: Path, n: int, size: int, seed: int = 0) -> Path:
    """`n` size x size JPEGs with .txt captions: bicubically enlarged 8 x 8 colour fields with grain (noise alone
    would be costlier to decode than any photograph, a flat colour cheaper)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        base = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).resize((size, size), Image.BICUBIC)
        grain = rng.normal(0, 8, (size, size, 3))
        arr = np.clip(np.asarray(base, dtype=np.float32) + grain, 0, 255).astype(np.uint8)
        Image.fromarray(arr).save(folder / f"{i:06d}.jpg", quality=90)
        (folder / f"{i:06d}.txt").write_text(f"a synthetic picture number {i % 97}, colour field {i % 13}")
    return folder


def debug_vae(folder: Path) -> Path:
    """A random 2-level AutoencoderKL of the tests' size (8 / 16 channels, downsample 2, 4 latent channels), as a
    diffusers folder. Without the mid block's attention: over 128 x 128 latent cells it would cost more than all the
    convolutions (3 images/s on a 2-core CPU instead of 20), a cost no real VAE has at 256 px (theirs run at 32 x 32)."""
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16), layers_per_block=1,
                  down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                  norm_num_groups=4, sample_size=256, mid_block_add_attention=False).save_pretrained(folder)
    return folder


def run_precompute(overrides: list[str], ranks: int, tmp: Path, timeout_s: float) -> float:
    """`python -m data_prep.precompute` on `ranks` processes; the wall seconds until the last one exits."""
    threads = str(max(1, (os.cpu_count() or 1) // ranks))
    procs = []
    start = time.perf_counter()
    for r in range(ranks):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(r), "OMP_NUM_THREADS": threads,
               "MKL_NUM_THREADS": threads}
        cmd = [sys.executable, "-m", "data_prep.precompute", *overrides, f"hydra.run.dir={tmp / f'hydra_{r}'}"]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    seconds = time.perf_counter() - start
    for r, (p, log) in enumerate(zip(procs, logs)):
        if p.returncode:
            raise RuntimeError(f"precompute rank {r} of {ranks} failed ({p.returncode}):\n{log[-3000:]}")
    return seconds


def summarize(out: Path, ranks: int, workers: int, wall_s: float) -> dict[str, Any]:
    """One row from the parts' done markers of the dataset at `out`."""
    marks = [json.loads(f.read_text()) for f in sorted((out / "done").glob("part_*.json"))]
    total = lambda key: sum(m[key] for m in marks)
    images, seconds = total("images"), total("seconds")
    per_rank = [sum(m["seconds"] for m in marks if m["rank"] == r) for r in range(ranks)]
    rate = lambda key: images / total(key) if total(key) else None
    return {"ranks": ranks, "decode_workers": workers, "parts": len(marks), "records": total("records"),
            "images": images, "rows": total("rows"), "images_per_s": images / max(per_rank),
            "decode_img_s": rate("seconds_decode"), "encode_img_s": rate("seconds_encode"),
            "write_img_s": rate("seconds_write"), "encoder_busy": total("seconds_encode") / seconds,
            "waiting": total("seconds_wait") / seconds, "wall_s": wall_s,
            **{f"seconds_{k}": total(f"seconds_{k}") for k in ("decode", "wait", "encode", "write")},
            "seconds": seconds}


def run(cfg: PrecomputeBench) -> list[dict[str, Any]]:
    tmp = Path(cfg.dir or tempfile.mkdtemp(prefix="lf-bench-precompute-")).expanduser().resolve()
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        source = cfg.source
        if source.path is None:
            source = SourceConfig(name="folder", path=str(synthetic_images(tmp / "images", cfg.images, cfg.image_size)))
        vae = str(debug_vae(tmp / "vae")) if cfg.vae == "debug" else cfg.vae
        per_part = cfg.records_per_part or max(1, -(-cfg.images // (2 * max(cfg.ranks))))
        fields = {k: v for k, v in vars(source).items() if k != "name" and v != getattr(SourceConfig(), k)}
        base = [f"source={source.name}", *(f"source.{k}={v}" for k, v in fields.items()),
            f"vae={vae}", f"text_encoder={cfg.text_encoder}", f"resolution={cfg.resolution}",
            f"batch_size={cfg.batch_size}", f"records_per_part={per_part}", "progress=false",
            *([f"device={cfg.device}"] if cfg.device else [])]
        rows = []
        for ranks in cfg.ranks:
            for workers in cfg.workers:
                out = tmp / f"out_r{ranks}_w{workers}"
                wall = run_precompute([*base, f"decode_workers={workers}", f"out={out}"], ranks, tmp, cfg.timeout_s)
                rows.append({**summarize(out, ranks, workers, wall), "vae": cfg.vae, "batch_size": cfg.batch_size,
                             "resolution": cfg.resolution, "cpus": os.cpu_count()})
                shutil.rmtree(out, ignore_errors=True)
    finally:
        if cfg.dir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    print_table(rows, ["ranks", "decode_workers", "images", "images_per_s", "decode_img_s", "encode_img_s", "write_img_s",
                       "encoder_busy", "waiting", "wall_s"])
    return rows
