"""Prompt sets of the datasets that have a built-in classifier (digits, digit pairs), and class labels
for class-conditional models: what framework.eval generates and scores, and what plugins calibrate on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# --------------------------------------------------------------------------------------------
# Prompt sets (one per kind of dataset that has a classifier)
# --------------------------------------------------------------------------------------------


@dataclass
class PromptSet:
    """What is generated (one entry per prompt and seed) and how the images are scored."""

    kind: str  # "digits", "pairs" or "motion" (moving digits' clips)
    prompts: list[str]
    targets: list[Any]  # digit, (left, right), or (digit, direction)
    heldout: np.ndarray  # bool: a held-out phrasing (digits) or a held-out pair (pairs)
    labels: list[int] | None  # class labels for class-conditional models

    @property
    def judge(self) -> str:
        return self.kind  # each kind has the judge of the same name (framework/evaluation/judge.py)


def digit_prompts(phrasings: int) -> list[tuple[str, int]]:
    """(prompt, digit) pairs: every digit in `phrasings` of the training caption phrasings."""
    from data_prep.sources.digits import digit_captions

    pairs = []
    for d in range(10):
        caps = digit_captions(d)
        if phrasings > len(caps):
            raise ValueError(f"phrasings={phrasings}: the digits captions have only {len(caps)} phrasings")
        pairs += [(c, d) for c in caps[:phrasings]]
    return pairs


def dataset_kind(info: dict[str, Any]) -> str | None:
    """'digits', 'pairs', 'motion' or None (no classifier knows this data) from a dataset.json."""
    name = str((info.get("source") or {}).get("name", ""))
    if name == "moving_digits":
        return "motion"
    if name == "digit_pairs" and info.get("num_classes") == 100:
        return "pairs"
    if info.get("num_classes") == 10 and "digits" in name:
        return "digits"
    return None


def prompt_set(kind: str, seeds: int, phrasings: int) -> PromptSet:
    from data_prep.sources.digit_pairs import HELDOUT_PAIRS, pair_captions
    from data_prep.sources.digits import heldout_digit_captions

    if seeds < 1 or phrasings < 1:
        raise ValueError(f"seeds={seeds} and phrasings={phrasings} must be >= 1")
    items: list[tuple[str, Any, bool]] = []
    if kind == "digits":
        items += [(c, d, False) for c, d in digit_prompts(phrasings)]
        items += [(c, d, True) for d in range(10) for c in heldout_digit_captions(d)]
        label = lambda t: t
    elif kind == "motion":
        from data_prep.sources.moving_digits import DIRECTIONS, heldout_motion_captions, motion_captions

        for d in range(10):
            for way in DIRECTIONS:
                caps = motion_captions(d, way)
                if phrasings > len(caps):
                    raise ValueError(f"phrasings={phrasings}: the moving digits' captions have only {len(caps)} phrasings")
                items += [(c, (d, way), False) for c in caps[:phrasings]]
                items += [(c, (d, way), True) for c in heldout_motion_captions(d, way)]
        label = lambda t: t[0]
    else:
        for a in range(10):
            for b in range(10):
                caps = pair_captions(a, b)
                if phrasings > len(caps):
                    raise ValueError(f"phrasings={phrasings}: the pair captions have only {len(caps)} phrasings")
                items += [(c, (a, b), (a, b) in HELDOUT_PAIRS) for c in caps[:phrasings]]
        label = lambda t: 10 * t[0] + t[1]
    rows = [it for it in items for _ in range(seeds)]
    return PromptSet(kind, [r[0] for r in rows], [r[1] for r in rows], np.array([r[2] for r in rows]),
                     [label(r[1]) for r in rows])


def training_prompts(kind: str) -> list[str]:
    """Every training phrasing of every class of a built-in prompt set (none held out), phrasing by phrasing: every
    class in its first phrasing, then every class in its second, ..."""
    from data_prep.sources.digit_pairs import pair_captions
    from data_prep.sources.digits import digit_captions

    if kind == "digits":
        phrasings = len(digit_captions(0))
    elif kind == "motion":
        from data_prep.sources.moving_digits import DIRECTIONS, motion_captions

        phrasings = len(motion_captions(0, DIRECTIONS[0]))
    else:
        phrasings = len(pair_captions(0, 1))
    ps = prompt_set(kind, seeds=1, phrasings=phrasings)
    kept = [p for p, held in zip(ps.prompts, ps.heldout) if not held]  # class by class, `phrasings` each
    return [kept[c * phrasings + k] for k in range(phrasings) for c in range(len(kept) // phrasings)]


GENERIC_GRID_PROMPTS = ["a photo of a cat", "a red car", "a mountain lake"]


def grid_prompts(info: dict[str, Any]) -> list[str]:
    """The training grid's prompts when sample.prompts is null: the ones the dataset encoded at precompute;
    for datasets written before that, the digits' or pairs' own; else three generic prompts."""
    if info.get("prompts"):
        return list(info["prompts"])
    kind = dataset_kind(info)
    if kind is not None:
        from data_prep.sources.digit_pairs import PAIR_GRID_PROMPTS
        from data_prep.sources.digits import DIGIT_GRID_PROMPTS

        return list(DIGIT_GRID_PROMPTS if kind == "digits" else PAIR_GRID_PROMPTS)
    return list(GENERIC_GRID_PROMPTS)


def prompt_labels(pipe: Any, prompts: list[str]) -> list[int | None] | None:
    """Class labels for class-conditional models: "class N" is label N (any dataset, e.g. ImageNet's 1,000);
    otherwise the digit, or 10 * left + right for digit pairs."""
    import re

    if pipe.model.cfg.num_classes is None:
        return None
    explicit = [re.fullmatch(r"\s*class\s+(\d+)\s*", p) for p in prompts]
    if all(explicit):
        return [int(m.group(1)) for m in explicit]  # type: ignore[union-attr]
    if pipe.model.cfg.num_classes == 100:
        from data_prep.sources.digit_pairs import parse_pair

        return [None if lr is None else 10 * lr[0] + lr[1] for lr in map(parse_pair, prompts)]
    from framework.evaluation.judge import prompt_digit

    return [prompt_digit(p) for p in prompts]
