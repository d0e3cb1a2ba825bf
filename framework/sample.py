"""`python -m framework.sample ckpt=PATH out=DIR prompts=[...]`: write one PNG per prompt and a grid.

With `best_of=N judge=NAME` it draws N candidates per prompt and keeps the one the judge scores
highest for that prompt (for the digits judge: the largest margin of the requested digit).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from framework.cli import quiet_hydra, resolve_device
from framework.pipeline import Pipeline, save_grid, to_pil


@dataclass
class SampleCommand:
    """Arguments of `python -m framework.sample`."""

    ckpt: str = "???"
    """Checkpoint to sample from."""
    out: str = "samples"
    """Output folder for the PNGs and grid.png."""
    prompts: list[str] = field(default_factory=lambda: ["a handwritten 3"])
    """Prompts, one image each (times best_of candidates)."""
    steps: int = 20
    guidance: float = 4.0
    sampler: str | None = None
    """ddim, dpm++ or flow_euler; null: the objective's default."""
    seed: int = 0
    best_of: int = 1
    """Candidates per prompt; > 1 needs a judge."""
    judge: str | None = None
    """Judge that picks the best candidate (digits)."""
    weights: str = "ema"
    """ema (when the checkpoint has EMA weights) or train."""
    device: str = "auto"

    def __post_init__(self) -> None:
        if self.best_of < 1:
            raise ValueError(f"best_of={self.best_of} must be >= 1")
        if self.best_of > 1 and self.judge is None:
            raise ValueError("best_of > 1 needs a judge to pick the best candidate: add judge=digits")


ConfigStore.instance().store(name="sample_command", node=SampleCommand)


def _labels(pipe: Pipeline, prompts: list[str]) -> list[int | None] | None:
    if pipe.model.cfg.num_classes is None:
        return None
    from framework.judge import prompt_digit

    return [prompt_digit(p) for p in prompts]


def run(cfg: SampleCommand) -> list[Path]:
    pipe = Pipeline.from_checkpoint(cfg.ckpt, device=resolve_device(cfg.device), weights=cfg.weights)
    prompts = list(cfg.prompts)
    cands = [p for p in prompts for _ in range(cfg.best_of)]
    images = pipe.generate(cands, cfg.steps, cfg.guidance, cfg.sampler, cfg.seed, labels=_labels(pipe, cands))
    images = images.view(len(prompts), cfg.best_of, *images.shape[1:])
    if cfg.best_of > 1:
        from framework.judge import get_judge, prompt_digit

        judge = get_judge(cfg.judge)
        digits = [prompt_digit(p) for p in prompts]
        if any(d is None for d in digits):
            bad = [p for p, d in zip(prompts, digits) if d is None]
            raise ValueError(f"judge={cfg.judge} cannot tell which digit these prompts ask for: {bad}")
        scores = judge.score(images.flatten(0, 1), [d for d in digits for _ in range(cfg.best_of)])
        best = torch.as_tensor(scores).view(len(prompts), cfg.best_of).argmax(dim=1)
        chosen = images[torch.arange(len(prompts)), best]
    else:
        chosen = images[:, 0]
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (p, img) in enumerate(zip(prompts, chosen)):
        path = out / f"{i:03d}_{re.sub(r'[^a-zA-Z0-9]+', '_', p).strip('_')[:60]}.png"
        to_pil(img, 256).save(path)
        paths.append(path)
    paths.append(save_grid(chosen, prompts, out / "grid.png"))
    return paths


@hydra.main(version_base="1.3", config_path=None, config_name="sample_command")
def main(cfg: SampleCommand) -> None:
    for p in run(OmegaConf.to_object(cfg)):
        print(p)


if __name__ == "__main__":
    quiet_hydra()
    main()
