"""`python -m framework.sample ckpt=PATH out=DIR prompts=[...]`: write one PNG per prompt and a grid; a video model
writes one MP4 and one GIF per prompt, a grid of their frames (a row a clip) and grid.gif (the clips side by side,
playing).

With `best_of=N judge=NAME` it draws N candidates per prompt and keeps the `pick` (default 1) that the
judge prefers: by score (`selection=score`) or by a knockout tournament (`selection=tournament`).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from framework.cli import EncoderPaths, RankSharing, quiet_hydra, resolve_device, share_ranks
from framework.inference.pipeline import Pipeline, frame_strips, save_grid, save_video, to_pil
from framework.inference.sampling import SamplingPlan
from framework.evaluation.prompts import prompt_labels
from framework.evaluation.settings import ImageSize


@dataclass
class SampleCommand(RankSharing, EncoderPaths, ImageSize):
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
    """Judge that picks among the candidates (framework/evaluation/judge.py: digits, pairs, clip, vlm, digits_vlm)."""
    judge_path: str | None = None
    """Weights of judges that load them (clip: a local CLIP folder; vlm: a local vision-language model folder)."""
    selection: str = "score"
    """score (the judge's highest scores) or tournament (SANA-1.5's knockout of pairwise comparisons)."""
    pick: int = 1
    """Images kept per prompt."""
    weights: str = "ema"
    """ema (when the checkpoint has EMA weights) or train."""
    cache_schedule: str | None = None
    """Cached sampling: a cache_schedule.json from experiment=cache_router (or its run dir), or uniform:K."""
    device: str = "auto"
    fps: float | None = None
    """Video models: frames a second of the MP4s and GIFs; null: the rate the dataset's clips were taken at (else 8)."""

    def __post_init__(self) -> None:
        from framework.inference.bestof import SELECTIONS

        if self.fps is not None and self.fps <= 0:
            raise ValueError(f"fps={self.fps} must be positive")
        if self.best_of < 1:
            raise ValueError(f"best_of={self.best_of} must be >= 1")
        if self.best_of > 1 and self.judge is None:
            raise ValueError("best_of > 1 needs a judge to pick the candidates: add judge=digits (or pairs, clip, "
                             "vlm judge_path=DIR, digits_vlm)")
        if not 1 <= self.pick <= self.best_of:
            raise ValueError(f"pick={self.pick} must be between 1 and best_of={self.best_of}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection={self.selection!r}: use one of {SELECTIONS}")


ConfigStore.instance().store(name="sample_command", node=SampleCommand)
DEFAULT_FPS = 8.0  # a video model's frames a second when neither fps= nor its dataset gives one


def run(cfg: SampleCommand) -> list[Path]:
    from framework.inference.bestof import select
    from framework.evaluation.judge import get_judge

    pipe = Pipeline.from_checkpoint(cfg.ckpt, device=resolve_device(cfg.device), weights=cfg.weights,
                                    vae=cfg.vae, text_encoder=cfg.text_encoder, lazy=bool(cfg.decode_ranks))
    rank0 = share_ranks(pipe, cfg)
    prompts = list(cfg.prompts)
    judge = get_judge(cfg.judge, cfg.judge_path) if cfg.best_of > 1 else None
    t0 = time.perf_counter()
    plan = SamplingPlan.of(cfg, candidates=cfg.best_of, size=pipe.latent_size(cfg.height, cfg.width, cfg.aspect,
                                                                                cfg.num_frames))
    images = pipe.generate(prompts, plan, prompt_labels(pipe, prompts), ranks=cfg.sharing(), progress=True)
    seconds = time.perf_counter() - t0
    if images is None or not rank0:  # a rank that only helped (decode_ranks, sequence_parallel): rank 0 writes
        return []
    what = "clips" if images.ndim == 5 else "images"
    print(f"generated {len(images)} {what} ({len(prompts)} prompts x best_of {cfg.best_of}) in {seconds:.1f} s: "
          f"{len(images) / seconds:.1f} {what}/s")
    kept = select(images.view(len(prompts), cfg.best_of, *images.shape[1:]), prompts, judge, cfg.selection, cfg.pick)
    chosen = kept.flatten(0, 1)
    prompts = [p for p in prompts for _ in range(cfg.pick)]
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    fps = cfg.fps or pipe.info.get("fps") or DEFAULT_FPS
    for i, (p, img) in enumerate(zip(prompts, chosen)):
        stem = out / f"{i:03d}_{re.sub(r'[^a-zA-Z0-9]+', '_', p).strip('_')[:60]}"
        if img.ndim == 4:  # a clip (F, C, H, W)
            paths += [save_video(img, stem.with_suffix(".mp4"), fps), save_video(img, stem.with_suffix(".gif"), fps)]
        else:
            to_pil(img, 256).save(stem.with_suffix(".png"))
            paths.append(stem.with_suffix(".png"))
    paths.append(save_grid(chosen, prompts, out / "grid.png", ncol=1 if chosen.ndim == 5 else None))  # a row a clip
    if chosen.ndim == 5:  # and every clip playing at once, side by side; tiny clips enlarged by a whole factor
        both = frame_strips(chosen.transpose(0, 1))  # frame f of every clip side by side: (F, C, H, W')
        factor = max(1, 128 // both.shape[-2])
        paths.append(save_video(both, out / "grid.gif", fps, size=factor * max(both.shape[-2:])))
    return paths


@hydra.main(version_base="1.3", config_path=None, config_name="sample_command")
def main(cfg: SampleCommand) -> None:
    from framework.distributed.env import leave

    for p in run(OmegaConf.to_object(cfg)):
        print(p)
    leave()  # under torchrun: every rank ends its part in the process group before the interpreter exits


if __name__ == "__main__":
    quiet_hydra()
    main()
