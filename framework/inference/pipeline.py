"""Prompt -> image generation, shared by training grids, framework.sample and framework.eval.

Text is encoded with the encoder recorded in the dataset's dataset.json, latents are decoded with
its image codec, and the denoiser comes either from the live LightningModule or a checkpoint.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Sequence

import torch
from PIL import Image, ImageDraw, ImageFont

from data_prep.record import latent_frame_count, unscale_latents
from framework.inference.checkpoint import CKPT_KEY, build_model, read_checkpoint, weights_used
from framework.inference.caching import CacheSchedule, resolve_schedule
from framework.inference.sampling import Draws, Sampler, SamplingPlan
from framework.inference.sharing import OneProcess, Sharing
from framework.models.backbones import Denoiser, ModelConfig, build_denoiser
from framework.models.objectives import DEFAULT_SAMPLER, Objective, ObjectiveConfig

# --------------------------------------------------------------------------------------------
# Encoders for generation
# --------------------------------------------------------------------------------------------


def with_encoders(info: dict[str, Any], vae: str | None = None, text_encoder: str | None = None,
                  keys: tuple[str, str] = ("vae", "text_encoder"), text: bool = True) -> dict[str, Any]:
    """`info` (a dataset summary) with its image codec and text encoder replaced where given, after checking
    that they exist on this machine (the text encoder only when `text`: prompts may all be precomputed):
    dataset.json records the folders of the machine that ran precompute, which a training node or a laptop
    may not have. `keys` name the settings in the error (training: sample.vae / sample.text_encoder)."""
    from data_prep.encoders import minilm_path

    info = {**info, **({"image_codec": vae} if vae else {}), **({"text_encoder": text_encoder} if text_encoder else {})}
    checks = [(info["image_codec"], keys[0], "VAE")] + ([(info["text_encoder"], keys[1], "text encoder")] if text else [])
    for spec, key, what in checks:
        if spec in ("pixel", "none"):
            continue
        # As load_text_encoder resolves it; minilm_path() itself says when its package is not installed.
        path = minilm_path() if spec == "minilm" else Path(spec).expanduser()
        if not path.is_dir():
            source = "given" if spec in (vae, text_encoder) else f"recorded in the dataset's dataset.json ({info.get('path')})"
            raise FileNotFoundError(f"the {what} folder {spec} ({source}) is not on this machine; set {key}=PATH to a "
                                    f"local copy of it (the same weights the dataset was encoded with)")
    return info


# --------------------------------------------------------------------------------------------
# The pipeline
# --------------------------------------------------------------------------------------------


class Pipeline:
    """Denoiser + objective + the dataset's encoders, ready to turn prompts into images."""

    def __init__(
        self,
        model: Denoiser,
        objective: Objective,
        empty_text: torch.Tensor,
        dataset_info: dict[str, Any],
        device: torch.device | str = "cpu",
    ) -> None:
        self.model, self.objective, self.info = model, objective, dataset_info
        self.device = torch.device(device)
        self.empty_text = empty_text.float()
        self._codec = None  # the image codec (a VAE), loaded by the first decode: a rank that never decodes never loads it
        self._build: Any = None  # from_checkpoint(lazy=True): builds the denoiser on its first use (ensure_model)
        self.sequence: Any = None  # the SequenceParallel to split it over when built (split_when_built)
        self.group_size = 1  # DecodeRanks: the denoising ranks' sequence-parallel group size
        self._text_encoder = None
        # The dataset's precomputed grid prompts: generating them loads no text encoder.
        self._cache: dict[str, torch.Tensor] = {p: e.float() for p, e in dataset_info.get("prompt_embeds", {}).items()}

    def sizes(self) -> list[tuple[int, ...]]:
        """The latent shapes after the channels the model was trained at, (h, w) of images and (frames, h, w) of clips:
        its dataset's buckets, or its one shape."""
        return [tuple(b) for b in self.info.get("buckets") or []] or [tuple(self.model.cfg.latent_shape)]

    def latent_size(self, height: int | None = None, width: int | None = None, aspect: str | None = None,
                    num_frames: int | None = None) -> tuple[int, ...]:
        """The latent shape after the channels for an image of height x width pixels, or of aspect ratio "W:H" (the
        trained bucket nearest it), the model's own size when neither is given; a video model's clip of `num_frames`
        frames (pixels; null: the longest it was trained at) takes (latent frames, h, w). A size or frame count the
        model was not trained at is refused."""
        hw = self._latent_hw(height, width, aspect)
        if not self.model.cfg.is_video:
            if num_frames is not None:
                raise ValueError(f"num_frames={num_frames}: this model makes images; drop num_frames")
            return hw
        counts = sorted({s[0] for s in self.sizes() if tuple(s[1:]) == hw} or {s[0] for s in self.sizes()})
        if num_frames is None:
            return (counts[-1], *hw)
        step = int(self.info.get("temporal_compression") or 1)  # pixel frames per latent frame after the first
        pixel_frames = lambda c: 1 + (c - 1) * step
        if num_frames < 1 or (num_frames - 1) % step or latent_frame_count(num_frames, step) not in counts:
            raise ValueError(f"num_frames={num_frames}: the model was trained on clips of "
                             f"{', '.join(str(pixel_frames(c)) for c in counts)} frames at this size; use one of those")
        return (latent_frame_count(num_frames, step), *hw)

    def _latent_hw(self, height: int | None, width: int | None, aspect: str | None) -> tuple[int, int]:
        """The latent (h, w) of latent_size."""
        ds, sizes = int(self.info.get("downsample", 1)), list(dict.fromkeys(tuple(s[-2:]) for s in self.sizes()))
        pixels = lambda s: f"{s[0] * ds}x{s[1] * ds}"
        if aspect is not None:
            if height is not None or width is not None:
                raise ValueError(f"aspect={aspect} with height / width: give one or the other")
            try:
                w, h = (float(v) for v in str(aspect).split(":"))
                assert w > 0 and h > 0
            except (ValueError, AssertionError):
                raise ValueError(f"aspect={aspect}: write it as width:height, e.g. aspect=16:9") from None
            if len(sizes) == 1:
                raise ValueError(f"aspect={aspect}: this model was trained at {pixels(sizes[0])} only (its dataset has no "
                                 "aspect-ratio buckets; precompute with buckets=... to train several shapes)")
            from data_prep.buckets import nearest_bucket

            return sizes[nearest_bucket(h, w, sizes)]
        if height is None and width is None:
            return tuple(self.model.cfg.latent_hw)
        if height is None or width is None or height % ds or width % ds:
            raise ValueError(f"height={height} width={width}: give both, multiples of the VAE's downsampling {ds}")
        size = (height // ds, width // ds)
        if size not in sizes:
            near = sorted(sizes, key=lambda s: abs(math.log(s[0] / s[1]) - math.log(size[0] / size[1])))[:3]
            raise ValueError(f"height={height} width={width}: the model was not trained at that size; its sizes nearest "
                             f"that aspect ratio are {', '.join(pixels(s) for s in near)} (or use aspect=W:H)")
        return size

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, device: str = "cpu", weights: str = "ema",
                        vae: str | None = None, text_encoder: str | None = None, lazy: bool = False) -> "Pipeline":
        """The pipeline of a checkpoint (one file or a sharded folder), EMA weights when present and asked for;
        `vae` / `text_encoder` replace the encoder folders the dataset recorded (checked to exist). lazy: the
        denoiser is built, loaded and moved to `device` on its first use (ensure_model), the file memory-mapped
        until then: a rank that only decodes (decode_ranks) never holds it."""
        return cls.from_checkpoint_dict(read_checkpoint(path, mmap=lazy), device, weights, path, vae, text_encoder, lazy)

    @classmethod
    def from_checkpoint_dict(cls, ckpt: dict[str, Any], device: str = "cpu", weights: str = "ema",
                             path: str | os.PathLike = "checkpoint", vae: str | None = None,
                             text_encoder: str | None = None, lazy: bool = False) -> "Pipeline":
        """Like from_checkpoint, for a checkpoint already read with read_checkpoint (`path` names it in errors)."""
        extra = ckpt[CKPT_KEY]
        cfg = extra["config"]
        used, model_cfg = weights_used(ckpt, weights), ModelConfig(**cfg["model"])

        def build() -> Denoiser:
            return build_model(ckpt, used, path).to(device).eval()

        objective = Objective(ObjectiveConfig(**cfg["objective"]))
        info = with_encoders(extra["dataset"], vae, text_encoder)
        if not lazy:
            return cls(build(), objective, extra["empty_text"], info, device)
        return cls.deferred(build, model_cfg, objective, extra["empty_text"], info, device)

    @classmethod
    def deferred(cls, build: Any, model_cfg: ModelConfig, objective: Objective, empty_text: torch.Tensor,
                 dataset_info: dict[str, Any], device: torch.device | str = "cpu") -> "Pipeline":
        """A pipeline whose denoiser `build()` makes on its first use (ensure_model); until then `model` is a
        meta-device placeholder of `model_cfg` (its config and structure, no memory)."""
        with torch.device("meta"):
            placeholder = build_denoiser(model_cfg)
        pipe = cls(placeholder.eval(), objective, empty_text, dataset_info, device)
        pipe._build = build
        return pipe

    def ensure_model(self) -> Denoiser:
        """The denoiser, built and loaded now if the pipeline was made lazily (and split over its sequence-parallel
        group if split_when_built asked for it)."""
        if self._build is not None:
            self.model, self._build = self._build(), None
            if self.sequence is not None:
                from framework.distributed.sequence import install

                install(self.model, self.sequence)
        return self.model

    def split_when_built(self, sp: Any, group_size: int) -> None:
        """Split the lazily built denoiser over `sp` (a SequenceParallel; None on a rank that only decodes) when it is
        built; `group_size`: the denoising groups' size, which every rank of decode_ranks needs to know."""
        if self._build is None:
            raise RuntimeError("split_when_built: the denoiser is already built; split it with sequence.install")
        self.sequence, self.group_size = sp, group_size

    @property
    def codec(self) -> Any:
        """The dataset's image codec (or sample.vae's), loaded on first use."""
        if self._codec is None:
            from data_prep.encoders import load_image_codec

            self._codec = load_image_codec(self.info["image_codec"], device=self.device,
                                           image_mode=self.info.get("image_mode", "RGB"), tile=self.info.get("vae_tile"))
        return self._codec

    def encode(self, prompts: Sequence[str]) -> list[torch.Tensor]:
        """Per-token embeddings of each prompt (cached; the encoder loads on first use)."""
        todo = [p for p in dict.fromkeys(prompts) if p not in self._cache]
        if todo:
            if self._text_encoder is None:
                from data_prep.encoders import load_text_encoder

                self._text_encoder = load_text_encoder(self.info["text_encoder"], device=self.device,
                                                       **self.info.get("text_settings", {}))
            for p, e in zip(todo, self._text_encoder.encode(list(todo))):
                self._cache[p] = e.float().cpu()
        return [self._cache[p] for p in prompts]

    def free_text_encoder(self) -> None:
        """Drop the text encoder (a T5-XXL is ~9.5 GB) until the next prompt that needs it; embeddings stay cached."""
        self._text_encoder = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def generate(self, prompts: Sequence[str], plan: SamplingPlan | None = None,
                 labels: Sequence[int | None] | None = None, *, ranks: Sharing | None = None,
                 batch_size: int = 64, progress: bool = False) -> torch.Tensor | None:
        """Images (N * plan.candidates, C, H, W) in [-1, 1] of the prompts, each prompt's candidates together.

        plan: what to draw (framework/inference/sampling.py); None: SamplingPlan()'s defaults. labels: a class label
        per prompt (a class-conditional model needs them). ranks: how the ranks of a multi-process job share the work
        (framework/inference/sharing.py: SplitRanks, DecodeRanks; every rank then calls this); None: OneProcess, this
        process draws every image. All images are drawn in batches of `batch_size`, each image the same whatever
        batch it lands in; progress: a bar over the images (on rank 0).
        """
        plan = plan or SamplingPlan()
        if self.model.cfg.num_classes is not None and (labels is None or any(lbl is None for lbl in labels)):
            raise ValueError("this model is class-conditional: give a class label for every prompt")
        sampler = Sampler(self, plan, batch_size, progress)
        return (ranks or OneProcess()).run(sampler, Draws.of(prompts, labels, plan.seed, plan.candidates))

    def schedule(self, spec: str | CacheSchedule | None, sampler: str | None, steps: int) -> CacheSchedule | None:
        """The cache schedule `spec` names, checked against this model, the sampler and the step count."""
        name = sampler or DEFAULT_SAMPLER[self.objective.cfg.name]
        if isinstance(spec, CacheSchedule):
            spec.check(self.model, self.objective.cfg.name, name, steps)
            return spec
        return resolve_schedule(spec, self.model, self.objective.cfg.name, name, steps)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Scaled latents -> pixels in [-1, 1] (undoes the data module's scaling): images (B, C, H, W) of latents
        (B, c, h, w); clips (B, F, C, H, W) of latents (B, c, f, h, w), a video codec decoding them whole (F = 1 + (f -
        1) x its temporal compression), an image codec each frame (F = f)."""
        raw = unscale_latents(z, self.info["scaling_factor"], self.info["shift_factor"])
        if raw.ndim == 5 and self.codec.is_video:
            return self.codec.decode(raw).float().clamp(-1, 1).cpu().transpose(1, 2)  # (B, C, F, H, W) -> (B, F, ...)
        if raw.ndim == 5:
            b, frames = raw.shape[0], raw.shape[2]
            out = self.codec.decode(raw.transpose(1, 2).flatten(0, 1))  # (B * F, C, H, W)
            return out.float().clamp(-1, 1).cpu().unflatten(0, (b, frames))
        return self.codec.decode(raw).float().clamp(-1, 1).cpu()


# --------------------------------------------------------------------------------------------
# Pictures
# --------------------------------------------------------------------------------------------


def frame_strips(images: torch.Tensor) -> torch.Tensor:
    """Clips (N, F, C, H, W) -> (N, C, H, F * (W + 1) - 1): each clip's frames side by side, left to right, a white
    column between two; images unchanged."""
    if images.ndim != 5:
        return images
    gap = images.new_ones(*images.shape[:-1], 1)  # (N, F, C, H, 1)
    strips = torch.cat([images, gap], -1).permute(0, 2, 3, 1, 4).flatten(3, 4)  # (N, C, H, F * (W + 1))
    return strips[..., :-1]


def to_pil(img: torch.Tensor, size: int | None = None) -> Image.Image:
    """(C, H, W) in [-1, 1] -> PIL image, upscaled with nearest neighbour to `size` (tiny latents stay crisp); a clip
    (F, C, H, W) becomes the strip of its frames."""
    if img.ndim == 4:
        img = frame_strips(img[None])[0]
    arr = ((img.clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0).numpy()
    im = Image.fromarray(arr[..., 0] if arr.shape[-1] == 1 else arr)
    if size and max(im.size) < size:  # keep the aspect ratio (digit pairs are 8x16)
        f = size / max(im.size)
        im = im.resize((round(im.width * f), round(im.height * f)), Image.NEAREST)
    return im


def save_grid(images: torch.Tensor, captions: Sequence[str], path: str | os.PathLike, ncol: int | None = None,
              cell: int = 96) -> Path:
    """Write a PNG grid with each image's prompt printed under it; a clip is shown as the strip of its frames."""
    images = frame_strips(images)
    n = len(images)
    ncol = ncol or min(n, 10)
    nrow = math.ceil(n / ncol)
    label_h = 28
    cell_w = round(cell * images.shape[-1] / images.shape[-2])  # cell is the height; wide images get wide cells
    grid = Image.new("RGB", (ncol * cell_w, nrow * (cell + label_h)), "white")
    draw = ImageDraw.Draw(grid)
    font = ImageFont.load_default()
    for i, (img, cap) in enumerate(zip(images, captions)):
        r, c = divmod(i, ncol)
        x, y = c * cell_w, r * (cell + label_h)
        grid.paste(to_pil(img).convert("RGB").resize((cell_w, cell), Image.NEAREST), (x, y))
        for k, line in enumerate(_wrap(cap, max(4, cell_w // 6))[:2]):
            draw.text((x + 2, y + cell + 1 + 12 * k), line, fill="black", font=font)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    return path


def _wrap(text: str, width: int) -> list[str]:
    lines, cur = [], ""
    for word in text.split():
        if cur and len(cur) + 1 + len(word) > width:
            lines.append(cur)
            cur = word
        else:
            cur = f"{cur} {word}".strip()
    return lines + ([cur] if cur else [])


# --------------------------------------------------------------------------------------------
# Clips
# --------------------------------------------------------------------------------------------

def video_frames(clip: torch.Tensor, size: int | None = None) -> list[Image.Image]:
    """(F, C, H, W) in [-1, 1] -> F RGB frames, each upscaled as to_pil does (and to even sides, which H.264 needs)."""
    frames = [to_pil(f, size).convert("RGB") for f in clip]
    w, h = frames[0].size
    if w % 2 or h % 2:
        frames = [f.resize((w + w % 2, h + h % 2), Image.NEAREST) for f in frames]
    return frames


def save_video(clip: torch.Tensor, path: str | os.PathLike, fps: float, size: int | None = 256) -> Path:
    """Write a clip (F, C, H, W) in [-1, 1] as an H.264 MP4 (PyAV) or, for a .gif path, an animated GIF (Pillow),
    `fps` frames a second; tiny clips are upscaled with nearest neighbour to `size`."""
    from fractions import Fraction

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frames = video_frames(clip, size)
    if path.suffix == ".gif":
        frames[0].save(path, save_all=True, append_images=frames[1:], duration=round(1000 / fps), loop=0)
        return path
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1000))
        stream.width, stream.height = frames[0].size
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "12"}
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_image(frame)))
        container.mux(stream.encode())
    return path
