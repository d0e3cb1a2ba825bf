"""Judges: models that score how well an image fits its prompt, used to pick among candidates (best_of=N).

A judge is one small class registered by name (`@register_judge("name")`); `get_judge(name, path)` builds
it once per process. `score(images, prompts)` returns one number per image, higher is better;
`prefers(a, b, prompts)` is the pairwise comparison the knockout tournament asks (by default: the
higher score wins, ties to `a`).

- `digits`: an RBF support-vector classifier trained on the `judge` half of the training digits; the
  score is the margin of the requested digit over the best other one. The metrics' classifier trains
  on the other half (framework/evaluation/metrics.py), so picking cannot simply overfit the metric.
- `pairs`: the digits judge on each half of a digit-pairs image; the score is the smaller margin.
- `clip`: CLIP score (torchmetrics) from a local CLIP folder (`judge_path=...`), for real data.
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

import numpy as np
import torch

from data_prep.sources.digits import DIGIT_WORDS, MAX_VALUE

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
    from framework.evaluation.metrics import to_unit_digits

    return (to_unit_digits(images) * MAX_VALUE).flatten(1).numpy()


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------


class Judge:
    """Scores (image, prompt) pairs; subclasses set `name` and implement `score`."""

    name = ""

    def score(self, images: torch.Tensor, prompts: Sequence[str]) -> np.ndarray:
        raise NotImplementedError

    def prefers(self, a: torch.Tensor, b: torch.Tensor, prompts: Sequence[str]) -> np.ndarray:
        """For each prompt, True when image a[i] is at least as good as b[i]."""
        return self.score(a, prompts) >= self.score(b, prompts)


JUDGES: dict[str, Callable[..., Judge]] = {}
_BUILT: dict[tuple[str, str | None], Judge] = {}


def register_judge(name: str):
    def add(cls):
        cls.name = name
        JUDGES[name] = cls
        return cls

    return add


def get_judge(name: str, path: str | None = None) -> Judge:
    """The judge `name`, built once per process (and per `path` for judges that load weights)."""
    if name not in JUDGES:
        raise ValueError(f"judge={name!r} is unknown; available: {sorted(JUDGES)}")
    key = (name, path)
    if key not in _BUILT:
        _BUILT[key] = JUDGES[name](path) if path is not None else JUDGES[name]()
    return _BUILT[key]


def _no_path(name: str, path: str | None) -> None:
    if path is not None:
        raise ValueError(f"judge={name} is built in and takes no judge_path (got {path!r})")


# --------------------------------------------------------------------------------------------
# Judges
# --------------------------------------------------------------------------------------------


@register_judge("digits")
class DigitJudge(Judge):
    """RBF SVM on the `judge` half of the training digits; score = margin of the requested digit."""

    def __init__(self, path: str | None = None) -> None:
        from sklearn.svm import SVC

        from data_prep.sources.digits import load_digits
        from framework.evaluation.metrics import training_half

        _no_path("digits", path)
        x_tr, y_tr = training_half("judge")
        # gamma=0.001, C=10 on raw 0..16 pixels is the classic setting for this data set.
        self.clf = SVC(gamma=0.001, C=10.0).fit(x_tr.reshape(len(x_tr), -1).astype(np.float64), y_tr)
        x_te, y_te = load_digits("heldout")
        self.heldout_accuracy = float((self.clf.predict(x_te.reshape(len(x_te), -1)) == y_te).mean())

    def margins(self, images: torch.Tensor, digits: Sequence[int]) -> np.ndarray:
        """Margin of each requested digit over the best other class (> 0 means judged right)."""
        dec = self.clf.decision_function(to_digit_features(images))  # (N, 10), one-vs-rest shape
        idx = np.arange(len(digits))
        own = dec[idx, list(digits)]
        dec[idx, list(digits)] = -np.inf
        return own - dec.max(axis=1)

    def score(self, images: torch.Tensor, prompts: Sequence[str]) -> np.ndarray:
        digits = [prompt_digit(p) for p in prompts]
        bad = [p for p, d in zip(prompts, digits) if d is None]
        if bad:
            raise ValueError(f"judge=digits cannot tell which digit these prompts ask for: {bad[:3]}")
        return self.margins(images, digits)


@register_judge("pairs")
class PairJudge(Judge):
    """The digits judge on the left and the right half; score = the smaller of the two margins."""

    def __init__(self, path: str | None = None) -> None:
        _no_path("pairs", path)
        self.digits = get_judge("digits")

    def score(self, images: torch.Tensor, prompts: Sequence[str]) -> np.ndarray:
        from data_prep.sources.digit_pairs import parse_pair

        pairs = [parse_pair(p) for p in prompts]
        bad = [p for p, lr in zip(prompts, pairs) if lr is None]
        if bad:
            raise ValueError(f"judge=pairs cannot read which digit goes where in: {bad[:3]} "
                             "(it knows the digit_pairs caption phrasings)")
        left, right = images.chunk(2, dim=-1)
        return np.minimum(self.digits.margins(left, [a for a, _ in pairs]),
                          self.digits.margins(right, [b for _, b in pairs]))


@register_judge("clip")
class ClipJudge(Judge):
    """CLIP score (100 x cosine of image and text embeddings, torchmetrics) from a local CLIP folder."""

    def __init__(self, path: str | None = None) -> None:
        from pathlib import Path

        from torchmetrics.multimodal.clip_score import CLIPScore

        if path is None or not Path(path).is_dir():
            raise ValueError(f"judge=clip needs judge_path=<a local CLIP folder (transformers CLIPModel + "
                             f"processor)>; got {path!r}")
        def load():  # torchmetrics takes hub names or a loader; ours reads the local folder only
            from transformers import CLIPModel, CLIPProcessor

            return CLIPModel.from_pretrained(path).eval(), CLIPProcessor.from_pretrained(path)

        self.metric = CLIPScore(model_name_or_path=load)

    @torch.no_grad()
    def score(self, images: torch.Tensor, prompts: Sequence[str]) -> np.ndarray:
        from torchmetrics.functional.multimodal.clip_score import _clip_score_update

        pixels = ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        if pixels.shape[1] == 1:
            pixels = pixels.repeat(1, 3, 1, 1)
        scores, _ = _clip_score_update(list(pixels), list(prompts), self.metric.model, self.metric.processor)
        return scores.float().cpu().numpy()
