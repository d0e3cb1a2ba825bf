"""SANA (diffusers' SanaTransformer2DModel): linear self-attention, softmax cross-attention to Gemma-2 captions and a
GLUMBConv (Mix-FFN) MLP, on a DC-AE's 32x-downsampled latents."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import SanaTransformer2DModel
from torch import nn

from framework.models.families.base import (
    N002, ZERO, ModelConfig, TransformerFamily, constant, fused_xavier, keep_mask, transformer_blocks,
)
from framework.models.families.pixart import TEXT_TRANSFORMER_ARGS
from framework.models.plans import ParallelPlan, SequencePlan


def cross_heads(cfg: ModelConfig) -> tuple[int, int]:
    """SANA's cross-attention heads: from kwargs, else the self-attention head size."""
    dim = cfg.kwargs.get("cross_attention_head_dim", cfg.head_dim)
    return cfg.kwargs.get("num_cross_attention_heads", cfg.hidden_size // dim), dim


class Sana(TransformerFamily):
    name = "sana"
    diffusers_class = SanaTransformer2DModel
    derived = TEXT_TRANSFORMER_ARGS
    plan = ParallelPlan(transformer_blocks, stack=True,
                        # SanaTransformerBlock.forward(hidden_states, attention_mask, encoder_hidden_states,
                        # encoder_attention_mask, timestep, height, width)
                        sequence=SequencePlan("patch_embed", "proj_out", "linear", rows_arg=5))
    # NVlabs/Sana diffusion/model/nets/sana.py, Sana.initialize_weights; its caption RMSNorm starts at
    # y_norm_scale_factor = 0.01 (diffusion/model/nets/sana_blocks.py RMSNorm with scale_factor). No zeroed
    # cross-attention output or final layer: SANA's init drops those of PixArt.
    init_rules = [
        (r"net\.transformer_blocks\.\d+\.attn1\.to_[qkv]\.weight", fused_xavier(3)),  # LiteLA's qkv
        (r"net\.transformer_blocks\.\d+\.attn2\.to_[kv]\.weight", fused_xavier(2)),
        (r"net\.time_embed\.guidance_embedder\.linear_1\.weight", N002),  # cfg_embedder (guidance_embeds)
        (r"net\.time_embed\.guidance_embedder\.linear_2\.(weight|bias)", ZERO),
        (r"net\.time_embed\.(emb\.)?timestep_embedder\.linear_[12]\.weight", N002),  # (emb. without guidance)
        (r"net\.time_embed\.linear\.weight", N002),
        (r"net\.caption_projection\.linear_[12]\.weight", N002),
        (r"net\.caption_norm\.weight", constant(0.01)),  # attention_y_norm, scale_factor 0.01
    ]
    patch_conv = "net.patch_embed.proj"
    pipeline_class = "SanaPipeline"
    lora_loader = "SanaPipeline"
    bare_call = {}

    def check(self, cfg: ModelConfig) -> None:
        super().check(cfg)
        heads, dim = cross_heads(cfg)
        if heads * dim != cfg.hidden_size:
            raise ValueError(f"model.kwargs.num_cross_attention_heads * model.kwargs.cross_attention_head_dim "
                             f"= {heads} * {dim} must equal the width {cfg.hidden_size}.")

    def diffusers_kwargs(self, cfg: ModelConfig) -> dict[str, Any]:
        heads, dim = cross_heads(cfg)
        args = dict(self.transformer_kwargs(cfg), caption_channels=cfg.text_dim, cross_attention_dim=cfg.hidden_size,
                    num_cross_attention_heads=heads, cross_attention_head_dim=dim)
        return {**args, **self.defaults, **cfg.kwargs}

    def forward(self, net: nn.Module, cfg: ModelConfig, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor | None,
                text_mask: torch.Tensor | None, labels: torch.Tensor | None,
                size_ids: torch.Tensor | None) -> torch.Tensor:
        return net(x, encoder_hidden_states=text, timestep=t, encoder_attention_mask=keep_mask(text_mask, x),
                   return_dict=False)[0]

    def check_pipeline(self, cfg: ModelConfig, vae: Any) -> None:
        if vae is not None and type(vae).__name__ != "AutoencoderDC":
            # SanaPipeline reads the DC-AE's config when it is built; any other VAE fails there.
            raise ValueError(f"export format=diffusers: diffusers' SanaPipeline takes an AutoencoderDC (DC-AE, the VAE "
                             f"SANA is trained with); this model's latents come from an {type(vae).__name__}. Export "
                             f"format=safetensors for the transformer alone, or encode the data with a DC-AE.")

    def pipeline_notes(self, cfg: ModelConfig, info: dict[str, Any], pipeline: str) -> list[str]:
        if not info.get("text_settings", {}).get("prefix"):
            return [f"export: stock {pipeline} puts Gemma-2's instruction text before each prompt; this model was "
                    "trained on its captions as they are: call the pipeline with complex_human_instruction=None"]
        return [f"export: this model was trained with precompute's text_prefix before each caption: call stock "
                f"{pipeline} with complex_human_instruction set to its lines (its default is its own instruction) "
                f"and max_sequence_length={info['text_settings'].get('max_tokens')}"]


FAMILY = Sana()
