"""`python -m framework.bench cache ckpt=PATH schedule=cache_schedule.json`: what cached sampling buys.

Four ways to sample the checkpoint's prompt set (framework.eval's), in one process on one machine with
the same seeds:
  full      every branch at every step (`steps` steps)
  learned   the learned schedule (experiment=cache_router)
  uniform   uniform:K with K chosen so it computes as many branches as the learned schedule
  fewer     plain sampling with fewer steps: of the three step counts around the learned schedule's time,
            the one whose time is closest to it
Timings: the variants take turns for `repeats` rounds after a warm-up round, and each keeps its best
(a shared machine's load swings); images are the same in every round. A first set of rounds picks the
step count of `fewer`; the reported times come from a second set in which all four take turns. Quality: framework.eval's
metrics (accuracy and fd) of the images.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from framework.cli import print_table, resolve_device
from framework.evaluation.settings import EvalSettings
from framework.evaluation.scoring import generate_candidates, score_images
from framework.inference.pipeline import Pipeline
from framework.evaluation.prompts import dataset_kind, prompt_set


@dataclass
class CacheBench:
    """Arguments of `python -m framework.bench cache`."""

    ckpt: str = "???"
    """The model's checkpoint."""
    schedule: str = "???"
    """Its learned cache_schedule.json (or the cache_router run dir)."""
    steps: int = 20
    guidance: float = 4.0
    sampler: str | None = None
    """null: the schedule's sampler."""
    seeds: int = 4
    phrasings: int = 5
    batch_size: int = 200
    """Images per forward (the whole prompt set of the quickstart in one batch)."""
    repeats: int = 4
    """Timed rounds per variant after the warm-up round (best kept)."""
    weights: str = "ema"
    device: str = "auto"
    out: str = "bench_cache.json"


def _time(pipe: Pipeline, ps: Any, settings: EvalSettings) -> tuple[Any, float]:
    """(images, seconds) of one generation of the prompt set."""
    t0 = time.perf_counter()
    images, _ = generate_candidates(pipe, ps, settings, 1)
    return images[:, 0], time.perf_counter() - t0


def run(cfg: CacheBench) -> list[dict[str, Any]]:
    from framework.inference.caching import CacheSchedule

    pipe = Pipeline.from_checkpoint(cfg.ckpt, device=resolve_device(cfg.device), weights=cfg.weights)
    learned = CacheSchedule.load(cfg.schedule)
    sampler = cfg.sampler or learned.sampler
    learned = pipe.schedule(learned, sampler, cfg.steps)  # refuses another model / sampler / step count
    kind = dataset_kind(pipe.info)
    if kind is None:
        raise ValueError(f"ckpt={cfg.ckpt}: no classifier scores its dataset; the cache bench needs digits or pairs")
    ps = prompt_set(kind, cfg.seeds, cfg.phrasings)
    base = dict(seeds=cfg.seeds, phrasings=cfg.phrasings, guidance=cfg.guidance, sampler=sampler,
                batch_size=cfg.batch_size)
    # uniform:K computing the same count of branch evaluations (ceil(steps / K) full steps).
    full_steps = max(1, round(learned.computed_fraction * cfg.steps))
    variants = {"full": EvalSettings(steps=cfg.steps, **base),
                "learned": EvalSettings(steps=cfg.steps, cache_schedule=str(cfg.schedule), **base),
                "uniform": EvalSettings(steps=cfg.steps, cache_schedule=f"uniform:{cfg.steps / full_steps:.6g}", **base)}
    images: dict[str, Any] = {}
    times: dict[str, list[float]] = {}

    def timed(names: list[str]) -> dict[str, float]:
        best: dict[str, float] = {}
        for r in range(cfg.repeats + 1):  # round 0 warms up (allocator, text encoder, caches)
            for name in names:
                images[name], seconds = _time(pipe, ps, variants[name])
                print(f"  {name:<10} steps {variants[name].steps:<3} {seconds:.3f} s" + ("" if r else " (warm-up)"))
                if r:
                    best[name] = min(best.get(name, math.inf), seconds)
                    times.setdefault(name, []).append(round(seconds, 4))
        return best

    first = timed(list(variants))
    # Plain sampling with as many steps as fit in the learned schedule's time: the estimate and its two
    # neighbours are timed with the others, and the one closest to the learned schedule's time is reported.
    guess = round(cfg.steps * first["learned"] / first["full"])
    for n in sorted({min(max(1, g), cfg.steps) for g in (guess - 1, guess, guess + 1)}):
        variants[f"fewer:{n}"] = EvalSettings(steps=n, **base)
    best = timed(list(variants))
    closest = min((v for v in variants if v.startswith("fewer:")), key=lambda v: abs(best[v] - best["learned"]))
    variants = {**{k: v for k, v in variants.items() if not k.startswith("fewer:")}, "fewer": variants[closest]}
    best["fewer"], images["fewer"], times["fewer"] = best[closest], images[closest], times[closest]
    rows = []
    n = len(ps.prompts)
    for name, settings in variants.items():
        m = score_images(ps, images[name])
        schedule = pipe.schedule(settings.cache_schedule, sampler, settings.steps)
        rows.append({"variant": name, "schedule": schedule.kind if schedule else "none", "steps": settings.steps,
                     "branches_computed": schedule.computed_fraction if schedule else 1.0,
                     "images_per_s": n / best[name], "speedup": best["full"] / best[name], "seconds": times[name],
                     "accuracy": m.get("prompt_accuracy", m.get("pair_accuracy")),
                     "heldout_accuracy": m.get("heldout_phrasing_accuracy", m.get("heldout_pair_accuracy")),
                     "fd": m["fd"], "num_images": n, "kind": kind, "sampler": sampler, "device": str(pipe.device)})
    print_table(rows, ["variant", "schedule", "steps", "branches_computed", "images_per_s", "speedup", "accuracy",
                       "heldout_accuracy", "fd"])
    return rows
