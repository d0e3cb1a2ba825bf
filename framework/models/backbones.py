"""Diffusion backbones: typed config, the diffusers families, one uniform `Denoiser`, weight loading.

Reads top to bottom: the config, helpers that turn it into diffusers arguments, the attention backend,
the `Denoiser` wrapper, `build_denoiser`, `load_weights`, and the presets (YAML files in conf/model/).
The networks themselves come from diffusers; this file only owns the glue diffusers does not provide:
one call signature for all families, validated sizes, and safe xformers selection.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from diffusers import (
    DiTTransformer2DModel,
    LatteTransformer3DModel,
    PixArtTransformer2DModel,
    SanaTransformer2DModel,
    UNet2DConditionModel,
    WanTransformer3DModel,
)
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0
from diffusers.models.transformers.sana_transformer import SanaAttnProcessor2_0
from omegaconf import DictConfig, OmegaConf
from torch import nn

from framework.models.init import INITS

FAMILIES: dict[str, type[nn.Module]] = {
    "pixart": PixArtTransformer2DModel,
    "sana": SanaTransformer2DModel,
    "dit": DiTTransformer2DModel,
    "unet": UNet2DConditionModel,
    "latte": LatteTransformer3DModel,
    "wan": WanTransformer3DModel,
}
# Families whose latents are clips (B, C, F, h, w): Latte's spatial blocks attend within each frame and its temporal
# blocks across frames (ST-DiT); Wan's blocks attend over all frames' tokens at once, with 3D RoPE.
VIDEO_FAMILIES = ("latte", "wan")
ATTENTION_BACKENDS = ("sdpa", "xformers")
PRESET_DIR = Path(__file__).resolve().parents[2] / "conf" / "model"

# Diffusers arguments that ModelConfig's own fields set; giving them again in `kwargs` would be ambiguous.
_DERIVED = {
    "pixart": {"num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "num_layers",
               "sample_size", "patch_size", "caption_channels", "cross_attention_dim"},
    "sana": {"num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "num_layers",
             "sample_size", "patch_size", "caption_channels", "cross_attention_dim"},
    "dit": {"num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "num_layers",
            "sample_size", "patch_size", "num_embeds_ada_norm"},
    "unet": {"in_channels", "out_channels", "sample_size", "layers_per_block", "cross_attention_dim",
             "attention_head_dim", "num_attention_heads", "addition_embed_type", "addition_time_embed_dim",
             "projection_class_embeddings_input_dim"},
    "latte": {"num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "num_layers",
              "sample_size", "patch_size", "caption_channels", "cross_attention_dim", "video_length"},
    "wan": {"num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "num_layers",
            "patch_size", "text_dim"},
}
# Constructor arguments that make the diffusers class the released model's, where its defaults differ (a preset's
# kwargs may still set them): Latte's blocks are PixArt's (adaLN-single, tanh GELU, biased attention, no affine norms).
_FAMILY_DEFAULTS = {
    "latte": {"norm_type": "ada_norm_single", "activation_fn": "gelu-approximate", "attention_bias": True,
              "norm_elementwise_affine": False, "norm_eps": 1e-6, "num_embeds_ada_norm": 1000},
}


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------

@dataclass
class ModelConfig:
    """One backbone: family, sizes and family-specific diffusers arguments (presets in conf/model/)."""

    name: str = "pixart_debug"
    # preset name, for logs and checkpoints; conf/model/<name>.yaml
    family: str = "pixart"
    # "pixart" | "sana" | "dit" | "unet" (images) | "latte" | "wan" (video): which diffusers class is built
    in_channels: int = 4
    # latent channels (4 for SD-VAE, 32 for DC-AE, 1 for the quickstart's pixel digits)
    sample_size: int = 8
    # latent side length h = w the net is built for (image side / VAE downsample)
    sample_width: int | None = None
    # latent width when it differs from sample_size (non-square data such as the 8x16 digit pairs); null = square
    num_frames: int | None = None
    # video families: latent frames per clip (the dataset's, after a video VAE's temporal compression); null for images
    text_len: int | None = None
    # wan: captions are zero-padded to this many tokens, as Wan pads its T5 prompts to 512 (its cross-attention takes
    # no mask, so the padding is part of the model); null for the other families
    patch_size: int = 2
    # transformer patch side; the unet works on pixels of the latent, so 1
    num_layers: int = 4
    # transformer blocks; for the unet: resnet/attention layers per down block (`layers_per_block`)
    num_heads: int | None = 4
    # self-attention heads; for the unet leave null (per level: block_out_channels[i] // head_dim)
    head_dim: int = 32
    # channels per attention head
    width: int | None = None
    # hidden size; null derives num_heads * head_dim, a value must equal it (a cross-check for presets)
    text_dim: int | None = 4096
    # caption-embedding dim the net reads (T5-XXL 4096, Gemma-2-2B 2304, OpenCLIP-H 1024); unused by dit
    learned_sigma: bool = False
    # net also predicts a variance (out channels doubled); Denoiser drops that half (fixed-variance samplers)
    num_classes: int | None = None
    # class count for the class-conditional dit; the label `num_classes` means "no class"
    attention: str = "sdpa"
    # "sdpa" (torch) | "xformers" (GPU + xformers package; only softmax attention is switched)
    size_conditioning: bool = False
    # pixart: PixArt-alpha-1024's resolution and aspect-ratio embedding (diffusers' use_additional_conditions), fed the
    # size of each batch's latents in pixels of an 8x VAE (what diffusers' PixArt pipeline passes): with aspect-ratio
    # buckets the model knows which shape it draws. unet: SDXL's micro-conditioning (diffusers' addition_embed_type
    # "text_time"): the image's original size, its crop's top-left corner and the target size (SIZE_IDS, in latent
    # units), embedded with the masked mean of the caption's tokens (the pooled text) and added to the timestep's
    kwargs: dict[str, Any] = field(default_factory=dict)
    # extra diffusers constructor arguments of the family's class (e.g. sana's mlp_ratio, unet block types)
    init: str = "diffusers"
    # from-scratch weights: "diffusers" (the constructor's PyTorch defaults) | "reference" (the family's reference code:
    # xavier linears, N(0, 0.02) embeddings, adaLN-Zero and zeroed output layers; framework/models/init.py). Not used
    # when init_from gives the weights.

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"model.family={self.family!r} is unknown; choose one of {sorted(FAMILIES)}.")
        if self.init not in INITS:
            raise ValueError(f"model.init={self.init!r} is unknown; choose one of {INITS} (the constructor's defaults, or "
                             "the family's reference code's initialisation).")
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"model.attention={self.attention!r} is unknown; choose one of {ATTENTION_BACKENDS}.")
        for key in ("in_channels", "sample_size", "patch_size", "num_layers", "head_dim"):
            if getattr(self, key) <= 0:
                raise ValueError(f"model.{key}={getattr(self, key)} must be positive.")
        for key in ("sample_size", "sample_width"):
            side = getattr(self, key)
            if side is not None and (side <= 0 or side % self.patch_size):
                raise ValueError(f"model.{key}={side} is not a positive multiple of model.patch_size="
                                 f"{self.patch_size}; pick a latent size that is a multiple of it.")
        self.kwargs = _plain(self.kwargs)
        self._check_kwargs()
        if self.family == "unet":
            self._check_unet()
        else:
            self._check_transformer()
        if self.family == "dit" and (self.num_classes is None or self.num_classes <= 0):
            raise ValueError("model.num_classes must be set (> 0) for model.family=dit: DiT is class-conditional.")
        self._check_frames()
        if self.family != "dit" and not self.text_dim:
            raise ValueError(f"model.text_dim must be set for model.family={self.family}: it is the caption "
                             "embedding size of the dataset's text encoder.")

    def _check_kwargs(self) -> None:
        allowed = set(inspect.signature(FAMILIES[self.family].__init__).parameters) - {"self"}
        for key in self.kwargs:
            if key in _DERIVED[self.family]:
                raise ValueError(f"model.kwargs.{key} is set from ModelConfig's own fields for "
                                 f"model.family={self.family}; set those fields instead.")
            if key not in allowed:
                raise ValueError(f"model.kwargs.{key} is not an argument of {FAMILIES[self.family].__name__}.")
        if self.family == "pixart" and "use_additional_conditions" in self.kwargs:
            raise ValueError("model.kwargs.use_additional_conditions is set from model.size_conditioning (the latents' "
                             "own size is the condition); set that instead.")
        if self.size_conditioning and self.family not in ("pixart", "unet"):
            raise ValueError(f"model.size_conditioning=true: model.family={self.family} has no size embedding here "
                             "(PixArt's resolution / aspect ratio, the UNet's SDXL-style micro-conditioning)")
        if self.size_conditioning and self.family == "pixart" and self.num_heads and (self.num_heads * self.head_dim) % 3:
            raise ValueError(f"model.size_conditioning=true needs a width divisible by 3 (PixArt splits it between the "
                             f"height, width and aspect-ratio embeddings; 1152 = 3 x 384): model.num_heads x "
                             f"model.head_dim = {self.num_heads * self.head_dim}")

    def _check_transformer(self) -> None:
        if not self.num_heads or self.num_heads <= 0:
            raise ValueError(f"model.num_heads must be set (> 0) for model.family={self.family}.")
        if self.width is not None and self.width != self.num_heads * self.head_dim:
            raise ValueError(f"model.width={self.width} but model.num_heads * model.head_dim = "
                             f"{self.num_heads} * {self.head_dim} = {self.num_heads * self.head_dim}; make them agree.")
        if self.family == "sana":
            heads, dim = _sana_cross_heads(self)
            if heads * dim != self.hidden_size:
                raise ValueError(f"model.kwargs.num_cross_attention_heads * model.kwargs.cross_attention_head_dim "
                                 f"= {heads} * {dim} must equal the width {self.hidden_size}.")

    def _check_frames(self) -> None:
        video = self.family in VIDEO_FAMILIES
        if video and (self.num_frames is None or self.num_frames <= 0):
            raise ValueError(f"model.num_frames must be set (> 0) for model.family={self.family}: the latent frames "
                             "of a clip (training takes it from the dataset's dataset.json).")
        if not video and self.num_frames is not None:
            raise ValueError(f"model.num_frames={self.num_frames}: model.family={self.family} denoises images; the "
                             f"video families are {', '.join(VIDEO_FAMILIES)}.")
        if (self.family == "wan") != (self.text_len is not None):
            raise ValueError(f"model.text_len={self.text_len}: it is set for model.family=wan only (the token count "
                             "captions are zero-padded to), and must be set there.")
        if self.text_len is not None and self.text_len <= 0:
            raise ValueError(f"model.text_len={self.text_len} must be positive.")

    @property
    def is_video(self) -> bool:
        """Whether the latents are clips (C, F, h, w)."""
        return self.family in VIDEO_FAMILIES

    @property
    def latent_shape(self) -> tuple[int, ...]:
        """The latents of one sample after the channels: (h, w), or (F, h, w) for a video family."""
        return ((self.num_frames,) if self.is_video else ()) + self.latent_hw

    def _check_unet(self) -> None:
        if self.num_heads is not None:
            raise ValueError("model.num_heads must be null for model.family=unet: heads per level are "
                             "block_out_channels[i] // model.head_dim.")
        if self.patch_size != 1:
            raise ValueError("model.patch_size must be 1 for model.family=unet (it has no patch embedding).")
        for c in _unet_channels(self):
            if c % self.head_dim:
                raise ValueError(f"model.kwargs.block_out_channels entry {c} is not divisible by "
                                 f"model.head_dim={self.head_dim}.")
        levels = len(_unet_channels(self))
        if self.sample_size % 2 ** (levels - 1):
            raise ValueError(f"model.sample_size={self.sample_size} must be divisible by {2 ** (levels - 1)} "
                             f"(the unet halves it {levels - 1} times).")

    @property
    def latent_hw(self) -> tuple[int, int]:
        """(height, width) of the latents the net denoises."""
        return self.sample_size, self.sample_width or self.sample_size

    @property
    def hidden_size(self) -> int:
        """Transformer width (num_heads * head_dim)."""
        return (self.num_heads or 0) * self.head_dim

    @property
    def out_channels(self) -> int:
        """Channels the diffusers net outputs: twice the input when it also predicts a variance."""
        return self.in_channels * (2 if self.learned_sigma else 1)


# --------------------------------------------------------------------------------------------------
# Helpers: config -> diffusers constructor arguments
# --------------------------------------------------------------------------------------------------

def _plain(value: Any) -> Any:
    """OmegaConf containers -> plain Python (diffusers stores its config as JSON)."""
    if OmegaConf.is_config(value):
        return OmegaConf.to_container(value, resolve=True)
    return dict(value) if isinstance(value, dict) else value


def _sana_cross_heads(cfg: ModelConfig) -> tuple[int, int]:
    """SANA's cross-attention heads: from kwargs, else the self-attention head size."""
    dim = cfg.kwargs.get("cross_attention_head_dim", cfg.head_dim)
    return cfg.kwargs.get("num_cross_attention_heads", cfg.hidden_size // dim), dim


def _unet_channels(cfg: ModelConfig) -> list[int]:
    default = inspect.signature(UNet2DConditionModel.__init__).parameters["block_out_channels"].default
    return list(cfg.kwargs.get("block_out_channels", default))


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


def diffusers_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """The constructor arguments of `FAMILIES[cfg.family]` for this config."""
    size = dict(in_channels=cfg.in_channels, out_channels=cfg.out_channels, sample_size=cfg.sample_size)
    if cfg.family == "unet":
        # diffusers' UNet calls the per-level head *count* `attention_head_dim` (SD2: [5, 10, 20, 20]).
        heads = [c // cfg.head_dim for c in _unet_channels(cfg)]
        if cfg.size_conditioning:  # SDXL's: each size number embedded in 256 sinusoids, next to the pooled text
            size.update(addition_embed_type="text_time", addition_time_embed_dim=SIZE_ID_DIM,
                        projection_class_embeddings_input_dim=cfg.text_dim + len(SIZE_IDS) * SIZE_ID_DIM)
        return dict(size, layers_per_block=cfg.num_layers, cross_attention_dim=cfg.text_dim,
                    attention_head_dim=heads, **cfg.kwargs)
    args = dict(size, num_attention_heads=cfg.num_heads, attention_head_dim=cfg.head_dim,
                num_layers=cfg.num_layers, patch_size=cfg.patch_size)
    if cfg.family == "pixart":
        # Captions are projected to the width before cross-attention, hence cross_attention_dim = width.
        args.update(caption_channels=cfg.text_dim, cross_attention_dim=cfg.hidden_size,
                    use_additional_conditions=cfg.size_conditioning)
    elif cfg.family == "sana":
        heads, dim = _sana_cross_heads(cfg)
        args.update(caption_channels=cfg.text_dim, cross_attention_dim=cfg.hidden_size,
                    num_cross_attention_heads=heads, cross_attention_head_dim=dim)
    elif cfg.family == "dit":
        args.update(num_embeds_ada_norm=cfg.num_classes)
    elif cfg.family == "latte":
        args.update(caption_channels=cfg.text_dim, cross_attention_dim=cfg.hidden_size, video_length=cfg.num_frames)
    elif cfg.family == "wan":  # no sample size: RoPE positions any clip; frames are never patched together here
        del args["sample_size"]
        args.update(patch_size=(1, cfg.patch_size, cfg.patch_size), text_dim=cfg.text_dim)
    args.update(_FAMILY_DEFAULTS.get(cfg.family, {}))
    args.update(cfg.kwargs)
    return args


# --------------------------------------------------------------------------------------------------
# Attention backend
# --------------------------------------------------------------------------------------------------

# Processors computing plain softmax(QK^T)V with to_q/to_k/to_v/to_out, which xformers' processor
# reproduces. SANA's self-attention is *linear* attention (SanaLinearAttnProcessor2_0): switching it
# would silently turn it into a different model, which `enable_xformers_memory_efficient_attention()`
# on the whole net does. So we select modules one by one.
_SOFTMAX_PROCESSORS = (AttnProcessor, AttnProcessor2_0, SanaAttnProcessor2_0)


def xformers_targets(net: nn.Module) -> dict[str, Attention]:
    """The Attention modules of `net` that `model.attention=xformers` switches (softmax ones, no qk-norm)."""
    return {
        name: m for name, m in net.named_modules()
        if isinstance(m, Attention) and isinstance(m.processor, _SOFTMAX_PROCESSORS)
        and m.norm_q is None and m.norm_k is None  # xformers' processor does not apply qk-norm
    }


def apply_attention_backend(net: nn.Module, attention: str) -> None:
    """Switch the softmax attention of `net` to xformers when asked; "sdpa" leaves diffusers' default."""
    if attention == "sdpa":
        return
    from diffusers.utils import is_xformers_available

    if not is_xformers_available() or not torch.cuda.is_available():
        raise RuntimeError(
            "model.attention=xformers needs the xformers package and a CUDA GPU "
            f"(xformers installed: {is_xformers_available()}, GPU: {torch.cuda.is_available()}). "
            "Install `latentforge[xformers]` on a GPU machine, or set model.attention=sdpa.")
    problem = xformers_problem()
    if problem is not None:
        raise RuntimeError(f"model.attention=xformers: {problem}. Reinstall xformers for torch {torch.__version__}, "
                           "or set model.attention=sdpa.")
    for module in xformers_targets(net).values():
        module.set_use_memory_efficient_attention_xformers(True)


def xformers_problem() -> str | None:
    """Why xformers' memory-efficient attention cannot run on this machine's GPU, or None when it can (one tiny
    bf16 call). An xformers wheel built for another torch imports but has no kernels to run."""
    try:
        import xformers.ops
    except ImportError as e:
        return f"xformers does not import ({e})"
    q = torch.randn(1, 8, 2, 64, device="cuda", dtype=torch.bfloat16)
    try:
        xformers.ops.memory_efficient_attention(q, q, q)
    except (NotImplementedError, RuntimeError) as e:
        return f"xformers {getattr(xformers, '__version__', '?')} has no kernel for this GPU and torch ({str(e).splitlines()[0]})"
    return None


# --------------------------------------------------------------------------------------------------
# The Denoiser: one call signature for every family
# --------------------------------------------------------------------------------------------------

class Denoiser(nn.Module):
    """Wraps a diffusers backbone as `forward(x, t, text, text_mask, labels) -> prediction shaped like x`.

    Samplers here use fixed variances, so a learned-sigma net's variance channels are split off and
    dropped. DiT's built-in 10% label dropout is switched off: like caption dropout, label dropout is
    the training module's job (with `null_labels`), so it is seeded and configurable in one place.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.net = FAMILIES[cfg.family](**diffusers_kwargs(cfg))
        self._after_build()

    def _after_build(self) -> None:
        if self.cfg.family == "dit":
            for block in self.net.transformer_blocks:
                labels = block.norm1.emb.class_embedder
                # The "no class" row exists only when diffusers built the table with dropout_prob > 0.
                assert labels.embedding_table.num_embeddings == self.cfg.num_classes + 1, "no null-class row"
                labels.dropout_prob = 0.0
        apply_attention_backend(self.net, self.cfg.attention)

    def null_labels(self, batch_size: int, device: torch.device | None = None) -> torch.Tensor | None:
        """Labels meaning "unconditional" (the extra embedding row) for dit; None for text families."""
        if self.cfg.family != "dit":
            return None
        return torch.full((batch_size,), self.cfg.num_classes, dtype=torch.long, device=device)

    def padded_text(self, text: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """wan: the caption tokens (B, L, D), padding zeroed, then zero-padded to (B, text_len, D). Wan's cross-attention
        reads the padding too, so every caption is padded to the same length whatever the batch's longest one is."""
        n = self.cfg.text_len
        if mask is not None:
            text = text * mask.unsqueeze(-1).to(text.dtype)
        if text.shape[1] > n:  # only then is the captions' length read (a host synchronisation)
            longest = text.shape[1] if mask is None or mask.is_meta else int(mask.sum(1).max())
            if longest > n:
                raise ValueError(f"a caption of {longest} tokens is longer than model.text_len={n}; raise "
                                 "model.text_len (or shorten the captions)")
        text = text[:, :n]
        return torch.nn.functional.pad(text, (0, 0, 0, n - text.shape[1]))

    def forward(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        text: torch.Tensor | None = None,
        text_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        size_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (B, C, h, w) (video families: (B, C, F, h, w)), t (B,) on the 0..1000 scale, text (B, L, D), text_mask
        (B, L) True = token; size_ids (B, 6)
        for a size-conditioned UNet (SIZE_IDS; None: default_size_ids), ignored by the other families."""
        t = t.expand(x.shape[0]) if t.ndim == 0 else t  # (B,)
        family = self.cfg.family
        if family == "dit":
            labels = self.null_labels(x.shape[0], x.device) if labels is None else labels
            out = self.net(x, timestep=t, class_labels=labels, return_dict=False)[0]  # (B, C', h, w)
        else:
            if text is None:
                raise ValueError(f"model.family={family} is text-conditional: pass `text` (B, L, D) embeddings.")
            # diffusers wants a 1 = keep / 0 = drop mask and turns it into an additive -10000 bias itself.
            mask = None if text_mask is None else text_mask.to(x.dtype)  # (B, L)
            if family == "pixart":
                sizes = {"resolution": None, "aspect_ratio": None}
                if self.cfg.size_conditioning:  # (B, 2) height and width in an 8x VAE's pixels, (B, 1) height / width
                    h, w = x.shape[-2:]
                    sizes = {"resolution": x.new_tensor([[8.0 * h, 8.0 * w]]).expand(x.shape[0], 2),
                             "aspect_ratio": x.new_tensor([[h / w]]).expand(x.shape[0], 1)}
                out = self.net(x, encoder_hidden_states=text, timestep=t, encoder_attention_mask=mask,
                               added_cond_kwargs=sizes, return_dict=False)[0]
            elif family == "sana":
                out = self.net(x, encoder_hidden_states=text, timestep=t, encoder_attention_mask=mask,
                               return_dict=False)[0]
            elif family == "latte":
                # Its spatial blocks see each frame as a sample: the caption's additive bias, one per frame.
                bias = None if mask is None else ((1 - mask) * -10000.0).repeat_interleave(x.shape[2], 0).unsqueeze(1)
                with latte_frames(self.net, x.shape[2]):
                    out = self.net(x, timestep=t, encoder_hidden_states=text, encoder_attention_mask=bias,
                                   return_dict=False)[0]
            elif family == "wan":
                out = self.net(x, timestep=t, encoder_hidden_states=self.padded_text(text, text_mask),
                               return_dict=False)[0]
            else:
                added = None
                if self.cfg.size_conditioning:
                    ids = default_size_ids(x) if size_ids is None else size_ids
                    added = {"text_embeds": pooled_text(text, text_mask), "time_ids": ids.to(x.device, x.dtype)}
                out = self.net(x, t, encoder_hidden_states=text, encoder_attention_mask=mask,
                               added_cond_kwargs=added, return_dict=False)[0]
        if self.cfg.learned_sigma:
            out, _variance = out.chunk(2, dim=1)  # (B, C, h, w) each
        return out


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


def to_model_config(cfg: ModelConfig | DictConfig | dict) -> ModelConfig:
    """A validated ModelConfig from a dataclass, a Hydra node or a dict."""
    if isinstance(cfg, ModelConfig):
        return cfg
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), cfg)
    return OmegaConf.to_object(merged)


def build_denoiser(cfg: ModelConfig | DictConfig | dict) -> Denoiser:
    """Build the backbone for `cfg` with random weights (load trained ones with `load_weights`)."""
    return Denoiser(to_model_config(cfg))


# --------------------------------------------------------------------------------------------------
# init_from: loading weights
# --------------------------------------------------------------------------------------------------

def _backbone_subfolder(path: Path, family: str) -> str | None:
    """Where a diffusers folder keeps the backbone: a whole pipeline's unet/ or transformer/, else the folder."""
    if (path / "model_index.json").exists():
        return "unet" if family == "unet" else "transformer"
    return None


def _ckpt_model_state(path: Path, mmap: bool = False) -> dict[str, torch.Tensor]:
    """The `model.*` weights of a Lightning .ckpt, keyed without that prefix."""
    # Our checkpoints hold only tensors and plain values, so no pickled code needs to run.
    ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    state = {k[len("model."):]: v for k, v in ckpt.get("state_dict", {}).items() if k.startswith("model.")}
    if not state:
        raise ValueError(f"init_from={path}: no `model.*` weights in its state_dict; expected a LatentForge "
                         "Lightning checkpoint.")
    return state


def _read_state_dict(path: Path, denoiser: Denoiser) -> dict[str, torch.Tensor]:
    """Denoiser-keyed (`net.*`) state dict from a diffusers folder, .safetensors or Lightning .ckpt."""
    if path.is_dir():
        cls = FAMILIES[denoiser.cfg.family]
        try:
            net = cls.from_pretrained(path, subfolder=_backbone_subfolder(path, denoiser.cfg.family),
                                      low_cpu_mem_usage=False)
        except Exception as err:
            raise ValueError(f"init_from={path}: cannot load a {cls.__name__} from this folder ({err}).") from err
        state = net.state_dict()
    elif path.suffix == ".safetensors":
        from safetensors.torch import load_file
        state = load_file(str(path))
    elif path.suffix == ".ckpt":
        state = _ckpt_model_state(path)
    else:
        raise ValueError(f"init_from={path}: expected a diffusers folder, a .safetensors file or a .ckpt.")
    return _with_net_prefix(state)


def _with_net_prefix(state: dict[str, Any]) -> dict[str, Any]:
    """Denoiser keys (`net.*`) for a bare diffusers state dict; a Denoiser's own keys unchanged."""
    if not any(k.startswith("net.") for k in state):
        state = {f"net.{k}": v for k, v in state.items()}
    return state


class _SafetensorsEntry:
    """One tensor of an open .safetensors file: its shape now, its bytes only when sliced (`t[a:b]`)."""

    def __init__(self, handle: Any, key: str) -> None:
        self._handle, self._slice = handle, handle.get_slice(key)  # the handle keeps the file open
        self.shape = torch.Size(self._slice.get_shape())

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self._slice[index]


def _open_safetensors(files: list[Path]) -> dict[str, Any]:
    from safetensors import safe_open

    state: dict[str, Any] = {}
    for file in files:
        handle = safe_open(str(file), framework="pt")
        state.update({k: _SafetensorsEntry(handle, k) for k in handle.keys()})
    return state


def _diffusers_safetensors(path: Path, family: str) -> list[Path]:
    """The .safetensors weight files of a diffusers folder (one file, or shards listed by an index); [] if none."""
    sub = _backbone_subfolder(path, family)
    folder = path / sub if sub else path
    single, index = folder / "diffusion_pytorch_model.safetensors", folder / "diffusion_pytorch_model.safetensors.index.json"
    if single.exists():
        return [single]
    if index.exists():
        import json

        return [folder / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return []


def open_weights(path: str | Path, denoiser: Denoiser) -> dict[str, Any]:
    """Like `_read_state_dict`, but lazily: each value has `.shape` and reads its bytes only when sliced.

    For strategy=fsdp, where each rank reads only its own rows (framework/distributed/fsdp.py): .safetensors
    files (also a diffusers folder's) through safetensors' slices, a .ckpt memory-mapped. A diffusers
    folder without .safetensors weights falls back to the whole read of `_read_state_dict`.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"init_from={path} does not exist.")
    if path.suffix == ".safetensors":
        return _with_net_prefix(_open_safetensors([path]))
    if path.suffix == ".ckpt":
        # mmap: only the pages a rank slices are read (and the optimizer state in the file never is).
        return _with_net_prefix(_ckpt_model_state(path, mmap=True))
    files = _diffusers_safetensors(path, denoiser.cfg.family) if path.is_dir() else []
    return _with_net_prefix(_open_safetensors(files)) if files else _read_state_dict(path, denoiser)


def check_fits(state: dict[str, Any], denoiser: Denoiser, path: str | Path) -> None:
    """Raise one clear error unless `state` (values with `.shape`) has exactly the keys and shapes of `denoiser`."""
    own = denoiser.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = [f"{k}: file {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
              for k in own if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or shapes:
        raise ValueError(
            f"init_from={path} looks like a checkpoint from another model: it does not fit model "
            f"{denoiser.cfg.name!r} (family {denoiser.cfg.family}). {len(missing)} missing keys "
            f"{missing[:3]}, {len(unexpected)} unexpected keys {unexpected[:3]}, {len(shapes)} shape "
            f"mismatches {shapes[:3]}. Pick the model= preset the weights were trained with.")


def load_weights(denoiser: Denoiser, path: str | Path) -> Denoiser:
    """Load weights only (`init_from=PATH`) into `denoiser`, with one clear error on any mismatch."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"init_from={path} does not exist.")
    state = _read_state_dict(path, denoiser)
    check_fits(state, denoiser, path)
    denoiser.load_state_dict(state)
    return denoiser


# --------------------------------------------------------------------------------------------------
# Presets: the YAML files in conf/model/ are the single source of sizes
# --------------------------------------------------------------------------------------------------

def preset_names() -> list[str]:
    """Names of the shipped presets (conf/model/*.yaml)."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_preset(name: str, **overrides: Any) -> ModelConfig:
    """ModelConfig of conf/model/<name>.yaml with field overrides, e.g. load_preset("pixart_debug", in_channels=1)."""
    file = PRESET_DIR / f"{name}.yaml"
    if not file.exists():
        raise ValueError(f"model={name} is not a preset; choose one of {preset_names()}.")
    return to_model_config(OmegaConf.merge(OmegaConf.load(file), overrides))
