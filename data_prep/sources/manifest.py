"""A parquet or jsonl manifest: one row per image with a local path and a caption (optional label); or one row per video,
read as a clip with precompute's num_frames.

The caption column may hold a list of captions per image (COCO's five: `"caption": ["a dog", "a brown dog"]`, or a
parquet list column): each becomes a row with caption_layout=per_caption, or all of them one row with per_image.

Relative image paths are resolved against the manifest's own directory. Its input shards are ranges of
`records_per_part` rows.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Iterator

import numpy as np
import pandas as pd

from data_prep.sources.base import ImageCaptionSource, Record, require_path


def _clean_caption(value) -> list[str]:
    """The non-blank captions of a cell: one string, or a list of them (a parquet list column comes as an array)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return []
    if isinstance(value, (list, tuple, np.ndarray)):
        return [c for v in value for c in _clean_caption(v)]
    text = str(value).strip()
    return [text] if text else []


class ManifestSource(ImageCaptionSource):
    name = "manifest"
    takes_videos = True

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        path = require_path(cfg, "manifest")
        if path.suffix == ".parquet":
            try:
                self.table = pd.read_parquet(path)
            except ImportError as err:
                raise ImportError(f"source.path={path}: reading parquet needs pyarrow ({err}); "
                                  "pip install pyarrow, or use a .jsonl manifest.") from None
        elif path.suffix in (".jsonl", ".json"):
            self.table = pd.read_json(path, lines=path.suffix == ".jsonl")
        else:
            raise ValueError(f"source.path={path}: a manifest must be .parquet or .jsonl")
        for key in (cfg.image_key, cfg.caption_key or cfg.image_key):
            if key not in self.table.columns:
                raise ValueError(
                    f"source.path={path}: no column {key!r} (columns: {list(self.table.columns)}); "
                    "set source.image_key / source.caption_key."
                )
        self.base = path.parent
        has_labels = bool(cfg.label_key) and cfg.label_key in self.table.columns
        self.label_key = cfg.label_key if has_labels else None
        if self.label_key:
            self.num_classes = int(self.table[self.label_key].max()) + 1
        elif not cfg.caption_key:
            raise ValueError(f"source.path={path}: source.caption_key=null needs class labels, and the manifest has no "
                             f"column {cfg.label_key!r} (source.label_key)")

    def shard_records(self, shard: list[int]) -> Iterator[Record]:
        start, stop = shard
        for i, row in enumerate(self.table.iloc[start:stop].itertuples(index=False), start):
            row = row._asdict()
            image = Path(str(row[self.cfg.image_key])).expanduser()
            image = image if image.is_absolute() else self.base / image
            label = int(row[self.label_key]) if self.label_key else None
            captions = _clean_caption(row[self.cfg.caption_key]) if self.cfg.caption_key else [f"class {label}"]
            yield Record(key=f"{i}:{image.name}", image=image, captions=captions, label=label)

    def size(self) -> int | None:
        return len(self.table)


SOURCE = ManifestSource
