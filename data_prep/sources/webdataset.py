"""WebDataset tar shards of image + .txt pairs, as img2dataset writes them (00000.tar: 000000001.jpg,
000000001.txt, 000000001.json, ...), or of video + .txt pairs (000000001.mp4, as video2dataset writes them), read as
clips with precompute's num_frames. Read with the standard library.

`source.path` is one .tar file, a folder searched recursively for *.tar, or a brace pattern as img2dataset and
webdataset write them (/data/{00000..00099}.tar, expanded by the `braceexpand` package webdataset uses); each .tar is
one input shard. Any of these may be on an object store instead (s3://bucket/tars/{00000..00099}.tar, s3://bucket/tars
for every .tar under that prefix): a rank lists the store once, then downloads the tars of its own parts only, one at
a time into precompute's staging folder, each deleted once read (data_prep/location.py does the transfers).

Each sample's .json (img2dataset's: width, height, original_width, original_height, punsafe, similarity, status, ...)
becomes the record's `meta`, which precompute's filters read (data_prep/filters.py); a missing or unparsable .json
gives an empty one.
"""
from __future__ import annotations

import json
import os
import posixpath
import tarfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from data_prep.location import RemoteLocation, common_folder, is_remote, staging_error
from data_prep.sources.base import IMAGE_EXTENSIONS, ImageCaptionSource, Record, require_path
from data_prep.video import VIDEO_EXTENSIONS


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
    takes_videos = True

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.root: Path | None = None  # the local folder holding every tar,
        self.store: RemoteLocation | None = None  # or the store's (listed at shards(), once precompute set `staging`)
        self.names: list[str] | None = None  # the tars' names relative to that folder
        if not is_remote(cfg.path):
            self.root, self.names = self._local_tars()

    def _local_tars(self) -> tuple[Path, list[str]]:
        if self.cfg.path and "{" in self.cfg.path:
            from braceexpand import braceexpand

            tars = [Path(p).expanduser() for p in braceexpand(self.cfg.path)]
            missing = [str(t) for t in tars if not t.is_file()]
            if missing:
                raise FileNotFoundError(f"source.path={self.cfg.path}: {len(missing)} of the pattern's {len(tars)} tars "
                                        f"do not exist, e.g. {missing[:3]}.")
            root = Path(os.path.commonpath([t.parent for t in tars]))
            return root, [str(t.relative_to(root)) for t in tars]
        root = require_path(self.cfg, "webdataset")
        if root.is_file():
            return root.parent, [root.name]
        tars = sorted(root.rglob("*.tar"))
        if not tars:
            raise ValueError(f"source.path={root}: no .tar shards found.")
        return root, [str(t.relative_to(root)) for t in tars]

    def _remote_tars(self) -> tuple[RemoteLocation, list[str]]:
        """The store's folder holding every tar, and the tars' names in it: one listing, no tar read."""
        path = self.cfg.path.rstrip("/")
        if self.staging is None:
            raise ValueError(staging_error(f"source.path={path}"))
        if "{" in path:
            from braceexpand import braceexpand

            urls = list(braceexpand(path))
        else:
            urls = [path] if path.endswith(".tar") else None
        root = common_folder(urls) if urls else path
        store = RemoteLocation(root, self.staging, key="source.path")
        present = store.names()
        if urls is None:
            names = [n for n in present if n.endswith(".tar")]
            if not names:
                raise ValueError(f"source.path={path}: no .tar objects under this prefix.")
            return store, names
        names = [u[len(root) + 1:] for u in urls]
        missing = sorted(set(names) - set(present))
        if missing:
            raise FileNotFoundError(f"source.path={path}: {len(missing)} of {len(names)} tars are not in the store, "
                                    f"e.g. {[posixpath.join(root, n) for n in missing[:3]]}.")
        return store, names

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
        image = next((group[e] for e in group if f".{e}" in IMAGE_EXTENSIONS + VIDEO_EXTENSIONS), None)
        text = group.get("txt", b"").decode("utf-8", errors="replace").strip()
        return Record(key=f"{tar_path.name}:{key}", image=image, captions=[text] if text else [],
                      meta=_meta(group.get("json")))

    def shards(self, records_per_part: int) -> list[str]:
        """One input shard per .tar (records_per_part does not apply), named relative to the folder holding them all
        (source.path, or a pattern's or a single tar's folder) so that a moved dataset resumes."""
        if self.names is None:
            self.store, self.names = self._remote_tars()
        return list(self.names)

    def shard_records(self, shard: str | Path) -> Iterator[Record]:
        if isinstance(shard, Path):  # a tar local_shard downloaded
            return self._samples(shard)
        return self._samples(self.root / shard) if self.root is not None else self._downloaded(shard)

    def _downloaded(self, shard: str) -> Iterator[Record]:
        """The records of the remote tar `shard`, downloaded into staging and deleted once read (or abandoned)."""
        with self.local_shard(shard) as local:
            yield from self._samples(local)

    @contextmanager
    def local_shard(self, shard: str) -> Iterator[str | Path]:
        """A local tar's name as it is; a remote one downloaded into staging (its Path), deleted when the `with`
        ends: precompute's decode workers then each read the one copy."""
        if self.root is not None:
            yield shard
            return
        if self.store is None:
            self.shards(1)
        local = self.store.fetch(shard)
        try:
            yield local
        finally:
            local.unlink(missing_ok=True)


SOURCE = WebDatasetSource
