"""Sequence parallelism (`strategy.sequence_parallel=P`): Ulysses for the pixart, sana, dit and wan families, layout
switching for latte (an ST-DiT; `_FrameSwitch`).

The W ranks form a (W/P data-parallel) x (P sequence-parallel) mesh; a sequence-parallel group is P
consecutive ranks, which see the same samples, timesteps and caption dropout (Streaming's `replication`
and the module's draw by data-parallel rank). Inside a group each rank holds 1/P of the image tokens,
a contiguous band of rows:

    patch embedding       every rank embeds the whole latent, then keeps its band (a forward hook)
    softmax self-attn     all-to-all sequence -> heads (q, k, v in one exchange per head group), attention
                          over all tokens for H/P heads, all-to-all back; with G head groups each group's
                          exchanges overlap another group's attention, forward and backward, and each group's
                          output is projected (its columns of the output projection) while later ones travel; the
                          block's caption K/V projections run while the first exchanges travel
    SANA linear attn      the small per-head sums K^T.V and sum(K) are all-reduced (one all-reduce per head group,
                          each travelling while the next group's sums, or the previous group's output, are computed,
                          forward and backward), then applied locally
    SANA Mix-FFN          the 3x3 depthwise conv gets its two neighbours' boundary rows first (send / receive)
    cross-attn, MLPs,     stay local: they mix channels or attend to the caption, never across tokens
    norms, adaLN
    output projection     gathered back to the whole sequence, so unpatchify, loss and sampler are as on
                          one rank (the sampler's final latent is whole on every rank before decoding)

A group of whole nodes (the mesh's ring dim R > 1): softmax attention's all-to-all runs over a node's P / R ranks,
leaving each N / R queries of H R / P heads, and the keys and values go round the R nodes (`_RingAttention`); the
halo, SANA's sums, Latte's switches and the gathers run over the whole group.

Wan (full 3D attention over every frame's tokens, 3D RoPE): its tokens are flattened frame by frame, row by row in
the net's forward, so the band is cut from the first block's input; its rotary tables are cut to the same band, so
each rank rotates its queries and keys by their own positions before the all-to-all (the places diffusers' own
context-parallel plan for Wan splits).

Gradients: each rank's backward gives the parameter gradient through its own tokens; the full gradient
is their sum over the group. The gather's backward returns P x this rank's slice, so the data-parallel
*mean* over all W ranks that DDP / FSDP2 already take (FSDP2 shards over every rank) is the mean over the
W/P groups of full gradients: the same step as one rank training on the data-parallel batch.

What is whose: diffusers has no context-parallel plan for these three families and its attention processors
for them do not dispatch through its context-parallel attention, so all of it is written here: the token split /
gather hooks, the processors, one Ulysses attention for every head-group count (torch's functional all-to-all,
asynchronous until its result is used, wrapped so that its backward is asynchronous too), SANA's linear-attention
all-reduces (the same, by head group) and Mix-FFN halo exchange. diffusers' own Ulysses attention
(`dispatch_attention_fn` with a ContextParallelConfig) is a reference in tests/workers/sequence.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from framework.distributed.mesh import Mesh
from framework.models.backbones import Denoiser, ModelConfig
from framework.models.families import families_with, plan_of



# --------------------------------------------------------------------------------------------------
# Checks and the process groups
# --------------------------------------------------------------------------------------------------

def check(cfg: ModelConfig, size: int, head_groups: int = 1, world: int | None = None) -> None:
    """Refuse a model (or world size) that `sequence_parallel=size` cannot split evenly."""
    if size < 1 or head_groups < 1:
        raise ValueError(f"sequence_parallel={size} and sequence_parallel_head_groups={head_groups} must be >= 1")
    if size == 1:
        return
    plan = plan_of(cfg.family)
    if plan.sequence is None:
        raise ValueError(f"sequence_parallel={size}: model.family={cfg.family} is not supported (only "
                         f"{families_with(lambda p: p.sequence)}: {plan.why_not}); set sequence_parallel=1")
    seq = plan.sequence
    if world is not None and world % size:
        raise ValueError(f"sequence_parallel={size} does not divide the {world} ranks of this job; use a "
                         f"device count that is a multiple of {size}")
    heads = cfg.num_heads
    if seq.attention == "switch":  # frames split for the spatial blocks, positions for the temporal ones
        rows, cols = (side // cfg.patch_size for side in cfg.latent_hw)
        if cfg.num_frames % size or (rows * cols) % size:
            raise ValueError(f"sequence_parallel={size} must divide model.{cfg.name}'s {cfg.num_frames} latent frames "
                             f"(its spatial blocks are split by frame) and its {rows * cols} tokens a frame ({rows}x"
                             f"{cols}: its temporal blocks are split by position)")
        if (rows * cols // size) % head_groups:
            raise ValueError(f"sequence_parallel_head_groups={head_groups} must divide the {rows * cols // size} "
                             f"positions each of the {size} ranks holds in model.{cfg.name}'s temporal blocks (its "
                             "layout switches go in that many slices of them)")
        return
    if seq.attention == "linear" and heads % head_groups:  # every rank keeps every head; the groups split them
        raise ValueError(f"sequence_parallel_head_groups={head_groups} does not divide model.num_heads={heads}: "
                         f"model.family={cfg.family}'s linear attention all-reduces its per-head sums in head groups")
    rows, cols = (side // cfg.patch_size for side in cfg.latent_hw)
    frames = cfg.num_frames if cfg.is_video else 1  # a video family's frames, patched one by one
    if seq.rows_arg is not None and rows % size:
        raise ValueError(f"sequence_parallel={size} does not divide the {rows} token rows of model.family={cfg.family} "
                         f"({rows}x{cols} tokens): its blocks mix neighbouring rows and need whole rows per rank")
    if (frames * rows * cols) % size:
        shape = (f"{frames}x" if cfg.is_video else "") + f"{rows}x{cols}"
        raise ValueError(f"sequence_parallel={size} does not divide the {frames * rows * cols} tokens ({shape}) "
                         f"of model.{cfg.name}; pick a latent size whose token count it divides")
    if cfg.attention == "xformers":
        raise ValueError("model.attention=xformers with sequence_parallel > 1: sequence-parallel self-attention "
                         "runs through torch's scaled_dot_product_attention; set model.attention=sdpa")


@dataclass
class SequenceParallel:
    """This rank's place in the (data parallel x sequence parallel) mesh."""

    size: int
    # P: ranks per sequence-parallel group
    rank: int
    # this rank's index inside its group (which band of token rows it holds)
    group: Any
    # the group's torch.distributed ProcessGroup
    dp_rank: int
    # which group this rank belongs to (the data-parallel rank)
    dp_size: int
    # number of groups (W / P)
    head_groups: int = 1
    # G: the heads' exchanges (SANA: all-reduces) go in G groups, each overlapping another group's attention
    ring: int = 1
    # R: the nodes the group spans; softmax attention is Ulysses over the P / R ranks of a node, ring attention across
    ring_group: Any = None
    # the group's R ranks with this rank's index on their nodes (None: R = 1)
    ring_rank: int = 0
    # this rank's index in ring_group: which R-th of the tokens its node's ranks hold
    ulysses_group: Any = None
    # the group's P / R ranks on this node (None: the whole group, R = 1)
    inter_layer: bool = True
    # latte: each spatial block's output switched to positions slice by slice as its per-token tail runs (False: the
    # temporal block switches it, for the overlap bench's comparison)

    @property
    def ulysses(self) -> tuple[Any, int]:
        """(the group softmax attention's all-to-all runs over, its size)."""
        return (self.group, self.size) if self.ring == 1 else (self.ulysses_group, self.size // self.ring)


def init(mesh: Mesh, head_groups: int = 1) -> SequenceParallel:
    """This rank's SequenceParallel from the job's mesh (framework/distributed/mesh.py): its ring x ulysses dims are
    the group (its collectives follow the mesh's backend)."""
    group, rank = mesh.sequence_group()
    sp = SequenceParallel(mesh.dims.sequence, rank, group, mesh.data_parallel_rank, mesh.dims.data_parallel,
                          head_groups)
    if mesh.dims.ring > 1:
        sp.ring, (sp.ring_group, sp.ring_rank), sp.ulysses_group = mesh.dims.ring, mesh.ring_group(), mesh.ulysses_group()[0]
    return sp


def split_for_sampling(model: Denoiser, size: int, head_groups: int = 1) -> None:
    """For the sample and eval commands under torchrun: join the job's process group and split `model` over
    groups of `size` ranks."""
    from framework.distributed.env import init_from_env
    from framework.distributed.mesh import job_mesh

    world = init_from_env()
    if world == 1:
        raise ValueError(f"sequence_parallel={size} needs a multi-process job: launch with "
                         f"torchrun --standalone --nproc_per_node={size} -m ...")
    check(model.cfg, size, head_groups, world)
    device = next(model.parameters()).device
    install(model, init(job_mesh(size, device_type=device.type), head_groups))


def group_of(module: nn.Module) -> SequenceParallel | None:
    """The SequenceParallel a Denoiser was split with (None: whole sequences)."""
    denoiser = module if isinstance(module, Denoiser) else getattr(module, "model", None)
    return getattr(denoiser, "sequence_parallel", None)


# --------------------------------------------------------------------------------------------------
# Autograd pieces
# --------------------------------------------------------------------------------------------------

class _GatherTokens(torch.autograd.Function):
    """(B, N/P, C) on each rank -> (B, N, C) on every rank. Backward: P x this rank's slice (module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
        ctx.sp, ctx.n = sp, x.shape[1]
        parts = [torch.empty_like(x) for _ in range(sp.size)]
        dist.all_gather(parts, x.contiguous(), group=sp.group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        sp, n = ctx.sp, ctx.n
        return grad[:, sp.rank * n:(sp.rank + 1) * n] * sp.size, None


class _HaloRows(torch.autograd.Function):
    """(B, C, h, W) -> (B, C, h + 2k, W): k rows from the neighbouring bands above and below (zeros at the
    image's edges, as the convolution's own zero padding). Only the edge rows travel, to the two neighbours
    (send / receive): an interior rank receives 2k rows whatever P is. Backward sends the halo's gradient home."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, k: int, sp: SequenceParallel) -> torch.Tensor:
        ctx.k, ctx.sp = k, sp
        above, below = _swap_edges(x[:, :, :k], x[:, :, -k:], sp)  # the band above's last rows, below's first
        return torch.cat([above, x, below], dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        k, sp = ctx.k, ctx.sp
        g = grad[:, :, k:-k].clone()
        # my "above" halo was the band above's last rows: its gradient goes back up; the band below's "above" halo
        # was my last rows, and its gradient comes back to me (likewise the other way)
        from_above, from_below = _swap_edges(grad[:, :, :k], grad[:, :, -k:], sp)
        g[:, :, :k] += from_above
        g[:, :, -k:] += from_below
        return g, None, None


def _swap_edges(up: torch.Tensor, down: torch.Tensor, sp: SequenceParallel) -> tuple[torch.Tensor, torch.Tensor]:
    """Send `up` to the band above and `down` to the band below; return what the band above sent down and what the
    band below sent up (zeros at the image's edges). Non-blocking sends and receives, waited together."""
    up, down = up.contiguous(), down.contiguous()
    from_above, from_below = torch.zeros_like(down), torch.zeros_like(up)
    ops = []
    if sp.rank > 0:
        peer = dist.get_global_rank(sp.group, sp.rank - 1)
        ops += [dist.P2POp(dist.isend, up, peer, sp.group), dist.P2POp(dist.irecv, from_above, peer, sp.group)]
    if sp.rank < sp.size - 1:
        peer = dist.get_global_rank(sp.group, sp.rank + 1)
        ops += [dist.P2POp(dist.isend, down, peer, sp.group), dist.P2POp(dist.irecv, from_below, peer, sp.group)]
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return from_above, from_below


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    """torch's functional all_to_all_single over equal slices of dim 0: issued now, waited where the result is first
    used (an operation that is not a view of it) or by _wait."""
    import torch.distributed._functional_collectives as funcol

    return funcol.all_to_all_single(x.contiguous(), None, None, group)


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    """torch's functional all_reduce (sum) over the group: issued now, waited where the result is first used."""
    import torch.distributed._functional_collectives as funcol

    return funcol.all_reduce(x.contiguous(), "sum", group)


def _wait(x: torch.Tensor) -> torch.Tensor:
    return x.wait() if hasattr(x, "wait") else x


class _Layout:
    """The send and receive layouts of one head group's exchanges, chosen so that the received buffers are viewed,
    never copied, into what attention takes and gives (a copy would wait for the collective there)."""

    def __init__(self, B: int, n: int, H: int, D: int, G: int, P: int) -> None:
        self.B, self.n, self.D, self.G, self.P = B, n, D, G, P
        self.hg, self.hl = H // G, H // (G * P)  # heads per group; per rank of a group

    def send_qkv(self, qkv: torch.Tensor, g: int) -> torch.Tensor:
        """(3, B, n, H, D) -> group g's (P: destination, n, 3, B, hl, D)."""
        x = qkv[:, :, :, g * self.hg:(g + 1) * self.hg]
        return x.reshape(3, self.B, self.n, self.P, self.hl, self.D).permute(3, 2, 0, 1, 4, 5).contiguous()

    def unsend_qkv(self, d: torch.Tensor) -> torch.Tensor:
        """The adjoint of send_qkv's layout: (P, n, 3, B, hl, D) -> (3, B, n, hg, D)."""
        return d.permute(2, 3, 1, 0, 4, 5).reshape(3, self.B, self.n, self.hg, self.D)

    @staticmethod
    def received_qkv(r: torch.Tensor) -> list[torch.Tensor]:
        """(P: source band, n, 3, B, hl, D) -> q, k, v (B, hl, N, D), views."""
        x = r.flatten(0, 1)  # (N, 3, B, hl, D): the bands in order
        return [x[:, i].permute(1, 2, 0, 3) for i in range(3)]

    def send_out(self, o: torch.Tensor) -> torch.Tensor:
        """(B, hl, N, D) -> (P: destination band, n, B, hl, D). In backward its gradient, received in this layout,
        views back into (B, hl, N, D) without a copy: attention's backward is the first to wait for it."""
        return o.reshape(self.B, self.hl, self.P, self.n, self.D).permute(2, 3, 0, 1, 4)

    def received_out(self, r: torch.Tensor) -> torch.Tensor:
        """(P: source heads, n, B, hl, D), waited for here -> (B, n, hg, D) (a copy, where the output is needed)."""
        return _wait(r).permute(2, 1, 0, 3, 4).reshape(self.B, self.n, self.hg, self.D)

    def unreceived_out(self, d: torch.Tensor) -> torch.Tensor:
        """The adjoint of received_out: (B, n, hg, D) -> (P, n, B, hl, D)."""
        return d.reshape(self.B, self.n, self.P, self.hl, self.D).permute(2, 1, 0, 3, 4)


class _SendInputs(torch.autograd.Function):
    """(3, B, n, H, D) q, k, v -> each group's send buffer. Backward assembles the groups' input gradients, waiting
    for their exchanges (issued by _Tied) only here, after every group's attention backward has run."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, lay: _Layout) -> tuple[torch.Tensor, ...]:
        ctx.lay = lay
        return tuple(lay.send_qkv(qkv, g) for g in range(lay.G))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.cat([ctx.lay.unsend_qkv(_wait(g)) for g in grads], dim=3), None


class _Tied(torch.autograd.Function):
    """A collective's result (issued in forward outside autograd, still unwaited) tied to the tensor it was issued from,
    so that backward issues the adjoint collective on the gradient and returns it unwaited: the gradient's first use
    waits, after the autograd engine has run the nodes made later in forward, which hide it. Ulysses' q/k/v exchange
    (applied just before its group's attention; an all-to-all of equal slices is its own adjoint; _SendInputs waits,
    while the next group's attention backward runs) and SANA's per-head sums (every rank uses the group's total, so
    the local sums' gradient is the total of every rank's: an all-reduce)."""

    @staticmethod
    def forward(ctx, sent: torch.Tensor, received: torch.Tensor, adjoint: Any, group: Any) -> torch.Tensor:
        ctx.adjoint, ctx.group = adjoint, group
        return received.view_as(received)  # a view: the collective's result stays unwaited

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return ctx.adjoint(grad, ctx.group), None, None, None


class _Arrived(torch.autograd.Function):
    """One group's attention output, back from its heads -> sequence exchange (issued in forward as soon as the group
    had attended), waited for here as (B, n, hg, D). Backward issues the group's output-gradient exchange and returns
    it unwaited: the group's attention backward is the first to wait for it, and the autograd engine runs the later-made
    nodes first (the other groups' output projections and exchanges), which hide it."""

    @staticmethod
    def forward(ctx, sent: torch.Tensor, received: torch.Tensor, lay: _Layout, group: Any) -> torch.Tensor:
        ctx.lay, ctx.group = lay, group
        return lay.received_out(received)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _all_to_all(ctx.lay.unreceived_out(grad), ctx.group), None, None, None


def _ring_pass(x: torch.Tensor, sp: SequenceParallel) -> Any:
    """Send `x` to the next node's rank of the ring and receive the previous one's (non-blocking); `_ring_wait` gives the
    received tensor. With R = 2 the two are the same peer."""
    x = x.contiguous()
    got = torch.empty_like(x)
    to = dist.get_global_rank(sp.ring_group, (sp.ring_rank + 1) % sp.ring)
    frm = dist.get_global_rank(sp.ring_group, (sp.ring_rank - 1) % sp.ring)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, to, sp.ring_group),
                                    dist.P2POp(dist.irecv, got, frm, sp.ring_group)])
    return got, works


def _ring_wait(pending: Any) -> torch.Tensor:
    got, works = pending
    for work in works:
        work.wait()
    return got


def _chunk_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """(B, h, M, D) queries x (B, h, M', D) keys -> (B, h, M, M') scaled scores in q's accumulation dtype."""
    return (q @ k.to(q.dtype).transpose(-1, -2)) * scale


class _RingAttention(torch.autograd.Function):
    """Softmax attention of this node's queries over every node's keys: q, k, v (B, h, M, D), the M = N / R tokens of
    this rank's ring position (its node's bands, after the Ulysses exchange), -> (B, h, M, D).

    Forward: the R key / value chunks go round the ring (each rank sends its current one to the next node and receives
    the previous node's while it attends to the current one); each chunk gives a partial output and the log-sum-exp
    of its scores, merged into the running ones (the online softmax). Backward: the chunks go round again, each
    with the gradient of its keys and values so far, which every node adds to (waited for only after the node has
    computed its own share, so it travels while the previous chunk runs); one more pass takes it home. The
    scores are recomputed per chunk from the saved log-sum-exp (no R x M x M scores kept). Sums in fp32 at least."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
        acc = torch.promote_types(q.dtype, torch.float32)
        scale = q.shape[-1] ** -0.5
        qa, kv = q.to(acc), torch.stack([k, v])
        out = lse = None
        for step in range(sp.ring):
            pending = _ring_pass(kv, sp) if step < sp.ring - 1 else None  # the next chunk travels while this one runs
            s = _chunk_scores(qa, kv[0], scale)
            m = torch.logsumexp(s, dim=-1)  # (B, h, M)
            o = torch.exp(s - m.unsqueeze(-1)) @ kv[1].to(acc)
            if out is None:
                out, lse = o, m
            else:
                total = torch.logaddexp(lse, m)
                out = out * torch.exp(lse - total).unsqueeze(-1) + o * torch.exp(m - total).unsqueeze(-1)
                lse = total
            if pending is not None:
                kv = _ring_wait(pending)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.sp, ctx.scale = sp, scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        sp, scale = ctx.sp, ctx.scale
        acc = lse.dtype
        qa, g = q.to(acc), grad.to(acc)
        delta = (g * out.to(acc)).sum(-1, keepdim=True)  # (B, h, M, 1): the softmax's row term
        dq = torch.zeros_like(qa)
        kv = torch.stack([k, v])
        sums = None  # this chunk's key and value gradients so far, still travelling from the previous node
        for step in range(sp.ring):
            pending = _ring_pass(kv, sp) if step < sp.ring - 1 else None
            p = torch.exp(_chunk_scores(qa, kv[0], scale) - lse.unsqueeze(-1))  # (B, h, M, M'): the true softmax
            ds = p * (g @ kv[1].to(acc).transpose(-1, -2) - delta)
            dq += (ds @ kv[0].to(acc)) * scale
            mine = torch.stack([(ds.transpose(-1, -2) @ qa) * scale, p.transpose(-1, -2) @ g])
            dkv = mine if sums is None else _ring_wait(sums) + mine  # waited only now, after this chunk's work
            sums = _ring_pass(dkv, sp)  # on to the chunk's next node while the next chunk runs; after the last, home
            if pending is not None:
                kv = _ring_wait(pending)
        dkv = _ring_wait(sums)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sp: SequenceParallel,
                      out_proj: nn.Linear, gap: Any = None) -> torch.Tensor:
    """Softmax attention over the whole sequence from this rank's tokens, then its output projection `out_proj`:
    (B, N/P, H, D) q, k, v -> (B, N/P, C), in `sp.head_groups` head groups G (1: one exchange in, one out).

    Per group, q, k and v travel in one all-to-all (sequence -> heads: all N tokens of H/(G P) heads). Forward: every
    group's exchange is issued first; group g waits for its own inputs only, attends, and issues its output exchange,
    which travels while group g+1 attends. Each group's output is then projected with its own columns of `out_proj`
    as soon as it is back (the partial projections summed), while the later groups' outputs still travel. `gap`, if
    given, runs right after the first exchanges are issued (the block's caption K/V projections: CaptionKV). Backward:
    each group's output-gradient exchange is issued as soon as its projection's backward has run; group g's attention
    backward waits for its own, and its input-gradient exchange travels while group g+1's runs; they are waited
    together at the end (PipeDiT's head-group pipelining, PipeSP, both ways). Attention itself is torch's, with its own autograd
    (activation checkpointing recomputes it as any other layer).

    Heads that G x P does not divide are padded with zero heads (their attention gives zeros, and the output
    projection gets zero columns for them), so any head count splits, exactly; the last ranks then attend with the
    padding's share of idle heads."""
    B, n, H, D = q.shape
    weight = out_proj.weight
    group, U = sp.ulysses  # the whole sequence group, or (across nodes) its ranks on this node
    pad = -H % (sp.head_groups * U)
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))  # (B, n, H + pad, D)
        weight = F.pad(weight, (0, pad * D))
        H += pad
    lay = _Layout(B, n, H, D, sp.head_groups, U)
    qkv = torch.stack([q, k, v])  # (3, B, n, H, D)
    grad = torch.is_grad_enabled() and qkv.requires_grad
    sends = _SendInputs.apply(qkv, lay) if grad else [lay.send_qkv(qkv, g) for g in range(lay.G)]
    received = [_all_to_all(s.detach(), group) for s in sends]  # every group's exchange issued first
    if gap is not None:  # work that needs none of them, done while they travel
        gap()
    out_sends, out_received = [], []
    for s, r in zip(sends, received):
        r = _Tied.apply(s, r, _all_to_all, group) if grad else r
        qkv_heads = lay.received_qkv(r)  # (B, hl, N / R, D) each
        # waits for this group's inputs; across nodes, attends to the other nodes' keys as they come round the ring
        o = F.scaled_dot_product_attention(*qkv_heads) if sp.ring == 1 else _RingAttention.apply(*qkv_heads, sp)
        out_sends.append(lay.send_out(o))
        out_received.append(_all_to_all(out_sends[-1].detach(), group))
    cols = lay.hg * D  # group g's heads are out_proj's input columns [g cols, (g + 1) cols)
    out = None
    for g, (s, r) in enumerate(zip(out_sends, out_received)):
        o = _Arrived.apply(s, r, lay, group) if grad else lay.received_out(r)  # waits for this group's output
        part = F.linear(o.flatten(2).to(q.dtype), weight[:, g * cols:(g + 1) * cols])
        out = part if out is None else out + part
    return out if out_proj.bias is None else out + out_proj.bias


def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """SANA's linear attention over the whole sequence from this rank's tokens: q (B, H, D, n), k (B, H, n, D) and v
    (B, H, E, n) -> (B, H, E, n), the per-head sums V.K^T (E, D) over all N tokens applied to this rank's queries.

    The sums are all-reduced in `sp.head_groups` head groups G: group g's local sums are computed and their all-reduce
    issued, and it travels while group g+1's sums are computed; each group's output waits for its own total only.
    Backward issues each group's gradient all-reduce as its output backward finishes (_Tied) and waits for it in
    the local sums' backward, after the other groups' output backward ran."""
    grad = torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)
    chunks = [t.chunk(sp.head_groups, dim=1) for t in (q, k, v)]
    local = [vg @ kg for vg, kg in zip(chunks[2], chunks[1])]  # (B, H/G, E, D) each
    issued = [_all_reduce(s.detach(), sp.group) for s in local]  # each issued as soon as its sums exist
    out = []
    for s, total, qg in zip(local, issued, chunks[0]):
        total = _Tied.apply(s, total, _all_reduce, sp.group) if grad else total
        out.append(total @ qg)  # waits for this group's total
    return torch.cat(out, dim=1)


# --------------------------------------------------------------------------------------------------
# Attention processors (diffusers' processor interface; the parameters stay where they are)
# --------------------------------------------------------------------------------------------------

class CaptionKV:
    """A gap filler of our own: a block's cross-attention key and value projections of the caption, which do not
    depend on the image tokens, computed while the self-attention's exchanges travel (`fill`, from the self-attention
    processor) and handed to the cross-attention's to_k / to_v when they are called on that same caption tensor (else
    they compute as usual). Nothing is computed at a cached-sampling step that reuses the cross-attention's output. The
    caption is taken from the block's call; the layers' own `forward` is replaced on the instance, so parameters and
    state-dict keys stay as they are. `filled` counts the projections computed in gaps, `hits` those handed over."""

    def __init__(self, block: nn.Module) -> None:
        self.block, self.attn2, self.caption, self.ready, self.filled, self.hits = block, block.attn2, None, {}, 0, 0
        block.register_forward_pre_hook(self.capture, with_kwargs=True)
        for name in ("to_k", "to_v"):
            layer = getattr(self.attn2, name)
            layer.forward = functools.partial(self.project, name, layer)

    @staticmethod
    def applies(block: nn.Module) -> bool:
        attn2 = getattr(block, "attn2", None)  # dit's blocks have no cross-attention; a normed caption differs
        return attn2 is not None and attn2.is_cross_attention and attn2.norm_cross is None

    def capture(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.caption = kwargs.get("encoder_hidden_states", args[2] if len(args) > 2 else None)

    def fill(self) -> None:
        x, self.caption = self.caption, None
        runs = getattr(self.block.attn2, "runs", None)  # cached sampling's stand-in (caching._Branch) says
        if x is not None and (runs is None or runs()):
            self.ready = {name: (x, type(layer).forward(layer, x))
                          for name, layer in (("to_k", self.attn2.to_k), ("to_v", self.attn2.to_v))}
            self.filled += 2

    def project(self, name: str, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        done = self.ready.pop(name, None)
        if done is not None and done[0] is x:
            self.hits += 1
            return done[1]
        return type(layer).forward(layer, x)


class UlyssesAttnProcessor:
    """Softmax self-attention on this rank's tokens (replaces AttnProcessor2_0 on pixart / dit attn1); with `kv`, the
    block's caption K/V projections fill the gap while the first exchange travels."""

    def __init__(self, sp: SequenceParallel, kv: CaptionKV | None = None) -> None:
        self.sp, self.kv = sp, kv

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, **_: Any) -> torch.Tensor:
        if attention_mask is not None:  # these families' self-attention takes none; refuse rather than ignore one
            raise ValueError("sequence parallelism does not take a self-attention mask (the image tokens' attention is "
                             "unmasked in pixart and dit); set strategy.sequence_parallel=1")
        q, k, v = softmax_qkv(attn, hidden_states)
        gap = self.kv.fill if self.kv is not None else None
        return attn.to_out[1](ulysses_attention(q, k, v, self.sp, attn.to_out[0], gap))


def softmax_qkv(attn: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A plain softmax self-attention's (AttnProcessor2_0's) query, key and value of `hidden_states` (B, n, C), each
    (B, n, H, D), its q / k norms applied."""
    B, n, _ = hidden_states.shape
    q, k, v = (proj(hidden_states).view(B, n, attn.heads, -1) for proj in (attn.to_q, attn.to_k, attn.to_v))
    if attn.norm_q is not None:
        q = attn.norm_q(q)
    if attn.norm_k is not None:
        k = attn.norm_k(k)
    return q, k, v


def check_plain_softmax(attn: Any, name: str, what: str) -> None:
    """Refuse a self-attention that is not plain softmax attention through AttnProcessor2_0 (`what`: the feature)."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    if type(attn.processor) is not AttnProcessor2_0 or attn.residual_connection or attn.group_norm is not None \
            or attn.spatial_norm is not None or attn.rescale_output_factor != 1.0:
        raise ValueError(f"{what}: {name} is not plain softmax self-attention ({type(attn.processor).__name__}); "
                         f"{what} cannot take it")


class UlyssesWanAttnProcessor:
    """Wan's self-attention on this rank's tokens (replaces WanAttnProcessor on attn1): q, k, v and their RMS norms
    per token, the rotary table of this rank's band (cut by install's hook on the net's rope), then the Ulysses
    exchange and attention over all tokens."""

    def __init__(self, sp: SequenceParallel) -> None:
        self.sp = sp

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, rotary_emb: tuple | None = None) -> torch.Tensor:
        if attention_mask is not None or encoder_hidden_states is not None:
            raise ValueError("sequence parallelism splits Wan's unmasked self-attention only; set "
                             "strategy.sequence_parallel=1")
        q, k, v = wan_qkv(attn, hidden_states, rotary_emb)
        return attn.to_out[1](ulysses_attention(q, k, v, self.sp, attn.to_out[0]))


def wan_qkv(attn: Any, hidden_states: torch.Tensor, rotary_emb: tuple | None) -> tuple[torch.Tensor, ...]:
    """Wan's self-attention query, key and value (B, n, H, D) of `hidden_states`, RMS-normed and rotated as
    WanAttnProcessor does."""
    from diffusers.models.transformers.transformer_wan import _get_qkv_projections

    q, k, v = _get_qkv_projections(attn, hidden_states, None)
    q, k = attn.norm_q(q), attn.norm_k(k)
    q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))  # (B, n, H, D)
    if rotary_emb is not None:
        q, k = (rotate_pairs(t, *rotary_emb) for t in (q, k))
    return q, k, v


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding: channels 2i and 2i+1 of each head rotated by angle i of the token's position; x (B, n,
    H, D), cos / sin (1, n, 1, D) with each angle's value in both channels of its pair."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2).type_as(x)


class UlyssesLinearAttnProcessor:
    """SANA's ReLU linear self-attention on this rank's tokens (replaces SanaLinearAttnProcessor2_0): the
    per-head sums over tokens, V.K^T and sum(K) (one padded row of V), are all-reduced over the group in head groups
    (linear_attention)."""

    def __init__(self, sp: SequenceParallel) -> None:
        self.sp = sp

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, **_: Any) -> torch.Tensor:
        dtype = hidden_states.dtype
        acc = torch.promote_types(dtype, torch.float32)  # sums in fp32 at least (diffusers' processor: fp32 always)
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        if attn.norm_q is not None:
            q, k = attn.norm_q(q), attn.norm_k(k)
        q = F.relu(q.transpose(1, 2).unflatten(1, (attn.heads, -1))).to(acc)                 # (B, H, D, n)
        k = F.relu(k.transpose(1, 2).unflatten(1, (attn.heads, -1)).transpose(2, 3)).to(acc)  # (B, H, n, D)
        v = F.pad(v.transpose(1, 2).unflatten(1, (attn.heads, -1)).to(acc), (0, 0, 0, 1), value=1.0)  # (B, H, D+1, n)
        out = linear_attention(q, k, v, self.sp)                                               # (B, H, D+1, n)
        out = (out[:, :, :-1] / (out[:, :, -1:] + 1e-15)).flatten(1, 2).transpose(1, 2).to(dtype)
        out = attn.to_out[1](attn.to_out[0](out))
        return out.clip(-65504, 65504) if dtype == torch.float16 else out  # as diffusers' processor: no fp16 inf


# --------------------------------------------------------------------------------------------------
# Installing it on a Denoiser
# --------------------------------------------------------------------------------------------------

def install(denoiser: Denoiser, sp: SequenceParallel) -> None:
    """Split `denoiser`'s sequence over `sp` in place (hooks and processors: parameters and state-dict keys
    unchanged, so checkpoints and FSDP2 sharding are as without it). Installed once; re-installing is refused."""
    from diffusers.models.attention_processor import SanaLinearAttnProcessor2_0
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    from framework.models.blocks import block_views

    cfg = denoiser.cfg
    check(cfg, sp.size, sp.head_groups, sp.size * sp.dp_size)
    if getattr(denoiser, "sequence_parallel", None) is not None:
        raise RuntimeError("this model is already split for sequence parallelism")
    net = denoiser.net

    def band(out: torch.Tensor) -> torch.Tensor:
        if out.shape[1] % sp.size:
            raise ValueError(f"sequence_parallel={sp.size} does not divide this input's {out.shape[1]} tokens")
        n = out.shape[1] // sp.size
        # a copy, not a view: a view would keep the whole sequence's embedding alive until backward
        return out[:, sp.rank * n:(sp.rank + 1) * n].clone()

    def keep_band(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return band(out)

    def gather(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return _GatherTokens.apply(out, sp)

    seq = plan_of(cfg.family).sequence  # check() refused a family without one
    if seq.attention == "switch":
        _FrameSwitch(net, sp).install()
        denoiser.sequence_parallel = sp
        return
    if seq.split_input:  # the band of the first input (Wan's first block: the tokens are flattened in the forward)
        net.get_submodule(seq.embed).register_forward_pre_hook(lambda module, args: (band(args[0]), *args[1:]))
    else:
        net.get_submodule(seq.embed).register_forward_hook(keep_band)
    if seq.rope is not None:  # each rank's rows of the rotary tables: its own tokens' positions
        net.get_submodule(seq.rope).register_forward_hook(lambda module, args, out: tuple(band(t) for t in out))
    net.get_submodule(seq.out).register_forward_hook(gather)
    for view in block_views(denoiser):
        attn = view.module.attn1
        if isinstance(attn.processor, WanAttnProcessor):
            if attn.add_k_proj is not None:
                raise ValueError(f"sequence_parallel: {view.name}.attn1 also attends to an image (Wan's image-to-video "
                                 "attention); only text-to-video Wan is split")
            attn.set_processor(UlyssesWanAttnProcessor(sp))
        elif seq.attention == "linear":
            if not isinstance(attn.processor, SanaLinearAttnProcessor2_0):
                raise ValueError(f"sequence_parallel: {view.name}.attn1 uses {type(attn.processor).__name__}; "
                                 f"only SANA's linear self-attention is split for model.family={cfg.family}")
            attn.set_processor(UlyssesLinearAttnProcessor(sp))
        else:
            check_plain_softmax(attn, f"{view.name}.attn1", "sequence_parallel")
            kv = CaptionKV(view.module) if CaptionKV.applies(view.module) else None
            attn.set_processor(UlyssesAttnProcessor(sp, kv))
        if seq.rows_arg is not None:
            _split_rows(view.module, sp, seq.rows_arg)
    denoiser.sequence_parallel = sp


class _FrameSwitch:
    """Latte (framework/models/plans.py `switch`): each rank keeps its F/P frames after the patch embedding; a spatial
    block attends within frames, so it runs on them as they are, given those frames' caption, mask and timestep rows;
    before each temporal block one all-to-all gives each rank its N/P positions of every frame (and their timestep
    rows), and after it one switches back; the output norm and projection run on this rank's frames (the modulation
    between them on every frame's rows, the others' zeros) and the projection's output is gathered, so unpatchify is as
    on one rank. The temporal position table added before the first temporal block
    (still in the frames layout) is cut to this rank's frames for the forward.

    `dims` holds one forward's sizes (B, F, N), the position tables and the switches handed from spatial block i to
    temporal block i."""

    def __init__(self, net: nn.Module, sp: SequenceParallel) -> None:
        self.net, self.sp, self.P, self.r = net, sp, sp.size, sp.rank
        self.dims: dict[str, Any] = {}

    def install(self) -> None:
        net = self.net
        net.register_forward_pre_hook(self.start, with_kwargs=True)
        net.register_forward_hook(self.end, with_kwargs=True)
        net.pos_embed.register_forward_hook(lambda module, args, out: self.frames_of(out).clone())
        for i, block in enumerate(net.transformer_blocks):
            block.register_forward_pre_hook(self.spatial_inputs)
            block.forward = functools.partial(self.spatial, block, block.forward, i)
        for i, block in enumerate(net.temporal_transformer_blocks):
            block.forward = functools.partial(self.temporal, block.forward, i)
        net.norm_out.register_forward_hook(self.spread_frames)
        net.proj_out.register_forward_hook(self.gather_output)

    def frames_of(self, t: torch.Tensor) -> torch.Tensor:  # (B * F, ...) -> this rank's frames (B * F/P, ...)
        B, F, r = self.dims["B"], self.dims["F"], self.r
        f = F // self.P
        return t.reshape(B, F, *t.shape[1:])[:, r * f:(r + 1) * f].reshape(B * f, *t.shape[1:])

    def positions_of(self, t: torch.Tensor) -> torch.Tensor:  # (B * N, ...) -> this rank's positions (B * N/P, ...)
        B, N, r = self.dims["B"], self.dims["N"], self.r
        m = N // self.P
        return t.reshape(B, N, *t.shape[1:])[:, r * m:(r + 1) * m].reshape(B * m, *t.shape[1:])

    def start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        P, r = self.P, self.r
        x = args[0] if args else kwargs["hidden_states"]  # (B, C, F, H, W)
        B, _, F, H, W = x.shape
        p = module.config.patch_size
        if F % P or ((H // p) * (W // p)) % P:
            raise ValueError(f"sequence_parallel={P} does not divide this clip's {F} latent frames and "
                             f"{(H // p) * (W // p)} tokens a frame")
        self.dims.update(B=B, F=F, N=(H // p) * (W // p), table=module.temp_pos_embed)
        # the first spatial block adds this rank's frames' rows of the temporal position table to its output (before
        # any switch); the loop's own addition (after it) adds zeros
        mine = module.temp_pos_embed[:, r * (F // P):(r + 1) * (F // P)]
        self.dims["first_table"] = mine if F > 1 else None
        module.temp_pos_embed = torch.zeros_like(mine)

    def end(self, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        module.temp_pos_embed = self.dims.pop("table")

    def spatial_inputs(self, module: nn.Module, args: tuple) -> tuple:
        # Latte calls (hidden, None, caption (B F, L, D), mask (B F, 1, L) or None, timestep (B F, 6D), None, None)
        caption, mask, timestep = args[2:5]
        return (args[0], args[1], self.frames_of(caption), None if mask is None else self.frames_of(mask),
                self.frames_of(timestep), *args[5:])

    def spread_frames(self, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        """The output norm's (B F/P, N, D) -> (B F, N, D): this rank's frames in place, zeros for the others (nothing
        exchanged). Latte's modulation after the norm takes every frame's rows; only this rank's reach `gather_output`."""
        B, F, r = self.dims["B"], self.dims["F"], self.r
        f, rest = F // self.P, out.shape[1:]
        own = out.reshape(B, f, *rest)
        before, after = own.new_zeros(B, r * f, *rest), own.new_zeros(B, F - (r + 1) * f, *rest)
        return torch.cat([before, own, after], dim=1).reshape(B * F, *rest)

    def gather_output(self, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        """The output projection's (B F, N, C), of which this rank's frames are its own, -> every rank's frames: the one
        gather, at C = p^2 x the output channels (32 for Latte-1, against 1,152 hidden channels before the norm)."""
        B, F, r, sp = self.dims["B"], self.dims["F"], self.r, self.sp
        f = F // self.P
        return _GatherTokens.apply(out.reshape(B, F, -1)[:, r * f:(r + 1) * f], sp).reshape(out.shape)

    @staticmethod
    def _own_branches(block: nn.Module, rest: tuple) -> bool:
        """Whether spatial `block` is diffusers' plain adaLN-single block with its own attention and MLP modules, so
        that its tail can be run by slices here (not cached sampling's or the cache router's stand-ins)."""
        from diffusers.models.attention import FeedForward
        from diffusers.models.attention_processor import Attention

        return block.norm_type == "ada_norm_single" and block.pos_embed is None and block._chunk_size is None \
            and not block.only_cross_attention and not any(rest) and isinstance(block.attn1, Attention) \
            and isinstance(block.attn2, Attention) and isinstance(block.ff, FeedForward)

    def spatial(self, block: nn.Module, inner: Any, i: int, hidden: torch.Tensor, attention_mask: Any = None,
                caption: Any = None, caption_mask: Any = None, timestep: Any = None, *rest: Any) -> torch.Tensor:
        """Spatial block i on this rank's frames, its output switched to this rank's positions as it is made
        (ScaleFusion's inter-layer schedule): the block's self-attention over each frame's tokens, then its per-token
        tail (cross-attention, norm, MLP, their gates) in S = sp.head_groups slices of the positions, each slice's
        switch issued as soon as it is computed, travelling while the next slice's tail runs. The switches are handed
        to temporal block i still travelling (its slice s waits for slice s only) and the block returns a stand-in for
        Latte's rearrangement. With activation checkpointing the recomputation must return what the forward returned,
        so the block waits for its switches and returns them in the frames layout's shape, arranged so that Latte's
        rearrangement hands the temporal block every frame of its positions. A block whose branches are not its own
        modules (cached sampling's stand-ins, the cache router's) runs whole and is switched by the temporal block. The
        first block adds the temporal position table's rows of its frames."""
        dims, P, sp = self.dims, self.P, self.sp
        table = dims["first_table"] if i == 0 else None
        dims[f"switched{i}"] = False  # True: returned switched and waited (below, checkpointed)
        B, N, F = dims["B"], dims["N"], dims["F"]
        f, D = F // P, hidden.shape[-1]
        if not (sp.inter_layer and self._own_branches(block, rest)):
            out = inner(hidden, attention_mask, caption, caption_mask, timestep, *rest)
            return out if table is None else (out.reshape(B, f, N, D) + table.to(out.dtype)[:, :, None]).reshape(
                B * f, N, D)
        # as BasicTransformerBlock.forward (norm_type ada_norm_single), the tail by position slices
        mods = block.scale_shift_table[None] + timestep.reshape(B * f, 6, -1)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods.chunk(6, dim=1)
        x = block.norm1(hidden) * (1 + scale_msa) + shift_msa
        hidden = gate_msa * block.attn1(x, encoder_hidden_states=None, attention_mask=attention_mask) + hidden
        S = sp.head_groups
        w = N // P // S
        rows = hidden.reshape(B * f, P, S, w, D)  # positions by destination rank, slice, index
        grad = torch.is_grad_enabled() and hidden.requires_grad
        sends, arrivals = [], []
        for s in range(S):
            h = rows[:, :, s].reshape(B * f, P * w, D)
            h = block.attn2(h, encoder_hidden_states=caption, attention_mask=caption_mask) + h
            h = gate_mlp * block.ff(block.norm2(h) * (1 + scale_mlp) + shift_mlp) + h
            if table is not None:
                h = h.reshape(B, f, P * w, D) + table.to(h.dtype)[:, :, None]
            sends.append(h.reshape(B, f, P, w, D).permute(2, 0, 3, 1, 4).contiguous())  # (P: destination, B, w, f, D)
            arrivals.append(_all_to_all(sends[-1].detach(), sp.group))  # travels while slice s + 1's tail runs
        if not (self.net.gradient_checkpointing and torch.is_grad_enabled()):
            # handed to temporal block i unwaited (its slice s waits for slice s only); Latte's rearrangement of
            # this block's output, which would wait for every slice, gets a stand-in of no cost
            dims[f"handoff{i}"] = (sends, arrivals, grad)
            return hidden.new_zeros(()).expand(B * f, N, D)
        # checkpointed (the recomputation must return what the forward returned): waited here, returned in the
        # frames layout's shape, (S, P: source frames, B, w, f, D) -> (B, f, S, P, w, D), so that Latte's
        # rearrangement gives (B, S, P, w, f, D)
        dims[f"switched{i}"] = True
        arrived = [_Tied.apply(send, a, _all_to_all, sp.group) if grad else a for send, a in zip(sends, arrivals)]
        return torch.stack(arrived).permute(2, 4, 0, 1, 3, 5).reshape(B * f, N, D)

    def temporal(self, inner: Any, i: int, hidden: torch.Tensor, *args: Any) -> torch.Tensor:
        """Temporal block i between its two layout switches (DSP's; ScaleFusion schedules them): (B N, F/P, D), every
        position of this rank's frames, -> (B N/P, F, D), this rank's positions of every frame, by one all-to-all; the
        block; and back. In sp.head_groups = S slices of this rank's positions (ScaleFusion's intra-layer schedule;
        positions are independent in a temporal block; S = 1: the whole switch): every slice's switch to positions is
        issued first; slice s waits for its own, runs, and its switch back travels while slice s+1 runs. Backward: each
        exchange's adjoint is issued as its gradient is ready and waited where it is used (_Tied)."""
        dims, P, sp, S = self.dims, self.P, self.sp, self.sp.head_groups
        B, N, F = dims["B"], dims["N"], dims["F"]
        f, D = F // P, hidden.shape[-1]
        w = N // P // S  # positions a slice
        t = self.positions_of(args[3]).reshape(B, S, w, -1)  # this rank's positions' timestep rows, by slice
        grad = torch.is_grad_enabled() and hidden.requires_grad
        switched = dims[f"switched{i}"]  # spatial block i returned its output switched, waited
        handoff = dims.pop(f"handoff{i}", None)
        if handoff is not None:  # spatial block i's switches, still travelling
            sends, arrivals, grad = handoff
        elif switched:  # by the spatial block, waited (checkpointed): (B, S, P: source frames, w, f, D)
            switched_rows = hidden.reshape(B, S, P, w, f, D)
        else:
            x = hidden.reshape(B, P, S, w, f, D)  # positions by destination rank, slice, index
            sends = [x[:, :, s].transpose(0, 1).contiguous() for s in range(S)]  # (P: destination, B, w, f, D)
            arrivals = [_all_to_all(send.detach(), sp.group) for send in sends]  # every slice's exchange issued
        back_sends, backs = [], []
        for s in range(S):
            if switched:
                rows = switched_rows[:, s].permute(0, 2, 1, 3, 4).reshape(B * w, F, D)
            else:
                arrived = _Tied.apply(sends[s], arrivals[s], _all_to_all, sp.group) if grad else arrivals[s]
                # (P: source frames, B, w, f, D) -> (B w, F, D); waits for slice s: every frame of its positions
                rows = arrived.permute(1, 2, 0, 3, 4).reshape(B * w, F, D)
            y = inner(rows, *args[:3], t[:, s].reshape(B * w, -1), *args[4:])
            back_sends.append(y.reshape(B, w, P, f, D).permute(2, 0, 1, 3, 4).contiguous())  # (P: frames, ...)
            backs.append(_all_to_all(back_sends[-1].detach(), sp.group))  # travels while slice s + 1 runs
        outs = [_Tied.apply(send, back, _all_to_all, sp.group) if grad else back
                for send, back in zip(back_sends, backs)]
        whole = torch.stack(outs, dim=2)  # (P: source positions, B, S, w, f, D)
        return whole.permute(1, 0, 2, 3, 4, 5).reshape(B * N, f, D)


def _split_rows(block: nn.Module, sp: SequenceParallel, rows_arg: int) -> None:
    """A block whose ff mixes neighbouring token rows (SANA's Mix-FFN): it sees this rank's band of rows (its
    positional argument `rows_arg`, or `height=`, made the band's height), and the depthwise conv its
    neighbours' edge rows."""
    conv = block.ff.conv_depth
    k = conv.kernel_size[0] // 2
    if conv.padding[0] != k:
        raise ValueError(f"sequence_parallel: the Mix-FFN convolution pads {conv.padding} (expected 'same')")

    def band_height(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        # height: the whole image's token rows (framework/models/plans.py names its position)
        rows = kwargs["height"] if "height" in kwargs else args[rows_arg]
        if rows % sp.size:
            raise ValueError(f"sequence_parallel={sp.size} does not divide this input's {rows} token rows")
        if "height" in kwargs:
            kwargs = {**kwargs, "height": rows // sp.size}
        else:
            args = (*args[:rows_arg], rows // sp.size, *args[rows_arg + 1:])
        return args, kwargs

    def add_halo(module: nn.Module, args: tuple) -> tuple:
        return (_HaloRows.apply(args[0], k, sp), *args[1:])

    def drop_halo(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return out[:, :, k:-k]

    block.register_forward_pre_hook(band_height, with_kwargs=True)
    conv.register_forward_pre_hook(add_halo)
    conv.register_forward_hook(drop_halo)
