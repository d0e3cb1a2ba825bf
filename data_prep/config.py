"""Typed configs for `python -m data_prep.precompute`, registered in Hydra's ConfigStore."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore


@dataclass
class SourceConfig:
    """Which image-caption source to encode (conf/source/*.yaml pick one)."""

    name: str = "digits"  # a module in data_prep/sources/
    path: Optional[str] = None  # folder / manifest file / tar folder (not used by digits)
    split: str = "train"  # digits: "train" (training set) or "heldout" (evaluation only)
    rows_per_image: int = 3  # digits, digit_pairs: rows written per image, rotating through the caption phrasings
    pairs_per_combination: int = 40  # digit_pairs: images of each of the 90 training pairs
    scenes: int = 1200  # shapes: synthetic mixed-aspect scenes (a third each wide, tall, square)
    recursive: bool = True  # folder: search sub-folders too
    image_key: str = "image"  # manifest: column holding the image path
    caption_key: str = "caption"  # manifest: column holding the caption
    label_key: Optional[str] = "label"  # manifest: integer class column, used when present

    def __post_init__(self) -> None:
        if self.pairs_per_combination < 1:
            raise ValueError(f"source.pairs_per_combination={self.pairs_per_combination}: must be >= 1.")
        if self.scenes < 1:
            raise ValueError(f"source.scenes={self.scenes}: must be >= 1.")
        if self.rows_per_image < 1:
            raise ValueError(f"source.rows_per_image={self.rows_per_image}: must be >= 1.")
        if self.split not in ("train", "heldout"):
            raise ValueError(f"source.split={self.split!r}: use 'train' or 'heldout'.")


@dataclass
class PrecomputeConfig:
    """Encode a source once into MDS shards + dataset.json; the trainer never runs these encoders."""

    source: SourceConfig = field(default_factory=SourceConfig)
    vae: str = "pixel"  # "pixel" or a local diffusers AutoencoderKL/AutoencoderDC folder
    text_encoder: str = "minilm"  # "minilm" or a local transformers text-encoder folder
    resolution: int = 8  # images are resized (shorter side) and center-cropped to this square size
    width: Optional[int] = None  # non-square output (resolution x width, e.g. digit pairs 8x16); null = square
    # aspect-ratio buckets (data_prep/buckets.py): pixart_256 | pixart_512 | pixart_1024 | sdxl | [[h, w], ...]; each
    # image is encoded at the size of nearest aspect ratio instead of a square crop; null = resolution x width
    buckets: Optional[Any] = None
    out: str = "data/digits"  # output dataset folder (index.json + dataset.json + shards)
    image_mode: Optional[str] = None  # pixel codec: "L" or "RGB"; null = the source's own (digits: L)
    posterior: str = "mean"  # KL VAEs: store the posterior "mean" or a "sample" (recorded in dataset.json)
    max_tokens: int = 128  # caption token limit (also capped by the tokenizer's model_max_length)
    prompts: Optional[list[str]] = None  # grid prompts encoded with the data (training never loads the text
    # encoder for them); null: the source's own (digits: the ten digits), else the first 8 distinct captions
    batch_size: int = 64  # images per encoder call
    caption_cache_mb: float = 1024.0  # caption embeddings kept for reuse, least recently used dropped beyond this
    device: Optional[str] = None  # null = cuda:<LOCAL_RANK> when a GPU is present, else cpu
    dtype: Optional[str] = None  # null = bf16/fp16 on GPU, fp32 on CPU
    shard_size: str = "64mb"  # MDS shard size limit (bytes or "64mb"-style)
    compression: Optional[str] = "zstd"  # MDS shard compression
    max_bad_fraction: float = 0.01  # fail when more than this fraction of images/captions is unusable
    # records of a folder, manifest or built-in source per part of the output (out/part_NNNNNN/): the unit dealt to
    # ranks, marked done and, after a kill, encoded again; webdataset makes one part per .tar whatever this says
    records_per_part: int = 1000
    merge_timeout_s: float = 3600.0  # rank 0 waits this long for every part to be done before merging
    progress: bool = True  # show a tqdm bar

    def __post_init__(self) -> None:
        if self.resolution < 1:
            raise ValueError(f"resolution={self.resolution}: must be a positive image side in pixels.")
        if self.width is not None and self.width < 1:
            raise ValueError(f"width={self.width}: must be a positive image width in pixels, or null (square).")
        if self.image_mode not in (None, "L", "RGB"):
            raise ValueError(f"image_mode={self.image_mode!r}: use L, RGB or null (the source's default).")
        if self.posterior not in ("mean", "sample"):
            raise ValueError(f"posterior={self.posterior!r}: use 'mean' or 'sample'.")
        if not 0.0 <= self.max_bad_fraction <= 1.0:
            raise ValueError(f"max_bad_fraction={self.max_bad_fraction}: must be in [0, 1].")
        if self.records_per_part < 1:
            raise ValueError(f"records_per_part={self.records_per_part}: must be >= 1.")
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size}: must be >= 1.")
        if self.caption_cache_mb < 0:
            raise ValueError(f"caption_cache_mb={self.caption_cache_mb}: must be >= 0 (0 encodes every caption anew).")
        if self.buckets is not None and self.width is not None:
            raise ValueError(f"buckets={self.buckets} and width={self.width}: the buckets set every image's size; "
                             "drop width.")


def register_configs() -> None:
    """Make `precompute_schema` (primary) and `source/source_schema` available to Hydra."""
    cs = ConfigStore.instance()
    cs.store(name="precompute_schema", node=PrecomputeConfig)
    cs.store(group="source", name="source_schema", node=SourceConfig)
