"""The per-step figures a run logs beyond train/loss, as a callback (framework.train registers it with every logger).

On logging steps only (framework.training.registry.logging_step, with a logger): each figure costs a host
synchronisation, which the other steps do without.
    train/data_wait_ms    time from the end of the last step to the start of this one (the loader's fetch and
                          Lightning's transfer)
    train/peak_mem_gib    the device's peak allocation so far (GPUs only)
    train/loss_t0..3      the loss per quarter of the noise-level range (t0: least noise), over the global batch
    train/grad_norm       the global gradient norm (framework/training/finite.py), before clipping
    trainer/images_seen   samples of the whole job trained on so far (DiffusionModule.images_seen)
and the FLOPs of a batch (batch_flops), which Lightning's ThroughputMonitor (framework.training.callbacks.
LoggedStepThroughput) turns into TFLOP/s and MFU.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch

from framework.training.registry import logging_step

LEVEL_BUCKETS = 4  # train/loss_t0..3: the loss per quarter of the noise-level range (t0: least noise)


def logged(trainer: pl.Trainer, stepped: bool = False) -> bool:
    """Whether this step's values reach a logger (framework.training.registry.logging_step, with a logger)."""
    return bool(trainer.loggers) and logging_step(trainer, stepped)


def sample_losses(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(B,) each sample's mean squared error, detached: what train/loss_t0..3 average."""
    return (pred.detach().float() - target.float()).pow(2).flatten(1).mean(1)


def log_loss_by_level(pl_module: pl.LightningModule, per: torch.Tensor, t: torch.Tensor) -> None:
    """train/loss_t{k}: the mean loss of the global batch's samples whose noise level t / T falls in bucket k
    of LEVEL_BUCKETS (where a model is weak shows here, not in the mean)."""
    trainer = pl_module.trainer
    k = (t.float() / pl_module.objective.cfg.num_train_timesteps * LEVEL_BUCKETS).long().clamp(0, LEVEL_BUCKETS - 1)
    sums = per.new_zeros(LEVEL_BUCKETS).index_add_(0, k, per)
    counts = per.new_zeros(LEVEL_BUCKETS).index_add_(0, k, torch.ones_like(per))
    if trainer.world_size > 1:
        both = trainer.strategy.reduce(torch.cat([sums, counts]), reduce_op="sum")
        sums, counts = both[:LEVEL_BUCKETS], both[LEVEL_BUCKETS:]
    for i, (total, n) in enumerate(zip(sums.tolist(), counts.tolist())):
        if n > 0:
            pl_module.log(f"train/loss_t{i}", total / n, on_step=True, on_epoch=False)


def batch_flops(module: pl.LightningModule, batch: dict[str, Any]) -> int:
    """The training FLOPs of `batch`, counted once per latent shape (module._batch_flops): the buckets of a dataset
    (sizes, clip lengths) cost differently. A count set from outside before training (module.flops_per_batch: the
    bench's, whose batches may be pixels) stands for its one shape."""
    shape = tuple(batch["latents"].shape) if "latents" in batch else ()
    if shape not in module._batch_flops:
        if module.flops_per_batch is not None and not module._batch_flops:
            module._batch_flops[shape] = module.flops_per_batch
        else:
            from framework.models.flops import count_train_flops_per_sample

            module._batch_flops[shape] = count_train_flops_per_sample(module.model, batch) * shape[0]
    return module._batch_flops[shape]


class StepFigures(pl.Callback):
    """Logs the figures above on logging steps. The module hands over what only its step knows: the step's
    per-sample losses and levels (training_step's outputs "sample_loss", "t") and the gradient norm (finite)."""

    def __init__(self) -> None:
        self._batch_end: float | None = None  # when the last step ended: the next one's data wait starts there
        self._log_norm = False  # this batch's optimizer step is a logged one (decided before it is taken)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if not logged(trainer):
            return
        if self._batch_end is not None:
            pl_module.log("train/data_wait_ms", (time.perf_counter() - self._batch_end) * 1e3, on_step=True,
                          on_epoch=False)
        if pl_module.device.type == "cuda":
            pl_module.log("train/peak_mem_gib", torch.cuda.max_memory_allocated(pl_module.device) / 2**30,
                          on_step=True, on_epoch=False)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        self._log_norm = logged(trainer)  # read as the step's own hook reads it, before the step counts

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if isinstance(outputs, dict) and "sample_loss" in outputs:
            log_loss_by_level(pl_module, outputs["sample_loss"], outputs["t"])
        if self._log_norm:
            pl_module.log("train/grad_norm", pl_module.finite.grad_norm.detach().float(), on_step=True,
                          on_epoch=False)
            pl_module.log("trainer/images_seen", float(pl_module.images_seen), on_step=True, on_epoch=False)
            self._log_norm = False
        self._batch_end = time.perf_counter()
