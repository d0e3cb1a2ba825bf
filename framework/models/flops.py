"""Training FLOPs per sample of a Denoiser, for model-FLOPs utilisation (MFU) in the throughput monitor.

Counted, not estimated: torch's FlopCounterMode runs one forward + backward on a batch of 1-2 real
samples, so every family (linear attention, convs, unet resnets) is covered without per-family formulas.
Gap filled here: FlopCounterMode has no formula for the fused CPU attention kernel
(`aten._scaled_dot_product_flash_attention_for_cpu`), so on a CPU attention would count as zero; we
map it (and its backward) to torch's own SDPA formulas. And torch counts a grouped convolution's weight gradient
as dense; counted here as the forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import flop_counter

from framework.models.backbones import Denoiser


def _cpu_sdpa(query, key, value, *args: Any, out_shape=None, **kwargs: Any) -> int:
    return flop_counter.sdpa_flop_count(query, key, value)


def _cpu_sdpa_backward(grad_out, query, key, value, *args: Any, out_shape=None, **kwargs: Any) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)


def _conv_backward(grad_out_shape, x_shape, w_shape, bias, stride, padding, dilation, transposed, output_padding,
                   groups, output_mask, out_shape=None, **kwargs: Any) -> int:
    """torch's formula counts a grouped convolution's weight gradient as if the convolution were dense (`groups`
    times too much: SANA's depthwise 3x3 over 11,200 channels made its training FLOPs 6.4x too large). The weight
    gradient costs what the forward does, like the input gradient, which torch counts right."""
    flops = flop_counter.conv_backward_flop(grad_out_shape, x_shape, w_shape, bias, stride, padding, dilation,
                                            transposed, output_padding, groups, [output_mask[0], False],
                                            out_val=out_shape)  # torch wraps it: out_val, not out_shape
    if output_mask[1]:
        flops += flop_counter.conv_flop_count(x_shape, w_shape, grad_out_shape, transposed)
    return flops


_CUSTOM = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward,
    torch.ops.aten.convolution_backward: _conv_backward,
}


def count_train_flops_per_sample(denoiser: Denoiser, batch_example: dict[str, Any], n: int = 2) -> int:
    """FLOPs of forward + backward for one sample, measured on the first `n` samples of a batch.

    `batch_example` is a training batch (`latents`, `text_embeds`, `text_mask`, optional `label`). Counted on a
    meta-device replica of the model (meta_replica: shapes only, no memory: a live real-size model sharded over
    ranks would gather its blocks and keep a forward's activations for the count, more than its training step holds
    with activation checkpointing), or, when the model's structure is not its config's, on the model itself: then
    the parameters' existing `.grad` are put back afterwards, so a live model can be measured mid-run.
    (torch.autograd.grad would avoid touching `.grad`, but FlopCounterMode's module hooks reject it.)
    """
    replica = meta_replica(denoiser)
    model = replica if replica is not None else denoiser
    device = next(model.parameters()).device
    x = batch_example["latents"][:n].to(device)  # (n, C, h, w)
    n = x.shape[0]
    text = batch_example.get("text_embeds")
    mask = batch_example.get("text_mask")
    labels = batch_example.get("label")
    text = None if text is None else text[:n].to(device, x.dtype)  # (n, L, D); the loader's are fp16
    mask = None if mask is None else mask[:n].to(device)  # (n, L)
    labels = None if labels is None else labels[:n].to(device)  # (n,)
    key = None if model is denoiser else replica_key(model, (x, text, mask, labels))
    if key in _ON_REPLICAS:
        return _ON_REPLICAS[key]
    t = torch.full((n,), 500.0, device=device)  # any timestep costs the same
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:  # a frozen backbone (a distillation stage): backward still runs through its activations
        x = x.clone().requires_grad_()
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        with flop_counter.FlopCounterMode(display=False, custom_mapping=_CUSTOM) as counter, FusedAttentionOnMeta():
            out = model(x, t, text, mask, labels)  # (n, C, h, w)
            out.float().square().mean().backward()
    finally:
        for p, grad in zip(params, saved):
            p.grad = grad
    flops = int(counter.get_total_flops() // n)
    if key is not None:
        _ON_REPLICAS[key] = flops
    return flops


# A replica's count, by what decides it: a process that trains the same model again (a study's arms, a sweep, the
# test suite) counts it once; the count is about a third of a short run's time on a CPU.
_ON_REPLICAS: dict[tuple, int] = {}


def replica_key(replica: Denoiser, inputs: tuple[torch.Tensor | None, ...]) -> tuple:
    """What a meta replica's count depends on: its config, which parameters train, its adapters and the inputs'
    shapes and dtypes."""
    trainable = tuple(name for name, p in replica.named_parameters() if p.requires_grad)
    adapters = getattr(replica.net, "peft_config", None)
    shapes = tuple(None if v is None else (tuple(v.shape), v.dtype) for v in inputs)
    return repr(replica.cfg), trainable, repr(adapters), shapes


def meta_replica(denoiser: Denoiser) -> Denoiser | None:
    """The denoiser's config built on the meta device, its parameters frozen where the model's are; None when the
    model is not what its config builds (parameter names or shapes differ: a plugin reshaped or extended it)."""
    from framework.models.backbones import build_denoiser

    with torch.device("meta"):
        replica = build_denoiser(denoiser.cfg)
        adapters = getattr(denoiser.net, "peft_config", None)  # an adapter run's (framework/models/adapters.py)
        if adapters:
            from peft import inject_adapter_in_model

            for name, config in adapters.items():  # on the replica's fp32 base: the count does not depend on dtypes
                inject_adapter_in_model(config, replica.net, adapter_name=name)
    shapes = lambda m: {name: tuple(p.shape) for name, p in m.named_parameters()}  # a DTensor's shape is the whole
    if shapes(replica) != shapes(denoiser):
        return None
    trainable = {name: p.requires_grad for name, p in denoiser.named_parameters()}
    for name, p in replica.named_parameters():
        p.requires_grad_(trainable[name])
    return replica


class FusedAttentionOnMeta(TorchFunctionMode):
    """SDPA on meta tensors as the CPU's fused kernel: on the meta device torch falls back to attention's math form
    (matrix products and a softmax), whose backward keeps the probabilities and so costs one matrix product less than
    a fused kernel's, which recomputes them. The CPU kernel has a meta implementation, so a meta replica counts what
    a run on real tensors does."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
            given = {**dict(zip(names, args)), **kwargs}
            q, k, v, mask = given["query"], given["key"], given["value"], given.get("attn_mask")
            if q.device.type == "meta" and not given.get("enable_gqa"):
                if mask is not None and mask.dtype == torch.bool:  # the kernel takes an additive mask
                    mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
                return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q, k, v, given.get("dropout_p", 0.0), given.get("is_causal", False), attn_mask=mask,
                    scale=given.get("scale"))[0]
        return func(*args, **kwargs)


def forward_flops_by_module(module: torch.nn.Module, *args: Any) -> dict[str, int]:
    """FLOPs of one no-grad forward `module(*args)` per submodule, under FlopCounterMode's names
    (`ClassName.path.to.sub`), CPU attention included."""
    with torch.no_grad(), flop_counter.FlopCounterMode(display=False, depth=None, custom_mapping=_CUSTOM) as counter:
        module(*args)
    return {name: int(sum(counts.values())) for name, counts in counter.get_flop_counts().items()}
