"""model.init=reference: each family's from-scratch weights as its reference code initialises them
(framework/models/init.py cites the files). References: the rules as the reference code states them (zeros, a normal
of std 0.02, xavier-uniform's bound and spread, SANA's caption norm at 0.01) checked on every parameter they name, and
the constructor's own draw for every parameter they leave alone.
"""
from __future__ import annotations

import math

import pytest
import torch

from framework.models.backbones import build_denoiser, load_preset
from framework.models.init import init_weights

# preset -> (overrides, parameters zeroed, parameters drawn from N(0, 0.02), parameters set to a constant {name: value})
FAMILIES = {
    "dit_debug": ({},
        ["net.transformer_blocks.0.norm1.linear.weight", "net.transformer_blocks.3.norm1.linear.bias",
         "net.proj_out_1.weight", "net.proj_out_1.bias", "net.proj_out_2.weight", "net.proj_out_2.bias",
         "net.pos_embed.proj.bias", "net.transformer_blocks.0.attn1.to_q.bias", "net.transformer_blocks.1.ff.net.2.bias"],
        ["net.transformer_blocks.0.norm1.emb.timestep_embedder.linear_1.weight",
         "net.transformer_blocks.1.norm1.emb.timestep_embedder.linear_2.weight",
         "net.transformer_blocks.2.norm1.emb.class_embedder.embedding_table.weight"], {}),
    "pixart_debug": ({},
        ["net.transformer_blocks.0.attn2.to_out.0.weight", "net.transformer_blocks.3.attn2.to_out.0.bias",
         "net.proj_out.weight", "net.proj_out.bias", "net.transformer_blocks.0.attn2.to_k.bias"],
        ["net.adaln_single.emb.timestep_embedder.linear_1.weight", "net.adaln_single.linear.weight",
         "net.caption_projection.linear_1.weight", "net.caption_projection.linear_2.weight"], {}),
    "sana_debug": ({"kwargs": {"guidance_embeds": True}},  # with SANA-1.5's guidance embedding
        ["net.time_embed.guidance_embedder.linear_2.weight", "net.time_embed.guidance_embedder.linear_2.bias",
         "net.transformer_blocks.0.attn2.to_k.bias", "net.proj_out.bias"],
        ["net.time_embed.timestep_embedder.linear_2.weight", "net.time_embed.linear.weight",
         "net.caption_projection.linear_1.weight", "net.time_embed.guidance_embedder.linear_1.weight"],
        {"net.caption_norm.weight": 0.01}),
    "sd2_unet_debug": ({},
        ["net.down_blocks.0.resnets.0.conv2.weight", "net.up_blocks.1.resnets.1.conv2.bias",
         "net.mid_block.resnets.1.conv2.weight", "net.down_blocks.0.attentions.0.proj_out.weight",
         "net.mid_block.attentions.0.proj_out.bias", "net.conv_out.weight", "net.conv_out.bias"], [], {}),
    # PixArt's rules on Latte's spatial and temporal blocks
    "latte_debug": ({},
        ["net.transformer_blocks.0.attn2.to_out.0.weight", "net.transformer_blocks.1.attn2.to_out.0.bias",
         "net.proj_out.weight", "net.proj_out.bias", "net.temporal_transformer_blocks.1.attn1.to_k.bias"],
        ["net.adaln_single.emb.timestep_embedder.linear_1.weight", "net.adaln_single.linear.weight",
         "net.caption_projection.linear_1.weight"], {}),
    "wan_debug": ({},
        ["net.proj_out.weight", "net.blocks.0.attn1.to_q.bias", "net.blocks.1.ffn.net.2.bias",
         "net.condition_embedder.time_proj.bias"],
        ["net.condition_embedder.text_embedder.linear_1.weight", "net.condition_embedder.text_embedder.linear_2.weight",
         "net.condition_embedder.time_embedder.linear_2.weight"], {}),
}
# xavier-uniform weights: (name, fan_in, fan_out), the fan-out of the reference's fused projection where diffusers
# splits it (self-attention's qkv: 3 x width; cross-attention's kv: 2 x width)
XAVIER = {
    "dit_debug": [("net.transformer_blocks.0.attn1.to_q.weight", 128, 384), ("net.pos_embed.proj.weight", 16, 128),
                  ("net.transformer_blocks.1.ff.net.2.weight", 512, 128)],
    "pixart_debug": [("net.transformer_blocks.0.attn1.to_v.weight", 128, 384),
                     ("net.transformer_blocks.0.attn2.to_k.weight", 128, 256),
                     ("net.transformer_blocks.0.attn2.to_q.weight", 128, 128), ("net.pos_embed.proj.weight", 16, 128),
                     ("net.transformer_blocks.2.ff.net.0.proj.weight", 128, 512)],
    "sana_debug": [("net.transformer_blocks.0.attn1.to_q.weight", 64, 192), ("net.patch_embed.proj.weight", 4, 64),
                   ("net.transformer_blocks.0.attn2.to_out.0.weight", 64, 64), ("net.proj_out.weight", 64, 4)],
    "sd2_unet_debug": [],
    "latte_debug": [("net.temporal_transformer_blocks.0.attn1.to_q.weight", 128, 384),
                    ("net.transformer_blocks.1.attn2.to_v.weight", 128, 256), ("net.pos_embed.proj.weight", 16, 128)],
    # Wan's own projections are separate linears; its 3D patch conv over (in x 1 x 2 x 2)
    "wan_debug": [("net.blocks.0.attn1.to_k.weight", 128, 128), ("net.patch_embedding.weight", 16, 128),
                  ("net.condition_embedder.time_proj.weight", 128, 768), ("net.blocks.1.ffn.net.0.proj.weight", 128, 256)],
}
# Parameters no rule names: the constructor's draw stays (the same seed gives the diffusers build's values).
KEPT = {
    "dit_debug": [],  # every DiT parameter has a rule (its norms have no affine parameters)
    "pixart_debug": ["net.scale_shift_table", "net.transformer_blocks.1.scale_shift_table", "net.pos_embed.proj.bias"],
    "sana_debug": ["net.transformer_blocks.0.ff.conv_depth.weight", "net.scale_shift_table", "net.patch_embed.proj.bias"],
    "sd2_unet_debug": ["net.down_blocks.0.resnets.0.conv1.weight", "net.conv_in.weight",
                       "net.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight"],
    "latte_debug": ["net.scale_shift_table", "net.temporal_transformer_blocks.0.scale_shift_table"],
    "wan_debug": ["net.scale_shift_table", "net.blocks.0.scale_shift_table", "net.patch_embedding.bias",
                  "net.blocks.0.attn1.norm_q.weight"],
}


def built(name: str, init: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    model = build_denoiser(load_preset(name, init=init, **FAMILIES[name][0]))
    init_weights(model)
    return {k: p.detach() for k, p in model.named_parameters()}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_reference_init_follows_the_reference_code(name):
    _, zeroed, normal, constant = FAMILIES[name]
    ref, default = built(name, "reference"), built(name, "diffusers")
    for k in zeroed:
        assert not ref[k].any(), k
        assert default[k].any(), f"{k} is zero in the diffusers build too: the test would not see the rule"
    for k in normal:  # N(0, 0.02): the sample's std within 15% of it (>= 4,096 values), its mean near 0
        w = ref[k].float()
        assert w.numel() >= 1000 and abs(w.std().item() / 0.02 - 1) < 0.15 and abs(w.mean().item()) < 0.004, k
    for k, value in constant.items():
        assert torch.equal(ref[k], torch.full_like(ref[k], value)), k
    for k, fan_in, fan_out in XAVIER[name]:  # xavier-uniform: |w| <= sqrt(6 / (fan_in + fan_out)), std bound / sqrt(3)
        w = ref[k].float()
        bound = math.sqrt(6 / (fan_in + fan_out))
        assert w.abs().max() <= bound and abs(w.std().item() / (bound / math.sqrt(3)) - 1) < 0.1, k
    for k in KEPT[name]:
        assert torch.equal(ref[k], default[k]), k
    assert not any(torch.equal(ref[k], default[k]) for k in zeroed + normal + [k for k, *_ in XAVIER[name]])


def test_an_unknown_init_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"model.init='paper' is unknown; choose one of \('diffusers', 'reference'\)"):
        load_preset("pixart_debug", init="paper")
