"""A folder of images with same-named .txt captions (`cat.png` + `cat.txt`), searched recursively.

Its input shards are ranges of the sorted file list (`records_per_part` files each).
"""
from __future__ import annotations

from pathlib import Path

from data_prep.sources.base import IMAGE_EXTENSIONS, ImageCaptionSource, Record, require_path


def read_caption(path: Path) -> list[str]:
    """The caption file's text, or [] when it is missing or blank (counted as a missing caption)."""
    if not path.is_file():
        return []
    text = path.read_text(encoding="utf-8", errors="replace").strip()
    return [text] if text else []


class FolderSource(ImageCaptionSource):
    name = "folder"
    extensions, kind = IMAGE_EXTENSIONS, "images"  # the files it reads

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.root = require_path(cfg, self.name)
        pattern = "**/*" if cfg.recursive else "*"
        self.files = sorted(p for p in self.root.glob(pattern) if p.suffix.lower() in self.extensions)
        if not self.files:
            raise ValueError(f"source.path={self.root}: no {self.kind} ({', '.join(self.extensions)}) found.")

    def record(self, index: int) -> Record:
        # __init__ listed file names only: file `index`'s caption (and, in precompute, its image) is read here, by the
        # rank whose input shard holds it.
        f = self.files[index]
        return Record(key=str(f.relative_to(self.root)), image=f, captions=read_caption(f.with_suffix(".txt")))

    def size(self) -> int | None:
        return len(self.files)


SOURCE = FolderSource
