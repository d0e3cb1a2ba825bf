"""Wan 2.1 (diffusers' WanTransformer3DModel): one stack of blocks attending over all frames' tokens at once, with 3D
RoPE, cross-attention to T5 captions zero-padded to model.text_len (its cross-attention takes no mask)."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import WanTransformer3DModel
from torch import nn

from framework.models.families.base import ATTENTION, N002, ZERO, ModelConfig, TransformerFamily
from framework.models.plans import ParallelPlan, SequencePlan


def padded_text(cfg: ModelConfig, text: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The caption tokens (B, L, D), padding zeroed, then zero-padded to (B, model.text_len, D). Wan's cross-attention
    reads the padding too, so every caption is padded to the same length whatever the batch's longest one is."""
    n = cfg.text_len
    if mask is not None:
        text = text * mask.unsqueeze(-1).to(text.dtype)
    if text.shape[1] > n:  # only then is the captions' length read (a host synchronisation)
        longest = text.shape[1] if mask is None or mask.is_meta else int(mask.sum(1).max())
        if longest > n:
            raise ValueError(f"a caption of {longest} tokens is longer than model.text_len={n}; raise "
                             "model.text_len (or shorten the captions)")
    text = text[:, :n]
    return torch.nn.functional.pad(text, (0, 0, 0, n - text.shape[1]))


def _blocks(net: nn.Module) -> list[nn.Module]:
    return list(net.blocks)


class Wan(TransformerFamily):
    name = "wan"
    diffusers_class = WanTransformer3DModel
    derived = frozenset({"num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "num_layers",
                         "patch_size", "text_dim"})
    video = True
    pads_text = True
    # diffusers' own context-parallel plan for Wan (WanTransformer3DModel._cp_plan) splits the same three places
    plan = ParallelPlan(_blocks, stack=True, stack_attrs=("blocks",),
                        sequence=SequencePlan("blocks.0", "proj_out", "softmax", split_input=True, rope="rope"))
    # Wan-Video/Wan2.1 wan/modules/model.py, WanModel.init_weights: xavier linears with zero bias, the 3D patch conv
    # xavier over its flattened view, the text and time embedding MLPs N(0, 0.02), the head's linear zeroed. Its
    # time_projection (diffusers' time_proj) keeps the basic init.
    init_rules = [
        (r"net\.condition_embedder\.(text|time)_embedder\.linear_[12]\.weight", N002),
        (r"net\.proj_out\.weight", ZERO),
    ]
    patch_conv = "net.patch_embedding"
    # its feed-forward layers too, as musubi-tuner's and DiffSynth's Wan LoRAs train
    adapter_targets = [*ATTENTION, "ffn.net.0.proj", "ffn.net.2"]
    pipeline_class = "WanPipeline"
    lora_loader = "WanPipeline"

    def diffusers_kwargs(self, cfg: ModelConfig) -> dict[str, Any]:
        # no sample size: RoPE positions any clip; frames are never patched together here
        args = self.transformer_kwargs(cfg)
        del args["sample_size"]
        args.update(patch_size=(1, cfg.patch_size, cfg.patch_size), text_dim=cfg.text_dim)
        return {**args, **self.defaults, **cfg.kwargs}

    def forward(self, net: nn.Module, cfg: ModelConfig, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor | None,
                text_mask: torch.Tensor | None, labels: torch.Tensor | None,
                size_ids: torch.Tensor | None) -> torch.Tensor:
        return net(x, timestep=t, encoder_hidden_states=padded_text(cfg, text, text_mask),
                   return_dict=False)[0]

    def named_blocks(self, net: nn.Module) -> list[tuple[str, nn.Module]]:
        return [(f"blocks.{i}", b) for i, b in enumerate(net.blocks)]

    def check_pipeline(self, cfg: ModelConfig, vae: Any) -> None:
        """WanPipeline decodes with an AutoencoderKLWan's latent statistics, which an image VAE has not."""
        self.require_vae(vae, "AutoencoderKLWan", "decodes with an AutoencoderKLWan (its latents' mean and std)",
                         "encode the clips with the Wan VAE")

    def pipeline_notes(self, cfg: ModelConfig, info: dict[str, Any], pipeline: str) -> list[str]:
        return [f"export: call stock {pipeline} with max_sequence_length={cfg.text_len} (this model's "
                "model.text_len; its default is Wan's 512)"]


FAMILY = Wan()
