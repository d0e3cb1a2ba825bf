"""scikit-learn's 1,797 real handwritten digits (8x8, values 0..16), each with several captions.

A fixed, seeded 20% of the images is held out for evaluation (the judge classifier trains on the
`train` split and is tested on `heldout`); the training dataset is built from `train` only.
"""
from __future__ import annotations

import numpy as np

from data_prep.sources.base import ImageCaptionSource, Record

DIGIT_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
HELDOUT_FRACTION = 0.2
SPLIT_SEED = 1797  # fixed forever: changing it would leak held-out digits into training
NUM_CLASSES = 10
MAX_VALUE = 16  # load_digits pixel range is 0..16

# Phrasings rotate so the text encoder, not a single template, carries the class.
_PHRASINGS = [
    "a handwritten {d}",
    "the digit {w}",
    "{a} {w} written by hand",
    "the number {d}, handwritten",
    "a drawing of the digit {w}",
]


# Phrasings that never appear in training data: evaluation reports accuracy on them separately, to see
# whether the model follows the text encoder's meaning or memorised the training templates.
_HELDOUT_PHRASINGS = [
    "handwriting showing the number {w}",
    "a scribbled {d}",
    "the numeral {d} in someone's handwriting",
]


# The quickstart's grid: one column per digit.
DIGIT_GRID_PROMPTS = [f"a handwritten {d}" for d in range(10)]


def heldout_digit_captions(d: int) -> list[str]:
    """The evaluation-only phrasings for digit `d` (never written into a training dataset)."""
    if not 0 <= d <= 9:
        raise ValueError(f"digit must be in 0..9, got {d}")
    return [p.format(d=d, w=DIGIT_WORDS[d]) for p in _HELDOUT_PHRASINGS]


def to_pixels(digits: np.ndarray) -> np.ndarray:
    """Digit arrays in 0..16 -> uint8 pixels in 0..255 (what an image file of them would hold)."""
    return (digits.astype(np.float32) * (255.0 / MAX_VALUE)).round().astype(np.uint8)


def digit_captions(d: int) -> list[str]:
    """Every caption phrasing for digit `d` (0..9)."""
    if not 0 <= d <= 9:
        raise ValueError(f"digit must be in 0..9, got {d}")
    w = DIGIT_WORDS[d]
    return [p.format(d=d, w=w, a="an" if w[0] in "aeiou" else "a") for p in _PHRASINGS]


def load_digits(split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """The fixed split: images uint8 (N, 8, 8) in 0..16 and labels int64 (N,)."""
    from sklearn.datasets import load_digits as sk_load_digits

    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split must be 'train', 'heldout' or 'all', got {split!r}")
    bunch = sk_load_digits()
    images = bunch.images.astype(np.uint8)  # (1797, 8, 8)
    labels = bunch.target.astype(np.int64)
    if split == "all":
        return images, labels
    order = np.random.default_rng(SPLIT_SEED).permutation(len(images))
    n_heldout = int(round(HELDOUT_FRACTION * len(images)))
    idx = np.sort(order[:n_heldout] if split == "heldout" else order[n_heldout:])
    return images[idx], labels[idx]


class DigitsSource(ImageCaptionSource):
    """Each image becomes `rows_per_image` rows, rotating through the phrasings."""

    name = "digits"
    default_image_mode = "L"  # grayscale: the pixel codec keeps 1 channel
    num_classes = NUM_CLASSES

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.images, self.labels = load_digits(cfg.split)
        if getattr(cfg, "labels", None) is not None:  # source.labels: only these digits
            keep = np.isin(self.labels, [int(d) for d in cfg.labels])
            self.images, self.labels = self.images[keep], self.labels[keep]

    def record(self, index: int) -> Record:
        k, label = max(1, int(self.cfg.rows_per_image)), int(self.labels[index])
        phrasings = digit_captions(label)
        captions = [phrasings[(index * k + j) % len(phrasings)] for j in range(k)]
        return Record(key=f"digits-{self.cfg.split}-{index:04d}", image=to_pixels(self.images[index]),
                      captions=captions, label=label)

    def size(self) -> int | None:
        return len(self.images)

    def metadata(self) -> dict:
        meta = {"class_names": DIGIT_WORDS, "split": self.cfg.split, "rows_per_image": self.cfg.rows_per_image}
        if getattr(self.cfg, "labels", None) is not None:
            meta["labels"] = [int(d) for d in self.cfg.labels]
        return meta

    def grid_prompts(self) -> list[str]:
        return DIGIT_GRID_PROMPTS


SOURCE = DigitsSource
