"""Decoupled generation (PipeDiT's DiT/VAE decoupling): some ranks denoise, the others decode.

With `decode_ranks=K` on W ranks, ranks 0..W-K-1 run the sampler and ranks W-K..W-1 run the image
decoder. Batch b (the same batches plain sampling draws) is denoised by denoiser b mod (W-K) and its
latents are sent, without waiting, to decoder b mod K, so decoding batch b overlaps denoising batch
b+1. Decoded images are sent to rank 0, which returns all of them in order; the other ranks return
None. Every image is computed exactly as plain sampling computes it (same noise, same batches, same
decode batches), so the images are identical.

torch.distributed gives the point-to-point sends; what it lacks is the schedule above, written here.
Launch: `torchrun --nproc_per_node=N -m framework.sample ... decode_ranks=K` (or framework.eval).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from framework.distributed.env import init_from_env


def join(decode_ranks: int | str) -> None:
    """For a command with decode_ranks=K (or auto): join torchrun's process group, refuse too few processes."""
    world = init_from_env()
    roles(world, 1 if decode_ranks == "auto" else decode_ranks)


def split_denoisers(pipe: Any, decode_ranks: int, size: int, head_groups: int = 1) -> None:
    """decode_ranks=K with sequence_parallel=P on W ranks: the W - K denoising ranks form groups of P consecutive
    ranks, each group denoising its batches together (its model split over the group when it is built: the
    pipeline's model is built on first use); the K decoding ranks decode. Every rank calls this (the groups are
    created collectively)."""
    from framework.distributed.sequence import SequenceParallel, check

    rank, world = dist.get_rank(), dist.get_world_size()
    denoisers = world - decode_ranks
    if denoisers % size:
        raise ValueError(f"decode_ranks={decode_ranks} with sequence_parallel={size} on {world} ranks leaves {denoisers} "
                         f"denoising ranks, not whole groups of {size}: launch {size * max(1, denoisers // size) + decode_ranks}"
                         f" processes, or change decode_ranks")
    check(pipe.model.cfg, size, head_groups, denoisers)
    groups = [dist.new_group(list(range(g * size, (g + 1) * size))) for g in range(denoisers // size)]
    sp = SequenceParallel(size, rank % size, groups[rank // size], rank // size, denoisers // size, head_groups) \
        if rank < denoisers else None
    pipe.split_when_built(sp, size)


def choose_decode_ranks(pipe: Any, batch: Any, denoise: Callable[[Any], torch.Tensor],
                        latent_shape: tuple[int, ...]) -> int:
    """decode_ranks=auto: K from measured stage times. Rank 0 (always a denoiser) denoises `batch` and sends the
    latents to the last rank (always a decoder), which decodes them, each timed once warm (models loaded first);
    the other ranks wait. With W ranks, denoising keeps up with decoding when (W - K) / t_denoise = K / t_decode:
    K = W t_decode / (t_denoise + t_decode), rounded, between 1 and W - 1. Every rank returns the same K."""
    rank, world = dist.get_rank(), dist.get_world_size()
    times = torch.zeros(2, dtype=torch.float64)
    if rank == 0:
        pipe.ensure_model()
        t0 = time.perf_counter()
        z = denoise(batch)
        times[0] = time.perf_counter() - t0
        dist.send(_wire(z), dst=world - 1)
    elif rank == world - 1:
        z = _wire(torch.empty(len(batch), *latent_shape))
        dist.recv(z, src=0)
        _ = pipe.codec  # loaded before the clock starts
        t0 = time.perf_counter()
        pipe.decode(z.to(pipe.device))
        times[1] = time.perf_counter() - t0
    times = _wire(times)
    dist.all_reduce(times)
    t_denoise, t_decode = times.tolist()
    k = min(max(round(world * t_decode / (t_denoise + t_decode)), 1), world - 1)
    if rank == 0:
        print(f"decode_ranks=auto: a batch of {len(batch)} takes {t_denoise:.2f} s to denoise and {t_decode:.2f} s "
              f"to decode: {k} of {world} ranks decode", flush=True)
    return k


def roles(world: int, decode_ranks: int) -> tuple[list[int], list[int]]:
    """(denoising ranks, decoding ranks) for decode_ranks=K on `world` ranks."""
    if not 1 <= decode_ranks < world:
        raise ValueError(f"decode_ranks={decode_ranks} needs at least {decode_ranks + 1} processes (one or more "
                         f"denoise, {decode_ranks} decode) but this job has {world}: launch with "
                         f"torchrun --nproc_per_node={decode_ranks + 1} (or more), or set decode_ranks=0")
    return list(range(world - decode_ranks)), list(range(world - decode_ranks, world))


_IMAGE_GROUPS: dict[int, Any] = {}


def _image_group() -> Any:
    """The process group decoded images return to rank 0 on, apart from the one latents travel on.

    NCCL pairs a pair of ranks' sends and receives in the order they were issued, on one stream per pair and
    process group. On one group, a decoder's send of batch b's images (pending until rank 0 receives them, after
    its own denoising) would sit before its receive of its next latents, while rank 0's send of those latents sits
    before its receive of the images: each waits on the other, a deadlock as soon as a decoder falls behind.
    Two groups give each direction its own order. Created once per job (a collective: every rank calls it).
    """
    key = id(dist.distributed_c10d._get_default_group())
    if key not in _IMAGE_GROUPS:
        _IMAGE_GROUPS[key] = dist.new_group(backend=dist.get_backend())
    return _IMAGE_GROUPS[key]


def _wire(t: torch.Tensor) -> torch.Tensor:
    """Where tensors travel: GPU memory under nccl, host memory under gloo."""
    backend = dist.get_backend()
    return t.contiguous().cuda() if backend == "nccl" else t.contiguous().cpu()


def generate_decoupled(pipe: Any, batches: Sequence[Any], decode_ranks: int,
                       denoise: Callable[[Any], torch.Tensor], latent_shape: tuple[int, ...],
                       on_batch: Callable[[int], None] | None = None, group_size: int = 1) -> torch.Tensor | None:
    """Run `denoise(batch) -> latents` on the denoising ranks and `pipe.decode` on the decoding ranks (`pipe`: a
    framework.inference.pipeline.Pipeline; framework/inference/sharing.py's DecodeRanks calls this). group_size:
    the denoising ranks' sequence-parallel groups (split_denoisers); each group's first rank sends its latents.

    Every rank calls this with the same `batches` (each a sized batch, framework/inference/sampling.py's Draws).
    Rank 0 gets the images of all batches in order; the other ranks get None.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    denoisers, decoders = roles(world, decode_ranks)
    P = group_size  # a sequence-parallel group of P consecutive denoising ranks draws each of its batches together
    groups = len(denoisers) // P
    denoiser_of = lambda b: (b % groups) * P  # the group's first rank sends its latents
    decoder_of = lambda b: decoders[b % len(decoders)]
    images_group = _image_group()
    sends = []
    if rank in denoisers:
        for b, batch in enumerate(batches):
            if b % groups == rank // P:
                z = denoise(batch)  # (n, *latent_shape)
                if rank == denoiser_of(b):
                    sends.append((dist.isend(_wire(z), dst=decoder_of(b), tag=b), z))  # decoded while we go on
                if on_batch:
                    on_batch(len(batch))
    else:
        for b, batch in enumerate(batches):
            if decoder_of(b) == rank:
                z = _wire(torch.empty(len(batch), *latent_shape))
                dist.recv(z, src=denoiser_of(b), tag=b)
                images = _wire(pipe.decode(z.to(pipe.device)))  # (n, c, h, w)
                shape = _wire(torch.tensor(images.shape, dtype=torch.long))
                sends += [(dist.isend(shape, dst=0, tag=b, group=images_group), shape),
                          (dist.isend(images, dst=0, tag=b, group=images_group), images)]
    out = None
    if rank == 0:
        out = []
        for b in range(len(batches)):
            shape = _wire(torch.empty(1 + len(latent_shape), dtype=torch.long))  # images: (n, c, *spatial) like latents
            dist.recv(shape, src=decoder_of(b), tag=b, group=images_group)
            images = _wire(torch.empty(*shape.tolist()))
            dist.recv(images, src=decoder_of(b), tag=b, group=images_group)
            out.append(images.cpu())
        out = torch.cat(out)
    for work, _tensor in sends:  # the tensor stays referenced until its send is done
        work.wait()
    return out
