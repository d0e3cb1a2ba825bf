"""Loggers: Lightning's CSV, W&B and TensorBoard loggers, set up for stable run directories that get resumed."""

from __future__ import annotations

import csv
import os
import uuid
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter


class _AppendingWriter(ExperimentWriter):
    """Lightning's writer deletes an existing metrics.csv; a resumed run must append to it instead."""

    def _check_log_dir_exists(self) -> None:
        if os.path.isfile(self.metrics_file_path):
            with open(self.metrics_file_path, newline="") as f:
                self.metrics_keys = list(next(csv.reader(f), []))


class RunCSVLogger(CSVLogger):
    """metrics.csv directly in run.dir (no version sub-folders), kept across restarts."""

    def __init__(self, run_dir: str | Path) -> None:
        super().__init__(save_dir=str(run_dir), name="", version="")

    @property
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment


def tensorboard_logger(run_dir: Path) -> Any:
    """Lightning's TensorBoardLogger writing to run.dir/tensorboard/ itself (no version sub-folders: a resumed run's
    event file goes beside the first's, and TensorBoard reads the folder as one run). Rank 0 writes. The run's config
    goes to hparams.yaml there and, as YAML, to the Text tab under `config` (Lightning writes its hparams event only
    with a metric, and its hparams.yaml only if none exists yet, possibly before the config is known)."""
    try:
        import tensorboard  # noqa: F401  (Lightning would fall back to tensorboardX, or fail at the first log)
        from lightning.pytorch.loggers import TensorBoardLogger
    except ImportError as e:
        raise ImportError('logger=tensorboard needs the tensorboard package: pip install -e ".[tensorboard]"') from e
    from lightning.pytorch.utilities import rank_zero_only

    class RunTensorBoardLogger(TensorBoardLogger):
        @rank_zero_only
        def log_hyperparams(self, params: Any, metrics: Any = None) -> None:
            import yaml

            super().log_hyperparams(params, metrics)
            text = yaml.safe_dump(dict(params), sort_keys=False)
            self._fs.makedirs(self.log_dir, exist_ok=True)
            Path(self.log_dir, self.NAME_HPARAMS_FILE).write_text(text)
            self.experiment.add_text("config", "```\n" + text + "```", 0)

    return RunTensorBoardLogger(save_dir=str(run_dir / "tensorboard"), name="", version="", default_hp_metric=False)


def log_images(logger: Any, key: str, images: list[Any], captions: list[str], step: int) -> None:
    """PIL images (one size) to a logger that shows pictures: W&B, one image per caption; TensorBoard, the images as
    one batch under `key` and their captions, numbered in that order, as text under `key`/captions. Others: none."""
    from lightning.pytorch.loggers import TensorBoardLogger

    if isinstance(logger, TensorBoardLogger):
        import numpy as np

        batch = np.stack([np.asarray(im.convert("RGB")) for im in images])
        logger.experiment.add_images(key, batch, step, dataformats="NHWC")
        logger.experiment.add_text(f"{key}/captions", "  \n".join(f"{i}: {c}" for i, c in enumerate(captions)), step)
    elif hasattr(logger, "log_image"):
        logger.log_image(key=key, images=images, caption=captions, step=step)


def wandb_logger(run_dir: Path, cfg: Any, run_name: str, rank: int) -> Any:
    """W&B in `cfg.mode` (online / offline) with the run's name, group and tags; a resumed or requeued run
    continues the same W&B run: its id lives in run.dir/wandb_id.txt, written by global rank 0 only (the
    other ranks log nothing and must not race it with ids of their own)."""
    from lightning.pytorch.loggers import WandbLogger

    run_id = None
    if rank == 0:
        id_file = run_dir / "wandb_id.txt"
        if not id_file.exists():
            # W&B run ids are short lowercase alphanumerics. wandb.util.generate_id moved between wandb
            # releases (gone in 0.31), so the id is drawn here rather than from a private helper.
            id_file.write_text(uuid.uuid4().hex[:8])
        run_id = id_file.read_text().strip()
    return WandbLogger(
        name=cfg.name or run_name, group=cfg.group, tags=list(cfg.tags) or None, project=cfg.project,
        entity=cfg.entity, save_dir=str(run_dir), offline=cfg.mode == "offline", id=run_id, resume="allow",
    )
