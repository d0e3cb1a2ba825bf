"""Diffusion backbones: typed config, one uniform `Denoiser`, weight loading.

Reads top to bottom: the config, the attention backend, the `Denoiser` wrapper, `build_denoiser`, `load_weights`,
and the presets (YAML files in conf/model/). The networks themselves come from diffusers, and what differs from
family to family (constructor arguments, how the net is fed) is the family's file in framework/models/families/;
this file owns the glue they share: one call signature for all families, validated sizes, safe xformers selection.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0
from diffusers.models.transformers.sana_transformer import SanaAttnProcessor2_0
from omegaconf import DictConfig, OmegaConf
from torch import nn

from framework.models.families import FAMILIES as REGISTRY
from framework.models.families import Family, family_of, names_with
from framework.models.families.unet import SIZE_ID_DIM, SIZE_IDS, default_size_ids, pooled_text  # noqa: F401 (API)
from framework.models.families.wan import padded_text
from framework.models.init import INITS

# The diffusers class of each family (framework/models/families/: one file a family, the registry `family_of`).
FAMILIES: dict[str, type[nn.Module]] = {name: fam.diffusers_class for name, fam in REGISTRY.items()}
# Families whose latents are clips (B, C, F, h, w): Latte's spatial blocks attend within each frame and its temporal
# blocks across frames (ST-DiT); Wan's blocks attend over all frames' tokens at once, with 3D RoPE.
VIDEO_FAMILIES = tuple(names_with(lambda fam: fam.video))
ATTENTION_BACKENDS = ("sdpa", "xformers")
PRESET_DIR = Path(__file__).resolve().parents[2] / "conf" / "model"
# ModelConfig fields the dataset decides (framework/preflight.py fit_model_to_data; framework/data/datamodule.py
# data_model_fields reads them off dataset.json): null in the presets, set once by a run from its data.
DATA_FIELDS = ("in_channels", "sample_size", "sample_width", "num_frames", "text_dim")


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
    # The data-decided fields (DATA_FIELDS): null = the dataset's (a training run sets them from dataset.json and
    # refuses a value that contradicts it); outside a run, `made_for` gives them (load_preset).
    in_channels: int | None = None
    # latent channels (4 for SD-VAE, 32 for DC-AE, 1 for the quickstart's pixel digits)
    sample_size: int | None = None
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
    text_dim: int | None = None
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
    made_for: dict[str, int] = field(default_factory=dict)
    # the data the preset's architecture was made for (the released model's VAE channels and latent side, its text
    # encoder's width, its clip frames): what load_preset builds with when no dataset is given (benchmarks, tests,
    # memory plans). A training run never reads it: its dataset decides those fields.
    init: str = "diffusers"
    # from-scratch weights: "diffusers" (the constructor's PyTorch defaults) | "reference" (the family's reference code:
    # xavier linears, N(0, 0.02) embeddings, adaLN-Zero and zeroed output layers; framework/models/init.py). Not used
    # when init_from gives the weights.

    def __post_init__(self) -> None:
        fam = family_of(self)  # refuses an unknown family, naming the known ones
        if self.init not in INITS:
            raise ValueError(f"model.init={self.init!r} is unknown; choose one of {INITS} (the constructor's defaults, or "
                             "the family's reference code's initialisation).")
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"model.attention={self.attention!r} is unknown; choose one of {ATTENTION_BACKENDS}.")
        for key in ("in_channels", "sample_size", "patch_size", "num_layers", "head_dim"):
            if getattr(self, key) is not None and getattr(self, key) <= 0:
                raise ValueError(f"model.{key}={getattr(self, key)} must be positive.")
        for key in ("sample_size", "sample_width"):
            side = getattr(self, key)
            if side is not None and (side <= 0 or side % self.patch_size):
                raise ValueError(f"model.{key}={side} is not a positive multiple of model.patch_size="
                                 f"{self.patch_size}; pick a latent size that is a multiple of it.")
        self.kwargs = _plain(self.kwargs)
        self._check_kwargs(fam)
        fam.check(self)
        self._check_frames(fam)
        if fam.reads_text and self.text_dim is not None and self.text_dim <= 0:
            raise ValueError(f"model.text_dim={self.text_dim} must be positive for model.family={self.family}: it is "
                             "the caption embedding size of the dataset's text encoder (null: the dataset's).")
        unknown = set(self.made_for) - set(DATA_FIELDS)
        if unknown:
            raise ValueError(f"model.made_for has {sorted(unknown)}: it holds only the data-decided fields {DATA_FIELDS}")

    def filled(self) -> ModelConfig:
        """This config with its unset data-decided fields from `made_for` (a model outside a training run)."""
        return replace(self, **{k: v for k, v in self.made_for.items() if getattr(self, k) is None})

    def unset_data_fields(self) -> list[str]:
        """The data-decided fields this model still needs (null: the dataset's, not yet given)."""
        fam = family_of(self)
        need = ["in_channels", "sample_size"] + (["text_dim"] if fam.reads_text else []) + \
               (["num_frames"] if fam.video else [])
        return [k for k in need if getattr(self, k) is None]

    def _check_kwargs(self, fam: Family) -> None:
        allowed = set(inspect.signature(fam.diffusers_class.__init__).parameters) - {"self"}
        for key in self.kwargs:
            if key in fam.derived:
                raise ValueError(f"model.kwargs.{key} is set from ModelConfig's own fields for "
                                 f"model.family={self.family}; set those fields instead.")
            if key not in allowed:
                raise ValueError(f"model.kwargs.{key} is not an argument of {fam.diffusers_class.__name__}.")
        fam.check_kwargs(self)
        if self.size_conditioning and not fam.size_conditioning:
            raise ValueError(f"model.size_conditioning=true: model.family={self.family} has no size embedding here "
                             "(PixArt's resolution / aspect ratio, the UNet's SDXL-style micro-conditioning)")

    def _check_frames(self, fam: Family) -> None:
        video = fam.video
        if video and self.num_frames is not None and self.num_frames <= 0:
            raise ValueError(f"model.num_frames={self.num_frames} must be positive for model.family={self.family}: "
                             "the latent frames of a clip (null: the dataset's, from its dataset.json).")
        if not video and self.num_frames is not None:
            raise ValueError(f"model.num_frames={self.num_frames}: model.family={self.family} denoises images; the "
                             f"video families are {', '.join(VIDEO_FAMILIES)}.")
        if fam.pads_text != (self.text_len is not None):
            raise ValueError(f"model.text_len={self.text_len}: it is set for model.family="
                             f"{'|'.join(names_with(lambda f: f.pads_text))} only (the token count "
                             "captions are zero-padded to), and must be set there.")
        if self.text_len is not None and self.text_len <= 0:
            raise ValueError(f"model.text_len={self.text_len} must be positive.")

    @property
    def is_video(self) -> bool:
        """Whether the latents are clips (C, F, h, w)."""
        return family_of(self).video

    @property
    def latent_shape(self) -> tuple[int, ...]:
        """The latents of one sample after the channels: (h, w), or (F, h, w) for a video family."""
        return ((self.num_frames,) if self.is_video else ()) + self.latent_hw

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
# Helpers: config -> diffusers constructor arguments (the family's own, framework/models/families/)
# --------------------------------------------------------------------------------------------------

def _plain(value: Any) -> Any:
    """OmegaConf containers -> plain Python (diffusers stores its config as JSON)."""
    if OmegaConf.is_config(value):
        return OmegaConf.to_container(value, resolve=True)
    return dict(value) if isinstance(value, dict) else value


def diffusers_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """The constructor arguments of the family's diffusers class for this config."""
    return family_of(cfg).diffusers_kwargs(cfg)


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
        unset = cfg.unset_data_fields()
        if unset:
            raise ValueError(f"model={cfg.name}: {', '.join('model.' + k for k in unset)} unset (null: the dataset's). "
                             "A training run sets them from its dataset.json; outside one, give them "
                             "(load_preset(name) fills them from the preset's made_for)")
        self.cfg = cfg
        self.net = self.family.diffusers_class(**diffusers_kwargs(cfg))
        self._after_build()

    @property
    def family(self) -> Family:
        """The backbone's family (framework/models/families/)."""
        return family_of(self.cfg)

    def _after_build(self) -> None:
        self.family.after_build(self.net, self.cfg)
        apply_attention_backend(self.net, self.cfg.attention)

    def null_labels(self, batch_size: int, device: torch.device | None = None) -> torch.Tensor | None:
        """Labels meaning "unconditional" (the extra embedding row) for dit; None for text families."""
        return self.family.null_labels(self.cfg, batch_size, device)

    def padded_text(self, text: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """wan: the caption tokens (B, L, D), padding zeroed, then zero-padded to (B, text_len, D)."""
        return padded_text(self.cfg, text, mask)

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
        fam = self.family
        if fam.reads_text and text is None:
            raise ValueError(f"model.family={fam.name} is text-conditional: pass `text` (B, L, D) embeddings.")
        out = fam.forward(self.net, self.cfg, x, t, text, text_mask, labels, size_ids)  # (B, C', ...) like x
        if self.cfg.learned_sigma:
            out, _variance = out.chunk(2, dim=1)  # (B, C, h, w) each
        return out


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
        return family_of(family).subfolder
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
        cls = denoiser.family.diffusers_class
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
    """ModelConfig of conf/model/<name>.yaml with field overrides, e.g. load_preset("pixart_debug", in_channels=1); the
    data-decided fields neither gives are the preset's `made_for` (the data it was made for), so the model builds."""
    file = PRESET_DIR / f"{name}.yaml"
    if not file.exists():
        raise ValueError(f"model={name} is not a preset; choose one of {preset_names()}.")
    return to_model_config(OmegaConf.merge(OmegaConf.load(file), overrides)).filled()
