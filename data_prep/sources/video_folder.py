"""A folder of videos (mp4, webm, mkv, mov, avi, gif) with same-named .txt captions (`walk.mp4` + `walk.txt`), searched
recursively; precompute turns each into a clip of `num_frames` frames at `fps` (data_prep/video.py).

Its input shards are ranges of the sorted file list (`records_per_part` files each), as source=folder's.
"""
from __future__ import annotations

from data_prep.sources.folder import FolderSource
from data_prep.video import VIDEO_EXTENSIONS


class VideoFolderSource(FolderSource):
    name = "video_folder"
    is_video = True
    extensions, kind = VIDEO_EXTENSIONS, "videos"


SOURCE = VideoFolderSource
