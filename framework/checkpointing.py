"""Checkpoints that survive being killed, resume=auto, and reading sharded checkpoint folders.

A checkpoint is either one file (Lightning's torch.save dict) or, under fsdp, a folder written by
torch.distributed.checkpoint (DCP): `.metadata` + one `__<rank>_0.distcp` file per rank with the
sharded `state_dict` and `optimizer_0`, plus Lightning's `meta.pt` with everything else (loop
state, data-loader state, our `latentforge` entry). Lightning writes both in place; the gaps filled
here are atomic replacement, picking the newest of last.ckpt and the Slurm `hpc_ckpt_*.ckpt`, and
turning a folder back into one plain dict without starting a process group.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch.plugins.io import TorchCheckpointIO

# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save to `<path>.tmp`, then os.replace: a reader never sees a half-written file."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)  # object stores are atomic per put
        path = Path(path)
        if path.is_dir():
            raise IsADirectoryError(f"{path} is a sharded checkpoint folder; set strategy.sharded_checkpoint=true "
                                    "or write the single-file checkpoint under another run.dir")
        tmp = path.with_name(path.name + ".tmp")
        super().save_checkpoint(checkpoint, tmp, storage_options)
        os.replace(tmp, path)


class FinalCheckpoint(pl.Callback):
    """Write checkpoints/last.ckpt when training ends, unless ModelCheckpoint just did at this step.

    Saved in on_train_end, while the fit loop still holds the data loader: after `fit` returns, a
    multi-rank StreamingDataLoader reports 0 samples seen and the checkpoint would restart the data.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        mc = trainer.checkpoint_callback
        if mc is not None and getattr(mc, "_last_global_step_saved", -1) == trainer.global_step and _complete(self.path):
            return
        trainer.save_checkpoint(self.path)


# --------------------------------------------------------------------------------------------
# resume=auto
# --------------------------------------------------------------------------------------------


def is_sharded(path: str | os.PathLike) -> bool:
    """A DCP checkpoint folder (Lightning's layout)."""
    p = Path(path)
    return p.is_dir() and (p / _METADATA_FILENAME).is_file() and (p / ".metadata").is_file()


def _complete(path: Path) -> bool:
    return is_sharded(path) or (path.is_file() and path.stat().st_size > 0)


def _stamp(path: Path) -> float:
    return (path / _METADATA_FILENAME).stat().st_mtime if path.is_dir() else path.stat().st_mtime


def find_resumable(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run: checkpoints/last.ckpt or Lightning's Slurm hpc_ckpt_*.ckpt.

    A `.old` copy counts too: it exists only when a job died while swapping a new folder in.
    """
    candidates = [run_dir / "checkpoints" / "last.ckpt", run_dir / "checkpoints" / "last.ckpt.old"]
    candidates += sorted(run_dir.glob("hpc_ckpt_*.ckpt"))
    found = [p for p in candidates if _complete(p)]
    return max(found, key=_stamp) if found else None


# --------------------------------------------------------------------------------------------
# Reading a sharded folder in one process (sample, eval, export, resume into another strategy)
# --------------------------------------------------------------------------------------------


def read_sharded(path: str | os.PathLike, with_optimizer: bool = False) -> dict[str, Any]:
    """A DCP folder as one Lightning-style dict: meta.pt + full (unsharded) `state_dict` tensors.

    DCP reads any sharding into plain tensors without a process group (no_dist=True).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    meta = torch.load(path / _METADATA_FILENAME, map_location="cpu", weights_only=True)
    reader = dcp.FileSystemReader(str(path))
    keys = reader.read_metadata().state_dict_metadata
    wanted = ("state_dict.", "optimizer_0.") if with_optimizer else ("state_dict.",)
    state: dict[str, Any] = {}
    for k, md in keys.items():
        if k.startswith(wanted) and isinstance(md, TensorStorageMetadata):
            state[k] = torch.empty(md.size, dtype=md.properties.dtype)
    dcp.load(state, storage_reader=reader, no_dist=True)
    meta["state_dict"] = {k[len("state_dict."):]: v for k, v in state.items() if k.startswith("state_dict.")}
    return meta


# --------------------------------------------------------------------------------------------
# Preemption under submitit
# --------------------------------------------------------------------------------------------


class SubmititPreemption(pl.Callback):
    """Save an hpc checkpoint on submitit's preemption signal, then let submitit requeue the job.

    submitit (the hydra/launcher=slurm path) owns the signal (USR2) and resubmits the job itself;
    Lightning's own SLURM handler sees another signal and would not save. This callback wraps
    submitit's handler: the signal only sets a flag, every rank agrees at the next step boundary
    (so the collective save happens at the same step everywhere), saves, then calls submitit.
    """

    def __init__(self, signum: int = signal.SIGUSR2) -> None:
        self.signum, self.flag, self._previous = signum, False, None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._previous = signal.getsignal(self.signum)
        signal.signal(self.signum, lambda *_: setattr(self, "flag", True))

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        flag = torch.tensor(float(self.flag), device=trainer.strategy.root_device)
        if trainer.world_size > 1:
            flag = trainer.strategy.reduce(flag, reduce_op="max")
        if not bool(flag):
            return
        trainer.save_checkpoint(trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir))
        if callable(self._previous):
            self._previous(self.signum, None)  # submitit: pickle the job, requeue, exit
