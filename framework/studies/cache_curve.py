"""`python -m framework.studies cache_curve ckpt=PATH sparsities=[...]`: quality against measured speed of cached sampling.

Does a learned cache schedule pay? One figure and one JSON answer it for a checkpoint:
  learned   a router per sparsity weight (trained here with `experiment` unless its run dir already holds a
            schedule; `routers=[...]` adds finished ones), each read at every threshold of `thresholds`
            (the schedule's betas are kept, so a threshold needs no retraining)
  uniform   uniform:K for every K of `uniform`, and one at each learned schedule's count of computed branches
  fewer     plain sampling with each step count of `fewer`
  full      every branch at every step (`steps`): the reference of the paired error and of the speed-ups
Quality, on the whole prompt set (seeds x phrasings: 2,000 images for the quickstart's digits at the defaults),
same seeds for every variant: fd to the real held-out images and accuracy, each with a bootstrap interval
(`bootstrap` resamples), and the paired error: each image's mean squared difference from the full sampler's image
of the same prompt and seed. fd's bootstrap is biased upward (a resample repeats images), so its interval sits
mostly above the estimate and two variants' intervals overlap even when one is better on every resample:
comparisons therefore bootstrap the difference, resampling the same images for both variants.
Speed: `time_images` images per round, the variants taking turns for `repeats`
rounds after a warm-up round, best round kept. Written: `out` (one row per variant) and the curve beside it (.png).
A learned point is compared with the uniform and fewer-step points within 3% of its speed; it "beats" one when the
paired interval of the fd difference (or of the paired-error difference) lies wholly below 0. `goal`: it beats a
uniform and a fewer-step point by fd; `goal_paired_error`: the same by paired error.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from framework.cli import print_table, run_complete, train_child
from framework.cli import resolve_device
from framework.inference.caching import SCHEDULE_FILE, CacheSchedule
from framework.inference.pipeline import Pipeline
from framework.inference.sampling import SamplingPlan
from framework.evaluation.prompts import PromptSet, dataset_kind, prompt_set

EQUAL_SPEED = 0.03  # "equal measured speed": within 3%


@dataclass
class CacheCurveStudy:
    """Arguments of `python -m framework.studies cache_curve`."""

    ckpt: str = "???"
    """The model's checkpoint."""
    sparsities: list[float] = field(default_factory=lambda: [1e-3, 3e-3, 1e-2])
    """A router is trained per value (plugins.cache_router.sparsity) into out's folder, unless already there."""
    thresholds: list[float] = field(default_factory=lambda: [0.3, 0.5, 0.7])
    """Each router's schedule read at each threshold."""
    routers: list[str] = field(default_factory=list)
    """Finished cache_router run dirs or schedule files to add."""
    experiment: str = "cache_router"
    """The stage's experiment (cache_router_pairs for the pairs model)."""
    router_steps: int = 400
    router_overrides: list[str] = field(default_factory=list)
    """More overrides of each router's training run, e.g. "router_overrides=['plugins.cache_router.hard=true']"."""
    uniform: list[float] = field(default_factory=lambda: [1.5, 2.0, 3.0])
    """uniform:K schedules (a full step every K steps)."""
    fewer: list[int] = field(default_factory=lambda: [6, 8, 10, 12, 14])
    """Plain sampling step counts."""
    steps: int = 20
    guidance: float = 4.0
    sampler: str | None = None
    """The routers' and every variant's sampler; null: flow_euler for a flow model, ddim otherwise."""
    seeds: int = 40
    phrasings: int = 5
    batch_size: int = 250
    time_images: int = 250
    """Images per timed round (the prompt set's first)."""
    repeats: int = 3
    bootstrap: int = 200
    weights: str = "ema"
    device: str = "auto"
    out: str = "runs/cache_curve/cache_curve.json"

    def __post_init__(self) -> None:
        if any(not 0 < t < 1 for t in self.thresholds):
            raise ValueError(f"thresholds={self.thresholds}: each must lie in (0, 1)")
        if any(k < 1 for k in self.uniform) or any(not 1 <= n <= self.steps for n in self.fewer):
            raise ValueError(f"uniform={self.uniform} needs K >= 1 and fewer={self.fewer} step counts in [1, {self.steps}]")


# --------------------------------------------------------------------------------------------
# The routers
# --------------------------------------------------------------------------------------------


def train_routers(cfg: CacheCurveStudy, sampler: str, objective: str) -> list[Path]:
    """The schedule file of each sparsity's router, trained in a child process unless its run finished earlier."""
    paths = []
    for s in cfg.sparsities:
        run = Path(cfg.out).parent / f"router_sparsity{s:g}"
        schedule = run / SCHEDULE_FILE
        if not run_complete(run) or not schedule.is_file():
            args = [f"experiment={cfg.experiment}", f"init_from={cfg.ckpt}", f"run.dir={run}", "resume=auto",
                    f"plugins.cache_router.sparsity={s}", f"plugins.cache_router.steps={cfg.steps}",
                    f"trainer.max_steps={cfg.router_steps}", f"eval.guidance={cfg.guidance}", "eval.at_end=false",
                    "logger=csv", f"objective={objective}", f"plugins.cache_router.sampler={sampler}",
                    *cfg.router_overrides]
            train_child(args, f"[cache_curve] router sparsity={s:g}", run)
        paths.append(schedule)
    return paths + [Path(r) / SCHEDULE_FILE if Path(r).is_dir() else Path(r) for r in cfg.routers]


def at_threshold(schedule: CacheSchedule, threshold: float) -> CacheSchedule:
    """The learned schedule read at another threshold (its betas kept; the full steps have beta 1)."""
    if schedule.beta is None:
        raise ValueError("a schedule without betas (uniform:K) has no threshold to move")
    compute = [[[v > threshold for v in block] for block in step] for step in schedule.beta]
    return CacheSchedule(schedule.sampler, schedule.steps, schedule.model, compute, kind="learned",
                         beta=schedule.beta, threshold=threshold, source=schedule.source)


def learned_name(schedule: CacheSchedule, path: Path, taken: set[str]) -> str:
    """A learned series' name: its sparsity, and "hard" for a straight-through router; its folder's name where that
    is not enough to tell it from a series already `taken` (two routers of one sparsity from different runs)."""
    source = schedule.source or {}
    name = f"learned {path.parent.name}"
    if "sparsity" in source:
        name = f"learned s={source['sparsity']:g}" + (" hard" if source.get("hard") else "")
    return f"{name} ({path.parent.name})" if name in taken else name


# --------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------


def subset(ps: PromptSet, n: int) -> PromptSet:
    return PromptSet(ps.kind, ps.prompts[:n], ps.targets[:n], ps.heldout[:n], None if ps.labels is None else ps.labels[:n])


def quality(ps: PromptSet, images: torch.Tensor, full: torch.Tensor, real: torch.Tensor,
            resamples: int) -> tuple[dict[str, Any], dict]:
    """fd (to the real images' `features`), accuracy (seen phrasings / pairs) and paired error to `full`, each with its
    95% bootstrap interval; and what the paired comparisons need (the images' features and per-image errors)."""
    from framework.evaluation.realdata import fid_with_interval, mean_with_interval
    from framework.evaluation.scoring import per_image_correct

    fake = features(ps, images)
    fd, fd_ci = fid_with_interval(real, fake, resamples)
    ok = per_image_correct(ps, images)
    right = torch.from_numpy(ok["digit" if ps.kind == "digits" else "both"][~ps.heldout]).double()
    accuracy, accuracy_ci = mean_with_interval(right, resamples)
    errors = (images.double() - full.double()).pow(2).mean((1, 2, 3))  # (N,)
    error, error_ci = mean_with_interval(errors, resamples)
    return ({"fd": fd, "fd_ci": fd_ci, "accuracy": accuracy, "accuracy_ci": accuracy_ci,
             "paired_error": error, "paired_error_ci": error_ci}, {"real": real, "features": fake, "errors": errors})


def features(ps: PromptSet, images: torch.Tensor) -> torch.Tensor:
    """(N, D) float64 features of the digit classifier fd is measured with."""
    from framework.evaluation.metrics import digit_scorer

    featurize = digit_scorer().featurizer(1 if ps.kind == "digits" else 2)
    with torch.no_grad():
        return torch.cat([featurize(images[i : i + 512].float()) for i in range(0, len(images), 512)]).double()


def paired_difference(a: dict, b: dict, resamples: int, seed: int = 0) -> dict[str, tuple[float, list[float]]]:
    """fd(a) - fd(b) and paired_error(a) - paired_error(b) with 95% intervals from one bootstrap that resamples the
    same images (same prompts and seeds) for both, and the same real images: the variants' shared noise cancels, which
    separate intervals of a biased statistic like fd do not show."""
    from framework.evaluation.realdata import fid_from_features, percentile_interval

    g = torch.Generator().manual_seed(seed)
    n, m = len(a["features"]), len(a["real"])
    fd_draws, err_draws = [], []
    for _ in range(resamples):
        r, i = torch.randint(m, (m,), generator=g), torch.randint(n, (n,), generator=g)
        real = a["real"][r]
        fd_draws.append(fid_from_features(real, a["features"][i]) - fid_from_features(real, b["features"][i]))
        err_draws.append(float((a["errors"][i] - b["errors"][i]).mean()))
    fd = fid_from_features(a["real"], a["features"]) - fid_from_features(b["real"], b["features"])
    return {"fd": (fd, percentile_interval(fd_draws)),
            "paired_error": (float((a["errors"] - b["errors"]).mean()), percentile_interval(err_draws))}


def compare(rows: list[dict[str, Any]], measured: dict[str, dict] | None = None, resamples: int = 200) -> None:
    """On each learned row: the uniform and fewer-step rows within 3% of its speed, and whether it beats them: with
    `measured` (each variant's features and errors), when the paired bootstrap interval of the difference lies wholly
    below 0; without, when the two rows' own intervals do not overlap."""
    below = lambda a, b, key: a[f"{key}_ci"][1] < b[f"{key}_ci"][0]  # a's interval wholly below b's
    for row in rows:
        if row["kind"] != "learned":
            continue
        for kind in ("uniform", "fewer"):
            near = [r for r in rows if r["kind"] == kind and abs(r["images_per_s"] / row["images_per_s"] - 1) <= EQUAL_SPEED]
            found = []
            for r in near:
                c = {"variant": r["variant"], "speed_ratio": r["images_per_s"] / row["images_per_s"]}
                if measured is not None:
                    diff = paired_difference(measured[row["variant"]], measured[r["variant"]], resamples)
                    c.update(fd_difference=diff["fd"][0], fd_difference_ci=diff["fd"][1],
                             paired_error_difference=diff["paired_error"][0],
                             paired_error_difference_ci=diff["paired_error"][1],
                             beats_fd=diff["fd"][1][1] < 0, loses_fd=diff["fd"][1][0] > 0,
                             beats_paired_error=diff["paired_error"][1][1] < 0)
                else:
                    c.update(beats_fd=below(row, r, "fd"), loses_fd=below(r, row, "fd"),
                             beats_paired_error=below(row, r, "paired_error"))
                found.append(c)
            row[f"vs_{kind}"] = found
        row["goal"] = all(any(c["beats_fd"] for c in row[f"vs_{kind}"]) for kind in ("uniform", "fewer"))
        row["goal_paired_error"] = all(any(c["beats_paired_error"] for c in row[f"vs_{kind}"])
                                       for kind in ("uniform", "fewer"))


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("fd", "fd to real held-out images (lower is better)"),
               ("paired_error", "paired error to the full sampler's image"), ("accuracy", "accuracy")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["series"], []).append(r)
    for ax, (key, label) in zip(axes, metrics):
        for name, rs in groups.items():
            rs = sorted(rs, key=lambda r: r["speedup"])
            xs, ys = [r["speedup"] for r in rs], [r[key] for r in rs]
            # fd's bootstrap is biased upward: its estimate may lie below its interval, so that bar starts at the point
            err = [[max(0.0, y - r[f"{key}_ci"][0]) for y, r in zip(ys, rs)],
                   [max(0.0, r[f"{key}_ci"][1] - y) for y, r in zip(ys, rs)]]
            marker = {"full": "*", "uniform": "s", "fewer": "^"}.get(rs[0]["kind"], "o")
            ax.errorbar(xs, ys, yerr=err, marker=marker, capsize=3, label=name, linestyle="-" if len(rs) > 1 else "none")
        ax.set_xlabel("measured speed-up over the full sampler")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(cfg: CacheCurveStudy) -> list[dict[str, Any]]:
    pipe = Pipeline.from_checkpoint(cfg.ckpt, device=resolve_device(cfg.device), weights=cfg.weights)
    kind = dataset_kind(pipe.info)
    if kind is None:
        raise ValueError(f"ckpt={cfg.ckpt}: no classifier scores its dataset; the cache curve needs digits or pairs")
    sampler = cfg.sampler or ("flow_euler" if pipe.objective.cfg.name == "flow" else "ddim")  # one a router trains for
    ps = prompt_set(kind, cfg.seeds, cfg.phrasings)
    timed_ps = subset(ps, cfg.time_images)
    labels = lambda p: p.labels if pipe.model.cfg.num_classes is not None else None

    # variant name -> (series, kind, steps, schedule)
    variants: dict[str, tuple[str, str, int, CacheSchedule | None]] = {"full": ("full", "full", cfg.steps, None)}
    for path in train_routers(cfg, sampler, pipe.objective.cfg.name):
        learned = pipe.schedule(CacheSchedule.load(path), sampler, cfg.steps)  # refuses another model / sampler / steps
        name = learned_name(learned, path, {v[0] for v in variants.values()})
        for t in cfg.thresholds:
            schedule = at_threshold(learned, t)
            variants[f"{name} t={t:g}"] = (name, "learned", cfg.steps, schedule)
            full_steps = max(1, round(schedule.computed_fraction * cfg.steps))
            variants.setdefault(f"uniform:{cfg.steps / full_steps:.4g}", ("uniform:K", "uniform", cfg.steps, None))
    for k in cfg.uniform:
        variants.setdefault(f"uniform:{k:.4g}", ("uniform:K", "uniform", cfg.steps, None))
    for n in cfg.fewer:
        variants[f"fewer:{n}"] = ("fewer steps", "fewer", n, None)
    schedules = {name: v[3] or (pipe.schedule(name, sampler, v[2]) if v[1] == "uniform" else None)
                 for name, v in variants.items()}

    def generate(p: PromptSet, name: str) -> torch.Tensor:
        plan = SamplingPlan(variants[name][2], cfg.guidance, sampler, seed=0, cache_schedule=schedules[name])
        return pipe.generate(p.prompts, plan, labels(p), batch_size=cfg.batch_size)

    best: dict[str, float] = {}
    for r in range(cfg.repeats + 1):  # round 0 warms up
        for name in variants:
            t0 = time.perf_counter()
            generate(timed_ps, name)
            seconds = time.perf_counter() - t0
            if r:
                best[name] = min(best.get(name, math.inf), seconds)
        print(f"[cache_curve] timing round {r}/{cfg.repeats}" + (" (warm-up)" if r == 0 else ""), flush=True)

    from tqdm import tqdm

    from framework.evaluation.scoring import real_reference

    full = generate(ps, "full")
    real = features(ps, real_reference(kind))  # the same for every variant
    rows, measured = [], {}
    for name in tqdm(variants, desc="cache_curve quality", unit="variant"):
        series, kind_, steps, _ = variants[name]
        imgs = full if name == "full" else generate(ps, name)
        schedule = schedules[name]
        metrics, measured[name] = quality(ps, imgs, full, real, cfg.bootstrap)
        rows.append({"variant": name, "series": series, "kind": kind_, "steps": steps,
                     "branches_computed": schedule.computed_fraction if schedule else 1.0,
                     "threshold": schedule.threshold if schedule is not None and kind_ == "learned" else None,
                     "images_per_s": len(timed_ps.prompts) / best[name], "speedup": best["full"] / best[name],
                     **metrics, "num_images": len(ps.prompts), "dataset": kind, "sampler": sampler,
                     "device": str(pipe.device)})
    compare(rows, measured, cfg.bootstrap)
    print_table(rows, ["variant", "branches_computed", "images_per_s", "speedup", "fd", "accuracy", "paired_error", "goal",
                       "goal_paired_error"])
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = plot(rows, out.with_suffix(".png"), f"{Path(cfg.ckpt).name}: {kind}, {sampler}, {cfg.steps} steps, "
                                              f"guidance {cfg.guidance}, {len(ps.prompts)} images, 95% bootstrap intervals")
    print(f"[cache_curve] wrote {png}")
    return rows
