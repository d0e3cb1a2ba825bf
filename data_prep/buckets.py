"""Aspect-ratio buckets: the (height, width) image sizes a multi-aspect dataset is encoded at.

Each image goes to the bucket whose aspect ratio is nearest its own (on a log scale, so 1:2 and 2:1 are as far
from 1:1), the pixel count breaking ties; it is resized to cover the bucket and centre-cropped to it. Presets:
  pixart_256 / pixart_512 / pixart_1024  PixArt-alpha's aspect-ratio bins (as diffusers' PixArt pipeline ships
                                         them): 33 sizes at about 256^2 / 512^2 / 1024^2 pixels, ratios 1:4 to 4:1
  sdxl                                   SDXL's scheme: sides in steps of 64, 90-100% of 1024^2 pixels, ratios 1:4 to 4:1
or a list of [height, width] pairs. The buckets' latents are stored in one MDS folder per bucket
(`bucket_<h>x<w>/`), so training reads them with Streaming's per-stream batching: every global batch from one bucket.

Clips are bucketed by frame count as well (precompute's num_frames=[9,17,33]): a clip bucket is (frames, height,
width), every count with every size, stored in `bucket_<frames>f_<h>x<w>/`. A clip goes to the longest count it has
frames for, then to the size nearest its aspect ratio.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

PRESETS = ("pixart_256", "pixart_512", "pixart_1024", "sdxl")


def sdxl_sizes(area: int = 1024 * 1024, step: int = 64, max_ratio: float = 4.0, band: float = 0.9) -> list[tuple[int, int]]:
    """SDXL's bucket sizes: both sides multiples of `step`, the area between band * `area` and `area`, ratios within
    1:max_ratio .. max_ratio:1 (this gives the sizes of SDXL's table, e.g. 1024x1024, 832x1216, 768x1344)."""
    top = int(math.sqrt(area * max_ratio)) // step * step
    sizes = [(h, w) for h in range(step, top + step, step) for w in range(step, top + step, step)
             if band * area <= h * w <= area and 1 / max_ratio <= h / w <= max_ratio]
    return sorted(sizes, key=lambda s: (s[0] / s[1], s[0] * s[1]))


def preset_sizes(name: str) -> list[tuple[int, int]]:
    if name == "sdxl":
        return sdxl_sizes()
    from diffusers.pipelines.pixart_alpha.pipeline_pixart_alpha import (ASPECT_RATIO_256_BIN, ASPECT_RATIO_512_BIN,
                                                                        ASPECT_RATIO_1024_BIN)

    table = {"pixart_256": ASPECT_RATIO_256_BIN, "pixart_512": ASPECT_RATIO_512_BIN, "pixart_1024": ASPECT_RATIO_1024_BIN}
    return [(int(h), int(w)) for h, w in table[name].values()]


def resolve_buckets(spec: Any, multiple: int) -> list[tuple[int, int]]:
    """The bucket sizes of `buckets=` (a preset name or [[h, w], ...]), deduplicated and sorted by aspect ratio;
    every side must be a multiple of `multiple` (the VAE's downsampling times the patch size)."""
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ValueError(f"buckets={spec}: use one of {', '.join(PRESETS)} or a list of [height, width] pairs")
        sizes = preset_sizes(spec)
    else:
        try:
            sizes = [(int(h), int(w)) for h, w in spec]
        except (TypeError, ValueError):
            raise ValueError(f"buckets={spec}: use one of {', '.join(PRESETS)} or a list of [height, width] "
                             "pairs, e.g. buckets=[[256,256],[192,320],[320,192]]") from None
        if not sizes:
            raise ValueError("buckets=[]: give at least one [height, width]")
    bad = [s for s in sizes if s[0] < 1 or s[1] < 1 or s[0] % multiple or s[1] % multiple]
    if bad:
        raise ValueError(f"buckets: {bad} are not positive multiples of {multiple} (the VAE's downsampling x 2, so "
                         "every latent side splits into 2x2 patches)")
    return sorted(set(sizes), key=lambda s: (s[0] / s[1], s[0] * s[1]))


def nearest_bucket(height: int, width: int, sizes: Sequence[tuple[int, int]]) -> int:
    """Index of the bucket nearest the image's aspect ratio (log scale), then its pixel count."""
    ratio, area = math.log(height / width), math.log(height * width)
    return min(range(len(sizes)), key=lambda i: (round(abs(math.log(sizes[i][0] / sizes[i][1]) - ratio), 9),
                                                 abs(math.log(sizes[i][0] * sizes[i][1]) - area)))


def clip_buckets(frame_counts: Sequence[int], sizes: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """The (frames, height, width) buckets of clips: every frame count with every size."""
    return [(int(f), h, w) for f in sorted(frame_counts) for h, w in sizes]


def nearest_clip_bucket(frames: int, height: int, width: int, buckets: Sequence[tuple[int, int, int]]) -> int:
    """Index of the clip bucket of the longest frame count at most `frames` (the clip has at least the shortest), and
    of the size nearest the clip's aspect ratio among that count's."""
    count = max(f for f, _, _ in buckets if f <= frames)
    sizes = [(h, w) for f, h, w in buckets if f == count]
    return list(buckets).index((count, *sizes[nearest_bucket(height, width, sizes)]))


def bucket_name(row: dict) -> str:
    """A bucket of dataset.json's `buckets` as messages name it: "256x384", or a clip bucket's "17 frames 256x384"."""
    return (f"{row['frames']} frames " if "frames" in row else "") + f"{row['size'][0]}x{row['size'][1]}"


def bucket_dir(size: Sequence[int]) -> str:
    """The MDS folder of a bucket, inside the dataset folder: (h, w) of images, (frames, h, w) of clips."""
    *frames, h, w = (int(v) for v in size)
    return f"bucket_{frames[0]}f_{h}x{w}" if frames else f"bucket_{h}x{w}"
