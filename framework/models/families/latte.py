"""Latte (diffusers' LatteTransformer3DModel): an ST-DiT for clips, PixArt-alpha's blocks alternating between spatial
blocks (each frame's tokens, with cross-attention) and temporal blocks (each position's frames)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from diffusers import LatteTransformer3DModel
from torch import nn

from framework.models.families.base import N002, ZERO, ModelConfig, TransformerFamily, fused_xavier, keep_mask
from framework.models.families.pixart import TEXT_TRANSFORMER_ARGS
from framework.models.plans import ParallelPlan, SequencePlan


@contextmanager
def latte_frames(net: nn.Module, frames: int) -> Iterator[None]:
    """Latte adds its whole table of temporal positions (one row per model.num_frames) to every clip; a clip of fewer
    frames (a frame-count bucket of precompute's num_frames=[...]) takes the first `frames` rows while in here."""
    full = net.temp_pos_embed  # (1, num_frames, D), a buffer
    if frames > full.shape[1]:
        raise ValueError(f"a clip of {frames} latent frames: this Latte's temporal positions go up to model.num_frames="
                         f"{full.shape[1]}")
    if frames == full.shape[1]:
        yield
        return
    net.temp_pos_embed = full[:, :frames]
    try:
        yield
    finally:
        net.temp_pos_embed = full


def _layers(net: nn.Module) -> list[nn.Module]:
    """Spatial block i, then temporal block i: the order Latte's forward runs them."""
    return [b for pair in zip(net.transformer_blocks, net.temporal_transformer_blocks) for b in pair]


class Latte(TransformerFamily):
    name = "latte"
    diffusers_class = LatteTransformer3DModel
    derived = TEXT_TRANSFORMER_ARGS | {"video_length"}
    # Latte's blocks are PixArt's (adaLN-single, tanh GELU, biased attention, no affine norms), where the class's
    # defaults differ (a preset's kwargs may still set them).
    defaults = {"norm_type": "ada_norm_single", "activation_fn": "gelu-approximate", "attention_bias": True,
                "norm_elementwise_affine": False, "norm_eps": 1e-6, "num_embeds_ada_norm": 1000}
    video = True
    plan = ParallelPlan(_layers, stack=True, stack_attrs=("transformer_blocks", "temporal_transformer_blocks"),
                        sequence=SequencePlan("pos_embed", "norm_out", "switch"))
    # Vchitect/Latte's text-to-video model starts from PixArt-alpha's weights and has no init of its own: from scratch
    # here, PixArt's rules, its temporal blocks' self-attention as the spatial blocks'.
    init_rules = [
        (r"net\.(temporal_)?transformer_blocks\.\d+\.attn1\.to_[qkv]\.weight", fused_xavier(3)),
        (r"net\.transformer_blocks\.\d+\.attn2\.to_[kv]\.weight", fused_xavier(2)),
        (r"net\.transformer_blocks\.\d+\.attn2\.to_out\.0\.(weight|bias)", ZERO),
        (r"net\.proj_out\.(weight|bias)", ZERO),
        (r"net\.adaln_single\.emb\.timestep_embedder\.linear_[12]\.weight", N002),
        (r"net\.adaln_single\.linear\.weight", N002),
        (r"net\.caption_projection\.linear_[12]\.weight", N002),
    ]
    patch_conv = "net.pos_embed.proj"
    pipeline_class = "LattePipeline"

    def diffusers_kwargs(self, cfg: ModelConfig) -> dict[str, Any]:
        args = dict(self.transformer_kwargs(cfg), caption_channels=cfg.text_dim, cross_attention_dim=cfg.hidden_size,
                    video_length=cfg.num_frames)
        return {**args, **self.defaults, **cfg.kwargs}

    def forward(self, net: nn.Module, cfg: ModelConfig, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor | None,
                text_mask: torch.Tensor | None, labels: torch.Tensor | None,
                size_ids: torch.Tensor | None) -> torch.Tensor:
        mask = keep_mask(text_mask, x)
        # Its spatial blocks see each frame as a sample: the caption's additive bias, one per frame.
        bias = None if mask is None else ((1 - mask) * -10000.0).repeat_interleave(x.shape[2], 0).unsqueeze(1)
        with latte_frames(net, x.shape[2]):
            return net(x, timestep=t, encoder_hidden_states=text, encoder_attention_mask=bias, return_dict=False)[0]

    def named_blocks(self, net: nn.Module) -> list[tuple[str, nn.Module]]:
        """Spatial block i, then temporal block i."""
        return [(f"{stack}.{i}", getattr(net, stack)[i]) for i in range(len(net.transformer_blocks))
                for stack in ("transformer_blocks", "temporal_transformer_blocks")]

    def check_pipeline(self, cfg: ModelConfig, vae: Any) -> None:
        """LattePipeline keeps the first half of the prediction's channels (it assumes Latte's learned sigma) unless the
        scheduler says the variance is learned, and decodes frame by frame with an image VAE."""
        if not cfg.learned_sigma and cfg.in_channels > 1:
            raise ValueError(f"export format=diffusers: stock LattePipeline keeps the first half of the transformer's "
                             f"output channels (Latte predicts a variance too), and this model predicts "
                             f"{cfg.in_channels} channels alone (model.learned_sigma=false): its samples would be "
                             "wrong. Export format=safetensors, or train with model.learned_sigma=true")
        self.require_vae(vae, "AutoencoderKL", "decodes each frame with an image VAE (AutoencoderKL)",
                         "sample with framework.sample")

    def pipeline_notes(self, cfg: ModelConfig, info: dict[str, Any], pipeline: str) -> list[str]:
        return [f"export: stock {pipeline} guides with the empty prompt padded to the prompt's length, padding "
                "attended; framework.sample guides with the dataset's empty caption alone: their guided samples "
                "differ, unguided ones (guidance_scale=1) are the same"]


FAMILY = Latte()
