"""Moving digits: each real handwritten digit (the fixed digits split) drifting across a 16x16 canvas, one clip per
digit and direction, captioned with the digit and where it goes ("a 3 drifting to the left").

A clip is FRAMES frames; the 8x8 digit moves one pixel a frame (SPEED) along its direction, from near the side it moves
away from, along a path through the canvas' middle give or take ACROSS_JITTER pixels (drawn per clip, seeded by its
index): a free start anywhere on the canvas made the motion much slower to learn. Phrasings
rotate over a clip's rows as the digits' do; the evaluation-only phrasings (`heldout_motion_captions`) never enter a
dataset. The clip is a uint8 array (FRAMES, 16, 16): precompute takes its first `num_frames` frames.
"""
from __future__ import annotations

import numpy as np

from data_prep.sources.base import ImageCaptionSource, Record
from data_prep.sources.digits import DIGIT_WORDS, load_digits, to_pixels

CANVAS = 16  # pixels per side
FRAMES = 8  # frames of a clip
SPEED = 1  # pixels a frame
DIRECTIONS = ("left", "right", "up", "down")
_STEP = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}  # (rows, columns) a frame
_WAY = {"left": "to the left", "right": "to the right", "up": "upwards", "down": "downwards"}
MOTION_SEED = 2024  # fixed: where each clip starts
ACROSS_JITTER = 0  # pixels a clip's path may lie off the canvas' middle line

_PHRASINGS = [
    "{a} {d} drifting {way}",
    "the digit {w} moving {dir}",
    "a handwritten {d} sliding {way}",
    "{a} {w} travelling {dir}",
]
_HELDOUT_PHRASINGS = [
    "{a} {d} that glides {way}",
    "the number {w} heading {dir}",
]


def _fill(template: str, digit: int, direction: str) -> str:
    return template.format(d=digit, w=DIGIT_WORDS[digit], a="an" if digit == 8 else "a", dir=direction,
                           way=_WAY[direction])


def motion_captions(digit: int, direction: str) -> list[str]:
    """Every training phrasing of `digit` (0..9) moving `direction` (one of DIRECTIONS)."""
    _check(digit, direction)
    return [_fill(p, digit, direction) for p in _PHRASINGS]


def heldout_motion_captions(digit: int, direction: str) -> list[str]:
    """The evaluation-only phrasings (never written into a training dataset)."""
    _check(digit, direction)
    return [_fill(p, digit, direction) for p in _HELDOUT_PHRASINGS]


def _check(digit: int, direction: str) -> None:
    if not 0 <= digit <= 9 or direction not in DIRECTIONS:
        raise ValueError(f"digit must be in 0..9 and direction one of {DIRECTIONS}, got {digit}, {direction!r}")


def moving_clip(digit: np.ndarray, direction: str, start: tuple[int, int]) -> np.ndarray:
    """uint8 (FRAMES, CANVAS, CANVAS): the 8x8 `digit` (pixels 0..255) with its top-left corner at `start` (row,
    column) in frame 0, moving SPEED pixels a frame towards `direction`."""
    h, w = digit.shape
    dr, dc = _STEP[direction]
    clip = np.zeros((FRAMES, CANVAS, CANVAS), dtype=np.uint8)
    for f in range(FRAMES):
        r, c = start[0] + dr * SPEED * f, start[1] + dc * SPEED * f
        if not (0 <= r <= CANVAS - h and 0 <= c <= CANVAS - w):
            raise ValueError(f"the digit leaves the canvas at frame {f} (corner {r}, {c})")
        clip[f, r : r + h, c : c + w] = digit
    return clip


def clip_start(index: int, direction: str, size: int = 8) -> tuple[int, int]:
    """Frame 0's top-left corner of clip `index`: drawn (seeded by the index) so that the digit of side `size` stays
    whole through the clip's travel along `direction`, within ACROSS_JITTER pixels of the middle across it."""
    g = np.random.default_rng([MOTION_SEED, index])
    room, travel = CANVAS - size, SPEED * (FRAMES - 1)
    along = int(g.integers(0, room - travel + 1))  # the start's distance from the side it moves away from
    across = room // 2 + int(g.integers(-ACROSS_JITTER, ACROSS_JITTER + 1))
    dr, dc = _STEP[direction]
    if dc:  # horizontal: moving left starts near the right side
        return across, along + travel if dc < 0 else along
    return (along + travel if dr < 0 else along), across


class MovingDigitsSource(ImageCaptionSource):
    """Clip i: training digit i // 4 moving DIRECTIONS[i % 4], `rows_per_image` rows rotating the phrasings."""

    name = "moving_digits"
    default_image_mode = "L"
    is_video = True
    num_classes = 10

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.images, self.labels = load_digits(cfg.split)

    def record(self, index: int) -> Record:
        i, direction = divmod(index, len(DIRECTIONS))
        direction = DIRECTIONS[direction]
        label, k = int(self.labels[i]), max(1, int(self.cfg.rows_per_image))
        phrasings = motion_captions(label, direction)
        captions = [phrasings[(index * k + j) % len(phrasings)] for j in range(k)]
        clip = moving_clip(to_pixels(self.images[i]), direction, clip_start(index, direction))
        return Record(key=f"moving-digits-{self.cfg.split}-{index:05d}", image=clip, captions=captions, label=label,
                      meta={"direction": direction})

    def size(self) -> int | None:
        return len(self.images) * len(DIRECTIONS)

    def metadata(self) -> dict:
        return {"class_names": DIGIT_WORDS, "directions": list(DIRECTIONS), "split": self.cfg.split,
                "rows_per_image": self.cfg.rows_per_image, "canvas": CANVAS, "frames": FRAMES, "speed": SPEED}

    def grid_prompts(self) -> list[str]:
        return [_fill(_PHRASINGS[0], d, direction) for d, direction in zip(range(0, 10, 3), DIRECTIONS)]


SOURCE = MovingDigitsSource
