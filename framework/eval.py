"""`python -m framework.eval ckpt=PATH`: generate for a prompt set and score it.

For the digits data the score is `prompt_accuracy`: the share of generated images the digit judge
classifies as the digit their prompt asked for, over every digit, several caption phrasings and
several seeds. The last line of output is one JSON object of metrics.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import numpy as np
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from framework.cli import quiet_hydra, resolve_device
from framework.config import EvalSettings
from framework.pipeline import Pipeline, save_grid


def digit_prompts(phrasings: int) -> list[tuple[str, int]]:
    """(prompt, digit) pairs: every digit in `phrasings` caption phrasings."""
    from data_prep.sources.digits import digit_captions

    pairs = []
    for d in range(10):
        caps = digit_captions(d)
        if phrasings > len(caps):
            raise ValueError(f"phrasings={phrasings}: the digits captions have only {len(caps)} phrasings")
        pairs += [(c, d) for c in caps[:phrasings]]
    return pairs


def is_digits(info: dict[str, Any]) -> bool:
    return info.get("num_classes") == 10 and "digits" in str(info.get("source", ""))


def evaluate_digits(
    pipe: Pipeline,
    seeds: int = 4,
    phrasings: int = 3,
    steps: int = 20,
    guidance: float = 4.0,
    sampler: str | None = None,
    batch_size: int = 64,
    grid_path: str | Path | None = None,
    split_ranks: bool = False,
) -> dict[str, Any]:
    """prompt_accuracy of `pipe` on the digits prompt set; optionally writes a grid of what it judged.

    split_ranks: called by every rank of a multi-process job, which share the generation (Pipeline.generate).
    """
    from framework.judge import get_judge

    judge = get_judge("digits")
    pairs = digit_prompts(phrasings)
    prompts = [p for p, _ in pairs for _ in range(seeds)]
    digits = [d for _, d in pairs for _ in range(seeds)]
    t0 = time.perf_counter()
    images = pipe.generate(prompts, steps, guidance, sampler, seed=0, labels=digits, batch_size=batch_size,
                           split_ranks=split_ranks)
    seconds = time.perf_counter() - t0
    pred = judge.predict(images)
    right = pred == np.array(digits)
    per_digit = {str(d): float(right[np.array(digits) == d].mean()) for d in range(10)}
    if grid_path is not None:
        # One row per phrasing-seed, one column per digit: the eye checks the judge.
        order = sorted(range(len(prompts)), key=lambda i: (i % (seeds * phrasings), digits[i]))
        caps = [f"{prompts[i]} -> {pred[i]}" for i in order]
        save_grid(images[order], caps, grid_path, ncol=10)
    return {
        "prompt_accuracy": float(right.mean()),
        "judge_heldout_accuracy": judge.heldout_accuracy,
        "num_images": len(prompts),
        "per_digit_accuracy": per_digit,
        "images_per_s": len(prompts) / seconds,
    }


# --------------------------------------------------------------------------------------------
# Command
# --------------------------------------------------------------------------------------------


@dataclass
class EvalCommand(EvalSettings):
    """Arguments of `python -m framework.eval`."""

    ckpt: str = "???"
    """Checkpoint to evaluate."""
    out: str | None = None
    """Folder for the judged grid and metrics.json (default: beside the checkpoint's run dir)."""
    weights: str = "ema"
    """ema (when the checkpoint has EMA weights) or train."""
    device: str = "auto"
    """auto: a GPU when present."""


ConfigStore.instance().store(name="eval_command", node=EvalCommand)


@hydra.main(version_base="1.3", config_path=None, config_name="eval_command")
def main(cfg: EvalCommand) -> None:
    cfg = OmegaConf.to_object(cfg)
    pipe = Pipeline.from_checkpoint(cfg.ckpt, device=resolve_device(cfg.device), weights=cfg.weights)
    if not is_digits(pipe.info):
        raise SystemExit(
            f"framework.eval: the checkpoint was trained on {pipe.info.get('source')!r}; only the digits prompt set"
            " has a judge. Use framework.sample to look at the images."
        )
    out = Path(cfg.out) if cfg.out else Path(cfg.ckpt).resolve().parent.parent / "eval"
    out.mkdir(parents=True, exist_ok=True)
    metrics = evaluate_digits(
        pipe, cfg.seeds, cfg.phrasings, cfg.steps, cfg.guidance, cfg.sampler, cfg.batch_size, out / "judged.png"
    )
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(f"judged grid: {out / 'judged.png'}")
    print(json.dumps(metrics))


if __name__ == "__main__":
    quiet_hydra()
    main()
