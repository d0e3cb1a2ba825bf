"""The `Family` interface: everything the framework needs to know of one backbone family, in one object.

A family file (framework/models/families/<name>.py) subclasses `Family` (or `TransformerFamily`, which holds what
the diffusers transformers share) and sets its attributes; code elsewhere asks the object for a capability
(`fam.video`, `fam.plan.sequence`, `fam.pipeline_class`) and never compares family names. The registry of the
families is framework/models/families/__init__.py; docs/adding-a-family.md walks through adding one.

Also here: the rule vocabulary of the reference init (framework/models/init.py applies the rules a family names).
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch
from torch import nn

from framework.models.plans import ParallelPlan

# framework.models.backbones.ModelConfig, which is not imported: backbones imports the families, never the reverse.
ModelConfig = Any


# --------------------------------------------------------------------------------------------------
# Reference-init rules: (shape, generator) -> the parameter's initial values
# --------------------------------------------------------------------------------------------------

Rule = Callable[[torch.Size, torch.Generator], torch.Tensor]


def fused_xavier(parts: int) -> Rule:
    """xavier_uniform over (out, everything else), a linear's weight or a conv's flattened as the references do, for a
    slice of a projection fused from `parts` such slices (the bound of the fused (parts * out, in) weight)."""
    def rule(shape: torch.Size, g: torch.Generator) -> torch.Tensor:
        fan_out, fan_in = parts * shape[0], max(1, int(torch.Size(shape[1:]).numel()))
        bound = (6.0 / (fan_in + fan_out)) ** 0.5
        return (torch.rand(shape, generator=g, dtype=torch.float32) * 2 - 1) * bound
    return rule


xavier = fused_xavier(1)


def normal(std: float) -> Rule:
    return lambda shape, g: torch.randn(shape, generator=g, dtype=torch.float32) * std


def constant(value: float) -> Rule:
    return lambda shape, g: torch.full(shape, value, dtype=torch.float32)


ZERO = constant(0.0)
N002 = normal(0.02)

# The attention projections (queries, keys, values, output) of every block: the default adapter targets.
ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]


# --------------------------------------------------------------------------------------------------
# Helpers the forward adapters share
# --------------------------------------------------------------------------------------------------

def keep_mask(text_mask: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """diffusers wants a 1 = keep / 0 = drop mask (it turns it into an additive -10000 bias itself): (B, L)."""
    return None if text_mask is None else text_mask.to(x.dtype)


def transformer_blocks(net: nn.Module) -> list[nn.Module]:
    """The FSDP2 units of a net whose blocks are `net.transformer_blocks`."""
    return list(net.transformer_blocks)


# --------------------------------------------------------------------------------------------------
# The interface
# --------------------------------------------------------------------------------------------------

class Family:
    """One backbone family: its diffusers class and how the framework builds, feeds, initialises, shards, views,
    adapts, exports and sizes it. Subclasses set the attributes and override the methods that differ."""

    name: ClassVar[str]
    diffusers_class: ClassVar[type[nn.Module]]
    derived: ClassVar[frozenset[str]]
    """Constructor arguments that ModelConfig's own fields set (giving them in model.kwargs is refused)."""
    defaults: ClassVar[dict[str, Any]] = {}
    """Constructor arguments that make the diffusers class the released model's, where its defaults differ."""
    released_own: ClassVar[frozenset[str]] = frozenset()
    """Further constructor arguments a released config.json sets through ModelConfig fields (not kwargs)."""
    video: ClassVar[bool] = False
    """Latents are clips (B, C, F, h, w)."""
    reads_text: ClassVar[bool] = True
    """Conditioned on caption embeddings (model.text_dim); False: class labels (model.num_classes)."""
    size_conditioning: ClassVar[bool] = False
    """Has a size embedding that model.size_conditioning switches on."""
    pads_text: ClassVar[bool] = False
    """Captions are zero-padded to model.text_len (which is set for these families only)."""
    any_aspect: ClassVar[bool] = True
    """Takes latents of any height and width (aspect-ratio buckets)."""
    subfolder: ClassVar[str] = "transformer"
    """The backbone's component in a diffusers pipeline (its subfolder there)."""
    plan: ClassVar[ParallelPlan]
    """FSDP2 units, the block stack, sequence parallelism, the cache router (framework/models/plans.py)."""
    init_rules: ClassVar[list[tuple[str, Rule]]] = []
    """model.init=reference: (pattern on the parameter name, rule), the first match wins."""
    patch_conv: ClassVar[str | None] = None
    """The convolution the reference code gives the basic (xavier) init, besides every nn.Linear."""
    basic_init: ClassVar[bool] = True
    """Every nn.Linear (and patch_conv) not named by a rule gets xavier weights and zero bias."""
    adapter_targets: ClassVar[list[str]] = ATTENTION
    """adapter.targets' default: the linear layers that get an adapter."""
    pipeline_class: ClassVar[str]
    """The stock diffusers pipeline that export format=diffusers writes."""
    pipeline_extras: ClassVar[dict[str, Any]] = {}
    """Further arguments of that pipeline's constructor."""
    lora_loader: ClassVar[str | None] = None
    """The stock pipeline whose LoRA loader mixin reads export format=lora's file; None: loaded through peft."""
    estimates_activations: ClassVar[bool] = True
    """framework/training/memory.py estimates its activations from tokens x width x layers (a transformer)."""
    offloads_blocks: ClassVar[bool] = True
    """adapter.offload_blocks works: its checkpointed units are whole blocks."""
    bare_call: ClassVar[dict[str, Any] | None] = None
    """The overhead bench's hand-written loop calls the net as net(x, encoder_hidden_states=, timestep=,
    encoder_attention_mask=, **bare_call); None: that loop does not cover the family."""

    # ---- config -> constructor ----

    def check_kwargs(self, cfg: ModelConfig) -> None:
        """Refuse model.kwargs this family sets from ModelConfig's fields in its own way, naming the field."""

    def check(self, cfg: ModelConfig) -> None:
        """Refuse sizes this family cannot build, naming the key."""

    def diffusers_kwargs(self, cfg: ModelConfig) -> dict[str, Any]:
        """The constructor arguments of `diffusers_class` for this config."""
        raise NotImplementedError

    def after_build(self, net: nn.Module, cfg: ModelConfig) -> None:
        """Adjust the freshly built diffusers net (before the attention backend is chosen)."""

    # ---- forward ----

    def forward(self, net: nn.Module, cfg: ModelConfig, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor | None,
                text_mask: torch.Tensor | None, labels: torch.Tensor | None,
                size_ids: torch.Tensor | None) -> torch.Tensor:
        """The diffusers net's prediction for latents x, timesteps t (B,) and the conditioning, as the net takes it."""
        raise NotImplementedError

    def null_labels(self, cfg: ModelConfig, batch_size: int, device: torch.device | None) -> torch.Tensor | None:
        """Labels meaning "unconditional"; None for a text-conditional family."""
        return None

    # ---- views ----

    def named_blocks(self, net: nn.Module) -> list[tuple[str, nn.Module]]:
        """The net's blocks with their names in it, in forward order (framework/models/blocks.py views them)."""
        return [(f"transformer_blocks.{i}", b) for i, b in enumerate(net.transformer_blocks)]

    # ---- released weights ----

    def released_fields(self, value: dict[str, Any]) -> dict[str, Any]:
        """The ModelConfig fields (besides in_channels and learned_sigma) that the constructor arguments `value` of a
        released config.json fix."""
        raise NotImplementedError

    # ---- export ----

    def pipeline_name(self, cfg: ModelConfig, run_name: str) -> str:
        """The stock pipeline for this model (`run_name`: the run's experiment name)."""
        return self.pipeline_class

    def check_pipeline(self, cfg: ModelConfig, vae: Any) -> None:
        """Refuse a model that its stock pipeline would build or sample wrongly (vae: the diffusers VAE or None)."""

    def require_vae(self, vae: Any, expected: str, how: str, otherwise: str) -> None:
        """Refuse a VAE (None: none given) of another class than `expected`, which the stock pipeline decodes with
        (`how`: in what way, for the message); `otherwise`: the way out besides exporting the transformer alone."""
        if vae is not None and type(vae).__name__ != expected:
            raise ValueError(f"export format=diffusers: stock {self.pipeline_class} {how}; this model's latents come "
                             f"from an {type(vae).__name__}. Export format=safetensors for the transformer alone, or "
                             f"{otherwise}")

    def pipeline_notes(self, cfg: ModelConfig, info: dict[str, Any], pipeline: str) -> list[str]:
        """What to tell the user about sampling this model with the stock pipeline (info: the dataset's)."""
        return []

    def __repr__(self) -> str:
        return f"<family {self.name}>"


class TransformerFamily(Family):
    """A diffusers transformer: heads x head_dim wide, num_layers blocks, patched latents."""

    def check(self, cfg: ModelConfig) -> None:
        if not cfg.num_heads or cfg.num_heads <= 0:
            raise ValueError(f"model.num_heads must be set (> 0) for model.family={cfg.family}.")
        if cfg.width is not None and cfg.width != cfg.num_heads * cfg.head_dim:
            raise ValueError(f"model.width={cfg.width} but model.num_heads * model.head_dim = "
                             f"{cfg.num_heads} * {cfg.head_dim} = {cfg.num_heads * cfg.head_dim}; make them agree.")

    def transformer_kwargs(self, cfg: ModelConfig) -> dict[str, Any]:
        """The arguments every diffusers transformer here takes alike."""
        return dict(in_channels=cfg.in_channels, out_channels=cfg.out_channels, sample_size=cfg.sample_size,
                    num_attention_heads=cfg.num_heads, attention_head_dim=cfg.head_dim, num_layers=cfg.num_layers,
                    patch_size=cfg.patch_size)

    def released_fields_shared(self, value: dict[str, Any]) -> dict[str, Any]:
        """The sizes every transformer's config.json gives alike."""
        return dict(num_layers=value["num_layers"], num_heads=value["num_attention_heads"],
                    head_dim=value["attention_head_dim"], patch_size=value["patch_size"],
                    width=value["num_attention_heads"] * value["attention_head_dim"])

    def released_fields(self, value: dict[str, Any]) -> dict[str, Any]:
        return dict(self.released_fields_shared(value), text_dim=value["caption_channels"])
