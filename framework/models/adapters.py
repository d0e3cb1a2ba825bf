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

A frozen base that fits (`adapter.base_dtype`, `adapter.offload_blocks`): the base held in bf16, or its linear
layers' weights in int8 or fp8 through torchao's weight-only quantization (a scale per output row; the product is
computed at the activations' dtype), as QLoRA-style trainers hold it; and the blocks' frozen weights kept in host
memory, copied to the device for each block's forward and for its recomputation in backward
(`offload_frozen_blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

KINDS = ("none", "lora", "lokr", "loha")
BASE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
QUANTIZED = ("int8", "fp8")  # the base's linear weights through torchao; its other weights stay fp32


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
    (e.g. to_q, attn2.to_k, ffn.net.2); null: the family's default (its adapter_targets, framework/models/families/:
    the attention projections)."""
    base_dtype: str = "fp32"
    """How the frozen base is held: fp32; bf16 (half its bytes; needs trainer.precision=bf16-mixed or 16-mixed, whose
    autocast computes with it); int8 or fp8 (its linear layers' weights, a quarter of their bytes, through torchao's
    weight-only quantization with a scale per output row; norms, convolutions and embeddings stay fp32). The adapter
    stays fp32. Sampling and export merge the adapter into the fp32 base of init_from."""
    offload_blocks: bool = False
    """Keep the blocks' frozen weights in host memory (pinned on a GPU run) and copy each block's to the device for
    its forward and for its recomputation in backward; needs strategy.activation_checkpointing=true (without it the
    copies would stay alive until backward). The adapter's weights and the layers outside the blocks stay on the
    device. Saves device memory at the price of a host-to-device copy of the base twice a step; on a CPU run it only
    adds the copies."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"adapter={self.kind!r}: expected one of {', '.join(KINDS)}")
        if self.rank < 1:
            raise ValueError(f"adapter.rank={self.rank} must be >= 1")
        if self.alpha is not None and self.alpha <= 0:
            raise ValueError(f"adapter.alpha={self.alpha} must be > 0 (null: alpha = rank)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"adapter.dropout={self.dropout} must be in [0, 1)")
        if self.base_dtype not in (*BASE_DTYPES, *QUANTIZED):
            raise ValueError(f"adapter.base_dtype={self.base_dtype!r}: expected one of "
                             f"{', '.join((*BASE_DTYPES, *QUANTIZED))}")
        if self.targets is not None and not self.targets:
            raise ValueError("adapter.targets=[] selects no layer; give layer names (e.g. [to_q,to_v]) or null for "
                             "the family's default")

    @property
    def on(self) -> bool:
        return self.kind != "none"

    def target_names(self, family: str) -> list[str]:
        from framework.models.families import family_of  # the diffusers classes load only when asked

        return list(self.targets) if self.targets is not None else list(family_of(family).adapter_targets)

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
    """Wrap the matching linear layers of `denoiser.net` in adapter layers (in place), freeze every other weight and
    hold it at `cfg.base_dtype` (quantized only on a real device: a meta-device model is for counting); returns the
    adapter's parameter count. The adapter starts as the identity (LoRA's B, LoKr's and LoHa's second factor are
    zero), so the adapted model's output equals the base's until the first step."""
    from peft import inject_adapter_in_model

    family = denoiser.cfg.family
    linear = sorted(n for n, m in denoiser.net.named_modules() if isinstance(m, nn.Linear))
    targets = cfg.target_names(family)
    matched = [n for n in linear if any(n == t or n.endswith("." + t) for t in targets)]
    if not matched:
        raise ValueError(f"adapter.targets={targets} matches no linear layer of this {family} backbone; its linear "
                         f"layers are named like {linear[:4]} (a target matches a name or its ending after a '.')")
    inject_adapter_in_model(cfg.peft_config(family), denoiser.net)
    if cfg.base_dtype in QUANTIZED and not any(p.is_meta for p in denoiser.parameters()):
        quantize_base(denoiser.net, cfg.base_dtype)
    dtype = BASE_DTYPES.get(cfg.base_dtype, torch.float32)
    for name, p in denoiser.named_parameters():  # peft freezes the base; nothing outside the adapter may train
        p.requires_grad_(is_adapter_key(name))
        if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)  # the frozen base held at adapter.base_dtype
    return sum(p.numel() for p in denoiser.parameters() if p.requires_grad)


def quantize_base(net: nn.Module, base_dtype: str) -> None:
    """The base's linear weights (not the adapter's) in int8 or fp8 through torchao's weight-only quantization, in
    place; their biases stay fp32. The layers become QuantizedLinear, whose backward keeps the quantized weight."""
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    config = Int8WeightOnlyConfig() if base_dtype == "int8" else Float8WeightOnlyConfig()
    layers = [m for n, m in net.named_modules() if is_base_linear(m, n)]
    quantize_(net, config, filter_fn=is_base_linear)
    for layer in layers:
        layer.__class__ = QuantizedLinear


def is_base_linear(module: nn.Module, name: str) -> bool:
    """Whether `module` (named `name`) is one of the base's linear layers, which int8 / fp8 quantize (not the adapter's
    own, LoRA's lora_A / lora_B)."""
    return isinstance(module, nn.Linear) and not is_adapter_key(name)


class _DequantizedInBackward(torch.autograd.Function):
    """x W^T + b with a frozen torchao-quantized W: autograd keeps W as it is held (a byte a weight) for the backward,
    which dequantizes it for the product, instead of the dequantized fp32 copy that torchao's own linear leaves it
    (an fp32 copy of every base weight alive until the backward, more than an fp32 base holds)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight)  # a saved tensor: activation checkpointing drops it and recomputes it
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        (weight,) = ctx.saved_tensors  # the base's bias is frozen: no gradient for it
        return (grad @ weight.dequantize(grad.dtype) if ctx.needs_input_grad[0] else None), None, None


class QuantizedLinear(nn.Linear):
    """A frozen base's linear layer whose weight torchao quantized (adapter.base_dtype=int8|fp8): computed as torchao
    computes it, in autocast's dtype under mixed precision, differentiated through _DequantizedInBackward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = x.device.type
        if torch.is_autocast_enabled(kind):  # in autocast's dtype, as it runs a plain linear layer (torchao: x's)
            x = x.to(torch.get_autocast_dtype(kind))
        return _DequantizedInBackward.apply(x, self.weight, self.bias)


def held_bytes(denoiser: nn.Module, base_dtype: str) -> float:
    """Bytes of `denoiser`'s frozen weights as `base_dtype` holds them (shapes only: a meta-device model will do):
    int8 / fp8 linear weights one byte each plus an fp32 scale per output row, everything else fp32 or bf16."""
    quantized = {f"{name}.weight" for name, m in denoiser.named_modules()
                 if base_dtype in QUANTIZED and is_base_linear(m, name)}
    itemsize = BASE_DTYPES.get(base_dtype, torch.float32).itemsize
    total = 0.0
    for name, p in denoiser.named_parameters():
        if not p.requires_grad:
            total += p.numel() + 4 * p.shape[0] if name in quantized else p.numel() * itemsize
    return total


def frozen_bytes_per_param(denoiser: nn.Module, cfg: AdapterConfig, blocks: list[nn.Module], on_gpu: bool) -> float:
    """The device's bytes a frozen parameter of an adapted `denoiser` costs on average (memory.predict's frozen_bytes):
    as `cfg.base_dtype` holds it, and with the blocks offloaded on a GPU run only the block being computed (its copy)
    on top of the weights outside the blocks."""
    frozen = sum(p.numel() for p in denoiser.parameters() if not p.requires_grad)
    held = held_bytes(denoiser, cfg.base_dtype)
    if cfg.offload_blocks and on_gpu and blocks:
        in_blocks = [held_bytes(block, cfg.base_dtype) for block in blocks]
        held = held - sum(in_blocks) + max(in_blocks)
    return held / max(frozen, 1)


def offload_frozen_blocks(blocks: list[nn.Module], device: torch.device) -> list[Any]:
    """adapter.offload_blocks: move each block's frozen weights to host memory and copy them to `device` around each
    call of the block (its forward, and its recomputation in backward under activation checkpointing); returns the
    hooks' handles. The module holds the host weights between calls; during a call it holds the copies, which the
    autograd graph keeps for as long as it needs them (a checkpointed block's forward keeps none)."""
    pin = device.type == "cuda"  # pinned host memory: the copies to the GPU run asynchronously (torchao's too)
    handles = []
    for block in blocks:
        host = []
        for module in block.modules():
            for name, p in list(module._parameters.items()):
                if p is not None and not p.requires_grad:
                    kept = nn.Parameter(p.detach().to("cpu"), requires_grad=False)
                    if pin:
                        kept.data = kept.data.pin_memory()
                    module._parameters[name] = kept
                    host.append((module, name, kept))

        def bring(_block: nn.Module, args: Any, kwargs: Any, host: list = host) -> None:
            # Where the call's inputs are: the training device, or wherever a later command (Lightning's teardown
            # moves the module to the CPU before the final evaluation) runs the module.
            to = next((v.device for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), device)
            for module, name, kept in host:  # a copy, never the host tensor: the device's is freed with the graph
                moved = kept.to(to, non_blocking=pin)  # (no detach: torchao's weights refuse it in inference mode)
                module._parameters[name] = moved.clone() if moved is kept else moved

        def send_back(_block: nn.Module, _args: Any, _out: Any, host: list = host) -> None:
            for module, name, kept in host:
                module._parameters[name] = kept

        handles += [block.register_forward_pre_hook(bring, with_kwargs=True),
                    block.register_forward_hook(send_back, always_call=True)]
    return handles


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
