"""What an evaluation generates and how: the settings shared by `python -m framework.eval`, the end-of-training
evaluation (`eval.*`) and the benchmarks. (Here rather than in framework/eval.py: that is a command, and
commands import the layers below them, never the reverse.)"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ImageSize:
    """The size to generate at, for models trained on aspect-ratio buckets (data_prep/buckets.py)."""

    height: int | None = None
    """Image height in pixels (with width): one of the sizes the model was trained at; null: the model's own size."""
    width: int | None = None
    """Image width in pixels (with height)."""
    aspect: str | None = None
    """Instead of height / width: an aspect ratio W:H (16:9, 3:4); the trained size nearest it."""
    num_frames: int | None = None
    """Video models: the frames of each clip, one of the counts the model was trained at (its dataset's frame-count
    buckets); null: the longest."""


@dataclass
class EvalSettings(ImageSize):
    """What is generated and how (shared by `python -m framework.eval` and the end-of-training eval)."""

    seeds: int = 4
    """Seeds per prompt."""
    phrasings: int = 3
    """Caption phrasings per class (digits)."""
    steps: int = 20
    """Sampler steps."""
    guidance: float = 4.0
    """Classifier-free guidance scale."""
    sampler: str | None = None
    """null: the objective's default sampler."""
    batch_size: int = 64
    """Images generated per forward pass."""
    best_of: int = 1
    """Candidates per prompt; the judge keeps `pick` of them (inference-time scaling)."""
    judge: str | None = None
    """Judge that picks among candidates (framework/evaluation/judge.py: digits, pairs, clip, vlm, digits_vlm); null:
    the data's own."""
    judge_path: str | None = None
    """Weights of judges that load them (clip: a local CLIP folder; vlm: a local vision-language model folder)."""
    selection: str = "score"
    """score (keep the judge's highest scores) or tournament (SANA-1.5's knockout of pairwise comparisons)."""
    pick: int = 1
    """Images kept (and scored) per prompt."""
    cache_schedule: str | None = None
    """Cached sampling (framework/inference/caching.py): a cache_schedule.json from experiment=cache_router (or its run
    dir), or uniform:K (a full step every K steps); null: every branch at every step."""
    real: str | None = None
    """One's own data (framework/evaluation/realdata.py): a folder of held-out real images, or videos for a video model
    (same-named .txt captions are the prompts unless `prompts` is given); fid (fvd) and clip_score are measured
    against it."""
    prompts: str | None = None
    """With `real`: a text file of prompts, one per line; null: the real images' captions."""
    inception: str | None = None
    """With `real`: the feature network of fid, a local TorchScript file (e.g. inception-2015-12-05.pt)."""
    i3d: str | None = None
    """With `real`, for a video model: the I3D network of fvd, a local TorchScript file (e.g. i3d_torchscript.pt, which
    StyleGAN-V's FVD loads)."""
    clip: str | None = None
    """With `real`: a local CLIP folder (transformers) for clip_score (of clips: per frame, averaged)."""
    bootstrap: int = 200
    """With `real`: bootstrap resamples of the 95% intervals."""

    def __post_init__(self) -> None:
        from framework.inference.bestof import SELECTIONS

        if self.real is not None and self.bootstrap < 2:
            raise ValueError(f"bootstrap={self.bootstrap} must be >= 2 (resamples of the intervals)")

        if self.best_of < 1:
            raise ValueError(f"best_of={self.best_of} must be >= 1")
        if not 1 <= self.pick <= self.best_of:
            raise ValueError(f"pick={self.pick} must be between 1 and best_of={self.best_of}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection={self.selection!r}: use one of {SELECTIONS}")
