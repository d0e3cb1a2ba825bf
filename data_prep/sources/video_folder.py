"""A folder of videos (mp4, webm, mkv, mov, avi, gif) with same-named .txt captions (`walk.mp4` + `walk.txt`), searched
recursively; precompute turns each into a clip of `num_frames` frames at `fps` (data_prep/video.py).

Its input shards are ranges of the sorted file list (`records_per_part` files each).
"""
from __future__ import annotations

from data_prep.sources.base import ImageCaptionSource, Record, require_path
from data_prep.sources.folder import read_caption
from data_prep.video import VIDEO_EXTENSIONS


class VideoFolderSource(ImageCaptionSource):
    name = "video_folder"
    is_video = True

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.root = require_path(cfg, "video_folder")
        pattern = "**/*" if cfg.recursive else "*"
        self.files = sorted(p for p in self.root.glob(pattern) if p.suffix.lower() in VIDEO_EXTENSIONS)
        if not self.files:
            raise ValueError(f"source.path={self.root}: no videos ({', '.join(VIDEO_EXTENSIONS)}) found.")

    def record(self, index: int) -> Record:
        f = self.files[index]  # read by the rank whose input shard holds it, the video in its decoding process
        return Record(key=str(f.relative_to(self.root)), image=f, captions=read_caption(f.with_suffix(".txt")))

    def size(self) -> int | None:
        return len(self.files)


SOURCE = VideoFolderSource
