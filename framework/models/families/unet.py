"""The UNet (diffusers' UNet2DConditionModel, Stable Diffusion's): resnets and cross-attention transformer blocks at
several resolutions; optionally SDXL's micro-conditioning on the image's sizes (model.size_conditioning)."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from diffusers import UNet2DConditionModel
from diffusers.models.attention import BasicTransformerBlock
from torch import nn

from framework.models.families.base import ZERO, Family, ModelConfig
from framework.models.plans import ParallelPlan

# The UNet's size conditioning (SDXL's six numbers, here in latent units: pixels over the VAE's factor), and the
# sinusoid width of each.
SIZE_IDS = ("original_height", "original_width", "crop_top", "crop_left", "target_height", "target_width")
SIZE_ID_DIM = 256


def default_size_ids(x: torch.Tensor) -> torch.Tensor:
    """(B, 6) size ids for latents `x` (B, C, h, w) taken whole: the original is the target, no crop (what SDXL
    samples with)."""
    h, w = x.shape[-2:]
    return x.new_tensor([[h, w, 0.0, 0.0, h, w]], dtype=torch.float32).expand(x.shape[0], len(SIZE_IDS))


def pooled_text(text: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """(B, D): the mean of each caption's own tokens (mask True = token)."""
    if mask is None:
        return text.mean(1)
    m = mask.to(text.dtype).unsqueeze(-1)  # (B, L, 1)
    return (text * m).sum(1) / m.sum(1).clamp_min(1.0)


def channels(cfg: ModelConfig) -> list[int]:
    """block_out_channels: from kwargs, else the constructor's default."""
    default = inspect.signature(UNet2DConditionModel.__init__).parameters["block_out_channels"].default
    return list(cfg.kwargs.get("block_out_channels", default))


def unet_stages(net: nn.Module) -> list[tuple[str, nn.Module]]:
    """The unet's down blocks, mid block and up blocks in forward order, with their names in the net."""
    stages = [(f"down_blocks.{i}", b) for i, b in enumerate(net.down_blocks)]
    if net.mid_block is not None:
        stages.append(("mid_block", net.mid_block))
    return stages + [(f"up_blocks.{i}", b) for i, b in enumerate(net.up_blocks)]


def _stage_units(net: nn.Module) -> list[nn.Module]:
    return [stage for _, stage in unet_stages(net)]


class UNet(Family):
    name = "unet"
    diffusers_class = UNet2DConditionModel
    derived = frozenset({"in_channels", "out_channels", "sample_size", "layers_per_block", "cross_attention_dim",
                         "attention_head_dim", "num_attention_heads", "addition_embed_type", "addition_time_embed_dim",
                         "projection_class_embeddings_input_dim"})
    size_conditioning = True
    subfolder = "unet"
    plan = ParallelPlan(_stage_units, stack=False, sequence=None, routed=False,
                        why_not="its transformer blocks sit between resnets and convolutions at several resolutions")
    # Stability-AI/stablediffusion ldm/modules/diffusionmodules/openaimodel.py and ldm/modules/attention.py:
    # zero_module on each ResBlock's last conv, each SpatialTransformer's proj_out and the output conv
    init_rules = [
        (r"net\.(down_blocks|up_blocks|mid_block)\.(\d+\.)?resnets\.\d+\.conv2\.(weight|bias)", ZERO),
        (r"net\.(down_blocks|up_blocks|mid_block)\.(\d+\.)?attentions\.\d+\.proj_out\.(weight|bias)", ZERO),
        (r"net\.conv_out\.(weight|bias)", ZERO),
    ]
    basic_init = False  # the UNet's linears and convs keep PyTorch's init
    pipeline_class = "StableDiffusionPipeline"
    pipeline_extras = {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}
    lora_loader = "StableDiffusionPipeline"
    estimates_activations = False  # the UNet's activations are not estimated here
    offloads_blocks = False  # it checkpoints layers inside its blocks, which would be recomputed without their weights

    def check(self, cfg: ModelConfig) -> None:
        if cfg.num_heads is not None:
            raise ValueError("model.num_heads must be null for model.family=unet: heads per level are "
                             "block_out_channels[i] // model.head_dim.")
        if cfg.patch_size != 1:
            raise ValueError("model.patch_size must be 1 for model.family=unet (it has no patch embedding).")
        for c in channels(cfg):
            if c % cfg.head_dim:
                raise ValueError(f"model.kwargs.block_out_channels entry {c} is not divisible by "
                                 f"model.head_dim={cfg.head_dim}.")
        levels = len(channels(cfg))
        if cfg.sample_size is not None and cfg.sample_size % 2 ** (levels - 1):
            raise ValueError(f"model.sample_size={cfg.sample_size} must be divisible by {2 ** (levels - 1)} "
                             f"(the unet halves it {levels - 1} times).")

    def diffusers_kwargs(self, cfg: ModelConfig) -> dict[str, Any]:
        size = dict(in_channels=cfg.in_channels, out_channels=cfg.out_channels, sample_size=cfg.sample_size)
        # diffusers' UNet calls the per-level head *count* `attention_head_dim` (SD2: [5, 10, 20, 20]).
        heads = [c // cfg.head_dim for c in channels(cfg)]
        if cfg.size_conditioning:  # SDXL's: each size number embedded in 256 sinusoids, next to the pooled text
            size.update(addition_embed_type="text_time", addition_time_embed_dim=SIZE_ID_DIM,
                        projection_class_embeddings_input_dim=cfg.text_dim + len(SIZE_IDS) * SIZE_ID_DIM)
        return dict(size, layers_per_block=cfg.num_layers, cross_attention_dim=cfg.text_dim,
                    attention_head_dim=heads, **cfg.kwargs)

    def forward(self, net: nn.Module, cfg: ModelConfig, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor | None,
                text_mask: torch.Tensor | None, labels: torch.Tensor | None,
                size_ids: torch.Tensor | None) -> torch.Tensor:
        added = None
        if cfg.size_conditioning:
            ids = default_size_ids(x) if size_ids is None else size_ids
            added = {"text_embeds": pooled_text(text, text_mask), "time_ids": ids.to(x.device, x.dtype)}
        mask = None if text_mask is None else text_mask.to(x.dtype)  # (B, L), 1 = keep
        return net(x, t, encoder_hidden_states=text, encoder_attention_mask=mask, added_cond_kwargs=added,
                   return_dict=False)[0]

    def named_blocks(self, net: nn.Module) -> list[tuple[str, nn.Module]]:
        """Its BasicTransformerBlocks in forward order, inside its stages."""
        return [(f"{prefix}.{name}", module) for prefix, stage in unet_stages(net)
                for name, module in stage.named_modules() if isinstance(module, BasicTransformerBlock)]

    def released_fields(self, value: dict[str, Any]) -> dict[str, Any]:
        levels = list(value["block_out_channels"])
        heads = value["attention_head_dim"]
        heads = heads if isinstance(heads, (list, tuple)) else [heads] * len(levels)  # diffusers: heads per level
        return dict(num_layers=value["layers_per_block"], text_dim=value["cross_attention_dim"],
                    head_dim=levels[0] // heads[0], size_conditioning=value["addition_embed_type"] == "text_time")

    def check_pipeline(self, cfg: ModelConfig, vae: Any) -> None:
        if cfg.size_conditioning:
            raise ValueError("export format=diffusers: this UNet is size-conditioned (model.size_conditioning=true), "
                             "and stock StableDiffusionPipeline passes no size ids to it; export format=safetensors for "
                             "the UNet alone, or sample with framework.sample")

    def pipeline_notes(self, cfg: ModelConfig, info: dict[str, Any], pipeline: str) -> list[str]:
        return [f"export: stock {pipeline} pads prompts to the tokenizer's length and attends to the padding; "
                "LatentForge trained on each caption's own tokens (masked), so its images can differ from "
                "framework.sample's"]


FAMILY = UNet()
