"""Synthetic mixed-aspect scenes for the aspect-ratio bucket demonstration (`python -m framework.bench buckets`).

Each scene is a landscape (16x32), portrait (32x16) or square (24x24) canvas with two coloured 4x4 blocks, one near
each end of its long side (within `EDGE` pixels of the border; left / right on a square). The caption names the
layout, the colours and where they are ("a wide scene with a red block at the left and a blue block at the right"),
so a square centre crop of a landscape or portrait scene cuts away exactly what its caption describes, which a
model trained on buckets keeps. `framework/evaluation/shapes.py` finds the blocks again in generated images.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from data_prep.sources.base import ImageCaptionSource, Record

SHAPES_SEED = 2407  # scene i is drawn from seed SHAPES_SEED + i; held-out scenes start at HELDOUT_OFFSET
HELDOUT_OFFSET = 1_000_000
LAYOUTS = {"wide": (16, 32), "tall": (32, 16), "square": (24, 24)}  # (h, w)
COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (50, 80, 230), "yellow": (230, 210, 40)}
BLOCK, EDGE = 4, 2  # block side; its outer edge lies within EDGE pixels of the border
BACKGROUND = 60


@dataclass(frozen=True)
class Scene:
    layout: str
    colours: tuple[str, str]  # first: left (wide, square) or top (tall); second: right or bottom

    @property
    def ends(self) -> tuple[str, str]:
        return ("top", "bottom") if self.layout == "tall" else ("left", "right")

    @property
    def caption(self) -> str:
        (c1, c2), (e1, e2) = self.colours, self.ends
        return f"a {self.layout} scene with a {c1} block at the {e1} and a {c2} block at the {e2}"


def draw_scene(index: int) -> tuple[Scene, np.ndarray]:
    """Scene `index` (deterministic) and its (h, w, 3) uint8 image."""
    rng = np.random.default_rng(SHAPES_SEED + index)
    layout = ["wide", "tall", "square"][index % 3]
    c1, c2 = rng.choice(list(COLOURS), 2, replace=False)
    h, w = LAYOUTS[layout]
    img = np.clip(BACKGROUND + rng.normal(0, 6, (h, w, 3)), 0, 255)
    long_side = w if layout != "tall" else h
    cross = (h if layout != "tall" else w) - BLOCK
    for colour, at_start in ((c1, True), (c2, False)):
        along = rng.integers(0, EDGE + 1)  # distance of the block from its border
        along = along if at_start else long_side - BLOCK - along
        across = rng.integers(0, cross + 1)
        y, x = (across, along) if layout != "tall" else (along, across)
        img[y : y + BLOCK, x : x + BLOCK] = COLOURS[colour]
    return Scene(layout, (str(c1), str(c2))), img.astype(np.uint8)


class ShapesSource(ImageCaptionSource):
    """`source.scenes` scenes (a third each wide, tall and square); `source.split=heldout` draws other ones."""

    name = "shapes"
    default_image_mode = "RGB"

    def size(self) -> int:
        return self.cfg.scenes

    def record(self, index: int) -> Record:
        index += HELDOUT_OFFSET if self.cfg.split == "heldout" else 0
        scene, img = draw_scene(index)
        return Record(key=f"scene{index:07d}", image=img, captions=[scene.caption])

    def grid_prompts(self) -> list[str]:
        return [draw_scene(HELDOUT_OFFSET + i)[0].caption for i in range(6)]


SOURCE = ShapesSource
