"""`model.init=reference`: a backbone's from-scratch weights as its reference code initialises them.

diffusers' constructors leave PyTorch's default init (kaiming-uniform linears and convs, N(0, 1) embeddings), which is
not what the papers trained from. Each family's reference code re-initialises after construction:

    dit     facebookresearch/DiT models.py, DiT.initialize_weights
    pixart  PixArt-alpha/PixArt-alpha diffusion/model/nets/PixArt.py, PixArt.initialize_weights (PixArtMS alike)
    sana    NVlabs/Sana diffusion/model/nets/sana.py, Sana.initialize_weights; its caption RMSNorm starts at
            y_norm_scale_factor = 0.01 (diffusion/model/nets/sana_blocks.py RMSNorm with scale_factor)
    unet    Stability-AI/stablediffusion ldm/modules/diffusionmodules/openaimodel.py and ldm/modules/attention.py:
            zero_module on each ResBlock's last conv, each SpatialTransformer's proj_out and the output conv
    latte   Vchitect/Latte's text-to-video model starts from PixArt-alpha's weights and has no init of its own: from
            scratch here, PixArt's rules, its temporal blocks' self-attention as the spatial blocks'
    wan     Wan-Video/Wan2.1 wan/modules/model.py, WanModel.init_weights: xavier linears with zero bias, the 3D patch
            conv xavier over its flattened view, the text and time embedding MLPs N(0, 0.02), the head's linear zeroed

The rules, on diffusers' parameter names (`rules`): every nn.Linear xavier-uniform with zero bias (the transformers'
`_basic_init`), its bound that of the fused projection the reference has where diffusers splits one (self-attention's
qkv, 3 x width out; cross-attention's kv, 2 x width out); the patch embedding's conv xavier-uniform over its flattened
(out, in * k * k) view (its bias zeroed by DiT only); the timestep MLP, the caption projection, PixArt's t_block and
size embedders, SANA's guidance MLP's first layer and DiT's label table N(0, 0.02); zeros where the reference zeroes:
DiT's adaLN modulation and final layer (adaLN-Zero), PixArt's cross-attention output projection and final linear,
SANA's guidance MLP's last layer. What no rule names keeps its constructor init (the scale-shift tables,
randn / sqrt(width) in the reference too; norms; SANA's convolutions). The position embeddings are fixed sin-cos
buffers in diffusers already.

Each parameter is drawn from its own generator, seeded by a number drawn once from the global RNG after construction
and by the parameter's name, so a parameter's values do not depend on the order tensors are visited: the sharded
meta-device build (framework/distributed/fsdp.py fresh_shards) computes each whole tensor alone, takes its rows, and
gets bitwise the regular build's values.
"""
from __future__ import annotations

import hashlib
import re
from typing import Callable

import torch
from torch import nn

INITS = ("diffusers", "reference")
Rule = Callable[[torch.Size, torch.Generator], torch.Tensor]


def fused_xavier(parts: int) -> Rule:
    """xavier_uniform over (out, everything else), a linear's weight or a conv's flattened as the references do, for a
    slice of a projection fused from `parts` such slices (the bound of the fused (parts * out, in) weight)."""
    def rule(shape: torch.Size, g: torch.Generator) -> torch.Tensor:
        fan_out, fan_in = parts * shape[0], max(1, int(torch.Size(shape[1:]).numel()))
        bound = (6.0 / (fan_in + fan_out)) ** 0.5
        return (torch.rand(shape, generator=g, dtype=torch.float32) * 2 - 1) * bound
    return rule


xavier = fused_xavier(1)


def normal(std: float) -> Rule:
    return lambda shape, g: torch.randn(shape, generator=g, dtype=torch.float32) * std


def constant(value: float) -> Rule:
    return lambda shape, g: torch.full(shape, value, dtype=torch.float32)


ZERO = constant(0.0)
N002 = normal(0.02)

# (pattern on the parameter name, rule), the first match wins; then every nn.Linear / patch-embedding conv falls back
# to the basic init (xavier weight, zero bias). Names are those of the diffusers class inside a Denoiser (`net.`).
SPECIFIC: dict[str, list[tuple[str, Rule]]] = {
    "dit": [
        (r"net\.transformer_blocks\.\d+\.attn1\.to_[qkv]\.weight", fused_xavier(3)),  # timm Attention's qkv
        (r"net\.pos_embed\.proj\.bias", ZERO),
        (r"net\.transformer_blocks\.\d+\.norm1\.linear\.(weight|bias)", ZERO),  # adaLN modulation: adaLN-Zero
        (r"net\.proj_out_[12]\.(weight|bias)", ZERO),  # final layer's modulation and linear
        (r"net\.transformer_blocks\.\d+\.norm1\.emb\.timestep_embedder\.linear_[12]\.weight", N002),
        (r"net\.transformer_blocks\.\d+\.norm1\.emb\.class_embedder\.embedding_table\.weight", N002),
    ],
    "pixart": [
        (r"net\.transformer_blocks\.\d+\.attn1\.to_[qkv]\.weight", fused_xavier(3)),  # its attention's qkv
        (r"net\.transformer_blocks\.\d+\.attn2\.to_[kv]\.weight", fused_xavier(2)),  # cross-attention's kv_linear
        (r"net\.transformer_blocks\.\d+\.attn2\.to_out\.0\.(weight|bias)", ZERO),  # cross-attention output
        (r"net\.proj_out\.(weight|bias)", ZERO),  # final layer's linear
        (r"net\.adaln_single\.emb\.(timestep|resolution|aspect_ratio)_embedder\.linear_[12]\.weight", N002),
        (r"net\.adaln_single\.linear\.weight", N002),  # t_block
        (r"net\.caption_projection\.linear_[12]\.weight", N002),  # y_embedder
    ],
    "sana": [  # no zeroed cross-attention output or final layer: SANA's init drops those of PixArt
        (r"net\.transformer_blocks\.\d+\.attn1\.to_[qkv]\.weight", fused_xavier(3)),  # LiteLA's qkv
        (r"net\.transformer_blocks\.\d+\.attn2\.to_[kv]\.weight", fused_xavier(2)),
        (r"net\.time_embed\.guidance_embedder\.linear_1\.weight", N002),  # cfg_embedder (guidance_embeds)
        (r"net\.time_embed\.guidance_embedder\.linear_2\.(weight|bias)", ZERO),
        (r"net\.time_embed\.(emb\.)?timestep_embedder\.linear_[12]\.weight", N002),  # (emb. without guidance)
        (r"net\.time_embed\.linear\.weight", N002),
        (r"net\.caption_projection\.linear_[12]\.weight", N002),
        (r"net\.caption_norm\.weight", constant(0.01)),  # attention_y_norm, scale_factor 0.01
    ],
    "unet": [
        (r"net\.(down_blocks|up_blocks|mid_block)\.(\d+\.)?resnets\.\d+\.conv2\.(weight|bias)", ZERO),
        (r"net\.(down_blocks|up_blocks|mid_block)\.(\d+\.)?attentions\.\d+\.proj_out\.(weight|bias)", ZERO),
        (r"net\.conv_out\.(weight|bias)", ZERO),
    ],
    "latte": [
        (r"net\.(temporal_)?transformer_blocks\.\d+\.attn1\.to_[qkv]\.weight", fused_xavier(3)),
        (r"net\.transformer_blocks\.\d+\.attn2\.to_[kv]\.weight", fused_xavier(2)),
        (r"net\.transformer_blocks\.\d+\.attn2\.to_out\.0\.(weight|bias)", ZERO),
        (r"net\.proj_out\.(weight|bias)", ZERO),
        (r"net\.adaln_single\.emb\.timestep_embedder\.linear_[12]\.weight", N002),
        (r"net\.adaln_single\.linear\.weight", N002),
        (r"net\.caption_projection\.linear_[12]\.weight", N002),
    ],
    "wan": [  # its time_projection (diffusers' time_proj) keeps the basic init; only the head's weight is zeroed
        (r"net\.condition_embedder\.(text|time)_embedder\.linear_[12]\.weight", N002),
        (r"net\.proj_out\.weight", ZERO),
    ],
}
# The convolution the references give the basic init (their x_embedder / PatchEmbed); the UNet's keep PyTorch's.
PATCH_CONV = {"dit": "net.pos_embed.proj", "pixart": "net.pos_embed.proj", "sana": "net.patch_embed.proj",
              "latte": "net.pos_embed.proj", "wan": "net.patch_embedding"}


def rules(model: nn.Module, family: str) -> dict[str, Rule]:
    """{parameter name: its rule} of `model` (a Denoiser) under the reference init of `family`; parameters not named
    keep what the constructor drew."""
    specific = [(re.compile(p), r) for p, r in SPECIFIC[family]]
    out: dict[str, Rule] = {}
    for module_name, module in model.named_modules():
        basic = family != "unet" and (isinstance(module, nn.Linear) or module_name == PATCH_CONV.get(family))
        for short, _ in module.named_parameters(recurse=False):
            name = f"{module_name}.{short}" if module_name else short
            rule = next((r for p, r in specific if p.fullmatch(name)), None)
            if rule is None and basic and (short == "weight" or isinstance(module, nn.Linear)):
                rule = xavier if short == "weight" else ZERO  # a patch conv's bias: only DiT's is zeroed (above)
            if rule is not None:
                out[name] = rule
    return out


def generator(seed: int, name: str) -> torch.Generator:
    """The generator of parameter `name` under the init drawn as `seed`."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF)


def draw_seed() -> int:
    """The one number the reference init takes from the global RNG (after the constructor's draws)."""
    return int(torch.randint(0, 2**62, (1,), device="cpu"))


def value(rule: Rule, name: str, shape: torch.Size, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Parameter `name`'s whole initial tensor (CPU)."""
    return rule(torch.Size(shape), generator(seed, name)).to(dtype)


def apply(model: nn.Module, family: str, seed: int) -> None:
    """Re-initialise `model`'s parameters in place; meta tensors (a sharded build's stand-ins) are left to the caller."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, rule in rules(model, family).items():
            p = params[name]
            if not p.is_meta:
                p.copy_(value(rule, name, p.shape, seed, p.dtype))


def init_weights(model: nn.Module) -> None:
    """A freshly built Denoiser's from-scratch weights as its `model.init` says (the training module calls it when no
    init_from gives them; framework/distributed/fsdp.py fresh_shards does the same on the sharded build)."""
    if model.cfg.init == "reference":
        apply(model, model.cfg.family, draw_seed())
