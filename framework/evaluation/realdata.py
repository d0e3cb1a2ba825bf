"""Evaluation on one's own data: generated images (or clips) against a folder of held-out real ones.

    fid         Fréchet distance on the features of a local feature network (`eval.inception=PATH`: a
                TorchScript file, e.g. the FID Inception `inception-2015-12-05.pt` that clean-fid and
                StyleGAN's metrics use), torchmetrics' formula
    fvd         clips: the same distance on the features of a local I3D network (`eval.i3d=PATH`: a TorchScript
                file such as `i3d_torchscript.pt`, which StyleGAN-V's and most FVD code load), each clip's frames
                resized to 224 pixels, in [-1, 1], as that code feeds it
    clip_score  CLIPScore (torchmetrics) with a local CLIP folder (`eval.clip=PATH`); of clips, every frame against the
                prompt, averaged over the clip's frames

each with a percentile bootstrap interval (`eval.bootstrap` resamples of the generated images or clips; for fid and
fvd the real ones are resampled too). The prompts are the held-out files' own captions (same-named .txt files,
the folder and video_folder sources' layout) or `eval.prompts=FILE` (one per line); every prompt is drawn
`eval.seeds` times. Nothing here downloads: the networks load from the paths given.
"""

from __future__ import annotations

import math
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

# --------------------------------------------------------------------------------------------
# Inputs: the real images, the prompts, the feature network
# --------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def real_images(folder: str | Path, height: int, width: int) -> tuple[torch.Tensor, list[str]]:
    """The folder's images resized to cover (height, width) and centre-cropped, as (N, 3, H, W) in [-1, 1], and
    their captions ("" where an image has no .txt). Kept for the next call with the same arguments: a run's
    periodic evaluations read the held-out folder once."""
    from data_prep.precompute import load_pixels
    from data_prep.sources.base import IMAGE_EXTENSIONS
    from data_prep.sources.folder import read_caption

    root = Path(folder).expanduser()
    files = sorted(p for p in root.glob("**/*") if p.suffix.lower() in IMAGE_EXTENSIONS) if root.is_dir() else []
    if not files:
        raise FileNotFoundError(f"eval.real={folder}: no images ({', '.join(IMAGE_EXTENSIONS)}) in that folder")
    images = torch.stack([load_pixels(f, "RGB", height, width) for f in files])  # (N, 3, H, W)
    return images, [(read_caption(f.with_suffix(".txt")) or [""])[0] for f in files]


@lru_cache(maxsize=1)
def real_clips(folder: str | Path, frames: int, fps: float | None, height: int, width: int
               ) -> tuple[torch.Tensor, list[str]]:
    """The folder's videos as clips of `frames` frames taken `fps` times a second (as precompute takes them), each frame
    resized to cover (height, width) and centre-cropped: (N, F, 3, H, W) in [-1, 1], and their captions. A video too
    short or unreadable is refused, naming it."""
    from data_prep.precompute import cover_crop, to_tensor
    from data_prep.sources.folder import read_caption
    from data_prep.video import VIDEO_EXTENSIONS, read_clip

    root = Path(folder).expanduser()
    files = sorted(p for p in root.glob("**/*") if p.suffix.lower() in VIDEO_EXTENSIONS) if root.is_dir() else []
    if not files:
        raise FileNotFoundError(f"eval.real={folder}: no videos ({', '.join(VIDEO_EXTENSIONS)}) in that folder")
    clips = []
    for f in files:
        try:
            clip = read_clip(f, frames, fps, "RGB")
        except Exception as err:
            raise ValueError(f"eval.real: {f} does not give a clip of {frames} frames"
                             f"{f' at {fps} fps' if fps else ''}, as the model makes ({type(err).__name__}: {err})") from None
        clips.append(torch.stack([to_tensor(cover_crop(frame, height, width)[0]) for frame in clip]))
    return torch.stack(clips), [(read_caption(f.with_suffix(".txt")) or [""])[0] for f in files]


def eval_prompts(spec: str | None, captions: list[str]) -> list[str]:
    """`eval.prompts`: a text file with one prompt per line; null: the real images' captions."""
    if spec:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"eval.prompts={spec}: not a file (one prompt per line)")
        prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    else:
        prompts = [c for c in captions if c]
    if not prompts:
        raise ValueError("no prompts: the eval.real images have no .txt captions; give eval.prompts=FILE")
    return prompts


class ScriptedFeatures(nn.Module):
    """A TorchScript feature network from a local file: uint8 (N, 3, H, W) images -> (N, D) features."""

    key = "eval.inception"

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        path = Path(path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"{self.key}={path}: no such file (a TorchScript feature network)")
        self.net = torch.jit.load(str(path), map_location="cpu").eval()
        names = [a.name for a in self.net.forward.schema.arguments]
        # The FID Inception of clean-fid / StyleGAN returns its 2048 pool features only when asked; so does the I3D
        # of FVD code, which also rescales and resizes its input unless told not to.
        self.kwargs = {k: v for k, v in (("return_features", True), ("rescale", False), ("resize", False)) if k in names}

    @torch.inference_mode()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images, **self.kwargs).flatten(1)


class VideoFeatures(ScriptedFeatures):
    """A TorchScript I3D from a local file: clips (N, F, C, H, W) in [-1, 1] -> (N, D) features. Each frame is resized
    so its shorter side is 224 pixels (bilinear) and centre-cropped to 224 x 224, gray repeated to 3 channels; the
    network gets (N, 3, F, 224, 224) in [-1, 1], rescale=False, resize=False, return_features=True (the logits before
    the softmax, 400 of them for the Kinetics-400 I3D)."""

    key, size = "eval.i3d", 224

    @torch.inference_mode()
    def forward(self, clips: torch.Tensor) -> torch.Tensor:
        n, f = clips.shape[:2]
        frames = clips.flatten(0, 1).float()  # (N * F, C, H, W)
        frames = frames.expand(-1, 3, -1, -1) if frames.shape[1] == 1 else frames
        scale = self.size / min(frames.shape[-2:])
        h, w = max(self.size, round(frames.shape[-2] * scale)), max(self.size, round(frames.shape[-1] * scale))
        frames = torch.nn.functional.interpolate(frames, size=(h, w), mode="bilinear", align_corners=False)
        top, left = (h - self.size) // 2, (w - self.size) // 2
        frames = frames[..., top : top + self.size, left : left + self.size].clamp(-1, 1)
        return self.net(frames.unflatten(0, (n, f)).transpose(1, 2), **self.kwargs).flatten(1)


def video_features(net: VideoFeatures, clips: torch.Tensor, batch_size: int = 16) -> torch.Tensor:
    """(N, D) float64 I3D features of clips (N, F, C, H, W) in [-1, 1]."""
    return torch.cat([net(clips[i : i + batch_size]).double() for i in range(0, len(clips), batch_size)])


@lru_cache(maxsize=1)
def video_feature_net(path: str | Path) -> VideoFeatures:
    """The I3D of `path`, loaded once per run."""
    return VideoFeatures(path)


@lru_cache(maxsize=1)
def real_video_features(folder: str | Path, frames: int, fps: float | None, height: int, width: int,
                        i3d: str | Path) -> torch.Tensor:
    """I3D features of the held-out clips, computed once per run (they do not change between evaluations)."""
    return video_features(video_feature_net(i3d), real_clips(folder, frames, fps, height, width)[0])


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """[-1, 1] -> uint8, grayscale repeated to 3 channels."""
    images = ((images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return images.expand(-1, 3, -1, -1) if images.shape[1] == 1 else images


def features(net: nn.Module, images: torch.Tensor, batch_size: int = 64) -> torch.Tensor:
    """(N, D) float64 features of images in [-1, 1]."""
    return torch.cat([net(to_uint8(images[i : i + batch_size])).double() for i in range(0, len(images), batch_size)])


@lru_cache(maxsize=1)
def feature_net(path: str | Path) -> ScriptedFeatures:
    """The feature network of `path`, loaded once per run."""
    return ScriptedFeatures(path)


@lru_cache(maxsize=1)
def real_features(folder: str | Path, height: int, width: int, inception: str | Path) -> torch.Tensor:
    """Features of the held-out images, computed once per run (they do not change between evaluations)."""
    return features(feature_net(inception), real_images(folder, height, width)[0])


# --------------------------------------------------------------------------------------------
# Metrics with bootstrap intervals
# --------------------------------------------------------------------------------------------


def fid_from_features(real: torch.Tensor, fake: torch.Tensor) -> float:
    """Fréchet distance between two feature sets (N, D), torchmetrics' formula on their means and covariances."""
    from torchmetrics.image.fid import _compute_fid

    def stats(f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return f.mean(0), torch.cov(f.T)

    return max(0.0, float(_compute_fid(*stats(real), *stats(fake))))


def percentile_interval(values: list[float], level: float = 0.95) -> list[float]:
    lo, hi = np.quantile(np.asarray(values), [(1 - level) / 2, (1 + level) / 2])
    return [float(lo), float(hi)]


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95% t-interval of the mean of independent `values` (low = high = mean for one)."""
    from scipy import stats

    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, mean, mean
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def fid_with_interval(real: torch.Tensor, fake: torch.Tensor, resamples: int, seed: int = 0) -> tuple[float, list[float]]:
    """fid and its bootstrap interval: both sets resampled with replacement, `resamples` times."""
    g = torch.Generator().manual_seed(seed)
    draws = []
    for _ in range(resamples):
        r = real[torch.randint(len(real), (len(real),), generator=g)]
        f = fake[torch.randint(len(fake), (len(fake),), generator=g)]
        draws.append(fid_from_features(r, f))
    return fid_from_features(real, fake), percentile_interval(draws)


def clip_scores(images: torch.Tensor, prompts: list[str], clip_path: str | Path, batch_size: int = 64) -> torch.Tensor:
    """CLIPScore (torchmetrics: 100 x cosine of image and prompt embeddings, at least 0) of each image."""
    from torchmetrics.functional.multimodal.clip_score import _clip_score_update
    from transformers import CLIPModel, CLIPProcessor

    path = Path(clip_path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"eval.clip={clip_path}: not a folder (a local CLIP model, transformers format)")
    model, processor = CLIPModel.from_pretrained(path).eval(), CLIPProcessor.from_pretrained(path)
    scores = [_clip_score_update(list(to_uint8(images[i : i + batch_size])), prompts[i : i + batch_size], model,
                                 processor)[0] for i in range(0, len(images), batch_size)]
    return torch.cat(scores).double().clamp(min=0)


def mean_with_interval(values: torch.Tensor, resamples: int, seed: int = 0) -> tuple[float, list[float]]:
    g = torch.Generator().manual_seed(seed)
    draws = [float(values[torch.randint(len(values), (len(values),), generator=g)].mean()) for _ in range(resamples)]
    return float(values.mean()), percentile_interval(draws)


# --------------------------------------------------------------------------------------------
# The evaluation
# --------------------------------------------------------------------------------------------


def evaluate_real(pipe: Any, settings: Any, grid_path: str | Path | None = None, ranks: Any = None,
                  progress: bool = False) -> dict[str, Any]:
    """fid (fvd for clips) and clip_score of `pipe` against `settings.real` (EvalSettings), with bootstrap intervals.
    ranks: how the ranks share the generation (Pipeline.generate); a rank that gets no images gets {}."""
    from framework.inference.pipeline import save_grid
    from framework.inference.sampling import SamplingPlan

    video = pipe.model.cfg.is_video
    check_real_networks(settings, video)
    size = pipe.latent_size(settings.height, settings.width, settings.aspect, settings.num_frames)
    # (1, C, H, W), or a clip (1, F, C, H, W): the size images come out at, the frames a video VAE gives
    probe = pipe.decode(torch.zeros(1, pipe.model.cfg.in_channels, *size))
    if video:
        real, captions = real_clips(settings.real, probe.shape[1], pipe.info.get("fps"), probe.shape[-2],
                                    probe.shape[-1])
    else:
        real, captions = real_images(settings.real, probe.shape[-2], probe.shape[-1])
    prompts = eval_prompts(settings.prompts, captions)
    drawn = [p for p in prompts for _ in range(settings.seeds)]
    t0 = time.perf_counter()
    images = pipe.generate(drawn, SamplingPlan.of(settings, seed=0, size=size), ranks=ranks,
                           batch_size=settings.batch_size, progress=progress)
    if images is None:  # a rank that only helped (decode_ranks)
        return {}
    metrics: dict[str, Any] = {"num_images": len(images), "num_real": len(real), "num_prompts": len(prompts),
                               "images_per_s": len(images) / (time.perf_counter() - t0), "bootstrap": settings.bootstrap}
    if settings.inception:
        reference = real_features(settings.real, real.shape[-2], real.shape[-1], settings.inception)
        fid, interval = fid_with_interval(reference, features(feature_net(settings.inception), images), settings.bootstrap)
        metrics.update(fid=fid, fid_interval=interval)
    if getattr(settings, "i3d", None):
        reference = real_video_features(settings.real, probe.shape[1], pipe.info.get("fps"), probe.shape[-2],
                                        probe.shape[-1], settings.i3d)
        fake = video_features(video_feature_net(settings.i3d), images)
        fvd, interval = fid_with_interval(reference, fake, settings.bootstrap)
        metrics.update(fvd=fvd, fvd_interval=interval)
    if settings.clip and video:  # every frame against its clip's prompt, averaged over the clip
        per_frame = clip_scores(images.flatten(0, 1), [p for p in drawn for _ in range(images.shape[1])], settings.clip)
        score, interval = mean_with_interval(per_frame.view(len(images), -1).mean(1), settings.bootstrap)
        metrics.update(clip_score=score, clip_score_interval=interval)
    elif settings.clip:
        score, interval = mean_with_interval(clip_scores(images, drawn, settings.clip), settings.bootstrap)
        metrics.update(clip_score=score, clip_score_interval=interval)
    if video:
        metrics.update(num_frames=images.shape[1])
    if grid_path is not None:
        k = min(len(prompts), 8)
        order = [i * settings.seeds + s for s in range(min(settings.seeds, 4)) for i in range(k)]
        save_grid(images[order], [drawn[i] for i in order], grid_path, ncol=1 if video else k)
    return metrics


def check_real_networks(settings: Any, video: bool) -> None:
    """Refuse a metric network that does not score this kind of model, or none at all, naming the keys."""
    i3d = getattr(settings, "i3d", None)
    if video and settings.inception:
        raise ValueError("eval.inception scores images, and this model makes clips: give eval.i3d=FILE (fvd, an I3D "
                         "TorchScript file) and/or eval.clip=DIR (per-frame clip_score)")
    if not video and i3d:
        raise ValueError("eval.i3d scores clips (fvd), and this model makes images: give eval.inception=FILE (fid) "
                         "and/or eval.clip=DIR")
    if not (settings.inception or settings.clip or i3d):
        raise ValueError("evaluation on one's own data needs a metric network: eval.inception=PATH (fid of images), "
                         "eval.i3d=PATH (fvd of clips) and/or eval.clip=PATH (clip_score)")


def check_real_eval(settings: Any) -> None:
    """Refuse at start-up what evaluate_real would fail on later, naming the key."""
    if not (settings.inception or settings.clip or settings.i3d):
        raise ValueError("eval.real is set: give eval.inception=PATH (fid of images), eval.i3d=PATH (fvd of clips) "
                         "and/or eval.clip=PATH (clip_score)")
    for key, want_dir in (("real", True), ("inception", False), ("i3d", False), ("clip", True), ("prompts", False)):
        value = getattr(settings, key)
        if value and not (Path(value).expanduser().is_dir() if want_dir else Path(value).expanduser().is_file()):
            raise FileNotFoundError(f"eval.{key}={value}: no such {'folder' if want_dir else 'file'} on this machine")


def real_summary(metrics: dict[str, Any]) -> str:
    """One line for people."""
    parts = []
    for key in ("fid", "fvd", "clip_score"):
        if key in metrics:
            lo, hi = metrics[f"{key}_interval"]
            parts.append(f"{key} {metrics[key]:.3f} [{lo:.3f}, {hi:.3f}]")
    what = f"clips of {metrics['num_frames']} frames" if "num_frames" in metrics else "images"
    return "  ".join(parts) + f"  ({metrics['num_images']} {what}, {metrics['num_real']} real, 95% bootstrap intervals)"
