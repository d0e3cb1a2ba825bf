"""Evaluation on one's own data: generated images against a folder of held-out real images.

    fid         Fréchet distance on the features of a local feature network (`eval.inception=PATH`: a
                TorchScript file, e.g. the FID Inception `inception-2015-12-05.pt` that clean-fid and
                StyleGAN's metrics use), torchmetrics' formula
    clip_score  CLIPScore (torchmetrics) with a local CLIP folder (`eval.clip=PATH`)

each with a percentile bootstrap interval (`eval.bootstrap` resamples of the generated images; for fid the
real images are resampled too). The prompts are the held-out images' own captions (same-named .txt files,
the folder source's layout) or `eval.prompts=FILE` (one per line); every prompt is drawn `eval.seeds` times.
Nothing here downloads: both networks load from the paths given.
"""

from __future__ import annotations

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

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        path = Path(path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"eval.inception={path}: no such file (a TorchScript feature network)")
        self.net = torch.jit.load(str(path), map_location="cpu").eval()
        names = [a.name for a in self.net.forward.schema.arguments]
        # The FID Inception of clean-fid / StyleGAN returns its 2048 pool features only when asked.
        self.kwargs = {"return_features": True} if "return_features" in names else {}

    @torch.inference_mode()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images, **self.kwargs).flatten(1)


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
    """fid and clip_score of `pipe` against `settings.real` (EvalSettings), with bootstrap intervals. ranks: how the
    ranks share the generation (Pipeline.generate); a rank that gets no images gets {}."""
    from framework.inference.pipeline import save_grid
    from framework.inference.sampling import SamplingPlan

    if not (settings.inception or settings.clip):
        raise ValueError("evaluation on one's own data needs a feature network and/or CLIP: eval.inception=PATH "
                         "(fid) and/or eval.clip=PATH (clip_score)")
    size = pipe.latent_size(settings.height, settings.width, settings.aspect)
    probe = pipe.decode(torch.zeros(1, pipe.model.cfg.in_channels, *size))  # (1, C, H, W): the size images come out at
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
    if settings.clip:
        score, interval = mean_with_interval(clip_scores(images, drawn, settings.clip), settings.bootstrap)
        metrics.update(clip_score=score, clip_score_interval=interval)
    if grid_path is not None:
        k = min(len(prompts), 8)
        order = [i * settings.seeds + s for s in range(min(settings.seeds, 4)) for i in range(k)]
        save_grid(images[order], [drawn[i] for i in order], grid_path, ncol=k)
    return metrics


def check_real_eval(settings: Any) -> None:
    """Refuse at start-up what evaluate_real would fail on later, naming the key."""
    if not (settings.inception or settings.clip):
        raise ValueError("eval.real is set: give eval.inception=PATH (fid) and/or eval.clip=PATH (clip_score)")
    for key, want_dir in (("real", True), ("inception", False), ("clip", True), ("prompts", False)):
        value = getattr(settings, key)
        if value and not (Path(value).expanduser().is_dir() if want_dir else Path(value).expanduser().is_file()):
            raise FileNotFoundError(f"eval.{key}={value}: no such {'folder' if want_dir else 'file'} on this machine")


def real_summary(metrics: dict[str, Any]) -> str:
    """One line for people."""
    parts = []
    for key in ("fid", "clip_score"):
        if key in metrics:
            lo, hi = metrics[f"{key}_interval"]
            parts.append(f"{key} {metrics[key]:.3f} [{lo:.3f}, {hi:.3f}]")
    return "  ".join(parts) + f"  ({metrics['num_images']} images, {metrics['num_real']} real, 95% bootstrap intervals)"
