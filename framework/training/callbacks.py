"""Framework callbacks (not plugins): sample grids during training, throughput read on logging steps."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn

from framework.inference.pipeline import Pipeline, save_grid, to_pil, with_encoders
from framework.inference.sampling import SamplingPlan
from framework.inference.sharing import SplitRanks
from framework.evaluation.prompts import grid_prompts, prompt_labels
from framework.training.loggers import log_images
from framework.training.registry import averaged_weights, logging_step
from framework.distributed.fsdp import reshard


def module_pipeline(pl_module: pl.LightningModule, vae: str | None = None, text_encoder: str | None = None) -> Pipeline:
    """A Pipeline over the live module's denoiser (its current weights, whatever they are swapped to), with
    the dataset's encoders or the given folders (sample.vae / sample.text_encoder).

    Build it once per callback and keep it: it loads the image codec now and the text encoder on first use.
    """
    # The text encoder is checked at start-up, only where a prompt needs it (framework.preflight.check_encoders).
    info = with_encoders(pl_module.dataset_info, vae, text_encoder, ("sample.vae", "sample.text_encoder"), text=False)
    return Pipeline(pl_module.model, pl_module.objective, pl_module.empty_text, info, pl_module.device)


@contextmanager
def inference_view(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Iterator[None]:
    """The module as sampling and evaluation during training see it: eval mode, with the averaged weights when a
    plugin keeps them (a WeightAverager, e.g. plugins/ema.py); afterwards the training weights, sharded again under
    fsdp, and the module's training mode as it was. The hang watchdog does not time it (it progresses at its own
    pace)."""
    from framework.training.watchdog import paused

    was_training = pl_module.training
    pl_module.eval()
    try:
        with paused(), averaged_weights(trainer, pl_module), base_precision(trainer, pl_module):
            yield
    finally:
        reshard(pl_module.model)
        pl_module.train(was_training)


def base_precision(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
    """The training's autocast when the module's frozen base is held in bf16 (adapter.base_dtype=bf16), which computes
    only under it; nothing otherwise (sampling keeps the weights' own precision)."""
    from contextlib import nullcontext

    adapter = getattr(pl_module, "adapter_cfg", None)
    if adapter is None or adapter.base_dtype == "fp32":
        return nullcontext()
    return trainer.precision_plugin.forward_context()


class SampleGrid(pl.Callback):
    """Draws a prompt grid every `every_n_steps` steps and when training ends; saves it under run.dir/samples.

    Every rank runs the sampler on its share of the images (a sharded model needs all ranks in each
    forward); rank 0 decodes them all (only rank 0 loads the VAE) and writes.
    """

    def __init__(self, cfg: Any, out_dir: str | Path) -> None:
        self.cfg, self.out_dir = cfg, Path(out_dir)
        self.paths: list[Path] = []
        self.failed: str | None = None  # why the final grid failed, if it did
        self._pipe: Pipeline | None = None
        self._last_step = -1

    def _pipeline(self, pl_module: pl.LightningModule) -> Pipeline:
        if self._pipe is None:
            self._pipe = module_pipeline(pl_module, self.cfg.vae, self.cfg.text_encoder)
        return self._pipe

    def draw(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Path | None:
        step = trainer.global_step
        if step == self._last_step:
            return None
        self._last_step = step
        c = self.cfg
        columns = c.prompts or grid_prompts(pl_module.dataset_info)
        prompts = [p for p in columns for _ in range(c.per_prompt)]
        labels = prompt_labels(self._pipeline(pl_module), prompts)
        try:
            # Eager under strategy.compile=true: a grid's few forwards cost less than compiling the blocks' no-grad
            # graphs (two on a CPU PixArt: a 3-step test run took 39 s with them, 28 s without).
            with inference_view(trainer, pl_module), torch.compiler.set_stance("force_eager"):
                # Every rank denoises its share; rank 0 alone decodes (no VAE on the other ranks) and writes.
                ranks = SplitRanks(decode_on_rank0=True) if trainer.world_size > 1 else None
                images = self._pipeline(pl_module).generate(prompts, SamplingPlan.of(c), labels, ranks=ranks)
        finally:
            self._pipeline(pl_module).free_text_encoder()  # not held between grids
        if trainer.global_rank != 0:
            return None
        # Column = prompt, row = seed; clips (their frames a strip): a row each, each prompt's seeds together.
        video = images.ndim == 5
        order = ([i * c.per_prompt + r for i in range(len(columns)) for r in range(c.per_prompt)] if video else
                 [i * c.per_prompt + r for r in range(c.per_prompt) for i in range(len(columns))])
        path = save_grid(images[order], [prompts[i] for i in order], self.out_dir / f"step{step:07d}.png",
                         ncol=1 if video else len(columns))
        self.paths.append(path)
        # To W&B and TensorBoard: one image per prompt and seed with its prompt as the caption (the grid stays in
        # run.dir/samples/).
        captions = [prompts[i] + (f" (seed {k // len(columns)})" if c.per_prompt > 1 else "") for k, i in enumerate(order)]
        for logger in trainer.loggers:
            log_images(logger, "samples", [to_pil(images[i], size=96) for i in order], captions, step)
        return path

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        n = self.cfg.every_n_steps
        if n and trainer.global_step % n == 0 and trainer.global_step > 0:
            self.draw(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The final checkpoint is already written (FinalCheckpoint runs first): a grid that fails now is
        # reported, and the run it would otherwise end keeps its weights, logs and exit status.
        try:
            self.draw(trainer, pl_module)
        except Exception as err:  # noqa: BLE001 - any failure of the optional last picture
            self.failed = f"{type(err).__name__}: {err}"
            rank_zero_warn(f"the final sample grid failed, the run is saved: {self.failed}")


def evaluate_module(settings: Any, trainer: pl.Trainer, pl_module: pl.LightningModule, pipe: Pipeline,
                    out_dir: Path) -> dict[str, Any]:
    """framework.eval's metrics for the module's current weights (averaged ones when a plugin keeps them),
    generated through `pipe` (framework.training.callbacks.module_pipeline of the module).

    Every rank takes part (a sharded model needs all of them in each forward, and they share the
    images); rank 0 writes out_dir/metrics.json and the judged grid and logs `eval/*` at this step.
    Returns {} when the dataset has no built-in metrics.
    """
    from framework.evaluation.evaluate import evaluate
    from framework.evaluation.prompts import dataset_kind

    if dataset_kind(pl_module.dataset_info) is None and not settings.real:
        return {}
    rank0 = trainer.global_rank == 0
    if rank0:
        out_dir.mkdir(parents=True, exist_ok=True)
    with inference_view(trainer, pl_module):
        ranks = SplitRanks() if trainer.world_size > 1 else None
        metrics = evaluate(pipe, settings, out_dir / "judged.png" if rank0 else None, ranks)
    if rank0:
        (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
        flat = {f"eval/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}
        for logger in trainer.loggers:
            logger.log_metrics(flat, step=trainer.global_step)
            logger.save()
    return metrics


class PeriodicEval(pl.Callback):
    """`eval.every_n_steps=N`: the evaluation at step 0 (or the resumed step) and every N steps, written to
    run.dir/eval/stepNNNNNNN/ and logged as `eval/*` (metrics.csv, W&B): quality curves against steps."""

    def __init__(self, settings: Any, run_dir: str | Path, vae: str | None = None, text_encoder: str | None = None) -> None:
        self.settings, self.out_dir = settings, Path(run_dir) / "eval"
        self.encoders = (vae, text_encoder)  # sample.vae / sample.text_encoder
        self._last_step = -1
        self._pipe: Pipeline | None = None  # one for the whole run: the text encoder loads once

    def run(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step
        if step == self._last_step:  # several micro-batches per step, or already done at this step
            return
        self._last_step = step
        if self._pipe is None:
            self._pipe = module_pipeline(pl_module, *self.encoders)
        evaluate_module(self.settings, trainer, pl_module, self._pipe, self.out_dir / f"step{step:07d}")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.run(trainer, pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step % self.settings.every_n_steps == 0:
            self.run(trainer, pl_module)


class LoggedStepThroughput(ThroughputMonitor):
    """Lightning's ThroughputMonitor (samples/s, TFLOP/s, MFU) with the clock read on logging steps only.

    Lightning's reads it after every batch, and on a GPU waits for the device first (torch.cuda.synchronize), a
    host synchronisation on every step. Here the batches and samples of the other steps are counted on the host
    and the clock is read when the rates are logged: each rate is the average since the previous logging step.
    """

    def __init__(self) -> None:
        super().__init__(batch_size_fn=lambda b: b["latents"].shape[0], window_size=2)
        self._pending = (0, 0, 0)  # batches, samples and FLOPs since the last reading
        self._step = -1  # trainer.global_step after the previous batch: a batch that moved it ended a step

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._step = trainer.global_step

    @rank_zero_only
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           *args: Any) -> None:
        stepped, self._step = trainer.global_step != self._step, trainer.global_step
        flops = pl_module.batch_flops(batch) if hasattr(pl_module, "batch_flops") else 0
        if not stepped or not logging_step(trainer, stepped=True):  # mid-accumulation, or a step whose rates are not logged
            batches, samples, pending = self._pending
            self._pending = (batches + 1, samples + self.batch_size_fn(batch), pending + flops)
            return
        stage = trainer.state.stage
        batches, samples, pending = self._pending
        self._batches[stage] += batches  # the base class adds this batch's own
        self._samples[stage] += samples
        self._pending = (0, 0, 0)
        if hasattr(pl_module, "batch_flops"):
            # The base class reads flops_per_batch as the FLOPs since its previous reading (Throughput.update's
            # `flops`): every batch since then, each its own shape's count. A batch's count alone, as before, made
            # TFLOP/s and MFU log_every_n_steps x accumulate_grad_batches times too low.
            pl_module.flops_per_batch = pending + flops
        super().on_train_batch_end(trainer, pl_module, outputs, batch, *args)
