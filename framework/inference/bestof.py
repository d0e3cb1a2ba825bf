"""Inference-time scaling: draw N candidates per prompt and keep the ones a judge picks (SANA-1.5).

Two ways to pick, over candidates (P prompts, N candidates each):
- `score`: the judge scores every candidate once; the `pick` highest are kept.
- `tournament`: a knockout, as in SANA-1.5: candidates meet in pairs, the judge says which of the two
  it prefers, winners advance (an odd one out gets a bye) until `pick` remain. Every round is one
  batched judge call over all prompts.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

SELECTIONS = ("score", "tournament")


def pick_by_score(scores: np.ndarray, pick: int = 1) -> np.ndarray:
    """scores (P, N) -> indices (P, pick) of the highest scores, best first (ties: the earlier candidate)."""
    order = np.argsort(-scores, axis=1, kind="stable")
    return order[:, :pick]


def knockout(num_prompts: int, n: int, prefers: Callable[[np.ndarray, np.ndarray], np.ndarray], pick: int = 1) -> np.ndarray:
    """Indices (P, pick) of the tournament's survivors, in bracket order.

    prefers(a, b): a and b are (P, m) candidate indices; returns (P, m) booleans, True where a wins.
    """
    alive = np.tile(np.arange(n), (num_prompts, 1))
    while alive.shape[1] > pick:
        m = alive.shape[1]
        matches = min(m // 2, m - pick)  # never knock out more than needed to reach `pick`
        a, b = alive[:, 0 : 2 * matches : 2], alive[:, 1 : 2 * matches : 2]
        wins = np.asarray(prefers(a, b), dtype=bool)
        alive = np.concatenate([np.where(wins, a, b), alive[:, 2 * matches :]], axis=1)
    return alive


def select(candidates: torch.Tensor, prompts: Sequence[str], judge, selection: str = "score", pick: int = 1) -> torch.Tensor:
    """candidates (P, N, C, H, W) -> (P, pick, C, H, W) kept by `judge` (framework.evaluation.judge.Judge)."""
    if selection not in SELECTIONS:
        raise ValueError(f"selection={selection!r}: use one of {SELECTIONS}")
    p, n = candidates.shape[:2]
    if not 1 <= pick <= n:
        raise ValueError(f"pick={pick} must be between 1 and best_of={n}")
    if n == pick:
        return candidates
    rows = np.arange(p)[:, None]
    if selection == "score":
        flat = judge.score(candidates.flatten(0, 1), [q for q in prompts for _ in range(n)])
        idx = pick_by_score(np.asarray(flat, dtype=np.float64).reshape(p, n), pick)
    else:
        def prefers(a: np.ndarray, b: np.ndarray) -> np.ndarray:
            m = a.shape[1]
            rep = [q for q in prompts for _ in range(m)]
            won = judge.prefers(candidates[rows, a].flatten(0, 1), candidates[rows, b].flatten(0, 1), rep)
            return np.asarray(won, dtype=bool).reshape(p, m)

        idx = knockout(p, n, prefers, pick)
    return candidates[torch.as_tensor(rows), torch.as_tensor(idx)]
