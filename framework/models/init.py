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

import torch
from torch import nn

from framework.models.families import family_of
from framework.models.families.base import ZERO, Rule, xavier

INITS = ("diffusers", "reference")


# Each family's rules are its `init_rules` (framework/models/families/<name>.py): (pattern on the parameter name,
# rule), the first match wins; then every nn.Linear / the family's `patch_conv` falls back to the basic init (xavier
# weight, zero bias) where the family has `basic_init`. Names are those of the diffusers class inside a Denoiser.
def rules(model: nn.Module, family: str) -> dict[str, Rule]:
    """{parameter name: its rule} of `model` (a Denoiser) under the reference init of `family`; parameters not named
    keep what the constructor drew."""
    fam = family_of(family)
    specific = [(re.compile(p), r) for p, r in fam.init_rules]
    out: dict[str, Rule] = {}
    for module_name, module in model.named_modules():
        basic = fam.basic_init and (isinstance(module, nn.Linear) or module_name == fam.patch_conv)
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
