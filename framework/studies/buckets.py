"""`python -m framework.studies buckets`: what aspect-ratio buckets keep that square crops lose.

The synthetic shapes scenes (data_prep/sources/shapes.py: wide, tall and square canvases with a coloured block near
each end, the caption naming them) are encoded twice with the pixel codec: into buckets of the three shapes, and as
24x24 centre crops (the default precompute), which cut a wide or tall scene's blocks away. The same model and recipe
trains on each; then each draws held-out captions: the bucketed model at the caption's own layout (aspect=), the
cropped one at the only size it knows. The shapes detector (framework/evaluation/shapes.py) checks whether both named
blocks are where the caption puts them. Reported per layout with 95% bootstrap intervals; `out` (.json) and a figure
beside it (.png: the rates and a few images of each model).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from framework.cli import print_table, run_complete, train_child

BUCKET_SIZES = [[16, 32], [24, 24], [32, 16]]
SQUARE = 24


@dataclass
class BucketsStudy:
    """Arguments of `python -m framework.studies buckets`."""

    scenes: int = 1800
    """Training scenes (a third each wide, tall, square)."""
    steps: int = 1500
    """Training steps of each model."""
    batch_size: int = 32
    eval_scenes: int = 150
    """Held-out captions drawn by each model."""
    sample_steps: int = 20
    guidance: float = 4.0
    bootstrap: int = 500
    train_overrides: list[str] = field(default_factory=list)
    """More framework.train overrides for both models."""
    out: str = "runs/buckets_demo/buckets.json"


def prepare(cfg: BucketsStudy, root: Path) -> dict[str, Path]:
    from data_prep.precompute import precompute

    common = {"source": {"name": "shapes", "scenes": cfg.scenes}, "vae": "pixel", "text_encoder": "minilm",
              "image_mode": "RGB", "progress": False}
    return {"buckets": precompute({**common, "buckets": BUCKET_SIZES, "resolution": SQUARE, "out": str(root / "data_buckets")},
                                  rank=0, world_size=1),
            "square": precompute({**common, "resolution": SQUARE, "out": str(root / "data_square")}, rank=0, world_size=1)}


def train_arm(cfg: BucketsStudy, root: Path, arm: str, data: Path) -> Path:
    run = root / arm
    ckpt = run / "checkpoints" / "last.ckpt"
    if run_complete(run):
        print(f"[buckets] {arm}: trained, kept")
        return ckpt
    args = ["experiment=quickstart", "model=pixart_debug", f"data.path={data}", f"data.local={run / 'cache'}",
            f"run.dir={run}", f"trainer.max_steps={cfg.steps}", f"data.batch_size={cfg.batch_size}", "logger=csv",
            "resume=auto", "eval.at_end=false", "sample.every_n_steps=0", "trainer.enable_progress_bar=false",
            "data.num_workers=0", *cfg.train_overrides]
    train_child(args, f"[buckets] training the {arm} model", run)
    return ckpt


def draw(ckpt: Path, captions: list[str], bucketed: bool, cfg: BucketsStudy) -> list[torch.Tensor]:
    """Each caption's image: at its layout's aspect (bucketed) or the model's one size."""
    from data_prep.sources.shapes import LAYOUTS
    from framework.evaluation.shapes import parse_scene
    from framework.inference.pipeline import Pipeline
    from framework.inference.sampling import SamplingPlan

    pipe = Pipeline.from_checkpoint(ckpt, weights="train")
    images: list[torch.Tensor | None] = [None] * len(captions)
    layouts = [parse_scene(c).layout for c in captions]
    for layout in LAYOUTS:
        idx = [i for i, lay in enumerate(layouts) if lay == layout]
        h, w = LAYOUTS[layout]
        size = pipe.latent_size(h, w) if bucketed else None
        plan = SamplingPlan(cfg.sample_steps, cfg.guidance, seed=0, size=size)
        out = pipe.generate([captions[i] for i in idx], plan, batch_size=64)
        for i, img in zip(idx, out):
            images[i] = img
    return images  # type: ignore[return-value]


def plot(rows: list[dict[str, Any]], examples: dict[str, list[torch.Tensor]], captions: list[str], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from framework.inference.pipeline import to_pil

    layouts = ["wide", "tall", "square", "all"]
    fig = plt.figure(figsize=(13, 5.5))
    ax = fig.add_axes([0.05, 0.12, 0.33, 0.78])
    for k, arm in enumerate(["buckets", "square"]):
        rs = [next(r for r in rows if r["model"] == arm and r["layout"] == lay) for lay in layouts]
        ys = np.array([r["both_found"] for r in rs])
        err = np.array([[y - r["both_found_ci"][0] for y, r in zip(ys, rs)], [r["both_found_ci"][1] - y for y, r in zip(ys, rs)]])
        ax.bar(np.arange(4) + (k - 0.5) * 0.38, ys, 0.38, yerr=err, capsize=3,
               label="trained on buckets" if arm == "buckets" else f"trained on {SQUARE}x{SQUARE} centre crops")
    ax.set_xticks(range(4), layouts)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("both named blocks found where the caption puts them")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("held-out captions, 95% bootstrap intervals", fontsize=9)
    for k, arm in enumerate(["buckets", "square"]):
        for j, img in enumerate(examples[arm][:6]):
            sub = fig.add_axes([0.42 + 0.095 * j, 0.52 - 0.42 * k, 0.085, 0.36])
            sub.imshow(to_pil(img, 96))
            sub.set_xticks([])
            sub.set_yticks([])
            if j == 0:
                sub.set_ylabel("buckets" if arm == "buckets" else "crops", fontsize=9)
            if k == 0:
                sub.set_title(captions[j].replace("a ", "").replace(" scene with", ":").replace(" block", ""),
                              fontsize=5.5, wrap=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run(cfg: BucketsStudy) -> list[dict[str, Any]]:
    from data_prep.sources.shapes import HELDOUT_OFFSET, draw_scene
    from framework.evaluation.realdata import mean_with_interval
    from framework.evaluation.shapes import found_blocks, parse_scene

    root = Path(cfg.out).parent
    root.mkdir(parents=True, exist_ok=True)
    data = prepare(cfg, root)
    ckpts = {arm: train_arm(cfg, root, arm, path) for arm, path in data.items()}
    captions = [draw_scene(HELDOUT_OFFSET + i)[0].caption for i in range(cfg.eval_scenes)]
    scenes = [parse_scene(c) for c in captions]
    rows, examples = [], {}
    for arm, ckpt in ckpts.items():
        images = draw(ckpt, captions, arm == "buckets", cfg)
        examples[arm] = images
        found = torch.tensor([all(found_blocks(img, s)) for img, s in zip(images, scenes)], dtype=torch.float64)
        for layout in ("wide", "tall", "square", "all"):
            mask = torch.tensor([layout in ("all", s.layout) for s in scenes])
            rate, ci = mean_with_interval(found[mask], cfg.bootstrap)
            h, w = images[int(mask.nonzero()[0])].shape[-2:]  # the layout's first image ("all": the first image)
            rows.append({"model": arm, "layout": layout, "both_found": rate, "both_found_ci": ci,
                         "num_images": int(mask.sum()), "image_size": f"{h}x{w}", "train_steps": cfg.steps})
    print_table(rows, ["model", "layout", "image_size", "num_images", "both_found", "both_found_ci"])
    png = plot(rows, examples, captions, Path(cfg.out).with_suffix(".png"))
    print(f"[buckets] wrote {png}")
    return rows
