"""The checkpoint format as the commands read it (sample, eval, export, growth, pruning), without Lightning.

A training checkpoint is Lightning's dict (one torch.save file) or, under fsdp, a folder written by
torch.distributed.checkpoint (DCP): `.metadata` and one `__<rank>_0.distcp` file per rank with the sharded
`state_dict` and `optimizer_0`, plus `meta.pt` with everything else. Our own entry, `latentforge`
(CKPT_KEY), holds the run's config, the dataset's summary, the empty caption's embedding and the EMA.
Writing, resuming and preemption are training's (framework/training/checkpointing.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

CKPT_KEY = "latentforge"  # our own entry in the Lightning checkpoint dict
METADATA_FILE = "meta.pt"  # what Lightning names the non-tensor part of a sharded folder (its _METADATA_FILENAME)


# --------------------------------------------------------------------------------------------
# Sharded folders
# --------------------------------------------------------------------------------------------


def checkpoint_meta(path: Path) -> dict[str, Any]:
    """A checkpoint's entries for reading its small ones (global_step, CKPT_KEY): a folder's meta.pt, or a file
    memory-mapped, so that only the pages the entries read are, not the tensors."""
    if path.is_dir():
        return torch.load(path / METADATA_FILE, map_location="cpu", weights_only=True)
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def checkpoint_step(path: Path) -> int:
    """The global step a checkpoint was written at."""
    return int(checkpoint_meta(path)["global_step"])


def is_complete(path: Path) -> bool:
    """Whether a checkpoint is all there: a sharded folder with its metadata, or a non-empty file (files are written
    whole and renamed into place)."""
    return is_sharded(path) or (path.is_file() and path.stat().st_size > 0)


def is_sharded(path: str | os.PathLike) -> bool:
    """A DCP checkpoint folder (Lightning's layout)."""
    p = Path(path)
    return p.is_dir() and (p / METADATA_FILE).is_file() and (p / ".metadata").is_file()


def read_sharded(path: str | os.PathLike, with_optimizer: bool = False) -> dict[str, Any]:
    """A DCP folder as one Lightning-style dict: meta.pt + full (unsharded) `state_dict` tensors.

    DCP reads any sharding into plain tensors without a process group (no_dist=True).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    meta = torch.load(path / METADATA_FILE, map_location="cpu", weights_only=True)
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
# One checkpoint as a dict
# --------------------------------------------------------------------------------------------


def read_checkpoint(path: str | os.PathLike, mmap: bool = False) -> dict[str, Any]:
    """Load a Lightning checkpoint of ours: one file, or a sharded (fsdp) folder gathered into one dict. mmap: a
    file's tensors stay on disk (memory-mapped) until read."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"ckpt={path} does not exist")
    if path.is_dir() and not is_sharded(path):
        raise ValueError(f"ckpt={path} is a folder but not a sharded checkpoint (no meta.pt and .metadata)")
    # weights_only: no pickled code runs.
    ckpt = read_sharded(path) if path.is_dir() else torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    if CKPT_KEY not in ckpt or "state_dict" not in ckpt:
        raise ValueError(f"ckpt={path} is not a LatentForge training checkpoint (no '{CKPT_KEY}' entry)")
    return ckpt


def model_weights(ckpt: dict[str, Any], weights: str = "ema") -> dict[str, torch.Tensor]:
    """The denoiser's state dict: EMA weights when present and asked for, else the trained ones."""
    if weights not in ("ema", "train"):
        raise ValueError(f"weights={weights!r}: expected ema or train")
    state = ckpt["state_dict"]
    trained = {k[len("model.") :]: v for k, v in state.items() if k.startswith("model.")}
    if weights == "train":
        return trained
    ema = ckpt[CKPT_KEY].get("ema_state")  # single-file checkpoints: the whole averaged state dict
    if ema:
        return dict(ema)
    # Sharded checkpoints keep the EMA shards beside the model as `ema_state.<name>`; tensors the EMA
    # does not average (integer buffers) come from the model.
    averaged = {k[len("ema_state.") :]: v for k, v in state.items() if k.startswith("ema_state.")}
    return {**trained, **averaged}


MIN_EMA_PROGRESS = 0.5
"""An EMA that has moved less than this fraction of the way from the weights it started from (1 - decay^steps:
0.9999 over 1,000 steps is 9.5%) is still mostly its starting point: commands use the trained weights instead."""


def weights_used(ckpt: dict[str, Any], weights: str = "ema") -> str:
    """Which weights a command should read (model_weights(ckpt, weights_used(...))): "ema" when asked for, the
    checkpoint has them and they have caught up (MIN_EMA_PROGRESS; else said, and "train"), else "train"."""
    has_ema = bool(ckpt[CKPT_KEY].get("ema_state")) or any(k.startswith("ema_state.") for k in ckpt["state_dict"])
    if weights != "ema" or not has_ema:
        return "train"
    progress = ckpt[CKPT_KEY].get("ema_progress")
    if progress is not None and progress < MIN_EMA_PROGRESS:
        print(f"weights: the checkpoint's EMA has moved only {progress:.1%} of the way from its start (step "
              f"{ckpt.get('global_step')}; a decay too slow for this run's length); using the trained weights. "
              "Train longer or with a smaller plugins.ema.decay for an EMA worth using.")
        return "train"
    return "ema"


def build_model(ckpt: dict[str, Any], weights: str = "ema", where: str | os.PathLike = "checkpoint") -> Any:
    """The checkpoint's denoiser (a Denoiser of its config) with `weights` (see model_weights) loaded, every key checked.
    A run with an adapter (adapter=lora|lokr|loha) stored the adapter alone: it is put on the run's base weights
    (its init_from) and merged, so the result is a plain denoiser either way."""
    from framework.models.adapters import load_adapted, to_adapter_config
    from framework.models.backbones import ModelConfig, build_denoiser

    cfg = ckpt[CKPT_KEY]["config"]
    model = build_denoiser(ModelConfig(**cfg["model"]))
    adapter = to_adapter_config(cfg.get("adapter"))
    if adapter.on:
        return load_adapted(model, adapter, cfg.get("init_from"), model_weights(ckpt, weights), where=f"ckpt={where}")
    missing, unexpected = model.load_state_dict(model_weights(ckpt, weights), strict=False)
    if missing or unexpected:
        raise ValueError(f"ckpt={where} does not fit its own model config: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    return model
