"""`eval.val_every_n_steps=N`: the loss on held-out latents, at fixed noise and noise levels.

The held-out set is `data.val_path`, or the `val/` split precompute writes with `val_fraction=` (data.path/val).
Every sample is denoised at LEVEL_BUCKETS noise levels, one in each quarter of the level range, from noise and
offsets drawn once from (seed, the sample's index): two evaluations of the same weights give the same numbers,
so the curve moves only when the weights do (the training loss moves with each batch's noise and levels too).
Logged at step 0 (or the resumed step) and every N optimizer steps, to every logger (metrics.csv, W&B,
TensorBoard): `val/loss`, the mean over samples and levels, and `val/loss_t{k}`, the mean over the levels whose
network timestep t / T falls in bucket k, as train/loss_t{k} is bucketed. The trained weights are measured (not the
EMA's): the curve is the training's own.

Every rank takes part (a sharded model needs all of them in each forward): rank r of W data-parallel ranks takes
samples r, r + W, ... (a sequence-parallel group takes the same ones), every rank runs the same number of batches
(a short one is padded and the padding weighs nothing), and the sums are added over ranks.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import lightning.pytorch as pl
import torch

from framework.data.datamodule import DatasetInfo, LatentCollate, choose_captions, read_dataset_info
from framework.training.draws import stream_slots
from framework.training.figures import LEVEL_BUCKETS

VAL_DRAW = 3  # the generators of the validation noise are keyed by (seed, VAL_DRAW, sample index)


def val_folder(path: str | None, data_path: str) -> str | None:
    """data.val_path, or data.path/val when precompute wrote a val_fraction split there; None when neither exists."""
    if path:
        return path
    from data_prep.location import is_remote

    split = f"{data_path.rstrip('/')}/val"
    return split if not is_remote(data_path) and (Path(split) / "dataset.json").is_file() else None


def unpacked(path: Path) -> Path | tempfile.TemporaryDirectory:
    """The dataset folder as Streaming's LocalDataset reads it, every shard uncompressed: `path` itself when its shards
    are, else a temporary copy of its indexes with each compressed shard decompressed (removed with the object)."""
    from streaming.base.compression import decompress

    indexes = sorted(path.rglob("index.json"))
    shards = [(ix.parent, s) for ix in indexes for s in json.loads(ix.read_text())["shards"]]
    if all((d / s["raw_data"]["basename"]).is_file() for d, s in shards):
        return path
    tmp = tempfile.TemporaryDirectory(prefix="lf-val-")
    for ix in indexes:
        (Path(tmp.name) / ix.relative_to(path)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ix, Path(tmp.name) / ix.relative_to(path))
    for d, s in shards:
        raw = Path(tmp.name) / d.relative_to(path) / s["raw_data"]["basename"]
        raw.parent.mkdir(parents=True, exist_ok=True)
        if (d / s["raw_data"]["basename"]).is_file():
            shutil.copy(d / s["raw_data"]["basename"], raw)
        else:
            raw.write_bytes(decompress(s["compression"], (d / s["zip_data"]["basename"]).read_bytes()))
    return tmp


class HeldOut:
    """The held-out rows of a local dataset folder, grouped by shape (a bucket's folder each), read with Streaming's
    LocalDataset (random access, no partitioning)."""

    def __init__(self, path: str) -> None:
        from data_prep.location import is_remote
        from streaming import LocalDataset

        if is_remote(path):
            raise ValueError(f"data.val_path={path}: the validation set is read from a local folder; copy it to this "
                             "machine (it is small) and give that folder")
        self.path = path
        self.info: DatasetInfo = read_dataset_info(path)
        self._unpacked = unpacked(Path(path))
        root = self._unpacked.name if isinstance(self._unpacked, tempfile.TemporaryDirectory) else str(self._unpacked)
        dirs = [b["dir"] for b in self.info.buckets] or [None]
        self.groups = [LocalDataset(str(Path(root) / d) if d else root) for d in dirs]
        self.num_samples = sum(len(g) for g in self.groups)
        if self.num_samples == 0:
            raise ValueError(f"data.val_path={path} holds no samples")
        self.collate = LatentCollate(self.info.scaling_factor, self.info.shift_factor, self.info.downsample,
                                     self.info.text_storage, self.info.caption_layout)

    def batches(self, rank: int, world: int, batch_size: int) -> Iterator[tuple[dict[str, Any], torch.Tensor, torch.Tensor]]:
        """(batch, the samples' indices in the set, their weights: 1, or 0 for padding) of rank `rank` of `world`, the
        same number of batches on every rank. A sample of several captions is measured with its first."""
        start = 0
        for group in self.groups:
            n = len(group)
            per_rank = -(-n // world)  # every rank walks ceil(n / world) slots; slots past the end are padding
            for first in range(0, per_rank, batch_size):
                slots = range(first, min(first + batch_size, per_rank))
                rows = [rank + s * world for s in slots]
                real = [i < n for i in rows]
                rows = [i if ok else rank % n for i, ok in zip(rows, real)]  # padding repeats a real row
                batch = self.collate([group[i] for i in rows])
                if "caption_counts" in batch:
                    batch = choose_captions(batch, torch.zeros(len(rows), dtype=torch.long))
                yield batch, torch.tensor(rows) + start, torch.tensor(real, dtype=torch.float32)
            start += n


def validation_loss(module: Any, held_out: HeldOut, rank: int, world: int, batch_size: int, seed: int) -> dict[str, float]:
    """{val/loss, val/loss_t0..} of the module's current weights on its data-parallel share of `held_out`, summed over
    all ranks (every rank must call this)."""
    objective, device = module.objective, module.device
    sums = torch.zeros(2, LEVEL_BUCKETS, dtype=torch.float64)  # (loss sums, counts) per bucket of t / T
    g = torch.Generator()
    with torch.no_grad():
        for batch, index, weight in held_out.batches(rank, world, batch_size):
            x0 = batch["latents"].to(device)
            text = batch["text_embeds"].to(device).float()
            mask = batch["text_mask"].to(device)
            labels = batch.get("label")
            labels = labels.to(device) if labels is not None and module.model_cfg.num_classes is not None else None
            n = x0[0].numel()
            draws = torch.empty(len(index), LEVEL_BUCKETS, n + 1)
            for row, i in enumerate(index.tolist()):
                g.manual_seed(hash((seed, VAL_DRAW, i)) & 0x7FFF_FFFF_FFFF)
                torch.rand(LEVEL_BUCKETS, n + 1, generator=g, out=draws[row])
                draws[row, :, :n] = torch.randn(LEVEL_BUCKETS, n, generator=g)
            for k in range(LEVEL_BUCKETS):
                noise = draws[:, k, :n].reshape(x0.shape).to(device)
                u = ((k + draws[:, k, n]) / LEVEL_BUCKETS).to(device)  # a level in quarter k of [0, 1)
                xt, t, target = objective.corrupt(x0, noise, u)
                pred = module.model(xt, t, text, mask, labels, size_ids=batch.get("size_ids", None))
                per = (pred.float() - target.float()).pow(2).flatten(1).mean(1).double().cpu()  # (B,)
                bucket = (t.float().cpu() / objective.cfg.num_train_timesteps * LEVEL_BUCKETS).long()
                bucket = bucket.clamp(0, LEVEL_BUCKETS - 1)
                sums[0].index_add_(0, bucket, per * weight.double())
                sums[1].index_add_(0, bucket, weight.double())
    if module.trainer.world_size > 1:
        sums = module.trainer.strategy.reduce(sums.to(device), reduce_op="sum").cpu()
    out = {"val/loss": float(sums[0].sum() / sums[1].sum())}
    out.update({f"val/loss_t{k}": float(sums[0, k] / sums[1, k]) for k in range(LEVEL_BUCKETS) if sums[1, k] > 0})
    return out


class ValidationLoss(pl.Callback):
    """Measures validation_loss at the first step and every `every_n_steps` steps and logs it."""

    def __init__(self, path: str, every_n_steps: int, batch_size: int, seed: int) -> None:
        self.path, self.every, self.batch_size, self.seed = path, every_n_steps, batch_size, seed
        self.held_out: HeldOut | None = None
        self._last_step = -1
        self.history: list[tuple[int, dict[str, float]]] = []  # (step, metrics) of every evaluation of this run

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from framework.data.datamodule import check_compatible

        self.held_out = HeldOut(self.path)
        m = pl_module.model_cfg
        check_compatible(self.held_out.info, m.in_channels, m.latent_hw, m.text_dim, m.num_frames)

    def run(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step
        if step == self._last_step:  # several micro-batches per step
            return
        self._last_step = step
        r, world = stream_slots(trainer)
        was_training = pl_module.training
        pl_module.eval()
        try:
            from framework.training.callbacks import base_precision
            from framework.training.watchdog import paused

            with paused(), base_precision(trainer, pl_module):
                metrics = validation_loss(pl_module, self.held_out, r, world, self.batch_size, self.seed)
        finally:
            from framework.distributed.fsdp import reshard

            reshard(pl_module.model)
            pl_module.train(was_training)
        self.history.append((step, metrics))
        if trainer.global_rank == 0:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.run(trainer, pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step % self.every == 0:
            self.run(trainer, pl_module)
