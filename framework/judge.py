"""Judges that score generated images against their prompts.

`digits`: an RBF support-vector classifier trained on the real training digits (the fixed held-out
split never touches it). Generated images are brought to the real digits' format (8x8 grayscale,
0..16) before classification, so the judge sees exactly what it was trained on.
"""

from __future__ import annotations

import re
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.svm import SVC

from data_prep.sources.digits import DIGIT_WORDS, load_digits

_WORD_TO_DIGIT = {w: d for d, w in enumerate(DIGIT_WORDS)}


def prompt_digit(prompt: str) -> int | None:
    """The digit a prompt asks for ('a handwritten 7', 'the digit seven'), or None."""
    for tok in re.findall(r"[a-z]+|\d", prompt.lower()):
        if tok.isdigit():
            return int(tok)
        if tok in _WORD_TO_DIGIT:
            return _WORD_TO_DIGIT[tok]
    return None


def to_digit_features(images: torch.Tensor) -> np.ndarray:
    """(N, C, H, W) in [-1, 1] -> (N, 64) on the 0..16 scale of scikit-learn's digits."""
    x = images.float().mean(dim=1, keepdim=True)  # grayscale
    x = F.adaptive_avg_pool2d(x, 8)  # (N, 1, 8, 8)
    return ((x.clamp(-1, 1) + 1) * 8.0).flatten(1).numpy()


class DigitJudge:
    """Classifies generated digits; `heldout_accuracy` is measured on the real held-out digits."""

    def __init__(self) -> None:
        x_tr, y_tr = load_digits("train")
        x_te, y_te = load_digits("heldout")
        # gamma=0.001, C=10 on raw 0..16 pixels is the classic setting for this data set.
        self.clf = SVC(gamma=0.001, C=10.0).fit(x_tr.reshape(len(x_tr), -1).astype(np.float64), y_tr)
        self.heldout_accuracy = float((self.clf.predict(x_te.reshape(len(x_te), -1)) == y_te).mean())

    def predict(self, images: torch.Tensor) -> np.ndarray:
        return self.clf.predict(to_digit_features(images))

    def score(self, images: torch.Tensor, digits: list[int]) -> np.ndarray:
        """Margin of the requested digit over the best other class (higher is better; > 0 means judged right)."""
        dec = self.clf.decision_function(to_digit_features(images))  # (N, 10), one-vs-rest shape
        idx = np.arange(len(digits))
        own = dec[idx, digits]
        dec[idx, digits] = -np.inf
        return own - dec.max(axis=1)


@lru_cache(maxsize=1)
def digit_judge() -> DigitJudge:
    return DigitJudge()


JUDGES = {"digits": digit_judge}


def get_judge(name: str) -> DigitJudge:
    if name not in JUDGES:
        raise ValueError(f"judge={name!r} is unknown; available: {sorted(JUDGES)}")
    return JUDGES[name]()
