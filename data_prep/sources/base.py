"""The interface every image-caption source implements, and how a source is found by name."""
from __future__ import annotations

import importlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from data_prep.location import is_remote

# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")


@dataclass
class Record:
    """One source image and the caption rows it becomes (one row per caption)."""

    key: str  # stable id, used in messages about bad input
    image: Any  # bytes (encoded file), a path, or a uint8 ndarray (H, W) / (H, W, C)
    captions: list[str] = field(default_factory=list)  # empty -> "missing caption"
    label: int | None = None  # integer class, for sources that have one
    meta: dict[str, Any] = field(default_factory=dict)  # what the source knows about it (img2dataset's .json)


# ---------------------------------------------------------------------------------------------
# Source base class
# ---------------------------------------------------------------------------------------------


class ImageCaptionSource:
    """A small class per source; data_prep.precompute sees `shards()`, `shard_records()`, `size()` and the metadata.

    The source is read in input shards (a .tar, a range of files or rows): data_prep.precompute deals them out to
    its ranks, so a rank opens only the inputs of its own shards. A source that can build record i on its own
    implements `record(i)` and gets ranges of record indices as its shards; one with shards of its own (tar files)
    overrides `shards` and `shard_records`.
    """

    name: str = ""
    default_image_mode: str = "RGB"  # what the pixel codec keeps when `image_mode` is None
    num_classes: int | None = None  # set by labelled sources; stored in dataset.json
    has_meta: bool = False  # its records carry per-sample metadata (Record.meta) that `filters=` thresholds read
    is_video: bool = False  # its records are videos: precompute needs num_frames and writes clips (C, F, h, w)
    takes_videos: bool = False  # its records may be videos (a manifest's paths, a tar's .mp4): read as clips with num_frames
    # Where remote input shards are downloaded, one at a time: this rank's folder under precompute's `staging`, set by
    # precompute before it asks for the shards (None: no staging given).
    staging: Path | None = None

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    def shards(self, records_per_part: int) -> list[Any]:
        """The input shards in order, each a small JSON-able descriptor that `shard_records` reads: here
        [start, stop) ranges of `records_per_part` record indices."""
        n = self.size()
        if n is None:
            raise NotImplementedError(f"source={self.name}: no size() to cut into ranges; override shards()")
        return [[start, min(start + records_per_part, n)] for start in range(0, n, records_per_part)]

    def shard_records(self, shard: Any) -> Iterator[Record]:
        """The records of one input shard, in the source's order, reading nothing of the other shards."""
        start, stop = shard
        return (self.record(i) for i in range(start, stop))

    @contextmanager
    def local_shard(self, shard: Any) -> Iterator[Any]:
        """`shard` as a descriptor that `shard_records` reads from this machine's files alone, for as long as the
        `with` lasts: precompute's decode workers each read it so, and one download must serve them all. Here the
        shard itself; a source whose shards may be remote (webdataset) fetches it first and deletes it after."""
        yield shard

    def record(self, index: int) -> Record:
        """Record `index` (0 <= index < size()), for the default range shards."""
        raise NotImplementedError(f"source={self.name}: implement record(i) or shards() and shard_records()")

    def records(self) -> Iterator[Record]:
        """Every record, in order: the shards one after the other."""
        for shard in self.shards(records_per_part=max(1, self.size() or 1)):
            yield from self.shard_records(shard)

    def size(self) -> int | None:
        """Number of records when cheap to know (for the progress bar and the range shards), else None."""
        return None

    def metadata(self) -> dict[str, Any]:
        """Extra facts for dataset.json (e.g. class names)."""
        return {}

    def grid_prompts(self) -> list[str] | None:
        """Prompts for training's sample grids, encoded with the dataset; None: the first captions seen."""
        return None


def require_path(cfg: Any, source: str) -> Path:
    """`source.path` as an existing Path, or one clear message."""
    if not cfg.path:
        raise ValueError(f"source={source} needs source.path=... (got nothing).")
    if is_remote(cfg.path):
        raise ValueError(f"source.path={cfg.path}: source={source} reads files on this machine only (source=webdataset "
                         "reads tars from an object store too); copy them here first.")
    path = Path(cfg.path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"source.path={cfg.path} does not exist (source={source}).")
    return path


def get_source(cfg: Any) -> ImageCaptionSource:
    """Import data_prep.sources.<name> and build its `SOURCE` class: a new source is one new file."""
    try:
        module = importlib.import_module(f"data_prep.sources.{cfg.name}")
    except ModuleNotFoundError as err:
        if err.name != f"data_prep.sources.{cfg.name}":
            raise
        raise ValueError(
            f"source={cfg.name}: no such source; add data_prep/sources/{cfg.name}.py or pick one of "
            "digits, digit_pairs, shapes, folder, manifest, webdataset, video_folder."
        ) from None
    return module.SOURCE(cfg)
