"""Typed configs for `python -m data_prep.precompute`, registered in Hydra's ConfigStore."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore

TEXT_STORAGES = ("fp16", "bf16", "int8")  # the rows' text formats (data_prep/storage.py)
CAPTION_LAYOUTS = ("per_caption", "per_image")  # a row per caption, or a row per image with all its captions
POSTERIORS = ("mean", "sample", "distribution")  # what a KL VAE's rows store (PrecomputeConfig.posterior)


@dataclass
class SourceConfig:
    """Which image-caption source to encode (conf/source/*.yaml pick one)."""

    name: str = "digits"  # a module in data_prep/sources/
    # folder / manifest file / tar folder, .tar or brace pattern (webdataset: /data/{00000..00099}.tar, also on an
    # object store: s3://bucket/tars/{00000..00099}.tar or an s3:// prefix; needs staging=); not used by digits
    path: Optional[str] = None
    split: str = "train"  # digits: "train" (training set) or "heldout" (evaluation only)
    rows_per_image: int = 3  # digits, digit_pairs: rows written per image, rotating through the caption phrasings
    labels: Optional[list[int]] = None  # digits: only the images of these digits (e.g. [0,1,2,3,4]); null: all ten
    pairs_per_combination: int = 40  # digit_pairs: images of each of the 90 training pairs
    scenes: int = 1200  # shapes: synthetic mixed-aspect scenes (a third each wide, tall, square)
    recursive: bool = True  # folder: search sub-folders too
    image_key: str = "image"  # manifest: column holding the image path
    # manifest: column holding the caption; null for a manifest of labels only (ImageNet-style, with text_encoder=none):
    # each image is captioned "class N", which grids and framework.sample read as label N
    caption_key: Optional[str] = "caption"
    label_key: Optional[str] = "label"  # manifest: integer class column, used when present

    def __post_init__(self) -> None:
        if self.pairs_per_combination < 1:
            raise ValueError(f"source.pairs_per_combination={self.pairs_per_combination}: must be >= 1.")
        if self.scenes < 1:
            raise ValueError(f"source.scenes={self.scenes}: must be >= 1.")
        if self.rows_per_image < 1:
            raise ValueError(f"source.rows_per_image={self.rows_per_image}: must be >= 1.")
        if self.labels is not None and (not self.labels or any(not 0 <= int(d) <= 9 for d in self.labels)):
            raise ValueError(f"source.labels={self.labels}: digits from 0 to 9 (null: all ten).")
        if self.split not in ("train", "heldout"):
            raise ValueError(f"source.split={self.split!r}: use 'train' or 'heldout'.")


@dataclass
class PrecomputeConfig:
    """Encode a source once into MDS shards + dataset.json; the trainer never runs these encoders."""

    source: SourceConfig = field(default_factory=SourceConfig)
    # "pixel", or a local diffusers VAE folder: an image VAE (AutoencoderKL, AutoencoderDC; clips are encoded frame by
    # frame) or, for clips, a video VAE (AutoencoderKLWan, AutoencoderKLCogVideoX, AutoencoderKLHunyuanVideo), which
    # compresses time too: num_frames = 1 + 4k frames make 1 + k latent frames (data_prep/encoders.py VideoVAECodec)
    vae: str = "pixel"
    # A video VAE's tiles, in pixels a side: frames larger than this are encoded (and, at sampling, decoded) in
    # overlapping tiles, a quarter overlapping, so a long high-resolution clip fits in memory; recorded in dataset.json.
    # null: whole frames.
    vae_tile: Optional[int] = None
    # "minilm", a local transformers text-encoder folder, or "none": no captions encoded, for a class-conditional model
    # that reads the source's class labels only (DiT); the source must have labels
    text_encoder: str = "minilm"
    resolution: int = 8  # images are resized (shorter side) and center-cropped to this square size
    width: Optional[int] = None  # non-square output (resolution x width, e.g. digit pairs 8x16); null = square
    # aspect-ratio buckets (data_prep/buckets.py): pixart_256 | pixart_512 | pixart_1024 | sdxl | [[h, w], ...]; each
    # image is encoded at the size of nearest aspect ratio instead of a square crop; null = resolution x width
    buckets: Optional[Any] = None
    # Video sources (source=video_folder): each video becomes a clip of num_frames frames from its start, taken fps
    # times a second (null: every frame; the stride is the video's rate over fps, rounded, at least 1), each frame
    # resized and cropped like an image and encoded by the VAE: latents (C, num_frames, h, w) with an image VAE, (C, 1 +
    # (num_frames - 1) / 4, h, w) with a video VAE. A video with fewer frames at that rate is skipped and counted with
    # the unreadable ones. null: an image source.
    # A list of counts ([9, 17, 33]) makes frame-count buckets: each clip takes the longest count it has frames for at
    # that rate (one shorter than the shortest is skipped as too short), and is stored in that count's bucket beside
    # the aspect-ratio buckets (`buckets`): training draws every global batch from one (count, size) bucket.
    num_frames: Optional[Any] = None
    fps: Optional[float] = None
    out: str = "data/digits"  # output dataset folder (index.json + dataset.json + shards), or s3://bucket/prefix
    # A local folder that files pass through on their way to or from an object store, needed when out or source.path
    # is remote (s3://...): each rank stages there, in rank_<rank>/, one part's shards until they are uploaded and the
    # input tar it is encoding (deleted once encoded); emptied when the rank starts and when it ends. null: none.
    staging: Optional[str] = None
    image_mode: Optional[str] = None  # pixel codec: "L" or "RGB"; null = the source's own (digits: L)
    # KL VAEs: store the posterior's "mean", one "sample" of it, or its "distribution" (the mean, and its std in a
    # latents_std column: training draws a new sample each step, as the reference trainers that encode on the fly do;
    # twice the latent bytes). Recorded in dataset.json. A DC-AE and the pixel codec have no posterior.
    posterior: str = "mean"
    max_tokens: int = 128  # caption token limit (also capped by the tokenizer's model_max_length)
    # An instruction put before every caption for the text encoder (SANA's Gemma-2 "complex human instruction": copy
    # the lines of the SANA config you follow); the rows keep the first token and the window of max_tokens - 1 from the
    # instruction's last token on, so the caption keeps its room (data_prep/encoders.py TextEncoder). null: none.
    text_prefix: Optional[str] = None
    prompts: Optional[list[str]] = None  # grid prompts encoded with the data (training never loads the text
    # encoder for them); null: the source's own (digits: the ten digits), else the first 8 distinct captions
    batch_size: int = 64  # images per encoder call
    # Processes that read and decode the images (PIL decode, resize, crop) while this one encodes: a DataLoader's
    # workers over the part being encoded, each taking every decode_workers-th batch, the rows kept in the source's
    # order (docs/data.md "Decoding in worker processes"). 0: decode in the encoding process, between encoder calls.
    decode_workers: int = 2
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
    # How the rows store text embeddings (data_prep/storage.py, docs/data.md): fp16; bf16 (as many bytes, float32's
    # range); int8 (half the bytes: per token a float32 scale max|x| / 127 and int8 values). The reader decodes each.
    text_storage: str = "fp16"
    # A source that captions an image several times (digits' rows_per_image, a manifest's list of captions):
    # per_caption writes a row per caption, each with the image's latents; per_image a row per image, its latents once
    # and every caption's embedding, and training draws one of them per sample per step (docs/data.md).
    caption_layout: str = "per_caption"
    # Filters (data_prep/filters.py), applied before encoding; what each drops is counted in dataset.json's
    # skipped.filtered. min_size: the shorter side of the original image in pixels (img2dataset's .json
    # original_width / original_height when the record has them, else the decoded image); null = no limit.
    min_size: Optional[int] = None
    max_aspect: Optional[float] = None  # longest over shortest side of the original image, e.g. 3.0; null = no limit
    # Thresholds on numbers in each sample's img2dataset .json (source=webdataset): {key: {min: x, max: y}}, e.g.
    # filters={punsafe: {max: 0.5}, similarity: {min: 0.28}} or +filters.punsafe.max=0.5; bounds are inclusive. A
    # record without the key (or with null or a non-number there) is dropped and counted as <key>.missing.
    filters: Optional[Any] = None
    # A held-out split for the validation loss (eval.val_every_n_steps): this fraction of the records, chosen by a hash
    # of each record's key (the same records whatever the ranks or parts), is written to out/val instead of out, a
    # dataset of its own that training reads as data.path/val. 0: no split.
    val_fraction: float = 0.0
    # Which records this output holds: all, or (set by precompute itself for out and out/val) the train or val ones.
    split: str = "all"

    def __post_init__(self) -> None:
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"val_fraction={self.val_fraction}: the fraction of records held out for validation, in "
                             "[0, 1) (0: none).")
        if self.split not in ("all", "train", "val"):
            raise ValueError(f"split={self.split!r}: all, train or val (precompute sets it with val_fraction).")
        if self.resolution < 1:
            raise ValueError(f"resolution={self.resolution}: must be a positive image side in pixels.")
        if self.width is not None and self.width < 1:
            raise ValueError(f"width={self.width}: must be a positive image width in pixels, or null (square).")
        if self.image_mode not in (None, "L", "RGB"):
            raise ValueError(f"image_mode={self.image_mode!r}: use L, RGB or null (the source's default).")
        if self.posterior not in POSTERIORS:
            raise ValueError(f"posterior={self.posterior!r}: use one of {', '.join(POSTERIORS)}.")
        if not 0.0 <= self.max_bad_fraction <= 1.0:
            raise ValueError(f"max_bad_fraction={self.max_bad_fraction}: must be in [0, 1].")
        if self.records_per_part < 1:
            raise ValueError(f"records_per_part={self.records_per_part}: must be >= 1.")
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size}: must be >= 1.")
        if isinstance(self.decode_workers, bool) or not isinstance(self.decode_workers, int) or self.decode_workers < 0:
            raise ValueError(f"decode_workers={self.decode_workers!r}: the number of decoding processes, >= 0 (0 decodes "
                             "in the encoding process itself).")
        if self.caption_cache_mb < 0:
            raise ValueError(f"caption_cache_mb={self.caption_cache_mb}: must be >= 0 (0 encodes every caption anew).")
        self._check_storage_and_filters()
        self._check_staging()
        self._check_frames()
        if self.fps is not None and not self.fps > 0:
            raise ValueError(f"fps={self.fps}: the rate frames are taken at, > 0 (null: every frame of the video).")
        if self.vae_tile is not None and (self.vae_tile < 1 or self.num_frames is None):
            raise ValueError(f"vae_tile={self.vae_tile}: a video VAE's tile side in pixels (> 0), for clips (num_frames=); "
                             "null: whole frames.")
        if self.buckets is not None and self.width is not None:
            raise ValueError(f"buckets={self.buckets} and width={self.width}: the buckets set every image's size; "
                             "drop width.")

    def _check_frames(self) -> None:
        if self.num_frames is None:
            return
        counts = self.num_frames if isinstance(self.num_frames, (list, tuple)) else [self.num_frames]
        if (not counts or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts)
                or len(set(counts)) != len(counts)):
            raise ValueError(f"num_frames={self.num_frames}: the frames of each clip, >= 1, or a list of different "
                             "counts for frame-count buckets, e.g. num_frames=[9,17,33] (null for images).")
        if isinstance(self.num_frames, (list, tuple)):
            self.num_frames = list(self.num_frames) if len(counts) > 1 else counts[0]

    @property
    def frame_counts(self) -> list[int] | None:
        """The clips' frame counts, shortest first (one without frame-count buckets); None: images."""
        if self.num_frames is None:
            return None
        return sorted(self.num_frames) if isinstance(self.num_frames, list) else [self.num_frames]

    @property
    def clip_frames(self) -> int | None:
        """The frames of the longest clip (of every clip without frame-count buckets); None: images."""
        return None if self.num_frames is None else max(self.frame_counts)

    @property
    def clip_buckets(self) -> bool:
        """Clips in buckets: of several frame counts, or of several sizes (aspect-ratio buckets)."""
        return self.num_frames is not None and (isinstance(self.num_frames, list) or self.buckets is not None)

    def _check_staging(self) -> None:
        from data_prep.location import is_remote, staging_error

        # (other sources refuse a remote source.path themselves: they read local files only)
        source = self.source.path if self.source.name == "webdataset" else None
        remote = [f"{key}={value}" for key, value in (("out", self.out), ("source.path", source)) if is_remote(value)]
        if remote and not self.staging:
            raise ValueError(staging_error(" and ".join(remote)))
        if self.staging and is_remote(self.staging):
            raise ValueError(f"staging={self.staging}: must be a folder on this machine (the files on their way to or "
                             "from the object store are written there).")

    def _check_storage_and_filters(self) -> None:
        if self.text_storage not in TEXT_STORAGES:
            raise ValueError(f"text_storage={self.text_storage!r}: use one of {', '.join(TEXT_STORAGES)}.")
        if self.caption_layout not in CAPTION_LAYOUTS:
            raise ValueError(f"caption_layout={self.caption_layout!r}: use per_caption (a row per caption) or "
                             "per_image (a row per image with all its captions).")
        if self.min_size is not None and self.min_size < 1:
            raise ValueError(f"min_size={self.min_size}: a shorter side in pixels >= 1, or null (no limit).")
        if self.max_aspect is not None and not self.max_aspect >= 1.0:
            raise ValueError(f"max_aspect={self.max_aspect}: longest over shortest side, >= 1 (1: squares only), or "
                             "null (no limit).")
        if self.filters is not None and not isinstance(self.filters, dict):
            raise ValueError(f"filters={self.filters!r}: a mapping {{key: {{min: x, max: y}}}}, e.g. "
                             "filters={punsafe: {max: 0.5}, similarity: {min: 0.28}}.")
        for key, bounds in (self.filters or {}).items():
            if not isinstance(bounds, dict) or not bounds or set(bounds) - {"min", "max"}:
                raise ValueError(f"filters.{key}={bounds!r}: give min and/or max (both inclusive), e.g. "
                                 f"filters={{{key}: {{max: 0.5}}}}.")
            for name, value in bounds.items():
                if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                    raise ValueError(f"filters.{key}.{name}={value!r}: must be a number.")
            if bounds.get("min", -math.inf) > bounds.get("max", math.inf):
                raise ValueError(f"filters.{key}: min={bounds['min']} > max={bounds['max']}; no record could pass.")


def register_configs() -> None:
    """Make `precompute_schema` (primary) and `source/source_schema` available to Hydra."""
    cs = ConfigStore.instance()
    cs.store(name="precompute_schema", node=PrecomputeConfig)
    cs.store(group="source", name="source_schema", node=SourceConfig)
