"""`torchrun --standalone --nproc_per_node=2 -m framework.bench decode`: decoupled vs plain generation.

A transformer denoiser (a preset, random weights, 4 latent channels) and a VAE decoder with the
Stable Diffusion VAE's architecture (random weights: the cost is the architecture's) turn a batch of
MiniLM-encoded prompts into images three ways, every rank taking part in each:
  one_rank    rank 0 alone, plain sampling (the others wait)
  split       every rank denoises and decodes its share of the prompts (Pipeline.generate with ranks=SplitRanks())
  decoupled   the last `decode_ranks` ranks decode while the others denoise (decode_ranks, framework/inference/decoupled.py)
  decoupled_aco  the same, a decoding rank computing `aco` of each self-attention's heads while it has nothing to
              decode (PipeDiT's attention co-processing)
  sequence_parallel         every rank in groups of P splitting each image's tokens, the groups sharing the prompts
  sequence_parallel_decode  the denoising ranks in groups of P, the last `decode_ranks` ranks decoding
Each is timed `repeats` times after a warm-up; the best is kept; then one prompt alone (its latency). The denoiser
is built on first use, so a decoding rank never holds it; each rank's peak memory is reported with its role.
Rank 0 prints the table.
"""

from __future__ import annotations

import math
import resource
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from framework.cli import print_table
import torch.distributed as dist



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
    decode_ranks: Any = 1
    """Ranks that decode in the decoupled way; auto: chosen from the first batch's stage times."""
    vae: str = "sd"
    """The decoder: sd (the Stable Diffusion VAE's architecture) or small (the same 8x upsampling with a quarter of its
    channels and one layer a block: a decoder that is often idle, where Aco has time to help)."""
    aco: float = 0.5
    """The decoupled_aco way's share of each self-attention's heads for a free decoding rank."""
    sequence_parallel: int = 2
    """P of the sequence_parallel ways (all ranks in groups of P; the denoising ranks in groups of P)."""
    ways: list[str] = field(default_factory=lambda: ["one_rank", "split", "decoupled", "decoupled_aco",
                                                     "sequence_parallel", "sequence_parallel_decode"])
    """Which ways to run. On a CPU each rank's peak memory is its process's peak so far: run one way per command
    for per-role figures (on a GPU the peak is reset for each way)."""
    repeats: int = 2
    out: str = "bench_decode.json"


def sd_vae(folder: Path, small: bool = False) -> Path:
    """A random AutoencoderKL with the SD (1.x / 2.x) VAE's architecture (small: a quarter of its channels, one layer
    a block), saved as a diffusers folder."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4,
                  block_out_channels=(32, 64, 128, 128) if small else (128, 256, 512, 512),
                  layers_per_block=1 if small else 2, down_block_types=("DownEncoderBlock2D",) * 4,
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
    if cfg.vae not in ("sd", "small"):
        raise SystemExit(f"vae={cfg.vae}: sd or small")
    vae = sd_vae(Path(tempfile.mkdtemp(prefix=f"sd_vae_r{rank}_")), small=cfg.vae == "small")
    mcfg = load_preset(cfg.preset, in_channels=4, text_dim=384, sample_size=cfg.latent_size, learned_sigma=False)

    def build() -> Any:
        torch.manual_seed(0)
        return build_denoiser(mcfg).eval()

    info = {"image_codec": str(vae), "text_encoder": "minilm", "scaling_factor": 0.18215, "shift_factor": 0.0,
            "image_mode": "RGB"}
    prompts = [f"a handwritten {i % 10}" for i in range(cfg.images)]
    P, K = cfg.sequence_parallel, cfg.decode_ranks
    possible = {"sequence_parallel": world % P == 0, "sequence_parallel_decode": K != "auto" and (world - K) % P == 0}
    pipes: dict[str, Any] = {}

    def pipe_for(name: str) -> Any:
        """Each way its own pipeline, its denoiser built on first use as framework.sample loads a checkpoint (a
        decoding rank never builds it), split as the way needs."""
        if name not in pipes:
            pipe = Pipeline.deferred(build, mcfg, Objective(ObjectiveConfig()), torch.zeros(1, 384), info)
            if name == "sequence_parallel":
                from framework.distributed.sequence import split_for_sampling

                split_for_sampling(pipe.ensure_model(), P)
            elif name == "sequence_parallel_decode":
                from framework.inference.decoupled import split_denoisers

                split_denoisers(pipe, K, P)
            pipes[name] = pipe
        return pipes[name]

    def generate(name: str, chosen: list[str]) -> torch.Tensor | None:
        from framework.inference.sampling import SamplingPlan
        from framework.inference.sharing import DecodeRanks, SplitRanks

        pipe, plan = pipe_for(name), SamplingPlan(steps=cfg.steps)
        if name == "one_rank":
            return pipe.generate(chosen, plan, batch_size=cfg.batch_size) if rank == 0 else None
        if name in ("split", "sequence_parallel"):
            ranks = SplitRanks()
        else:
            ranks = DecodeRanks(K, cfg.aco if name == "decoupled_aco" else 0.0)
        return pipe.generate(chosen, plan, ranks=ranks, batch_size=cfg.batch_size)

    ways = [w for w in cfg.ways if possible.get(w, True)]
    for w in set(cfg.ways) - set(ways):
        if rank == 0:
            print(f"[bench decode] {w}: skipped ({world} ranks, decode_ranks={K}, sequence_parallel={P} do not divide)")
    cuda = torch.cuda.is_available()
    best: dict[str, float] = {}
    latency: dict[str, float] = {}
    memory: dict[str, list] = {}
    images: dict[str, torch.Tensor | None] = {}
    for name in ways:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for r in range(cfg.repeats + 1):  # round 0 warms up
            dist.barrier()
            t0 = time.perf_counter()
            images[name] = generate(name, prompts)
            dist.barrier()
            if r:
                best[name] = min(best.get(name, math.inf), time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        generate(name, prompts[:1])  # one prompt alone: its latency
        dist.barrier()
        latency[name] = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        memory[name] = [None] * world
        dist.all_gather_object(memory[name], {"peak_MiB": round(peak / 2**20), "denoiser": pipes[name]._build is None,
                                              "decoder": pipes[name]._codec is not None})
    rows = []
    if rank == 0:
        ref = images.get("one_rank")
        rows = [{"way": name, "ranks": 1 if name == "one_rank" else world,
                 "decode_ranks": K if name in ("decoupled", "decoupled_aco", "sequence_parallel_decode") else 0,
                 "aco": cfg.aco if name == "decoupled_aco" else 0.0,
                 "sequence_parallel": P if name.startswith("sequence") else 1, "images_per_s": cfg.images / best[name],
                 "seconds": best[name], "latency_s": latency[name],
                 "same_images_as_one_rank": None if ref is None else bool(torch.equal(images[name], ref)),
                 "max_diff_vs_one_rank": None if ref is None else float((images[name] - ref).abs().max()),
                 "per_rank": memory[name], "images": cfg.images, "image_size": list(images[name].shape[-2:]),
                 "preset": cfg.preset, "steps": cfg.steps, "batch_size": cfg.batch_size, "vae": cfg.vae,
                 "device": str(pipes[name].device)} for name in ways]
        for r in rows:
            r["peak_MiB_per_rank"] = [m["peak_MiB"] for m in r["per_rank"]]
        print_table(rows, ["way", "ranks", "decode_ranks", "aco", "sequence_parallel", "seconds", "images_per_s", "latency_s",
                           "peak_MiB_per_rank",
                           "same_images_as_one_rank"])
    return rows
