"""The per-step figures a run logs beyond train/loss, as a callback (framework.train registers it with every logger).

On logging steps only (framework.training.registry.logging_step, with a logger): each figure costs a host
synchronisation, which the other steps do without.
    train/data_wait_ms    time from the end of the last step to the start of this one (the loader's fetch and
                          Lightning's transfer)
    train/peak_mem_gib    the device's peak allocation so far (GPUs only)
    train/loss_t0..3      the loss per quarter of the noise-level range (t0: least noise), over the global batch
    train/grad_norm       the global gradient norm (framework/training/finite.py), before clipping
    trainer/images_seen   samples of the whole job trained on so far (DiffusionModule.images_seen)
and, with more than one rank, each rank's figures gathered, in milliseconds (step and wait: its mean per optimizer
step since the previous logging step):
    train/step_time_{min,median,max}     a step (its micro-batches) from the batch's start to its end; it holds the
                                         waits for slower ranks in the step's collectives, so it tells a slow job,
                                         not a slow rank
    train/data_wait_{min,median,max}     the time its loader took to produce its batches (its own: not a wait for a
                                         peer in some callback's collective)
    train/arrival_wait_{min,median,max}  at the logging step's last micro-batch, after the forward and before the
                                         step's first collective: how long it waited for the last rank to get there
                                         (arrival_wait_ms); the slowest rank waits about nothing. Under FSDP the
                                         forward's all-gathers come first, so only the part of a slow rank's forward
                                         after its last all-gather shows here
    train/slowest_rank                   the rank with the largest data wait less arrival wait: a rank slow to load
                                         or to compute shows as later than its peers in one or the other
    train/rank_gather_ms                 what the previous logging step's gather of these figures cost
Under CUDA the step is timed by the device (events, read at the logging step), the data wait by the host; the
arrival barrier adds one host synchronisation per logging step.
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


def times_arrival(trainer: pl.Trainer, batch_idx: int) -> bool:
    """Whether this micro-batch waits at the arrival barrier (arrival_wait_ms): with more than one rank, on a logged
    step, at the micro-batch that takes the optimizer step (Lightning's rule, an epoch's short last step aside)."""
    return (trainer.world_size > 1 and logged(trainer)
            and (batch_idx + 1) % trainer.accumulate_grad_batches == 0)


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


def arrival_wait_ms(device: torch.device) -> float:
    """Waits for every rank to get here (the device's work first) and returns how long that took: the last rank to
    arrive waits about nothing, the others wait for it. The training step calls it on logging steps after the forward,
    before the step's first collective (train/loss's average)."""
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    dist.barrier()
    return (time.perf_counter() - start) * 1e3


class RankTimes:
    """One rank's times since the last logging step: per micro-batch its loader's wait and the whole step (CUDA
    events on a GPU, read only when reported; the host's clock on a CPU), and at the logging step its arrival wait."""

    def __init__(self) -> None:
        self.wait_s = 0.0
        self._fetch_s = 0.0  # the loader's own fetch time when last read
        self.spans: list[tuple[Any, Any]] = []  # (start, end) of each micro-batch
        self._start: Any = None

    @staticmethod
    def mark(device: torch.device) -> Any:
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    @staticmethod
    def _ms(a: Any, b: Any) -> float:
        return a.elapsed_time(b) if isinstance(a, torch.cuda.Event) else (b - a) * 1e3

    def fetched(self, trainer: pl.Trainer, gap_s: float | None) -> None:
        """Adds this batch's wait: a LatentDataModule's loader's own time since the last batch (not time spent in a
        callback's collective waiting for a peer); other data sources: the host's gap since the last step ended."""
        seconds = getattr(trainer.datamodule, "fetch_seconds", None)
        if seconds is None:
            self.wait_s += gap_s or 0.0
            return
        now = seconds()
        self.wait_s += now - self._fetch_s
        self._fetch_s = now

    def start(self, device: torch.device) -> None:
        self._start = self.mark(device)

    def end(self, device: torch.device) -> None:
        if self._start is not None:
            self.spans.append((self._start, self.mark(device)))
            self._start = None

    def report(self, steps: int, arrival_ms: float) -> list[float]:
        """[step ms, data wait ms] per optimizer step and the arrival wait [ms], and a fresh window."""
        if self.spans and isinstance(self.spans[-1][1], torch.cuda.Event):
            self.spans[-1][1].synchronize()
        n = max(steps, 1)
        mine = [sum(self._ms(a, b) for a, b in self.spans) / n, self.wait_s * 1e3 / n, arrival_ms]
        self.spans, self.wait_s = [], 0.0
        return mine


RANK_FIGURES = ("step_time", "data_wait", "arrival_wait")  # milliseconds


def log_rank_figures(trainer: pl.Trainer, pl_module: pl.LightningModule, mine: list[float], gather_ms: float) -> float:
    """Gathers every rank's RANK_FIGURES and logs their spread (the list above); returns the gather's cost."""
    start = time.perf_counter()
    every = trainer.strategy.all_gather(torch.tensor(mine, dtype=torch.float64, device=pl_module.device))
    every = every.reshape(-1, len(RANK_FIGURES)).cpu()  # (ranks, 3): the gather synchronises, reading costs no more
    cost = (time.perf_counter() - start) * 1e3
    for i, name in enumerate(RANK_FIGURES):
        column = every[:, i]
        for stat, value in (("min", column.min()), ("median", column.median()), ("max", column.max())):
            pl_module.log(f"train/{name}_{stat}", float(value), on_step=True, on_epoch=False)
    late = every[:, 1] - every[:, 2]  # its own wait for data, less its wait for the others
    pl_module.log("train/slowest_rank", float(late.argmax()), on_step=True, on_epoch=False)
    if gather_ms >= 0:
        pl_module.log("train/rank_gather_ms", gather_ms, on_step=True, on_epoch=False)
    return cost


class StepFigures(pl.Callback):
    """Logs the figures above on logging steps. The module hands over what only its step knows: the step's
    per-sample losses and levels (training_step's outputs "sample_loss", "t") and the gradient norm (finite)."""

    def __init__(self) -> None:
        self._batch_end: float | None = None  # when the last step ended: the next one's data wait starts there
        self._log_norm = False  # this batch's optimizer step is a logged one (decided before it is taken)
        self._times = RankTimes()
        self._last_logged = 0  # the global step of the previous gather (the window's start)
        self._gather_ms = -1.0  # the previous gather's cost (none yet)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        wait = None if self._batch_end is None else time.perf_counter() - self._batch_end
        if trainer.world_size > 1:
            self._times.fetched(trainer, wait)
            self._times.start(pl_module.device)
        if not logged(trainer):
            return
        if wait is not None:
            pl_module.log("train/data_wait_ms", wait * 1e3, on_step=True, on_epoch=False)
        if pl_module.device.type == "cuda":
            pl_module.log("train/peak_mem_gib", torch.cuda.max_memory_allocated(pl_module.device) / 2**30,
                          on_step=True, on_epoch=False)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_logged = trainer.global_step  # a resumed run's window starts at its first step

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        self._log_norm = logged(trainer)  # read as the step's own hook reads it, before the step counts

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.world_size > 1:
            self._times.end(pl_module.device)
        if isinstance(outputs, dict) and "sample_loss" in outputs:
            log_loss_by_level(pl_module, outputs["sample_loss"], outputs["t"])
        if self._log_norm:
            pl_module.log("train/grad_norm", pl_module.finite.grad_norm.detach().float(), on_step=True,
                          on_epoch=False)
            pl_module.log("trainer/images_seen", float(pl_module.images_seen), on_step=True, on_epoch=False)
            if trainer.world_size > 1:  # every rank decides alike (the step number), so every rank gathers
                mine = self._times.report(trainer.global_step - self._last_logged, pl_module.arrival_ms)
                self._gather_ms = log_rank_figures(trainer, pl_module, mine, self._gather_ms)
                self._last_logged = trainer.global_step
            self._log_norm = False
        self._batch_end = time.perf_counter()
