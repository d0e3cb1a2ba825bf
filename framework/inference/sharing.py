"""The ways ranks share one generate call, each around the one-process Sampler (framework/inference/sampling.py).

- `OneProcess` (the default): this process draws every image. A model split over a sequence-parallel
  group (framework/distributed/sequence.py) is called by every rank of its group; they draw every image
  together and all get them.
- `SplitRanks`: inside a multi-process job every rank calls generate; each rank (each sequence-parallel
  group) draws a contiguous share and every rank gets all images back, the ones one process would draw;
  with decode_on_rank0 the shares' latents go to rank 0, which alone decodes (and loads the VAE).
- `DecodeRanks(k)`: the last k ranks decode while the others denoise (framework/inference/decoupled.py);
  rank 0 gets all images, the other ranks None.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from framework.distributed.sequence import group_of
from framework.inference.sampling import Draws, Sampler


@dataclass(frozen=True)
class OneProcess:
    """Every image on this process (on every rank of the model's sequence-parallel group, when it is split)."""

    def run(self, sampler: Sampler, draws: Draws) -> torch.Tensor:
        sampler.pipe.ensure_model()
        sp = group_of(sampler.pipe.model)
        if sp is None or _world_size() == 1:
            return sampler.images(draws)
        return _shared(sampler, draws, 1, 0, sp, decode_here=True)


@dataclass(frozen=True)
class SplitRanks:
    """Every rank (every sequence-parallel group) draws its own contiguous share; every rank gets all images, or with
    decode_on_rank0 rank 0 alone decodes and gets them (the others get None)."""

    decode_on_rank0: bool = False

    def run(self, sampler: Sampler, draws: Draws) -> torch.Tensor | None:
        import torch.distributed as dist

        sampler.pipe.ensure_model()
        world, sp = _world_size(), group_of(sampler.pipe.model)
        if world == 1:
            return sampler.images(draws)
        shares, share = (sp.dp_size, sp.dp_rank) if sp is not None else (world, dist.get_rank())
        return _shared(sampler, draws, shares, share, sp, decode_here=not (self.decode_on_rank0 and shares > 1))


@dataclass(frozen=True)
class DecodeRanks:
    """The last `k` ranks decode while the others denoise; "auto": k from the first batch's measured denoising and
    decoding times. `aco`: a decoding rank with nothing to decode computes this share of each self-attention's heads
    for the denoiser whose latents it waits for (PipeDiT's Aco; "auto": k / the ranks, PipeDiT's N_decode / N; 0:
    off). Rank 0 gets all images, the same ones plain sampling draws; the other ranks get None."""

    k: int | str
    aco: float | str = 0.0

    def run(self, sampler: Sampler, draws: Draws) -> torch.Tensor | None:
        import torch.distributed as dist
        from tqdm import tqdm

        from framework.inference.decoupled import (Aco, _wire, aco_processors, choose_decode_ranks, co_processing,
                                                   generate_decoupled)

        pipe, k = sampler.pipe, self.k
        sp = group_of(pipe.model)
        if sp is not None and sp is not pipe.sequence:  # (split_denoisers' groups are the supported way)
            raise ValueError("decode_ranks with a model split for sequence_parallel over every rank: split only the "
                             "denoising ranks (framework.cli.share_ranks with both set)")
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(f"decode_ranks={k} needs a multi-process job: launch with "
                             f"torchrun --nproc_per_node={k + 1 if isinstance(k, int) else 2} (or more)")
        batches = draws.batches(sampler.batch_size)
        bar = tqdm(total=len(draws), desc="denoise", unit="img", disable=not (sampler.progress and dist.get_rank() == 0),
                   leave=False)
        active: dict[str, Any] = {"runner": None}  # the cache runner, once installed
        denoise = lambda batch: sampler.latents(batch, active["runner"])  # noqa: E731
        if self.aco and pipe.group_size > 1:
            raise ValueError("aco with sequence-parallel denoising groups is not supported: set aco=0 or "
                             "sequence_parallel=1")
        if self.aco:  # refused on every rank alike (a decoding rank reads its placeholder's structure)
            aco_processors(pipe.model, None)
        world = dist.get_world_size()
        share = (k if isinstance(k, int) else 1) / world if self.aco == "auto" else self.aco  # auto: calibrated on 1
        aco = Aco(share, k) if self.aco else None  # (on every rank: its process group is a collective)
        if k == "auto":
            if pipe.group_size > 1:
                raise ValueError("decode_ranks=auto with sequence_parallel: give the number of decoding ranks")
            k, use_aco = choose_decode_ranks(pipe, batches[0], denoise, sampler.shape, aco)
            aco = aco if use_aco else None
            if aco is not None and self.aco == "auto":
                aco.share = k / world
        if aco is not None and self.aco == "auto" and sampler.progress and dist.get_rank() == 0:
            print(f"aco=auto: each idle decoding rank computes {aco.share:.3g} of the heads ({k} decoding of {world} "
                  "ranks)", flush=True)
        denoising = dist.get_rank() < dist.get_world_size() - k
        if denoising:  # a decoding rank never builds the denoiser
            pipe.ensure_model()
        with co_processing(pipe.model if denoising else None, aco if denoising else None), \
                sampler.caching(on=denoising) as active["runner"]:
            images = generate_decoupled(pipe, batches, k, denoise, sampler.shape, bar.update, pipe.group_size, aco)
        bar.close()
        if aco is not None:  # every rank's counts, told once
            counts = _wire(torch.tensor([aco.calls, aco.helped, aco.heads_sent], dtype=torch.long))
            dist.all_reduce(counts)
            if sampler.progress and dist.get_rank() == 0:
                calls, helped, heads = counts.tolist()
                print(f"aco: decoding ranks computed {heads} heads in {helped} of the {calls} self-attentions",
                      flush=True)
        return images


Sharing = OneProcess | SplitRanks | DecodeRanks  # how the ranks share a generate call


def _shared(sampler: Sampler, draws: Draws, shares: int, share: int, sp: Any, decode_here: bool) -> torch.Tensor | None:
    """Share `share` of `shares` equal shares drawn here (the last ones padded with a repeat of image 0, so that every
    rank runs the same number of forwards, which FSDP's collectives need), then gathered. A sequence-parallel group
    (P consecutive ranks) draws one share together; its P copies are identical, so its first rank decodes.
    decode_here=False: the latents go to rank 0, decoded there alone; the other ranks get None."""
    import torch.distributed as dist

    world, n, device = dist.get_world_size(), len(draws), sampler.pipe.device
    per = math.ceil(n / shares)
    idx = [i for i in range(share * per, (share + 1) * per) if i < n]
    idx += [0] * (per - len(idx))
    leader = sp is None or sp.rank == 0
    mine = sampler.images(draws[idx], decode=decode_here and leader,
                          progress=sampler.progress and dist.get_rank() == 0).to(device)
    if decode_here and sp is not None and sp.size > 1:
        mine = _from_group_leader(mine, sp, leader)
    if shares == 1:
        return mine.cpu()
    if not decode_here:
        gathered = [torch.empty_like(mine) for _ in range(world)] if dist.get_rank() == 0 else None
        dist.gather(mine, gathered, dst=0)
        if dist.get_rank() != 0:
            return None
        z = torch.cat(gathered[:: world // shares])[:n].to(device)
        return torch.cat([sampler.pipe.decode(z[i : i + sampler.batch_size]) for i in range(0, n, sampler.batch_size)])
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    return torch.cat(gathered[:: world // shares])[:n].cpu()


def _from_group_leader(images: torch.Tensor, sp: Any, leader: bool) -> torch.Tensor:
    """The images the sequence-parallel group's first rank decoded, on every rank of the group (the others hold
    their latents until then): the shape, then the images, broadcast inside the group."""
    import torch.distributed as dist

    src = dist.get_global_rank(sp.group, 0)
    shape = torch.tensor(list(images.shape) if leader else [0] * images.dim(), dtype=torch.long, device=images.device)
    dist.broadcast(shape, src=src, group=sp.group)
    out = images if leader else torch.empty(tuple(shape.tolist()), dtype=torch.float32, device=images.device)
    dist.broadcast(out, src=src, group=sp.group)
    return out


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
