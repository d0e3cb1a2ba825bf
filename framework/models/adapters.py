"""Parameter-efficient fine-tuning: LoRA, LoKr and LoHa adapters (peft) on a frozen denoiser.

`adapter=lora|lokr|loha` puts peft's adapter layers around the backbone's linear layers whose names match
`adapter.targets` (per-family defaults below), freezes everything else and trains the adapter alone. The
base weights come from `init_from` and are never written again: a checkpoint holds the adapter's tensors
(the trainable ones), which `load_adapted` puts back on the same base. Injected with peft's
`inject_adapter_in_model`, the call diffusers' `add_adapter` makes, so every family takes it, also the ones
whose diffusers class has no adapter mixin (pixart, dit, latte). For sampling and export the adapter is
merged into the base weights (`merge_adapter`): the merged model is an ordinary denoiser of the base's
config.

Default targets: the attention projections (queries, keys, values, output) of every block, self- and
cross-attention, as the diffusers LoRA examples, SimpleTuner's default for PixArt and the SANA LoRA recipe
train; Wan adds its feed-forward layers, as musubi-tuner's and DiffSynth's Wan LoRAs do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

KINDS = ("none", "lora", "lokr", "loha")
BASE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]
FAMILY_TARGETS: dict[str, list[str]] = {
    "pixart": ATTENTION, "dit": ATTENTION, "sana": ATTENTION, "latte": ATTENTION, "unet": ATTENTION,
    "wan": [*ATTENTION, "ffn.net.0.proj", "ffn.net.2"],
}


@dataclass
class AdapterConfig:
    """Fields of `adapter.*` (chosen with adapter=none|lora|lokr|loha)."""

    kind: str = "none"
    """none (train every weight), lora, lokr or loha; set by the group choice adapter=..."""
    rank: int = 16
    """The adapter's rank (LoRA's r; LoKr's and LoHa's r)."""
    alpha: float | None = None
    """Scale numerator: the update is (alpha / rank) x the adapter's product; null: alpha = rank (scale 1)."""
    dropout: float = 0.0
    """LoRA: dropout on the adapter's input; LoKr / LoHa: module dropout (the whole adapter dropped per step)."""
    targets: list[str] | None = None
    """Names of the linear layers that get an adapter: a layer whose name is one of these or ends with '.' + one
    (e.g. to_q, attn2.to_k, ffn.net.2); null: the family's default (FAMILY_TARGETS: the attention projections)."""
    base_dtype: str = "fp32"
    """How the frozen base is held: fp32, or bf16 (half its bytes; needs trainer.precision=bf16-mixed or 16-mixed,
    whose autocast computes with it; the adapter stays fp32)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"adapter={self.kind!r}: expected one of {', '.join(KINDS)}")
        if self.rank < 1:
            raise ValueError(f"adapter.rank={self.rank} must be >= 1")
        if self.alpha is not None and self.alpha <= 0:
            raise ValueError(f"adapter.alpha={self.alpha} must be > 0 (null: alpha = rank)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"adapter.dropout={self.dropout} must be in [0, 1)")
        if self.base_dtype not in BASE_DTYPES:
            raise ValueError(f"adapter.base_dtype={self.base_dtype!r}: expected one of {', '.join(BASE_DTYPES)}")
        if self.targets is not None and not self.targets:
            raise ValueError("adapter.targets=[] selects no layer; give layer names (e.g. [to_q,to_v]) or null for "
                             "the family's default")

    @property
    def on(self) -> bool:
        return self.kind != "none"

    def target_names(self, family: str) -> list[str]:
        return list(self.targets) if self.targets is not None else FAMILY_TARGETS[family]

    def peft_config(self, family: str) -> Any:
        """peft's config of this adapter for a backbone of `family`."""
        from peft import LoHaConfig, LoKrConfig, LoraConfig

        alpha = self.alpha if self.alpha is not None else float(self.rank)
        targets = self.target_names(family)
        if self.kind == "lora":
            return LoraConfig(r=self.rank, lora_alpha=alpha, lora_dropout=self.dropout, target_modules=targets)
        if self.kind == "lokr":
            return LoKrConfig(r=self.rank, alpha=alpha, module_dropout=self.dropout, target_modules=targets)
        return LoHaConfig(r=self.rank, alpha=alpha, module_dropout=self.dropout, target_modules=targets)


def to_adapter_config(cfg: AdapterConfig | dict | None) -> AdapterConfig:
    """An AdapterConfig from a checkpoint's stored config (a dict; absent in runs without adapters)."""
    if isinstance(cfg, AdapterConfig):
        return cfg
    return AdapterConfig(**(cfg or {}))


def add_adapter(denoiser: nn.Module, cfg: AdapterConfig) -> int:
    """Wrap the matching linear layers of `denoiser.net` in adapter layers (in place) and freeze every other weight;
    returns the adapter's parameter count. The adapter starts as the identity (LoRA's B, LoKr's and LoHa's second
    factor are zero), so the adapted model's output equals the base's until the first step."""
    from peft import inject_adapter_in_model

    family = denoiser.cfg.family
    linear = sorted(n for n, m in denoiser.net.named_modules() if isinstance(m, nn.Linear))
    targets = cfg.target_names(family)
    matched = [n for n in linear if any(n == t or n.endswith("." + t) for t in targets)]
    if not matched:
        raise ValueError(f"adapter.targets={targets} matches no linear layer of this {family} backbone; its linear "
                         f"layers are named like {linear[:4]} (a target matches a name or its ending after a '.')")
    inject_adapter_in_model(cfg.peft_config(family), denoiser.net)
    dtype = BASE_DTYPES[cfg.base_dtype]
    for name, p in denoiser.named_parameters():  # peft freezes the base; nothing outside the adapter may train
        p.requires_grad_(is_adapter_key(name))
        if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)  # the frozen base held at adapter.base_dtype
    return sum(p.numel() for p in denoiser.parameters() if p.requires_grad)


ADAPTER_PARTS = ("lora_", "lokr_", "hada_")


def is_adapter_key(name: str) -> bool:
    """Whether a state-dict key of an adapted denoiser is an adapter tensor (LoRA's lora_A/B, LoKr's lokr_*, LoHa's
    hada_*), not a base weight."""
    return any(part.startswith(ADAPTER_PARTS) for part in name.split("."))


def adapter_state(denoiser: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors of an adapted denoiser, by state-dict key."""
    return {k: v for k, v in denoiser.state_dict().items() if is_adapter_key(k)}


def base_key(name: str) -> str:
    """The key a base weight had before its layer was wrapped: `...to_q.base_layer.weight` -> `...to_q.weight`."""
    return name.replace(".base_layer.", ".")


def merge_adapter(denoiser: nn.Module) -> nn.Module:
    """Fold the adapter into its base weights and put the plain layers back (in place): the denoiser's keys and
    modules are then the base's, its output the adapted one's."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    wrapped = [(n, m) for n, m in denoiser.named_modules() if isinstance(m, BaseTunerLayer)]
    with torch.no_grad():
        for name, layer in wrapped:
            layer.merge()
            parent, _, leaf = name.rpartition(".")
            setattr(denoiser.get_submodule(parent), leaf, layer.get_base_layer())
    for p in denoiser.parameters():
        p.requires_grad_(True)
    return denoiser


def load_adapted(denoiser: nn.Module, cfg: AdapterConfig, base: str | None, state: dict[str, torch.Tensor],
                 where: str = "checkpoint") -> nn.Module:
    """`denoiser` (the base's config, freshly built) with the base weights of `base` (the run's init_from) and the
    adapter's tensors `state`, merged: what an adapter run's checkpoint stands for."""
    from framework.models.backbones import load_weights

    if not base:
        raise ValueError(f"{where} holds an adapter (adapter={cfg.kind}) but its run records no base weights (init_from)")
    from dataclasses import replace

    load_weights(denoiser, base)
    add_adapter(denoiser, replace(cfg, base_dtype="fp32"))  # merged into the base's own fp32 weights
    own = adapter_state(denoiser)
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(f"{where}: its adapter does not fit adapter={cfg.kind} on this base: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    denoiser.load_state_dict(state, strict=False)
    return merge_adapter(denoiser)
