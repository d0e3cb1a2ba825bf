"""A checkpoint's (or a training run's) pipeline scored on its dataset's prompt set: the evaluation that
framework.eval runs, that training runs at its end and every eval.every_n_steps (framework/training/evaluation.py),
and its one-line summary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from framework.evaluation.prompts import PromptSet, dataset_kind, prompt_set
from framework.evaluation.scoring import generate_candidates, score_images
from framework.evaluation.settings import EvalSettings
from framework.inference.pipeline import Pipeline, save_grid
from framework.inference.sharing import Sharing


def evaluate(
    pipe: Pipeline,
    settings: EvalSettings,
    grid_path: str | Path | None = None,
    ranks: Sharing | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Metrics of `pipe` on its dataset's prompt set (best_of / selection / pick from `settings`).

    ranks: how the ranks of a multi-process job share the generation (Pipeline.generate; every rank calls this):
    SplitRanks, every rank gets the metrics; DecodeRanks, rank 0 scores and the others get {}.
    """
    from framework.inference.bestof import select
    from framework.evaluation.judge import get_judge

    kind = dataset_kind(pipe.info)
    if settings.real:  # one's own data: fid / clip_score against held-out real images
        from framework.evaluation.realdata import evaluate_real

        return evaluate_real(pipe, settings, grid_path, ranks, progress)
    if kind is None:
        raise ValueError(f"no classifier scores this dataset (source {pipe.info.get('source')!r}); evaluation "
                         "knows the digits and digit_pairs data. Use framework.sample to look at the images.")
    ps = prompt_set(kind, settings.seeds, settings.phrasings)
    candidates, images_per_s = generate_candidates(pipe, ps, settings, settings.best_of, ranks, progress)
    if candidates is None:  # a rank that only helped (decode_ranks)
        return {}
    judge = None
    if settings.best_of > 1:
        judge = get_judge(settings.judge or ps.judge, settings.judge_path)
    kept = select(candidates, ps.prompts, judge, settings.selection, settings.pick).flatten(0, 1)
    metrics = score_images(ps, kept, settings.pick)
    metrics.update(images_per_s=images_per_s, best_of=settings.best_of)
    if settings.cache_schedule:
        schedule = pipe.schedule(settings.cache_schedule, settings.sampler, settings.steps)
        metrics.update(cache_schedule=schedule.kind, branches_computed=schedule.computed_fraction)
    if settings.best_of > 1:
        metrics.update(selection=settings.selection, judge=judge.name)
    if grid_path is not None:
        save_judged_grid(ps, kept[:: settings.pick], grid_path)
    return metrics


def save_judged_grid(ps: PromptSet, images: torch.Tensor, path: str | Path) -> Path:
    """digits: one column per digit, one row per phrasing-seed; pairs: a 10x10 grid (row = left digit)."""
    from framework.evaluation.metrics import digit_scorer

    scorer = digit_scorer()
    if ps.kind == "motion":  # one clip per digit and direction, a row per digit
        from framework.evaluation.motion import read_clips

        first = {}
        for i, t in enumerate(ps.targets):
            first.setdefault(tuple(t), i)
        order = list(first.values())
        read = read_clips(images[order])
        caps = [f"{ps.prompts[i]} -> {' '.join(map(str, digits))} {way}"
                for i, digits, way in zip(order, read["digits"], read["directions"])]
        return save_grid(images[order], caps, path, ncol=4)
    if ps.kind == "digits":
        pred = scorer.predict(images)
        per_digit = [[i for i, t in enumerate(ps.targets) if t == d] for d in range(10)]  # seen, then held out
        order = [col[r] for r in range(min(map(len, per_digit))) for col in per_digit]
        caps = [f"{ps.prompts[i]} -> {pred[i]}" for i in order]
        return save_grid(images[order], caps, path, ncol=10)
    first = {}
    for i, t in enumerate(ps.targets):
        first.setdefault(tuple(t), i)
    order = [first[(a, b)] for a in range(10) for b in range(10)]
    left, right = images[order].chunk(2, dim=-1)
    pl, pr = scorer.predict(left), scorer.predict(right)
    caps = [f"{ps.targets[i][0]}|{ps.targets[i][1]}{'*' if ps.heldout[i] else ''} -> {a}|{b}"
            for i, a, b in zip(order, pl, pr)]
    return save_grid(images[order], caps, path, ncol=10)


def eval_summary(metrics: dict[str, Any]) -> str:
    """One line for people: the headline accuracy, held-out accuracy and fd (or fid / clip_score on own data)."""
    if "direction_accuracy" in metrics:
        from framework.evaluation.motion import motion_summary

        return motion_summary(metrics)
    if "num_real" in metrics:
        from framework.evaluation.realdata import real_summary

        return real_summary(metrics)
    if "pair_accuracy" in metrics:
        head = (f"pair_accuracy {metrics['pair_accuracy']:.3f}  heldout_pair_accuracy "
                f"{metrics['heldout_pair_accuracy']:.3f}")
    else:
        head = (f"prompt_accuracy {metrics['prompt_accuracy']:.3f}  heldout_phrasing_accuracy "
                f"{metrics['heldout_phrasing_accuracy']:.3f}")
    return (f"{head}  fd {metrics['fd']:.2f}  (classifier accuracy on held-out real digits "
            f"{metrics['classifier_heldout_accuracy']:.3f}, {metrics['num_images']} images)")
