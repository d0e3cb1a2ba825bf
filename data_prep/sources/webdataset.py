"""WebDataset tar shards of image + .txt pairs, as img2dataset writes them (00000.tar: 000000001.jpg,
000000001.txt, 000000001.json, ...). Read with the standard library; no network.

`source.path` is one .tar file or a folder searched recursively for *.tar; each .tar is one input shard. Each
sample's .json (img2dataset's: width, height, original_width, original_height, punsafe, similarity, status, ...)
becomes the record's `meta`, which precompute's filters read (data_prep/filters.py); a missing or unparsable .json
gives an empty one.
"""
from __future__ import annotations

import json
import tarfile
from pathlib import Path
from typing import Iterator

from data_prep.sources.base import IMAGE_EXTENSIONS, ImageCaptionSource, Record, require_path


def _split_member(name: str) -> tuple[str, str]:
    """'dir/000001.jpg' -> ('dir/000001', 'jpg'); webdataset keys end at the first dot of the basename."""
    head, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{head}/{stem}" if head else stem), ext.lower()


def _meta(raw: bytes | None) -> dict:
    try:
        meta = json.loads(raw) if raw else {}
    except ValueError:  # UnicodeDecodeError included
        return {}
    return meta if isinstance(meta, dict) else {}


class WebDatasetSource(ImageCaptionSource):
    name = "webdataset"
    has_meta = True

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.root = require_path(cfg, "webdataset")
        self.tars = [self.root] if self.root.is_file() else sorted(self.root.rglob("*.tar"))
        if not self.tars:
            raise ValueError(f"source.path={self.root}: no .tar shards found.")

    def _samples(self, tar_path: Path) -> Iterator[Record]:
        group: dict[str, bytes] = {}
        current = None
        try:
            tar = tarfile.open(tar_path)
        except tarfile.TarError as err:
            raise ValueError(f"{tar_path}: not a readable tar file ({err}).") from None
        with tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, ext = _split_member(member.name)
                if key != current and current is not None:
                    yield self._record(tar_path, current, group)
                    group = {}
                current = key
                group[ext] = tar.extractfile(member).read()
        if current is not None:
            yield self._record(tar_path, current, group)

    @staticmethod
    def _record(tar_path: Path, key: str, group: dict[str, bytes]) -> Record:
        image = next((group[e] for e in group if f".{e}" in IMAGE_EXTENSIONS), None)
        text = group.get("txt", b"").decode("utf-8", errors="replace").strip()
        return Record(key=f"{tar_path.name}:{key}", image=image, captions=[text] if text else [],
                      meta=_meta(group.get("json")))

    def shards(self, records_per_part: int) -> list[str]:
        """One input shard per .tar (records_per_part does not apply), named relative to source.path so that a
        moved dataset resumes."""
        return [tar.name if tar == self.root else str(tar.relative_to(self.root)) for tar in self.tars]

    def shard_records(self, shard: str) -> Iterator[Record]:
        return self._samples(self.root if self.root.is_file() else self.root / shard)


SOURCE = WebDatasetSource
