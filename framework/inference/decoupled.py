"""Decoupled generation (PipeDiT's DiT/VAE decoupling): some ranks denoise, the others decode.

With `decode_ranks=K` on W ranks, ranks 0..W-K-1 run the sampler and ranks W-K..W-1 run the image
decoder. Batch b (the same batches plain sampling draws) is denoised by denoiser b mod (W-K) and its
latents are sent, without waiting, to decoder b mod K, so decoding batch b overlaps denoising batch
b+1. Decoded images are sent to rank 0, which returns all of them in order; the other ranks return
None. Every image is computed exactly as plain sampling computes it (same noise, same batches, same
decode batches), so the images are identical.

Attention co-processing (PipeDiT's Aco, `aco=F`): a decoding rank with nothing to decode computes attention heads
for the denoiser whose latents it waits for. Decoder d, once it has decoded its batches before b (at once for its
first), sends "free for b" to b's denoiser and serves it until "done with b" comes, then receives b's latents. The
denoiser asks at each self-attention, without waiting, whether "free for b" is in; from then on it sends the query,
key and value of the last round(F H) of the H heads to the decoder, attends over its own heads meanwhile, and takes
the decoder's heads back. Heads are independent of each other, so the images are those without Aco. Only the
first batch of each decoder is waited for (its decoder is free from the start); later, a decoder still decoding
is not waited for, and the denoiser computes every head itself. (`Aco`, `co_processing`, `_serve`.)

torch.distributed gives the point-to-point sends; what it lacks is the schedule above, written here.
Launch: `torchrun --nproc_per_node=N -m framework.sample ... decode_ranks=K` (or framework.eval).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

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
                        latent_shape: tuple[int, ...], aco: "Aco | None" = None) -> tuple[int, bool]:
    """decode_ranks=auto: K from measured stage times. Rank 0 (always a denoiser) denoises `batch` and sends the
    latents to the last rank (always a decoder), which decodes them, each timed once warm (models loaded first);
    with `aco`, rank 0 then denoises it with the last rank computing its share of the heads, and once more alone, both
    timed (the first run is then a warm-up only: a first call's one-time costs would favour Aco). The other ranks
    wait. K is the count `throughput` predicts the most batches a second for (the fewest of equals), between 1 and
    W - 1. Every rank returns the same (K, whether to use Aco): not when a helped batch took as long as one alone."""
    rank, world = dist.get_rank(), dist.get_world_size()
    times = torch.zeros(3, dtype=torch.float64)
    if rank == 0:
        pipe.ensure_model()
        t0 = time.perf_counter()
        z = denoise(batch)
        times[0] = times[2] = time.perf_counter() - t0
        if aco is not None:  # the first run was also the warm-up: both timed warm, in turn
            with co_processing(pipe.model, aco):
                aco.begin(0, world - 1, wait=True)
                t0 = time.perf_counter()
                z = denoise(batch)
                times[2] = time.perf_counter() - t0
                aco.end()
            t0 = time.perf_counter()
            z = denoise(batch)
            times[0] = time.perf_counter() - t0
        dist.send(_wire(z), dst=world - 1)
    elif rank == world - 1:
        if aco is not None:
            _serve(aco, 0, 0, pipe.device)
        z = _wire(torch.empty(len(batch), *latent_shape))
        dist.recv(z, src=0)
        _ = pipe.codec  # loaded before the clock starts
        t0 = time.perf_counter()
        pipe.decode(z.to(pipe.device))
        times[1] = time.perf_counter() - t0
    times = _wire(times)
    dist.all_reduce(times)
    t_denoise, t_decode, t_helped = times.tolist()
    use_aco = aco is not None and t_helped < t_denoise
    rates = [throughput(world, k, t_denoise, t_decode, t_helped if use_aco else t_denoise) for k in range(1, world)]
    k = 1 + rates.index(max(rates))
    if aco is not None:  # the counts told after generation are its own
        aco.reset_counts()
    if rank == 0:
        helped = f" ({t_helped:.2f} s with a decoding rank's help)" if aco is not None else ""
        off = "; aco off: the help did not pay" if aco is not None and not use_aco else ""
        print(f"decode_ranks=auto: a batch of {len(batch)} takes {t_denoise:.2f} s to denoise{helped} and "
              f"{t_decode:.2f} s to decode: {k} of {world} ranks decode{off}", flush=True)
    return k, use_aco


def throughput(world: int, decoders: int, t_denoise: float, t_decode: float, t_helped: float) -> float:
    """Batches a second that `decoders` of `world` ranks are predicted to draw, from one batch's times: to denoise
    (t_denoise), to decode (t_decode), and to denoise with a decoding rank computing a share of the heads throughout
    (t_helped, at most t_denoise; = t_denoise without Aco).

    At a rate r each decoder is busy u = r t_decode / K of the time and free the rest; a free decoder helps one
    denoiser, so a share h = min(1, (1 - u) K / D) of the D = W - K denoisers' time is helped, and the denoisers draw
    D ((1 - h) / t_denoise + h / t_helped) batches a second. r is where that or K / t_decode (decoding), the lower,
    equals r; the lower one falls as r rises (less help), so r is found by bisection."""
    d, k = world - decoders, decoders
    decode_rate = k / max(t_decode, 1e-12)
    t_helped = min(t_helped, t_denoise)

    def rate(r: float) -> float:
        busy = min(1.0, r * t_decode / k)
        helped = min(1.0, (1 - busy) * k / d)
        return min(d * ((1 - helped) / t_denoise + helped / t_helped), decode_rate)

    lo, hi = 0.0, rate(0.0)
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rate(mid) > mid else (lo, mid)
    return lo


def roles(world: int, decode_ranks: int) -> tuple[list[int], list[int]]:
    """(denoising ranks, decoding ranks) for decode_ranks=K on `world` ranks."""
    if not 1 <= decode_ranks < world:
        raise ValueError(f"decode_ranks={decode_ranks} needs at least {decode_ranks + 1} processes (one or more "
                         f"denoise, {decode_ranks} decode) but this job has {world}: launch with "
                         f"torchrun --nproc_per_node={decode_ranks + 1} (or more), or set decode_ranks=0")
    return list(range(world - decode_ranks)), list(range(world - decode_ranks, world))


_SIDE_GROUPS: dict[tuple[int, str], Any] = {}


def _side_group(name: str) -> Any:
    """A process group of every rank for one kind of traffic, apart from the one latents travel on: "images"
    (decoded images return to rank 0) and "aco" (attention co-processing).

    NCCL pairs a pair of ranks' sends and receives in the order they were issued, on one stream per pair and
    process group. On one group, a decoder's send of batch b's images (pending until rank 0 receives them, after
    its own denoising) would sit before its receive of its next latents, while rank 0's send of those latents sits
    before its receive of the images: each waits on the other, a deadlock as soon as a decoder falls behind.
    Two groups give each direction its own order; Aco's messages, which a decoder answers only when free, get a
    third. Created once per job (a collective: every rank calls it, in the same order).
    """
    key = (id(dist.distributed_c10d._get_default_group()), name)
    if key not in _SIDE_GROUPS:
        _SIDE_GROUPS[key] = dist.new_group(backend=dist.get_backend())
    return _SIDE_GROUPS[key]


def _wire(t: torch.Tensor) -> torch.Tensor:
    """Where tensors travel: GPU memory under nccl, host memory under gloo."""
    backend = dist.get_backend()
    return t.contiguous().cuda() if backend == "nccl" else t.contiguous().cpu()


def generate_decoupled(pipe: Any, batches: Sequence[Any], decode_ranks: int,
                       denoise: Callable[[Any], torch.Tensor], latent_shape: tuple[int, ...],
                       on_batch: Callable[[int], None] | None = None, group_size: int = 1,
                       aco: "Aco | None" = None) -> torch.Tensor | None:
    """Run `denoise(batch) -> latents` on the denoising ranks and `pipe.decode` on the decoding ranks (`pipe`: a
    framework.inference.pipeline.Pipeline; framework/inference/sharing.py's DecodeRanks calls this). group_size:
    the denoising ranks' sequence-parallel groups (split_denoisers); each group's first rank sends its latents.
    aco: given on every rank (the same share) for attention co-processing; the denoising ranks' model has its
    processors (co_processing).

    Every rank calls this with the same `batches` (each a sized batch, framework/inference/sampling.py's Draws).
    Rank 0 gets the images of all batches in order; the other ranks get None.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    denoisers, decoders = roles(world, decode_ranks)
    P = group_size  # a sequence-parallel group of P consecutive denoising ranks draws each of its batches together
    groups = len(denoisers) // P
    denoiser_of = lambda b: (b % groups) * P  # the group's first rank sends its latents
    decoder_of = lambda b: decoders[b % len(decoders)]
    images_group = _side_group("images")
    sends = []
    if rank in denoisers:
        for b, batch in enumerate(batches):
            if b % groups == rank // P:
                if aco is not None:  # a decoder's first batch: it is free from the start
                    aco.begin(b, decoder_of(b), wait=b < len(decoders))
                z = denoise(batch)  # (n, *latent_shape)
                if aco is not None:
                    aco.end()
                if rank == denoiser_of(b):
                    sends.append((dist.isend(_wire(z), dst=decoder_of(b), tag=b), z))  # decoded while we go on
                if on_batch:
                    on_batch(len(batch))
    else:
        for b, batch in enumerate(batches):
            if decoder_of(b) == rank:
                if aco is not None:  # nothing to decode until b's latents come: help b's denoiser meanwhile
                    _serve(aco, denoiser_of(b), b, pipe.device)
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
    if aco is not None:
        aco.close()
    return out


# --------------------------------------------------------------------------------------------------
# Attention co-processing (Aco)
# --------------------------------------------------------------------------------------------------

_DONE, _ATTEND = 0, 1  # the kinds of a denoiser's message to its helper
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class _Arrival:
    """A posted receive that can be asked, without waiting, whether its message is in. NCCL's work says so itself;
    gloo's says complete only once waited for, so a thread waits for it (the wait releases the GIL), keeping what it
    raised (a timeout) for this thread to raise."""

    def __init__(self, work: Any, buffer: torch.Tensor) -> None:
        self.work, self.buffer, self.thread, self.error = work, buffer, None, None
        if dist.get_backend() != "nccl":
            self.thread = threading.Thread(target=self._wait, daemon=True)
            self.thread.start()

    def _wait(self) -> None:
        try:
            self.work.wait()
        except BaseException as e:  # noqa: BLE001 (raised again where the message is used)
            self.error = e

    def arrived(self) -> bool:
        if self.thread is None:
            return self.work.is_completed()
        if self.thread.is_alive():
            return False
        if self.error is not None:
            raise self.error
        return True

    def wait(self) -> None:
        if self.thread is None:
            self.work.wait()
            return
        self.thread.join()
        if self.error is not None:
            raise self.error


class Aco:
    """A rank's part in attention co-processing (`aco=share`): on a denoising rank, the link to the decoder of the
    batch it denoises, which co_processing's attention processors use (`attend`); on a decoding rank, what `_serve`
    counts. Create it on every rank (its process group is a collective)."""

    def __init__(self, share: float, decode_ranks: int | str) -> None:
        if not 0 < share < 1:
            raise ValueError(f"aco={share}: the share of each self-attention's heads an idle decoding rank computes, "
                             "between 0 and 1 (0: off)")
        self.share, self.group = share, _side_group("aco")
        self._connect(decode_ranks)
        self.helper: int | None = None  # the decoding rank of the batch being denoised
        self.batch = -1
        self.free: _Arrival | None = None  # its "free for this batch", once posted
        self.ready = False
        self.pending: list[Any] = []  # messages not yet known to be through: waited for in close()
        self.reset_counts()

    def reset_counts(self) -> None:
        """Zero the counts (logs, tests): self-attentions run and helped, heads sent; heads and calls served."""
        self.calls = self.helped = self.heads_sent = self.served = self.heads_served = 0

    def _connect(self, decode_ranks: int | str) -> None:
        """A first message between every denoising and decoding rank that may pair up, in one order on every rank,
        so that NCCL sets up each pair's connection now rather than on a batch's first "free" (where a denoiser would
        sit until its decoder is done with an earlier batch). auto: every pair of ranks."""
        world, rank = dist.get_world_size(), dist.get_rank()
        if decode_ranks == "auto":
            pairs = [(a, b) for a in range(world) for b in range(a + 1, world)]
        else:
            denoisers, decoders = roles(world, decode_ranks)
            pairs = [(a, b) for a in denoisers for b in decoders]
        token = _wire(torch.zeros(1, dtype=torch.long))
        for a, b in pairs:
            if rank == a:
                dist.send(token, dst=b, group=self.group)
            elif rank == b:
                dist.recv(token, src=a, group=self.group)

    def heads(self, H: int) -> int:
        """How many of H heads go to a free helper: round(share H), leaving at least one here."""
        return min(H - 1, round(self.share * H))

    def begin(self, b: int, helper: int, wait: bool) -> None:
        """Batch b starts, decoded by `helper`: listen for its "free for b" (wait: until it comes)."""
        self.helper, self.batch, self.ready = helper, b, False
        buffer = _wire(torch.zeros(1, dtype=torch.long))
        self.free = _Arrival(dist.irecv(buffer, src=helper, tag=b, group=self.group), buffer)
        if wait:
            self.free.wait()
            self.ready = True

    def end(self) -> None:
        """Batch b is denoised: "done with b" to its helper (it reads it once free, so not waited for here)."""
        done = _wire(torch.tensor([_DONE] + [0] * 7))
        self.pending.append((dist.isend(done, dst=self.helper, tag=self.batch, group=self.group), done))
        if not self.ready:
            self.pending.append((self.free, None))
        self.helper, self.free = None, None

    def close(self) -> None:
        for work, _tensor in self.pending:
            work.wait()
        self.pending = []

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Softmax attention of q, k, v (B, n, H, D) -> (B, n, H, D): the last heads(H) heads on the helper when it
        is free, the others here meanwhile; all here otherwise."""
        self.calls += 1
        H = q.shape[2]
        h = self.heads(H)
        if h and not self.ready and self.free is not None and self.free.arrived():
            self.free.wait()
            self.ready = True
        local = lambda heads: F.scaled_dot_product_attention(*(t[:, :, heads].transpose(1, 2) for t in (q, k, v)))
        if not (h and self.ready):
            return local(slice(None)).transpose(1, 2)
        own = H - h
        theirs = _wire(torch.stack([t[:, :, own:].transpose(1, 2) for t in (q, k, v)]))  # (3, B, h, n, D)
        header = _wire(torch.tensor([_ATTEND, _DTYPES.index(theirs.dtype), *theirs.shape, v.shape[-1]]))
        dist.send(header, dst=self.helper, tag=self.batch, group=self.group)
        sent = dist.isend(theirs, dst=self.helper, tag=self.batch, group=self.group)
        back = _wire(torch.empty(*theirs.shape[1:4], v.shape[-1], dtype=theirs.dtype))
        received = dist.irecv(back, src=self.helper, tag=self.batch, group=self.group)
        mine = local(slice(0, own))  # (B, own, n, D), while the helper computes its heads
        received.wait()
        sent.wait()
        self.helped, self.heads_sent = self.helped + 1, self.heads_sent + h
        return torch.cat([mine, back.to(mine.device)], dim=1).transpose(1, 2)


def _serve(aco: Aco, denoiser: int, b: int, device: Any) -> None:
    """On a decoding rank with nothing to decode before batch b: "free for b" to b's denoiser, then compute the
    attention heads it sends until it is done with b."""
    free = _wire(torch.ones(1, dtype=torch.long))
    told = dist.isend(free, dst=denoiser, tag=b, group=aco.group)
    header = _wire(torch.empty(8, dtype=torch.long))
    while True:
        dist.recv(header, src=denoiser, tag=b, group=aco.group)
        kind, dtype, *shape = header.tolist()
        if kind == _DONE:
            break
        qkv = _wire(torch.empty(*shape[:5], dtype=_DTYPES[dtype]))
        dist.recv(qkv, src=denoiser, tag=b, group=aco.group)
        out = F.scaled_dot_product_attention(*qkv.to(device))
        dist.send(_wire(out), dst=denoiser, tag=b, group=aco.group)
        aco.served, aco.heads_served = aco.served + 1, aco.heads_served + shape[2]
    told.wait()


class AcoAttnProcessor:
    """Plain softmax self-attention (in place of AttnProcessor2_0: pixart, dit, latte) with its heads shared with a
    free decoding rank (Aco.attend)."""

    def __init__(self, aco: Aco) -> None:
        self.aco = aco

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, **_: Any) -> torch.Tensor:
        from framework.distributed.sequence import softmax_qkv

        if attention_mask is not None or encoder_hidden_states is not None:
            raise ValueError("aco shares unmasked self-attention only; set aco=0")
        q, k, v = softmax_qkv(attn, hidden_states)
        out = self.aco.attend(q, k, v).flatten(2).to(q.dtype)
        return attn.to_out[1](attn.to_out[0](out))


class AcoWanAttnProcessor:
    """Wan's self-attention (in place of WanAttnProcessor on attn1) with its heads shared likewise."""

    def __init__(self, aco: Aco) -> None:
        self.aco = aco

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, rotary_emb: tuple | None = None) -> torch.Tensor:
        from framework.distributed.sequence import wan_qkv

        if attention_mask is not None or encoder_hidden_states is not None:
            raise ValueError("aco shares Wan's unmasked self-attention only; set aco=0")
        q, k, v = wan_qkv(attn, hidden_states, rotary_emb)
        out = self.aco.attend(q, k, v).flatten(2).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def aco_processors(denoiser: Any, aco: Any) -> list[tuple[Any, Any]]:
    """(self-attention module, the Aco processor for it) for every block of `denoiser`, or an error naming what Aco
    cannot share. Softmax self-attention only: SANA's linear attention costs less than sending its inputs, and the
    UNet is not a stack of blocks. Reads structure only, so a decoding rank runs it on its meta-device placeholder:
    every rank refuses before any Aco message (a refusal on the denoisers alone would leave the decoders waiting)."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    from framework.distributed.sequence import check_plain_softmax
    from framework.models.blocks import block_views
    from framework.models.families import families_with, plan_of

    family = denoiser.cfg.family
    seq = plan_of(family).sequence
    if seq is None or seq.attention == "linear":
        shared = families_with(lambda p: p.sequence is not None and p.sequence.attention != "linear")
        raise ValueError(f"aco: model.family={family} has no softmax self-attention stack to share (only {shared}); "
                         "set aco=0")
    out = []
    for view in block_views(denoiser):
        attn = view.module.attn1
        if isinstance(attn.processor, WanAttnProcessor):
            if attn.add_k_proj is not None:
                raise ValueError(f"aco: {view.name}.attn1 also attends to an image (Wan's image-to-video attention)")
            if getattr(attn.processor, "_attention_backend", None) is not None or \
                    getattr(attn.processor, "_parallel_config", None) is not None:
                raise ValueError(f"aco: {view.name}.attn1 has an attention backend or a context-parallel plan of "
                                 "diffusers' set; Aco computes with torch's attention: set aco=0")
            out.append((attn, AcoWanAttnProcessor(aco)))
        else:
            check_plain_softmax(attn, f"{view.name}.attn1", "aco")
            out.append((attn, AcoAttnProcessor(aco)))
    return out


@contextlib.contextmanager
def co_processing(denoiser: Any, aco: Aco | None) -> Iterator[None]:
    """With `aco`, every block's self-attention shares its heads (AcoAttnProcessor / AcoWanAttnProcessor in place of
    the processors diffusers put there, put back on exit); nothing without."""
    if aco is None:
        yield
        return
    swapped = []
    for attn, processor in aco_processors(denoiser, aco):
        swapped.append((attn, attn.processor))
        attn.set_processor(processor)
    try:
        yield
    finally:
        for attn, processor in swapped:
            attn.set_processor(processor)
