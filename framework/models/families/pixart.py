"""PixArt-alpha / -Sigma (diffusers' PixArtTransformer2DModel): DiT blocks with cross-attention to T5 captions and
adaLN-single; optionally PixArt-alpha-1024's resolution and aspect-ratio embedding (model.size_conditioning)."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import PixArtTransformer2DModel
from torch import nn

from framework.models.families.base import (
    N002, ZERO, ModelConfig, TransformerFamily, fused_xavier, keep_mask, transformer_blocks,
)
from framework.models.plans import ParallelPlan, SequencePlan

# What a text transformer derives from ModelConfig's fields (sana and latte alike).
TEXT_TRANSFORMER_ARGS = frozenset({"num_attention_heads", "attention_head_dim", "in_channels", "out_channels",
                                   "num_layers", "sample_size", "patch_size", "caption_channels", "cross_attention_dim"})


class PixArt(TransformerFamily):
    name = "pixart"
    diffusers_class = PixArtTransformer2DModel
    derived = TEXT_TRANSFORMER_ARGS
    released_own = frozenset({"use_additional_conditions"})
    size_conditioning = True
    plan = ParallelPlan(transformer_blocks, stack=True, sequence=SequencePlan("pos_embed", "proj_out", "softmax"))
    # PixArt-alpha/PixArt-alpha diffusion/model/nets/PixArt.py, PixArt.initialize_weights (PixArtMS alike)
    init_rules = [
        (r"net\.transformer_blocks\.\d+\.attn1\.to_[qkv]\.weight", fused_xavier(3)),  # its attention's qkv
        (r"net\.transformer_blocks\.\d+\.attn2\.to_[kv]\.weight", fused_xavier(2)),  # cross-attention's kv_linear
        (r"net\.transformer_blocks\.\d+\.attn2\.to_out\.0\.(weight|bias)", ZERO),  # cross-attention output
        (r"net\.proj_out\.(weight|bias)", ZERO),  # final layer's linear
        (r"net\.adaln_single\.emb\.(timestep|resolution|aspect_ratio)_embedder\.linear_[12]\.weight", N002),
        (r"net\.adaln_single\.linear\.weight", N002),  # t_block
        (r"net\.caption_projection\.linear_[12]\.weight", N002),  # y_embedder
    ]
    patch_conv = "net.pos_embed.proj"
    pipeline_class = "PixArtAlphaPipeline"
    bare_call = {"added_cond_kwargs": {"resolution": None, "aspect_ratio": None}}

    def check_kwargs(self, cfg: ModelConfig) -> None:
        if "use_additional_conditions" in cfg.kwargs:
            raise ValueError("model.kwargs.use_additional_conditions is set from model.size_conditioning (the latents' "
                             "own size is the condition); set that instead.")
        if cfg.size_conditioning and cfg.num_heads and (cfg.num_heads * cfg.head_dim) % 3:
            raise ValueError(f"model.size_conditioning=true needs a width divisible by 3 (PixArt splits it between the "
                             f"height, width and aspect-ratio embeddings; 1152 = 3 x 384): model.num_heads x "
                             f"model.head_dim = {cfg.num_heads * cfg.head_dim}")

    def diffusers_kwargs(self, cfg: ModelConfig) -> dict[str, Any]:
        # Captions are projected to the width before cross-attention, hence cross_attention_dim = width.
        args = dict(self.transformer_kwargs(cfg), caption_channels=cfg.text_dim, cross_attention_dim=cfg.hidden_size,
                    use_additional_conditions=cfg.size_conditioning)
        return {**args, **self.defaults, **cfg.kwargs}

    def forward(self, net: nn.Module, cfg: ModelConfig, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor | None,
                text_mask: torch.Tensor | None, labels: torch.Tensor | None,
                size_ids: torch.Tensor | None) -> torch.Tensor:
        sizes = {"resolution": None, "aspect_ratio": None}
        if cfg.size_conditioning:  # (B, 2) height and width in an 8x VAE's pixels, (B, 1) height / width
            h, w = x.shape[-2:]
            sizes = {"resolution": x.new_tensor([[8.0 * h, 8.0 * w]]).expand(x.shape[0], 2),
                     "aspect_ratio": x.new_tensor([[h / w]]).expand(x.shape[0], 1)}
        return net(x, encoder_hidden_states=text, timestep=t, encoder_attention_mask=keep_mask(text_mask, x),
                   added_cond_kwargs=sizes, return_dict=False)[0]

    def released_fields(self, value: dict[str, Any]) -> dict[str, Any]:
        fields = super().released_fields(value)
        # diffusers' PixArt: null means "on for the 1024 model" (sample_size 128), as its constructor decides
        conditions = value["use_additional_conditions"]
        fields["size_conditioning"] = value["sample_size"] == 128 if conditions is None else bool(conditions)
        return fields

    def pipeline_name(self, cfg: ModelConfig, run_name: str) -> str:
        if "sigma" in f"{cfg.name} {run_name}":
            # A PixArt-Sigma preset or experiment: the same transformer, whose stock pipeline reads prompts up to
            # Sigma's 300 tokens (PixArtAlphaPipeline would cut them at 120) and bins sizes up to 2048 px.
            return "PixArtSigmaPipeline"
        return self.pipeline_class


FAMILY = PixArt()
