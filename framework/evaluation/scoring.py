"""Scoring a prompt set's images (accuracy by the digit classifier, fd to real held-out images) and generating
them: what framework.eval, the end-of-training evaluation and the benchmarks share (core, so benchmarks
may use it; tests/test_layers.py keeps commands out of their imports).
"""

from __future__ import annotations

import time
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from framework.evaluation.settings import EvalSettings
from framework.inference.pipeline import Pipeline
from framework.inference.sampling import SamplingPlan
from framework.inference.sharing import Sharing
from framework.evaluation.prompts import PromptSet


@lru_cache(maxsize=2)
def real_reference(kind: str) -> torch.Tensor:
    """Real held-out images (never trained on by the model or the classifier) that `fd` compares against.

    Built once per process: a scaling curve scores a dozen image sets against it (read-only)."""
    from framework.evaluation.metrics import as_images, real_digit_images

    if kind == "digits":
        return real_digit_images("heldout")[0]
    if kind == "motion":  # the digit crops of the held-out digits' clips' frames, read as generated frames are
        from data_prep.config import SourceConfig
        from data_prep.sources.moving_digits import MovingDigitsSource
        from framework.evaluation.motion import digit_crops

        source = MovingDigitsSource(SourceConfig(name="moving_digits", split="heldout", rows_per_image=1))
        clips = np.stack([source.record(i).image for i in range(source.size())])  # (N, F, H, W) uint8
        return digit_crops(torch.from_numpy(clips).flatten(0, 1).unsqueeze(1).float() / 127.5 - 1)
    from data_prep.sources.digit_pairs import PAIR_SEED, make_pairs

    images, _ = make_pairs("heldout", [(a, b) for a in range(10) for b in range(10)], 4, PAIR_SEED + 1)
    return as_images(images)


def per_image_correct(ps: PromptSet, images: torch.Tensor, per_prompt: int = 1) -> dict[str, np.ndarray]:
    """Per image (P * per_prompt,): whether the classifier reads what was asked. digits: {"digit"}; pairs: {"left",
    "right", "both"}."""
    from framework.evaluation.metrics import digit_scorer

    scorer = digit_scorer()
    targets = np.array([x for x in ps.targets for _ in range(per_prompt)])
    if ps.kind == "digits":
        return {"digit": scorer.predict(images) == targets}
    left, right = images.chunk(2, dim=-1)
    ok_l, ok_r = scorer.predict(left) == targets[:, 0], scorer.predict(right) == targets[:, 1]
    return {"left": ok_l, "right": ok_r, "both": ok_l & ok_r}


def score_images(ps: PromptSet, images: torch.Tensor, per_prompt: int = 1) -> dict[str, Any]:
    """Metrics of `images` ((P * per_prompt, C, H, W), each prompt's kept images together; clips (.., F, C, H, W))."""
    from framework.evaluation.metrics import digit_scorer, frechet_distance

    scorer = digit_scorer()
    if ps.kind == "motion":
        from framework.evaluation.motion import score_clips

        out = score_clips(ps.targets, ps.heldout, images, per_prompt, real_reference("motion"))
        return {**out, "classifier_heldout_accuracy": scorer.heldout_accuracy}
    heldout = np.repeat(ps.heldout, per_prompt)
    mean = lambda mask: float(mask.mean()) if mask.size else float("nan")
    ok = per_image_correct(ps, images, per_prompt)
    out: dict[str, Any] = {}
    if ps.kind == "digits":
        targets = np.array([x for x in ps.targets for _ in range(per_prompt)])
        right = ok["digit"]
        out["prompt_accuracy"] = mean(right[~heldout])
        out["heldout_phrasing_accuracy"] = mean(right[heldout])
        out["per_digit_accuracy"] = {str(d): mean(right[~heldout & (targets == d)]) for d in range(10)}
        cells = 1
    else:
        for prefix, mask in (("", ~heldout), ("heldout_", heldout)):
            out[f"{prefix}pair_accuracy"] = mean(ok["both"][mask])
            out[f"{prefix}left_accuracy"] = mean(ok["left"][mask])
            out[f"{prefix}right_accuracy"] = mean(ok["right"][mask])
        cells = 2
    out["fd"] = frechet_distance(real_reference(ps.kind), images, scorer.featurizer(cells))
    out["classifier_heldout_accuracy"] = scorer.heldout_accuracy
    out["num_images"] = len(images)
    return out


def generate_candidates(pipe: Pipeline, ps: PromptSet, settings: EvalSettings, n: int, ranks: Sharing | None = None,
                        progress: bool = False) -> tuple[torch.Tensor | None, float]:
    """(P, n, C, H, W) candidates for the prompt set, and the images/s it took.

    ranks: how the ranks share the generation (Pipeline.generate); a rank that gets no images (DecodeRanks, other
    than rank 0) gets (None, images/s)."""
    t0 = time.perf_counter()
    labels = ps.labels if pipe.model.cfg.num_classes is not None else None
    size = pipe.latent_size(settings.height, settings.width, settings.aspect, settings.num_frames)
    plan = SamplingPlan.of(settings, seed=0, candidates=n, size=size)
    images = pipe.generate(ps.prompts, plan, labels, ranks=ranks, batch_size=settings.batch_size, progress=progress)
    seconds = time.perf_counter() - t0
    rate = len(ps.prompts) * n / seconds
    return (None if images is None else images.view(len(ps.prompts), n, *images.shape[1:])), rate
