"""Two real handwritten digits side by side (an 8x16 image), captioned with which digit is on which side.

A compositional benchmark in the spirit of GenEval's position and two-object tasks: the model must
put the right digit on the right side. Ten ordered pairs (HELDOUT_PAIRS) never enter training, so
evaluation can measure combinations the model has never seen; each of their digits does appear in
training, on both sides, in other pairs. Images come from the fixed digits split: training pairs are
drawn from the training digits, evaluation's real reference pairs from the held-out digits.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from data_prep.sources.base import ImageCaptionSource, Record
from data_prep.sources.digits import DIGIT_WORDS, load_digits, to_pixels

# (left, right): (i, i+3 mod 10); the reverse of a held-out pair is never held out itself.
HELDOUT_PAIRS = tuple((i, (i + 3) % 10) for i in range(10))
TRAIN_PAIRS = tuple((a, b) for a in range(10) for b in range(10) if (a, b) not in HELDOUT_PAIRS)
PAIR_SEED = 816  # fixed: which digit images form each training pair

_PHRASINGS = [
    "{al} on the left and {ar} on the right",
    "{ar} to the right of {al}",
    "{wl} and {wr}, from left to right",
    "{al} to the left of {ar}",
    "on the right {ar}, on the left {al}",
]


# The pairs experiment's grid: seen and held-out pairs in several phrasings.
PAIR_GRID_PROMPTS = ["a 3 on the left and a 7 on the right", "a 7 to the right of a 3", "a 0 on the left and a 3 on the right",
                     "one and nine, from left to right", "a 5 to the left of an 8"]


def _article(d: int) -> str:
    return f"{'an' if d == 8 else 'a'} {d}"


def pair_captions(left: int, right: int) -> list[str]:
    """Every caption phrasing of the ordered pair (left, right)."""
    if not (0 <= left <= 9 and 0 <= right <= 9):
        raise ValueError(f"digits must be in 0..9, got ({left}, {right})")
    return [p.format(al=_article(left), ar=_article(right), wl=DIGIT_WORDS[left], wr=DIGIT_WORDS[right])
            for p in _PHRASINGS]


@lru_cache(maxsize=1)
def _caption_table() -> dict[str, tuple[int, int]]:
    return {c.lower(): (a, b) for a in range(10) for b in range(10) for c in pair_captions(a, b)}


def parse_pair(caption: str) -> tuple[int, int] | None:
    """(left, right) digits a pair caption asks for, or None when it is not one of the pair phrasings."""
    return _caption_table().get(" ".join(caption.lower().split()))


def make_pairs(split: str, pairs: list[tuple[int, int]], per_pair: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`per_pair` images (8, 16) uint8 in 0..16 of each ordered pair, digits drawn from `split`; and (N, 2) labels."""
    images, labels = load_digits(split)
    by_digit = [np.flatnonzero(labels == d) for d in range(10)]
    rng = np.random.default_rng(seed)
    out, lab = [], []
    for a, b in pairs:
        left = rng.choice(by_digit[a], per_pair)
        right = rng.choice(by_digit[b], per_pair)
        out.append(np.concatenate([images[left], images[right]], axis=2))  # (per_pair, 8, 16)
        lab += [(a, b)] * per_pair
    return np.concatenate(out), np.array(lab, dtype=np.int64).reshape(-1, 2)


class DigitPairsSource(ImageCaptionSource):
    """`source.pairs_per_combination` images of each training pair, each with `rows_per_image` captions."""

    name = "digit_pairs"
    default_image_mode = "L"
    num_classes = 100  # label = 10 * left + right

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        if cfg.split != "train":
            raise ValueError("source=digit_pairs builds training data only (split=train); evaluation draws its "
                             "real reference pairs from the held-out digits itself")
        self.images, self.labels = make_pairs("train", list(TRAIN_PAIRS), int(cfg.pairs_per_combination), PAIR_SEED)

    def record(self, index: int) -> Record:
        k, (a, b) = max(1, int(self.cfg.rows_per_image)), self.labels[index]
        phrasings = pair_captions(int(a), int(b))
        captions = [phrasings[(index * k + j) % len(phrasings)] for j in range(k)]
        return Record(key=f"pairs-{index:05d}-{a}{b}", image=to_pixels(self.images[index]), captions=captions,
                      label=int(10 * a + b))

    def size(self) -> int | None:
        return len(self.images)

    def grid_prompts(self) -> list[str]:
        return PAIR_GRID_PROMPTS

    def metadata(self) -> dict:
        return {"heldout_pairs": [list(p) for p in HELDOUT_PAIRS], "split": "train",
                "pairs_per_combination": self.cfg.pairs_per_combination, "rows_per_image": self.cfg.rows_per_image}


SOURCE = DigitPairsSource
