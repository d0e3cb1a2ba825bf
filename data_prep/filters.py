"""Records dropped before encoding: by the original image's size and shape, and by the numbers in img2dataset's
per-sample .json (punsafe, similarity, aesthetic scores, ...).

A dropped record is counted once, under the first filter it fails, in this order: each `filters` key in the order
given (`<key>.missing`, `<key>.min`, `<key>.max`), then `min_size`, then `max_aspect`. The size and shape are the
original image's: img2dataset's `original_width` / `original_height` when the .json has them (it resized the image it
stored), else the decoded image's, checked once it is decoded. A record whose .json lacks a key a threshold names, or
holds null or a non-number there, is dropped: a threshold is a requirement, and an unknown value does not meet it
(`<key>.missing` says how many, so a misspelled key shows at once).
"""
from __future__ import annotations

import math
from typing import Any, Optional

ORIGINAL_SIZE_KEYS = ("original_height", "original_width")  # img2dataset's, before its own resize


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return float(value)


class RecordFilter:
    """The precompute config's min_size, max_aspect and filters; each check returns the failed filter's name or None."""

    def __init__(self, min_size: Optional[int] = None, max_aspect: Optional[float] = None,
                 thresholds: Optional[dict[str, dict[str, float]]] = None, val_fraction: float = 0.0,
                 split: str = "all") -> None:
        self.min_size, self.max_aspect = min_size, max_aspect
        self.thresholds = dict(thresholds or {})
        self.val_fraction, self.split = val_fraction, split

    @classmethod
    def from_config(cls, cfg: Any) -> "RecordFilter":
        return cls(cfg.min_size, cfg.max_aspect, cfg.filters, cfg.val_fraction, cfg.split)

    def names(self) -> list[str]:
        """Every counter, in the order the checks run (dataset.json lists them all, zeros included)."""
        names = ["other_split"] if self.split != "all" else []
        names += [f"{key}.{n}" for key, bounds in self.thresholds.items() for n in ("missing", *bounds)]
        return names + [n for n, v in (("min_size", self.min_size), ("max_aspect", self.max_aspect)) if v is not None]

    def check_split(self, key: str) -> Optional[str]:
        """First: a record of the other split of val_fraction (counted as other_split)."""
        if self.split == "all":
            return None
        return None if (in_val(key, self.val_fraction) == (self.split == "val")) else "other_split"

    def check_meta(self, meta: dict) -> Optional[str]:
        """Before decoding: the thresholds, and the size and shape when the .json gives the original size."""
        for key, bounds in self.thresholds.items():
            value = _number(meta.get(key))
            if value is None:
                return f"{key}.missing"
            if "min" in bounds and value < bounds["min"]:
                return f"{key}.min"
            if "max" in bounds and value > bounds["max"]:
                return f"{key}.max"
        original = original_size(meta)
        return None if original is None else self.check_size(*original)

    def check_decoded(self, meta: dict, height: int, width: int) -> Optional[str]:
        """Once decoded: the size and shape, unless the .json gave the original size (checked already)."""
        return None if original_size(meta) is not None else self.check_size(height, width)

    def check_size(self, height: float, width: float) -> Optional[str]:
        short, long = min(height, width), max(height, width)
        if self.min_size is not None and short < self.min_size:
            return "min_size"
        if self.max_aspect is not None and long > self.max_aspect * short:
            return "max_aspect"
        return None


def in_val(key: str, fraction: float) -> bool:
    """Whether the record `key` belongs to the held-out split of `fraction`: its key's CRC-32 in the lowest `fraction` of
    the range, so the split follows the keys alone."""
    import zlib

    return zlib.crc32(key.encode()) < fraction * 2**32


def check_source(cfg: Any, source: Any) -> None:
    """Refuse thresholds on a source whose records carry no metadata (every record would be dropped as missing), and
    a frame count the source cannot give (clips of an image source) or a video source without one."""
    if source.is_video and cfg.num_frames is None:
        raise ValueError(f"source={source.name} reads videos: give the frames of each clip, num_frames=F (and fps=R for "
                         "the rate they are taken at; null: every frame).")
    if cfg.num_frames is not None and not (source.is_video or source.takes_videos):
        raise ValueError(f"num_frames={cfg.num_frames}: source={source.name} holds images, not videos; drop num_frames "
                         "(or read videos with source=video_folder, manifest or webdataset).")
    if cfg.filters and not source.has_meta:
        raise ValueError(f"filters={cfg.filters} reads each sample's img2dataset .json, which source={source.name} "
                         "does not have (source=webdataset does); drop filters. min_size and max_aspect work with any "
                         "source.")


def original_size(meta: dict) -> Optional[tuple[float, float]]:
    """(height, width) of the image before img2dataset resized it, when its .json says (positive numbers)."""
    h, w = (_number(meta.get(k)) for k in ORIGINAL_SIZE_KEYS)
    return (h, w) if h and w and h > 0 and w > 0 else None
