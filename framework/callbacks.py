"""Framework callbacks (not plugins): sample grids during training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from framework.pipeline import Pipeline, save_grid
from framework.registry import averaged_weights
from framework.fsdp import reshard


def module_pipeline(pl_module: pl.LightningModule) -> Pipeline:
    """A Pipeline over the live module's denoiser (its current weights, whatever they are swapped to).

    Build it once per callback and keep it: it loads the image codec now and the text encoder on first use.
    """
    return Pipeline(pl_module.model, pl_module.objective, pl_module.empty_text, pl_module.dataset_info, pl_module.device)


class SampleGrid(pl.Callback):
    """Draws a prompt grid every `every_n_steps` steps and when training ends; saves it under run.dir/samples.

    Every rank runs the sampler on its share of the images (a sharded model needs all ranks in each
    forward); rank 0 writes.
    """

    def __init__(self, cfg: Any, out_dir: str | Path) -> None:
        self.cfg, self.out_dir = cfg, Path(out_dir)
        self.paths: list[Path] = []
        self._pipe: Pipeline | None = None
        self._last_step = -1

    def _pipeline(self, pl_module: pl.LightningModule) -> Pipeline:
        if self._pipe is None:
            self._pipe = module_pipeline(pl_module)
        return self._pipe

    def draw(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Path | None:
        step = trainer.global_step
        if step == self._last_step:
            return None
        self._last_step = step
        c = self.cfg
        prompts = [p for p in c.prompts for _ in range(c.per_prompt)]
        labels = None
        if pl_module.model_cfg.num_classes is not None:
            from framework.judge import prompt_digit

            labels = [prompt_digit(p) for p in prompts]
        was_training = pl_module.training
        pl_module.eval()
        try:
            # When a plugin keeps averaged weights (a WeightAverager, e.g. plugins/ema.py), grids show them.
            with averaged_weights(trainer, pl_module):
                images = self._pipeline(pl_module).generate(prompts, c.steps, c.guidance, c.sampler, c.seed, labels,
                                                            split_ranks=trainer.world_size > 1)
        finally:
            reshard(pl_module.model)
            pl_module.train(was_training)
        if trainer.global_rank != 0:
            return None
        # Column = prompt, row = seed.
        order = [i * c.per_prompt + r for r in range(c.per_prompt) for i in range(len(c.prompts))]
        path = save_grid(images[order], [prompts[i] for i in order], self.out_dir / f"step{step:07d}.png", ncol=len(c.prompts))
        self.paths.append(path)
        for logger in trainer.loggers:
            if hasattr(logger, "log_image"):
                logger.log_image(key="samples", images=[str(path)], step=step)
        return path

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        n = self.cfg.every_n_steps
        if n and trainer.global_step % n == 0 and trainer.global_step > 0:
            self.draw(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.draw(trainer, pl_module)
