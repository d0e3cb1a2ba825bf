"""Reading video clips with PyAV (the `av` package, `pip install -e '.[video]'`): a clip of `num_frames` frames taken
`fps` times a second from the start of a file, for data_prep.precompute's decoding processes."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from PIL import Image

VIDEO_EXTENSIONS = (".mp4", ".webm", ".mkv", ".mov", ".avi", ".gif")


class ShortVideo(ValueError):
    """The file holds fewer frames than a clip needs at the asked rate."""


def frame_stride(source_fps: float | None, fps: float | None) -> int:
    """Every how many source frames one is kept: the source's rate over the asked one, rounded (at least 1: frames are
    never repeated); 1 when either rate is unknown or none is asked."""
    if not fps or not source_fps:
        return 1
    return max(1, round(source_fps / fps))


def read_clip(video: Any, num_frames: int, fps: float | None = None, mode: str = "RGB",
              min_frames: int | None = None) -> list[Image.Image]:
    """The first `num_frames` frames of `video` (a path or the file's bytes) at `fps` (null: every frame), as PIL
    images in `mode`; with `min_frames`, as many as the file has up to `num_frames`, at least `min_frames` (frame-count
    buckets). Raises ShortVideo when the file ends first, and PyAV's error when it cannot be decoded.
    A uint8 array (F, H, W) or (F, H, W, C) is a clip already decoded (a generated source's): it has no rate of its
    own, so its frames are taken one after another."""
    import av
    import numpy as np

    least = num_frames if min_frames is None else min_frames
    if isinstance(video, np.ndarray):
        if len(video) < least:
            raise ShortVideo(f"{len(video)} frames, fewer than num_frames={least}")
        return [Image.fromarray(frame).convert(mode) for frame in video[:num_frames]]

    with av.open(str(video) if isinstance(video, (str, Path)) else io.BytesIO(video)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        rate = stream.average_rate or stream.guessed_rate
        stride = frame_stride(float(rate) if rate else None, fps)
        frames: list[Image.Image] = []
        for i, frame in enumerate(container.decode(stream)):
            if i % stride == 0:
                frames.append(frame.to_image().convert(mode))
                if len(frames) == num_frames:
                    return frames
    if len(frames) >= least:
        return frames
    raise ShortVideo(f"{len(frames)} frames at every {stride}th source frame, fewer than num_frames={least}")
