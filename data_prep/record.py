"""dataset.json: the one record of a precomputed dataset. data_prep.precompute writes it last (it marks the dataset
complete); the trainer, sampling and evaluation read it (framework/data/datamodule.py). One typed record, written
and read here only, with a format version.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

DATASET_FILE = "dataset.json"
# Raised when a field is added, removed or changes meaning; a reader refuses a record newer than itself.
#   1  text_embeds float16 rows
#   2  text_storage: the rows' text may also be bf16 bits (uint16) or int8 with a text_scale column
#   3  caption_layout per_image: a row per image holding all its captions (text_lengths, captions columns)
#   4  posterior distribution: the KL VAE's posterior std beside its mean (latents_std column), sampled in training
#   5  video clips: latents (C, num_frames, h, w), num_frames and fps recorded
#   6  video VAEs: latents (C, 1 + (num_frames - 1) / temporal_compression, h, w); scaling_factor and shift_factor may
#      be lists, one per latent channel
#   7  clip buckets: clips of several frame counts and sizes, each bucket's `frames` and `latent_frames` in `buckets`;
#      num_frames is the longest
# A record says the oldest version that describes it (`record_version`), so an fp16 dataset stays readable by a
# LatentForge that knows version 1 only, and one of another storage is refused by it instead of misread.
FORMAT_VERSION = 7
# present only for datasets that have them
_OMITTED_WHEN_NONE = ("width", "buckets", "bucket_spec", "num_frames", "fps", "temporal_compression")


def scale_latents(raw: Any, scaling_factor: float | list[float], shift_factor: float | list[float]) -> Any:
    """Latents as a dataset stores them (unscaled) -> as the model sees them: (raw - shift) * scaling, the factors
    floats or one per channel (dim 1 of raw: (B, C, ...))."""
    return (raw - _per_channel(shift_factor, raw)) * _per_channel(scaling_factor, raw)


def unscale_latents(z: Any, scaling_factor: float | list[float], shift_factor: float | list[float]) -> Any:
    """The inverse of scale_latents: the model's latents -> the codec's."""
    return z / _per_channel(scaling_factor, z) + _per_channel(shift_factor, z)


def _per_channel(factor: float | list[float], like: Any) -> Any:
    if isinstance(factor, (int, float)):
        return float(factor)
    import torch

    return torch.tensor(factor, dtype=torch.float32, device=like.device).view(-1, *[1] * (like.ndim - 2))


def latent_frame_count(frames: int, temporal_compression: int | None) -> int:
    """The latent frames of a clip of `frames` pixel frames: a video VAE makes one of the first frame, then one of every
    `temporal_compression` (None or 1: an image VAE, one a frame)."""
    return 1 + (frames - 1) // (temporal_compression or 1)


def write_json_atomic(path: Path, obj: dict) -> None:
    """Write `obj` as JSON so that a reader never sees half a file (a temporary file, then a rename)."""
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True))
    os.replace(tmp, path)


def record_version(text_storage: str, caption_layout: str = "per_caption", posterior: str = "mean",
                   num_frames: Any = None, video_vae: bool = False, clip_buckets: bool = False) -> int:
    """The oldest format version that describes a dataset of this text storage, caption layout, posterior, (video)
    frame count and codec (`video_vae`: one that compresses time, with per-channel scaling), and clip buckets."""
    if clip_buckets:
        return 7
    if video_vae:
        return 6
    if num_frames is not None:
        return 5
    if posterior == "distribution":
        return 4
    if caption_layout != "per_caption":
        return 3
    return 1 if text_storage == "fp16" else 2


@dataclass
class DatasetRecord:
    """What a dataset's latents and text embeddings are and how they were made."""

    image_codec: dict[str, Any]  # {"name": pixel | a VAE folder, "class", "tile" (a tiled video VAE's tile side)}
    text_encoder: dict[str, Any]  # {"name": minilm | a folder, "class", "max_tokens", "prefix" (only when one is set)}
    latent_channels: int
    latent_size: list[int]  # [h, w] of every latent (the base size when bucketed)
    text_dim: int
    scaling_factor: float | list[float]  # a list: one per latent channel (a video VAE's 1 / latents_std)
    shift_factor: float | list[float]  # a list: one per latent channel (a video VAE's latents_mean)
    num_samples: int  # rows: one per caption, or one per image with caption_layout per_image
    resolution: int
    empty_caption: str  # the file holding the empty caption's embedding (L0, D)
    downsample: int = 1  # pixels per latent cell
    posterior: str = "none"  # KL VAEs: "mean", "sample", or "distribution" (mean and std; sampled in training)
    image_mode: str = "RGB"
    num_classes: Optional[int] = None
    prompts: Optional[dict[str, Any]] = None  # {"file", "texts"}: the grid prompts' embeddings
    fingerprint: Optional[str] = None  # the precompute config's digest (precompute.json)
    num_images: Optional[int] = None
    # {"bad_images", "missing_captions"}, and with filters "filtered": {filter name: records it dropped}
    skipped: dict[str, Any] = field(default_factory=dict)
    columns: list[str] = field(default_factory=list)  # the MDS columns
    latents_scaled: bool = False  # the trainer applies (x - shift_factor) * scaling_factor exactly once
    source: dict[str, Any] = field(default_factory=dict)  # {"name", "path", ...the source's metadata}
    world_size: int = 1  # ranks of the run that finished it (a resumed dataset's earlier parts may have had others)
    width: Optional[int] = None  # the image width when it differs from the resolution
    # aspect-ratio buckets: [{"size", "dir", "latent_size", "num_samples"}], clip buckets with "frames" and "latent_frames"
    buckets: Optional[list[dict[str, Any]]] = None
    bucket_spec: Optional[str] = None
    text_storage: str = "fp16"  # how the rows hold text (data_prep/storage.py); records older than it are fp16
    # the parts' bytes on disk and uncompressed, and per sample (data_prep/storage.py dataset_size):
    # {"bytes", "raw_bytes", "per_sample": {"latents", "text", "other", "disk"}}
    size: dict[str, Any] = field(default_factory=dict)
    # per_caption: a row per caption, the image's latents in each; per_image: a row per image with all its captions
    # (docs/data.md "Several captions per image"); records older than it are per_caption
    caption_layout: str = "per_caption"
    num_captions: Optional[int] = None  # the captions encoded, in all
    num_frames: Optional[int] = None  # video clips: the frames of each (pixels; in clip buckets, the longest); None: images
    fps: Optional[float] = None  # video clips: the rate their frames were taken at (None: every frame of the video)
    # video clips: pixel frames per latent frame after the first (a video VAE's; absent: 1, an image VAE per frame)
    temporal_compression: Optional[int] = None
    format_version: int = FORMAT_VERSION

    @property
    def latent_frames(self) -> Optional[int]:
        """The frames of each clip's latents (C, latent_frames, h, w); None: images."""
        return None if self.num_frames is None else latent_frame_count(self.num_frames, self.temporal_compression)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        return {k: v for k, v in out.items() if not (k in _OMITTED_WHEN_NONE and v is None)}

    def write(self, folder: str | Path) -> Path:
        """Atomically: the file marks the dataset complete."""
        path = Path(folder) / DATASET_FILE
        write_json_atomic(path, self.to_json())
        return path

    @classmethod
    def from_json(cls, raw: dict[str, Any], where: str | Path) -> "DatasetRecord":
        """The record in `raw` (the parsed file `where`), with one clear error for each way it can be wrong."""
        if not isinstance(raw, dict):
            raise ValueError(f"{where} holds {type(raw).__name__}, not a dataset record; re-run data_prep.precompute.")
        version = raw.get("format_version", 1)  # the first records had the version from the start; be lenient
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise ValueError(f"{where} has format_version {version!r}; this LatentForge reads up to {FORMAT_VERSION}. "
                             "Upgrade LatentForge, or re-run data_prep.precompute with this version into a new folder.")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        required = [n for n, f in fields.items()
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [k for k in required if k not in raw]
        if missing:
            raise ValueError(f"{where} lacks {missing}; it was not written by this version of data_prep.precompute.")
        return cls(**{k: v for k, v in raw.items() if k in fields})

    @classmethod
    def read(cls, path: str | Path) -> "DatasetRecord":
        """A local dataset.json file (or the folder holding it)."""
        path = Path(path)
        if path.is_dir():
            path = path / DATASET_FILE
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is corrupt ({err}); re-run data_prep.precompute into a new folder.") from None
        return cls.from_json(raw, path)
