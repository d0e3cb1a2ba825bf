"""Loggers: Lightning's CSV and W&B loggers, set up for stable run directories that get resumed."""

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
