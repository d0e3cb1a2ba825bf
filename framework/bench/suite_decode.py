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
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from framework.bench.fresh import peak_rss_bytes
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

    world = init_from_env()
    if world < 2:
        raise SystemExit("framework.bench decode compares ways of sharing generation between ranks: run it under "
                         "torchrun --standalone --nproc_per_node=2 (or more)")
    if cfg.vae not in ("sd", "small"):
        raise SystemExit(f"vae={cfg.vae}: sd or small")
    rank = dist.get_rank()
    with tempfile.TemporaryDirectory(prefix=f"lf-decode-vae-r{rank}-") as folder:  # each rank's own copy
        ways = _Ways(cfg, sd_vae(Path(folder), small=cfg.vae == "small"), world)
        runnable = [w for w in cfg.ways if ways.possible.get(w, True)]
        for w in set(cfg.ways) - set(runnable):
            if rank == 0:
                print(f"[bench decode] {w}: skipped ({world} ranks, decode_ranks={ways.K}, sequence_parallel={ways.P} "
                      "do not divide)")
        measured = {name: ways.measure(name) for name in runnable}
    return _table(cfg, ways, measured) if rank == 0 else []


class _Ways:
    """The ways of generating `cfg.images` prompts, each with its own pipeline over one random denoiser and `vae`."""

    def __init__(self, cfg: DecodeBench, vae: Path, world: int) -> None:
        from framework.models.backbones import load_preset

        self.cfg, self.world, self.rank = cfg, world, dist.get_rank()
        self.mcfg = load_preset(cfg.preset, in_channels=4, text_dim=384, sample_size=cfg.latent_size,
                                learned_sigma=False)
        self.info = {"image_codec": str(vae), "text_encoder": "minilm", "scaling_factor": 0.18215, "shift_factor": 0.0,
                     "image_mode": "RGB"}
        self.prompts = [f"a handwritten {i % 10}" for i in range(cfg.images)]
        self.P, self.K = P, K = cfg.sequence_parallel, cfg.decode_ranks
        self.possible = {"sequence_parallel": world % P == 0,
                         "sequence_parallel_decode": K != "auto" and (world - K) % P == 0}
        self.pipes: dict[str, Any] = {}

    def build(self) -> Any:
        from framework.models.backbones import build_denoiser

        torch.manual_seed(0)
        return build_denoiser(self.mcfg).eval()

    def pipe_for(self, name: str) -> Any:
        """Each way its own pipeline, its denoiser built on first use as framework.sample loads a checkpoint (a
        decoding rank never builds it), split as the way needs."""
        from framework.inference.pipeline import Pipeline
        from framework.models.objectives import Objective, ObjectiveConfig

        if name not in self.pipes:
            pipe = Pipeline.deferred(self.build, self.mcfg, Objective(ObjectiveConfig()), torch.zeros(1, 384), self.info)
            if name == "sequence_parallel":
                from framework.distributed.sequence import split_for_sampling

                split_for_sampling(pipe.ensure_model(), self.P)
            elif name == "sequence_parallel_decode":
                from framework.inference.decoupled import split_denoisers

                split_denoisers(pipe, self.K, self.P)
            self.pipes[name] = pipe
        return self.pipes[name]

    def generate(self, name: str, chosen: list[str]) -> torch.Tensor | None:
        from framework.inference.sampling import SamplingPlan
        from framework.inference.sharing import DecodeRanks, SplitRanks

        cfg = self.cfg
        pipe, plan = self.pipe_for(name), SamplingPlan(steps=cfg.steps)
        if name == "one_rank":
            return pipe.generate(chosen, plan, batch_size=cfg.batch_size) if self.rank == 0 else None
        if name in ("split", "sequence_parallel"):
            ranks = SplitRanks()
        else:
            ranks = DecodeRanks(self.K, cfg.aco if name == "decoupled_aco" else 0.0)
        return pipe.generate(chosen, plan, ranks=ranks, batch_size=cfg.batch_size)

    def measure(self, name: str) -> dict[str, Any]:
        """Way `name`: the best of `repeats` timed runs after a warm-up, one prompt's latency, every rank's peak memory
        and role, and the images (rank 0's)."""
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        best, images = math.inf, None
        for r in range(self.cfg.repeats + 1):  # round 0 warms up
            dist.barrier()
            t0 = time.perf_counter()
            images = self.generate(name, self.prompts)
            dist.barrier()
            if r:
                best = min(best, time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        self.generate(name, self.prompts[:1])  # one prompt alone: its latency
        dist.barrier()
        latency = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes()
        memory: list[Any] = [None] * self.world
        pipe = self.pipes[name]
        dist.all_gather_object(memory, {"peak_MiB": round(peak / 2**20), "denoiser": pipe._build is None,
                                        "decoder": pipe._codec is not None})
        return {"seconds": best, "latency_s": latency, "per_rank": memory, "images": images,
                "device": str(pipe.device)}


def _table(cfg: DecodeBench, ways: _Ways, measured: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    ref = measured["one_rank"]["images"] if "one_rank" in measured else None
    K, P = ways.K, ways.P
    rows = []
    for name, m in measured.items():
        images = m["images"]
        rows.append({"way": name, "ranks": 1 if name == "one_rank" else ways.world,
                     "decode_ranks": K if name in ("decoupled", "decoupled_aco", "sequence_parallel_decode") else 0,
                     "aco": cfg.aco if name == "decoupled_aco" else 0.0,
                     "sequence_parallel": P if name.startswith("sequence") else 1,
                     "images_per_s": cfg.images / m["seconds"], "seconds": m["seconds"], "latency_s": m["latency_s"],
                     "same_images_as_one_rank": None if ref is None else bool(torch.equal(images, ref)),
                     "max_diff_vs_one_rank": None if ref is None else float((images - ref).abs().max()),
                     "per_rank": m["per_rank"], "peak_MiB_per_rank": [r["peak_MiB"] for r in m["per_rank"]],
                     "images": cfg.images, "image_size": list(images.shape[-2:]), "preset": cfg.preset,
                     "steps": cfg.steps, "batch_size": cfg.batch_size, "vae": cfg.vae, "device": m["device"]})
    print_table(rows, ["way", "ranks", "decode_ranks", "aco", "sequence_parallel", "seconds", "images_per_s", "latency_s",
                       "peak_MiB_per_rank", "same_images_as_one_rank"])
    return rows
