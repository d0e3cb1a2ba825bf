"""`torchrun --nproc_per_node=N -m tests.workers.decoupled DATA VAE DECODE_RANKS OUT`: plain vs decoupled generation.

Every rank builds the same random 4-channel PixArt over the digits prompts with a tiny random VAE as the
image decoder (tests/conftest.py), then generates the prompts plainly (each rank alone) and with
decode_ranks=K (all ranks together), with and without a cache schedule. Rank 0 writes OUT: whether the
decoupled images equal the plain ones bit for bit, and the other ranks' return values. DECODE_RANKS=0:
SplitRanks(decode_on_rank0=True) instead (every rank denoises a share, rank 0 decodes): how far its images
are from the plain ones, and which ranks loaded the VAE.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from framework.data.datamodule import read_dataset_info
from framework.distributed.env import init_from_env, leave
from framework.models.backbones import build_denoiser, load_preset
from framework.models.objectives import Objective, ObjectiveConfig
from framework.inference.pipeline import Pipeline
from framework.inference.sampling import Sampler, SamplingPlan
from framework.inference.sharing import DecodeRanks, SplitRanks

PROMPTS = ["a handwritten 3", "the digit seven", "a handwritten 0", "a scribbled 5", "a handwritten 9"]
PLAN = SamplingPlan(steps=3, seed=4)


def pixart_pipe(data: str, vae: str, preset: str = "pixart_debug") -> Pipeline:
    """A random 4-channel PixArt (or another image preset) over DATA's prompts, decoded by the VAE folder `vae`."""
    info = read_dataset_info(data)
    summary = {**info.summary(), "image_codec": vae, "scaling_factor": 0.5, "shift_factor": 0.1}
    torch.manual_seed(0)
    model = build_denoiser(load_preset(preset, in_channels=4, num_layers=2, text_dim=384))
    return Pipeline(model.eval(), Objective(ObjectiveConfig()), info.empty_text_embeds, summary)


def main(data: str, vae: str, decode_ranks: int, out: str) -> None:
    init_from_env()
    info = read_dataset_info(data)
    summary = {**info.summary(), "image_codec": vae, "scaling_factor": 0.5, "shift_factor": 0.1}
    pipe = pixart_pipe(data, vae)
    model = pipe.model
    result = {}
    if decode_ranks == 0:  # SplitRanks(decode_on_rank0=True) (training grids): a fresh pipeline, its VAE not yet loaded
        fresh = Pipeline(model.eval(), Objective(ObjectiveConfig()), info.empty_text_embeds, summary)
        split = fresh.generate(PROMPTS, PLAN, batch_size=2, ranks=SplitRanks(decode_on_rank0=True))
        loaded = [None] * dist.get_world_size()
        dist.all_gather_object(loaded, fresh._codec is not None)
        if dist.get_rank() == 0:
            plain = pipe.generate(PROMPTS, PLAN, batch_size=2)
            result["rank0"] = {"max_diff": float((split - plain).abs().max()), "shape": list(split.shape),
                               "codec_loaded": loaded, "max_abs": float(plain.abs().max())}
            with open(out, "w") as f:
                json.dump(result, f)
        else:
            assert split is None, "only rank 0 gets the images"
        leave()
        return
    slow = float(os.environ.get("SLOW_DECODE", "0"))
    if slow:  # a decoder that falls behind: each decode takes `slow` s more; when did denoising and decoding end?
        plain = pipe.generate(PROMPTS, PLAN, batch_size=2)
        events: list[tuple[str, float]] = []
        latents, decode = Sampler.latents, pipe.decode

        def timed_denoise(*a, **k):
            z = latents(*a, **k)
            events.append(("denoised", time.monotonic()))
            return z

        def slow_decode(z):
            time.sleep(slow)
            images = decode(z)
            events.append(("decoded", time.monotonic()))
            return images

        Sampler.latents, pipe.decode = timed_denoise, slow_decode  # (this worker process only)
        dist.barrier()
        split = pipe.generate(PROMPTS, PLAN, batch_size=2, ranks=DecodeRanks(decode_ranks))
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, events)
        if dist.get_rank() == 0:
            result["slow"] = {"equal": bool(torch.equal(split, plain)), "events": everyone}
            with open(out, "w") as f:
                json.dump(result, f)
        leave()
        return
    for schedule in (None, "uniform:2"):
        plan = dataclasses.replace(PLAN, cache_schedule=schedule)
        plain = pipe.generate(PROMPTS, plan, batch_size=2)  # 3 batches
        split = pipe.generate(PROMPTS, plan, batch_size=2, ranks=DecodeRanks(decode_ranks))
        returned = [None] * dist.get_world_size()
        dist.all_gather_object(returned, None if split is None else list(split.shape))
        if dist.get_rank() == 0:
            result[str(schedule)] = {"equal": bool(torch.equal(split, plain)), "shape": list(plain.shape),
                                     "returned": returned, "max_abs": float(plain.abs().max())}
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    leave()


def slow_alone(seconds: float) -> None:
    """decode_ranks=auto's calibration times each batch denoised alone `seconds` longer, so that Aco's helped batch is
    the faster and Aco stays on whatever this shared CPU does to the timings."""
    import contextlib

    from framework.inference import decoupled

    choose, co, helped = decoupled.choose_decode_ranks, decoupled.co_processing, [False]

    @contextlib.contextmanager
    def co_processing(*args, **kwargs):
        helped[0] = True
        try:
            with co(*args, **kwargs):
                yield
        finally:
            helped[0] = False

    def choose_decode_ranks(pipe, batch, denoise, *args, **kwargs):
        def timed(b):
            if not helped[0]:
                time.sleep(seconds)
            return denoise(b)
        return choose(pipe, batch, timed, *args, **kwargs)

    decoupled.co_processing, decoupled.choose_decode_ranks = co_processing, choose_decode_ranks


def roles_main(ckpt: str, decode_ranks: str, out: str) -> None:
    """`... tests.workers.decoupled roles CKPT K|auto OUT`: the sample command's way (a lazy pipeline of a checkpoint):
    per rank, whether it built the denoiser and loaded the image codec; rank 0 also
    checks the images against one process's."""
    from framework.cli import RankSharing, share_ranks
    from framework.distributed.sequence import group_of

    if os.environ.get("SLOW_ALONE"):
        slow_alone(float(os.environ["SLOW_ALONE"]))
    pipe = Pipeline.from_checkpoint(ckpt, lazy=True)
    k = decode_ranks if decode_ranks == "auto" else int(decode_ranks)
    cfg = RankSharing(decode_ranks=k, sequence_parallel=int(os.environ.get("SEQUENCE_PARALLEL", "1")),
                      aco=float(os.environ.get("ACO", "0")))
    share_ranks(pipe, cfg)
    images = pipe.generate(PROMPTS, PLAN, batch_size=2, ranks=cfg.sharing(), progress=True)
    again = pipe.generate(PROMPTS[:2], PLAN, batch_size=2, ranks=cfg.sharing(), progress=True)  # eval makes many
    sp = group_of(pipe.model)
    state = {"built": pipe._build is None, "codec": pipe._codec is not None,
             "meta": next(pipe.model.parameters()).is_meta, "split": None if sp is None else [sp.rank, sp.size]}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, state)
    if dist.get_rank() == 0:
        plain = Pipeline.from_checkpoint(ckpt).generate(PROMPTS, PLAN, batch_size=2)
        with open(out, "w") as f:
            json.dump({"equal": bool(torch.equal(images, plain)), "max_diff": float((images - plain).abs().max()),
                       "again_equal": bool(torch.equal(again, images[:2])), "ranks": everyone}, f)
    leave()


def wan_pipe(data: str, vae: str, tile: int, preset: str = "wan_debug") -> Pipeline:
    """A random Wan (or another video preset) whose latents (3 latent frames of 4x4) a tiny Wan video VAE decodes into
    9 frames of 16x16 (in TILE-pixel tiles; 0: whole frames), the prompts' text from DATA's encoder."""
    info = read_dataset_info(data)
    summary = {**info.summary(), "image_codec": vae, "image_mode": "RGB", "downsample": 4, "temporal_compression": 4,
               "scaling_factor": [1 / 1.5, 1 / 0.5, 1 / 2.0, 1.0], "shift_factor": [0.1, -0.2, 0.3, 0.0],
               "vae_tile": tile or None}
    torch.manual_seed(0)
    model = build_denoiser(load_preset(preset, in_channels=4, sample_size=4, num_frames=3, text_dim=384,
                                       num_layers=2))
    return Pipeline(model.eval(), Objective(ObjectiveConfig()), info.empty_text_embeds, summary)


def video_main(data: str, vae: str, decode_ranks: int, out: str, tile: int) -> None:
    """`... tests.workers.decoupled video DATA VAE K OUT TILE`: wan_pipe's decode_ranks=K clips against plain
    generation's. Rank 0 writes OUT."""
    init_from_env()
    pipe = wan_pipe(data, vae, tile)
    plain = pipe.generate(PROMPTS, PLAN, batch_size=2)
    split = pipe.generate(PROMPTS, PLAN, batch_size=2, ranks=DecodeRanks(decode_ranks))
    returned = [None] * dist.get_world_size()
    dist.all_gather_object(returned, None if split is None else list(split.shape))
    tiles = [None] * dist.get_world_size()
    dist.all_gather_object(tiles, None if pipe._codec is None else pipe._codec.tile)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"equal": bool(torch.equal(split, plain)), "shape": list(plain.shape), "returned": returned,
                       "max_abs": float(plain.abs().max()), "tiles": tiles}, f)
    leave()


def aco_main(family: str, data: str, vae: str, decode_ranks: int, out: str) -> None:
    """`... tests.workers.decoupled aco pixart|sana|wan|latte DATA VAE K OUT`: decode_ranks=K with aco=ACO_SHARE
    (default 0.5: half the heads to a free decoder; auto) against plain generation, and each rank's counts:
    self-attentions run and helped, heads sent and served. HOLD_DECODE=1: each decode waits until every denoising
    rank has sent its last "done" (a file each), so that every batch after a decoder's first finds it busy."""
    from pathlib import Path

    from framework.inference import decoupled

    init_from_env()
    image = family in ("pixart", "sana")
    pipe = pixart_pipe(data, vae, f"{family}_debug") if image else wan_pipe(data, vae, 8, f"{family}_debug")
    made = []
    init, end = decoupled.Aco.__init__, decoupled.Aco.end
    plan = dataclasses.replace(PLAN, steps=2)
    prompts = PROMPTS + PROMPTS[:1]  # 3 batches of 2
    world, rank = dist.get_world_size(), dist.get_rank()
    denoisers = world - decode_ranks
    mine = len(range(rank, 3, denoisers)) if rank < denoisers else 0  # this denoiser's batches

    def probe(self, *args):  # (this worker process only) every Aco made, to read its counts
        init(self, *args)
        made.append(self)

    def ended(self):  # a denoiser's last "done" sent: say so
        end(self)
        self.ends = getattr(self, "ends", 0) + 1
        if self.ends == mine:
            Path(f"{out}.done{rank}").touch()

    plain = pipe.generate(prompts, plan, batch_size=2) if rank == 0 else None  # before the probes: plainly
    decoupled.Aco.__init__, decoupled.Aco.end = probe, ended
    if os.environ.get("HOLD_DECODE") == "1":
        decode = pipe.decode

        def held(z):
            while not all(Path(f"{out}.done{r}").exists() for r in range(denoisers)):
                time.sleep(0.01)
            return decode(z)

        pipe.decode = held
    dist.barrier()
    share = os.environ.get("ACO_SHARE", "0.5")  # auto: PipeDiT's N_decode / N
    shared = pipe.generate(prompts, plan, batch_size=2,
                           ranks=DecodeRanks(decode_ranks, aco=share if share == "auto" else float(share)))
    (aco,) = made
    counts = {name: getattr(aco, name) for name in ("calls", "helped", "heads_sent", "served", "heads_served")}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, counts)
    if dist.get_rank() == 0:
        heads = pipe.model.cfg.num_heads
        with open(out, "w") as f:
            json.dump({"equal": bool(torch.equal(shared, plain)), "max_abs": float(plain.abs().max()),
                       "shape": list(shared.shape), "ranks": everyone, "heads": heads}, f)
    leave()


if __name__ == "__main__":
    if sys.argv[1] == "aco":
        aco_main(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6])
    elif sys.argv[1] == "roles":
        roles_main(sys.argv[2], sys.argv[3], sys.argv[4])
    elif sys.argv[1] == "video":
        video_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], int(sys.argv[6]))
    else:
        main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
