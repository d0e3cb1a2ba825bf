"""`torchrun --standalone --nproc_per_node=P -m tests.workers.sequence DATA OUT [PER_NODE]`: sequence-parallel forward and
backward of each family's debug preset against the same model on whole sequences, in fp64; and sampling (P = 2).
Also: with activation checkpointing, against diffusers' own Ulysses attention, and which all-gathers run.

Every rank builds the same random model and batch. The reference is the plain model on this rank alone;
the split model runs on all ranks together. Rank 0 writes OUT: per family and overlap setting, the largest
difference of the outputs, and of the parameter gradients after averaging over the ranks (what DDP does),
relative to the largest reference value; and for sampling (Pipeline.generate over the digits prompts of
DATA, fp32) the largest difference between the split model's images and the plain model's.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys

import torch
import torch.distributed as dist

from framework.inference.sampling import SamplingPlan
from framework.inference.sharing import SplitRanks
from framework.distributed.env import init_from_env, leave
from framework.models.backbones import build_denoiser, load_preset
from framework.distributed.mesh import Mesh, ParallelDims, job_mesh
from framework.distributed import sequence
from framework.distributed.sequence import init, install
from framework.models.blocks import block_views


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


class DiffusersUlysses:
    """diffusers' own Ulysses attention (dispatch_attention_fn with a ContextParallelConfig): the reference that
    framework.distributed.sequence.ulysses_attention replaced."""

    def __init__(self, mesh: Mesh) -> None:
        from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig

        self.config = ParallelConfig(context_parallel_config=ContextParallelConfig(ulysses_degree=mesh.dims.sequence))
        self.config.setup(mesh.rank, mesh.dims.world, torch.device("cpu"), mesh=mesh.sequence_mesh())

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **_):
        from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn

        B, n, _ = hidden_states.shape
        q, k, v = (proj(hidden_states).view(B, n, attn.heads, -1) for proj in (attn.to_q, attn.to_k, attn.to_v))
        out = dispatch_attention_fn(q, k, v, attn_mask=attention_mask, backend=AttentionBackendName.NATIVE,
                                    parallel_config=self.config)
        return attn.to_out[1](attn.to_out[0](out.flatten(2).to(q.dtype)))


def compare(mesh: Mesh, family: str, head_groups: int, hw: tuple[int, int] | None = None, ckpt: bool = False,
            diffusers_attention: bool = False, heads: int = 4, inter_layer: bool = True) -> dict[str, float]:
    torch.manual_seed(0)
    # 4 heads (2 per rank, 2 groups of 1 per rank with head_groups=2); sana: 8 rows of tokens, 4 per rank; heads=3: a
    # count the group does not divide (padded with a zero head)
    overrides = {"num_heads": heads, "width": 32 * heads, "num_layers": 2}
    if family == "sana":
        overrides["kwargs"] = {"num_cross_attention_heads": 4, "cross_attention_head_dim": 32}
    if family in ("wan", "latte"):  # 4 frames of 4x4 tokens; 32-wide captions
        overrides.update(text_dim=32)
    if family == "latte":  # an odd depth: a misplacement of positions that two temporal blocks would undo shows
        overrides.update(num_layers=3)
    ref = build_denoiser(load_preset(f"{family}_debug", **overrides)).double()
    for p in ref.parameters():  # zero-initialised output layers would hide errors in the blocks
        torch.nn.init.normal_(p, std=0.05) if p.dim() > 1 else torch.nn.init.normal_(p, std=0.02)
    model = copy.deepcopy(ref)
    sp = init(mesh, head_groups)
    sp.inter_layer = inter_layer
    install(model, sp)
    if diffusers_attention:
        reference = DiffusersUlysses(mesh)
        for block in model.net.transformer_blocks:
            block.attn1.set_processor(reference)
    if ckpt:
        from framework.distributed.fsdp import prepare_blocks

        prepare_blocks(model, activation_checkpointing=True, compile=False)
    seen, band_storage = [], []
    first = block_views(model)[0].module
    # the tokens a sample's first block saw: its band of N/P tokens, or Latte's F/P frames of N tokens (B = 3)
    first.register_forward_hook(lambda m, a, o: seen.append(o.shape[0] * o.shape[1] // 3))
    # bytes behind the first block's input: this rank's band only, not a view into the whole sequence's embedding
    # (wan: the band is cut from this input by the split's own pre-hook, which runs first)
    first.register_forward_pre_hook(
        lambda m, a: band_storage.append(a[0].untyped_storage().nbytes() / (a[0].numel() * a[0].element_size())))
    cfg = ref.cfg
    g = torch.Generator().manual_seed(1)
    B, shape = 3, hw or cfg.latent_shape  # hw: a non-square latent (an aspect-ratio bucket's); wan: (F, h, w)
    x = torch.randn(B, cfg.in_channels, *shape, generator=g, dtype=torch.float64)
    t = torch.rand(B, generator=g, dtype=torch.float64) * 900
    text = torch.randn(B, 5, cfg.text_dim or 1, generator=g, dtype=torch.float64) if cfg.text_dim else None
    mask = torch.ones(B, 5, dtype=torch.bool) if text is not None else None
    if text is not None:
        mask[0, 3:] = False
    labels = torch.tensor([1, 2, cfg.num_classes or 0]) if cfg.num_classes else None
    target = torch.randn(B, cfg.in_channels, *shape, generator=g, dtype=torch.float64)
    out, gathers, passes, events = {}, [], [], []
    all_gather, batch_isend_irecv, scores = dist.all_gather, dist.batch_isend_irecv, sequence._chunk_scores

    class Logged:  # a send's or receive's work, logging when it is waited for
        def __init__(self, work):
            self.work = work

        def wait(self):
            events.append("wait")
            return self.work.wait()

    def passing(ops):
        passes.append(len(ops))
        events.append("pass")
        return [Logged(w) for w in batch_isend_irecv(ops)]

    for name, m in (("ref", ref), ("sp", model)):
        # every all_gather of the forward and backward (the output gather's, and any other), and every batch of sends
        # and receives (SANA's halo; the ring's passes), with the ring's chunk attentions in order
        dist.all_gather = lambda parts, x, **kw: (gathers.append(x.numel()), all_gather(parts, x, **kw))[1]
        dist.batch_isend_irecv = passing
        sequence._chunk_scores = lambda *a: (events.append("attend"), scores(*a))[1]
        try:
            pred = m(x, t, text, mask, labels)
            ((pred - target) ** 2).mean().backward()
        finally:
            dist.all_gather, dist.batch_isend_irecv, sequence._chunk_scores = all_gather, batch_isend_irecv, scores
        out[name] = pred.detach()
    # Relative to the largest gradient of the model: some gradients are zero up to rounding (a softmax
    # attention's key bias), so per-parameter ratios would only compare rounding noise.
    scale = max(float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None)
    diffs = []
    for p, q in zip(ref.parameters(), model.parameters()):
        if p.grad is not None and q.grad is not None:
            dist.all_reduce(q.grad, op=dist.ReduceOp.AVG)
            diffs.append(float((q.grad - p.grad).abs().max()) / scale)
    kv = [getattr(v.module.attn1.processor, "kv", None) for v in block_views(model)]  # caption K/V in the gap
    return {"forward": relative(out["sp"], out["ref"]), "grad": max(diffs), "grads": len(diffs), "tokens": seen,
            "kv_in_gap": sum(k.hits for k in kv if k is not None),
            "band_storage": band_storage, "all_gathers": len(gathers), "passes": len(passes),
            "ring_order": [e for i, e in enumerate(events) if i == 0 or e != events[i - 1]],
            "params": sum(1 for p in ref.parameters() if p.grad is not None)}


def sample(mesh: Mesh, data: str, family: str) -> dict[str, float | list[int]]:
    from framework.data.datamodule import read_dataset_info
    from framework.models.objectives import Objective, ObjectiveConfig
    from framework.inference.pipeline import Pipeline

    info = read_dataset_info(data)
    torch.manual_seed(0)
    extra = {"kwargs": {"num_cross_attention_heads": 2, "cross_attention_head_dim": 32}} if family == "sana" else {}
    model = build_denoiser(load_preset(f"{family}_debug", in_channels=1, text_dim=384, **extra)).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    prompts = ["a handwritten 3", "the digit seven", "a handwritten 0"]
    plain = Pipeline(copy.deepcopy(model), Objective(ObjectiveConfig()), info.empty_text_embeds, info.summary())
    split = Pipeline(model, Objective(ObjectiveConfig()), info.empty_text_embeds, info.summary())
    three, cached = SamplingPlan(steps=3, seed=2), SamplingPlan(steps=4, seed=2, cache_schedule="uniform:2")
    want = plain.generate(prompts, three, batch_size=2)
    want_cached = plain.generate(prompts, cached, batch_size=2)
    install(model, init(mesh))
    got = split.generate(prompts, three, batch_size=2, ranks=SplitRanks())
    got_cached = split.generate(prompts, cached, batch_size=2, ranks=SplitRanks())
    # a schedule that runs the self-attention and reuses the cross-attention at steps 1 and 3: the caption K/V the
    # gap would compute there are not wanted
    uniform = split.schedule("uniform:2", None, 4)
    compute = [[[True, s % 2 == 0, True][: len(block)] for block in step] for s, step in enumerate(uniform.compute)]
    no_attn2 = dataclasses.replace(uniform, compute=compute, kind="learned")
    no_attn2 = SamplingPlan(steps=4, seed=2, cache_schedule=no_attn2)
    want_no_attn2 = plain.generate(prompts, no_attn2, batch_size=2)
    kv = [k for b in model.net.transformer_blocks if (k := getattr(b.attn1.processor, "kv", None)) is not None]
    for k in kv:
        k.filled = k.hits = 0
    got_no_attn2 = split.generate(prompts, no_attn2, batch_size=2, ranks=SplitRanks())
    diff = float((got - want).abs().max()) if got.shape == want.shape else float("inf")
    cached_diff = float((got_cached - want_cached).abs().max()) if got_cached.shape == want_cached.shape else float("inf")
    decoded = [None] * dist.get_world_size()  # which ranks loaded the codec: the first decode loads it
    dist.all_gather_object(decoded, split._codec is not None)
    return {"max_diff": diff, "max_abs": float(want.abs().max()), "shape": list(got.shape), "decoded": decoded,
            "cached_max_diff": cached_diff, "no_attn2_max_diff": float((got_no_attn2 - want_no_attn2).abs().max()),
            "no_attn2_kv": [sum(k.filled for k in kv), sum(k.hits for k in kv)], "kv_blocks": len(kv),
            "cached_vs_full": float((want_cached - plain.generate(
                prompts, SamplingPlan(steps=4, seed=2), batch_size=2)).abs().max())}


def across_nodes(per_node: int) -> dict[str, dict]:
    """One sequence group of every rank as if on nodes of `per_node` ranks: Ulysses within each, ring attention across
    (softmax families); SANA's sums and halo and Latte's switches over the whole group."""
    world = dist.get_world_size()
    mesh = ParallelDims.of(world, per_node, sequence=world).build("cpu")
    result = {}
    for family in ("pixart", "sana", "dit", "wan", "latte"):
        result[f"{family}/1"] = compare(mesh, family, 1)
    result["pixart/2"] = compare(mesh, "pixart", 2)  # 2 head groups, each with its own ring
    result["pixart/ckpt"] = compare(mesh, "pixart", 1, ckpt=True)  # the ring runs again in the recomputation
    result["wan/pad"] = compare(mesh, "wan", 1, heads=3)
    return result


def on_one_node(data: str) -> dict[str, dict]:
    """One sequence group of every rank, on one node: every family, sampling on 2 ranks."""
    world = dist.get_world_size()
    mesh = job_mesh(sequence=world)
    result = {}
    if world == 2:
        for family in ("pixart", "sana"):
            result[f"sample/{family}"] = sample(mesh, data, family)
    for family in ("pixart", "sana", "dit", "wan", "latte"):
        # 4 heads: G x P must divide them for softmax attention; SANA's linear attention keeps every head, G divides 4
        for head_groups in ((1, 2) if family in ("sana", "latte") or world == 2 else (1,)):
            result[f"{family}/{head_groups}"] = compare(mesh, family, head_groups)
        result[f"{family}/ckpt"] = compare(mesh, family, 1, ckpt=True)
    # latte's switch to positions made by the temporal block, not the spatial block's tail (the bench's comparison);
    # the tail's slices run again in the checkpointed recomputation
    result["latte/2/intra"] = compare(mesh, "latte", 2, inter_layer=False)
    result["latte/2/ckpt"] = compare(mesh, "latte", 2, ckpt=True)
    for family in ("pixart", "sana"):  # a model built for 8x8 latents, given 8x16 ones: split rows of another shape
        result[f"{family}/wide"] = compare(mesh, family, 1, (8, 16))
    result["pixart/diffusers"] = compare(mesh, "pixart", 1, diffusers_attention=True)
    for family in ("pixart", "wan"):  # 3 heads on 2 or 4 ranks: padded to 4
        result[f"{family}/pad"] = compare(mesh, family, 1, heads=3)
    return result


def main(data: str, out: str, per_node: str | None = None) -> None:
    init_from_env()
    result = on_one_node(data) if per_node is None else across_nodes(int(per_node))
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    leave()


if __name__ == "__main__":
    main(*sys.argv[1:])
