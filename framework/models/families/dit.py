"""DiT (diffusers' DiTTransformer2DModel): the class-conditional transformer of Peebles & Xie, adaLN-Zero blocks, no
captions (model.num_classes labels; the label `num_classes` means "no class")."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import DiTTransformer2DModel
from torch import nn

from framework.models.families.base import (
    N002, ZERO, ModelConfig, TransformerFamily, fused_xavier, transformer_blocks,
)
from framework.models.plans import ParallelPlan, SequencePlan


class DiT(TransformerFamily):
    name = "dit"
    diffusers_class = DiTTransformer2DModel
    derived = frozenset({"num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "num_layers",
                         "sample_size", "patch_size", "num_embeds_ada_norm"})
    reads_text = False
    any_aspect = False  # diffusers' DiT only unpatchifies square latents
    # diffusers' DiT final layer reads block 0's norm1.emb (its timestep and class embedding)
    plan = ParallelPlan(transformer_blocks, stack=True, sequence=SequencePlan("pos_embed", "proj_out_2", "softmax"),
                        required_blocks=(0,))
    # facebookresearch/DiT models.py, DiT.initialize_weights
    init_rules = [
        (r"net\.transformer_blocks\.\d+\.attn1\.to_[qkv]\.weight", fused_xavier(3)),  # timm Attention's qkv
        (r"net\.pos_embed\.proj\.bias", ZERO),
        (r"net\.transformer_blocks\.\d+\.norm1\.linear\.(weight|bias)", ZERO),  # adaLN modulation: adaLN-Zero
        (r"net\.proj_out_[12]\.(weight|bias)", ZERO),  # final layer's modulation and linear
        (r"net\.transformer_blocks\.\d+\.norm1\.emb\.timestep_embedder\.linear_[12]\.weight", N002),
        (r"net\.transformer_blocks\.\d+\.norm1\.emb\.class_embedder\.embedding_table\.weight", N002),
    ]
    patch_conv = "net.pos_embed.proj"
    pipeline_class = "DiTPipeline"

    def check(self, cfg: ModelConfig) -> None:
        super().check(cfg)
        if cfg.num_classes is None or cfg.num_classes <= 0:
            raise ValueError("model.num_classes must be set (> 0) for model.family=dit: DiT is class-conditional.")

    def diffusers_kwargs(self, cfg: ModelConfig) -> dict[str, Any]:
        args = dict(self.transformer_kwargs(cfg), num_embeds_ada_norm=cfg.num_classes)
        return {**args, **self.defaults, **cfg.kwargs}

    def after_build(self, net: nn.Module, cfg: ModelConfig) -> None:
        # Label dropout is the training module's job (with null_labels), seeded and configurable in one place.
        for block in net.transformer_blocks:
            labels = block.norm1.emb.class_embedder
            # The "no class" row exists only when diffusers built the table with dropout_prob > 0.
            assert labels.embedding_table.num_embeddings == cfg.num_classes + 1, "no null-class row"
            labels.dropout_prob = 0.0

    def null_labels(self, cfg: ModelConfig, batch_size: int, device: torch.device | None) -> torch.Tensor | None:
        return torch.full((batch_size,), cfg.num_classes, dtype=torch.long, device=device)

    def forward(self, net: nn.Module, cfg: ModelConfig, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor | None,
                text_mask: torch.Tensor | None, labels: torch.Tensor | None,
                size_ids: torch.Tensor | None) -> torch.Tensor:
        labels = self.null_labels(cfg, x.shape[0], x.device) if labels is None else labels
        return net(x, timestep=t, class_labels=labels, return_dict=False)[0]  # (B, C', h, w)

    def released_fields(self, value: dict[str, Any]) -> dict[str, Any]:
        fields = self.released_fields_shared(value)
        fields["num_classes"] = value["num_embeds_ada_norm"]
        return fields

    def pipeline_notes(self, cfg: ModelConfig, info: dict[str, Any], pipeline: str) -> list[str]:
        if cfg.num_classes == 1000:
            return []
        return [f"export: stock {pipeline} guides with class 1000 as the null class (ImageNet's); this model has "
                f"{cfg.num_classes} classes: sample it with guidance_scale=1 there, or with framework.sample"]


FAMILY = DiT()
