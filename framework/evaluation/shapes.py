"""A detector for the synthetic shapes scenes (data_prep/sources/shapes.py): are the blocks a caption names there?

A block counts as found when, in the quarter of the image at the end its caption names (left / right quarter of
the width, top / bottom quarter of the height), at least half a block's pixels lie within `TOLERANCE` of its colour
(RGB distance). Written for these scenes only: flat colours on a dark, slightly noisy background.
"""
from __future__ import annotations

import re

import torch

from data_prep.sources.shapes import BLOCK, COLOURS, LAYOUTS, Scene

TOLERANCE = 70.0  # RGB distance from a block's colour
_CAPTION = re.compile(r"a (\w+) scene with a (\w+) block at the (\w+) and a (\w+) block at the (\w+)")


def parse_scene(caption: str) -> Scene:
    m = _CAPTION.fullmatch(caption.strip())
    if m is None or m.group(1) not in LAYOUTS or m.group(2) not in COLOURS or m.group(4) not in COLOURS:
        raise ValueError(f"not a shapes caption: {caption!r}")
    return Scene(m.group(1), (m.group(2), m.group(4)))


def found_blocks(image: torch.Tensor, scene: Scene) -> list[bool]:
    """For each of the scene's two blocks: whether `image` ((3, H, W) in [-1, 1], any size) shows it at its end."""
    rgb = (image.float().clamp(-1, 1) + 1) * 127.5  # (3, H, W)
    _, H, W = rgb.shape
    regions = {"left": (slice(None), slice(0, W // 4)), "right": (slice(None), slice(W - W // 4, W)),
               "top": (slice(0, H // 4), slice(None)), "bottom": (slice(H - H // 4, H), slice(None))}
    out = []
    for colour, end in zip(scene.colours, scene.ends):
        ys, xs = regions[end]
        patch = rgb[:, ys, xs]  # (3, h, w)
        ref = torch.tensor(COLOURS[colour], dtype=patch.dtype).view(3, 1, 1)
        near = ((patch - ref).norm(dim=0) < TOLERANCE).sum()
        out.append(bool(near >= BLOCK * BLOCK // 2))
    return out
