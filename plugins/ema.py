"""`plugins=[ema]`: a scheduled exponential moving average (EMA) of the weights.

    ema <- d**k * ema + (1 - d**k) * w        every k optimizer steps, from step `start` on

`d` is the decay per optimizer step (or 0.5 ** (1 / half_life)), so the averaging horizon does not
change with `every`. Before `start` nothing is allocated and each step costs one integer compare;
at `start` the current weights are copied. MosaicML's SD2 recipe kept an EMA only over the last
50k of 1.4M steps, which is what `start` is for.

The gap this fills: Lightning's EMA callback (WeightAveraging) does not support sharded models and
Composer's EMA gathers full parameters at every update. Here every tensor is averaged where it
lives: under fsdp each rank keeps the EMA of its own local shards (the EMA tensors are DTensors
with the parameters' placements; updates touch only `.to_local()`: no all-gather, no full copy on
any rank); under ddp each rank keeps the full EMA (the replicas are identical).

The framework never imports this file. The callback is a `framework.training.registry.WeightAverager`:
`averaged_weights(pl_module)` is a context manager that swaps the EMA into the model and the
training weights back exactly on exit, which SampleGrid and the end-of-training evaluation enter
through `framework.training.registry.averaged_weights(trainer, pl_module)`. Checkpoints:
  * one file (single, ddp, fsdp with sharded_checkpoint=false): `checkpoint['latentforge']
    ['ema_state']` is the denoiser's full state dict with the averaged tensors in it, which
    framework.inference.pipeline.model_weights (sample, eval, export) uses by default;
  * a sharded folder (fsdp): the EMA shards go into the DCP `state_dict` as `ema_state.<name>`,
    written and read by every rank for its own shards (resumable at another world size).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from framework.distributed.dtensor import full_tensor, local_tensor
from framework.inference.checkpoint import MIN_EMA_PROGRESS
from framework.training.registry import register_plugin
from framework.distributed.fsdp import reshard

EMA_KEY = "ema_state"  # framework.inference.pipeline.model_weights reads checkpoint['latentforge'][EMA_KEY]

# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


@dataclass
class EMAConfig:
    """Fields of `plugins.ema.*`."""

    decay: float | None = 0.9999
    """Decay per optimizer step, in (0, 1). Set null when giving half_life."""
    half_life: float | None = None
    """Half-life in optimizer steps (decay = 0.5 ** (1 / half_life)); needs decay=null."""
    every: int = 1
    """Update every this many optimizer steps (the decay is compounded, so the horizon stays the same)."""
    start: float = 0
    """First step of the EMA: an optimizer step (>= 1, e.g. 1350000), or a fraction of trainer.max_steps in [0, 1)."""
    buffers: bool = True
    """Also average floating-point buffers that are saved in the state dict (e.g. running statistics)."""

    def __post_init__(self) -> None:
        if self.decay is not None and self.half_life is not None:
            raise ValueError(f"plugins.ema.decay={self.decay} and plugins.ema.half_life={self.half_life} are both set;"
                             " give one of them (add plugins.ema.decay=null to use the half-life)")
        if self.decay is None and self.half_life is None:
            raise ValueError("plugins.ema: give plugins.ema.decay (e.g. 0.9999) or plugins.ema.half_life (in steps)")
        if self.decay is not None and not 0.0 < self.decay < 1.0:
            raise ValueError(f"plugins.ema.decay={self.decay} must be in (0, 1), e.g. 0.9999")
        if self.half_life is not None and self.half_life <= 0:
            raise ValueError(f"plugins.ema.half_life={self.half_life} must be > 0 steps")
        if self.every < 1:
            raise ValueError(f"plugins.ema.every={self.every} must be >= 1 optimizer step")
        if self.start < 0 or (self.start >= 1 and self.start != int(self.start)):
            raise ValueError(f"plugins.ema.start={self.start}: give a whole step >= 1 or a fraction of"
                             " trainer.max_steps in [0, 1), e.g. plugins.ema.start=0.9")

    @property
    def step_decay(self) -> float:
        return self.decay if self.decay is not None else 0.5 ** (1.0 / self.half_life)

    def start_step(self, max_steps: int) -> int:
        """`start` as an optimizer step (fractions round down)."""
        return int(self.start) if self.start >= 1 else int(math.floor(self.start * max_steps))


# --------------------------------------------------------------------------------------------
# Helpers: which tensors, and their local parts
# --------------------------------------------------------------------------------------------


def averaged_tensors(model: nn.Module, buffers: bool = True) -> dict[str, torch.Tensor]:
    """Name -> tensor of what the EMA averages: trainable parameters, and persistent float buffers.

    Names are the model's state-dict keys. Frozen parameters never change, so they are not copied.
    """
    reshard(model)
    out = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if buffers:
        for n, b in model.named_buffers():
            owner, _, leaf = n.rpartition(".")
            persistent = leaf not in model.get_submodule(owner)._non_persistent_buffers_set
            if b.is_floating_point() and persistent:
                out[n] = b
    return out


# --------------------------------------------------------------------------------------------
# The callback
# --------------------------------------------------------------------------------------------


class EMA(pl.Callback):
    """Keeps `self.ema` (name -> tensor, shards under fsdp) from the start step on; None before.

    A framework.training.registry.WeightAverager: `averaged_weights(pl_module)` swaps the EMA in.
    """

    def __init__(self, cfg: EMAConfig) -> None:
        self.cfg = cfg
        self.ema: dict[str, torch.Tensor] | None = None
        self.start: int = 0  # resolved in setup() from trainer.max_steps
        self.last_step = -1  # global step of the last copy/update
        self.num_updates = 0
        self._trainer: pl.Trainer | None = None
        self._swapped = False
        self._said_early = False

    # ---- the average ------------------------------------------------------------------------

    def _begin(self, model: nn.Module, step: int) -> None:
        """Copy the current weights (each rank its own shards: DTensor.clone is local)."""
        with torch.no_grad():
            self.ema = {n: t.detach().clone() for n, t in averaged_tensors(model, self.cfg.buffers).items()}
        self.last_step = step

    def update(self, model: nn.Module, step: int) -> None:
        """ema <- lerp(ema, w, 1 - d**k) over the local parts, k = steps since the last update."""
        live = averaged_tensors(model, self.cfg.buffers)
        weight = 1.0 - self.cfg.step_decay ** (step - self.last_step)
        with torch.no_grad():
            ema, now = [local_tensor(self.ema[n]) for n in live], [local_tensor(t) for t in live.values()]
            torch._foreach_lerp_(ema, now, weight)
        self.last_step, self.num_updates = step, self.num_updates + 1

    def maybe_update(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start or update when due; idempotent within a step (also called before a swap-in)."""
        step = trainer.global_step
        if step == self.last_step or step < self.start:
            return  # before the start: nothing allocated, nothing done
        if self.ema is None:
            self._begin(pl_module.model, step)
        elif step - self.last_step >= self.cfg.every:
            self.update(pl_module.model, step)

    # ---- swapping in and out ----------------------------------------------------------------

    def _swap(self, model: nn.Module) -> None:
        """Exchange model and EMA values in place, tensor by tensor (an involution: bit-exact)."""
        reshard(model)
        live = averaged_tensors(model, self.cfg.buffers)
        with torch.no_grad():
            for n, t in live.items():
                w, e = local_tensor(t), local_tensor(self.ema[n])
                tmp = w.clone()
                w.copy_(e)
                e.copy_(tmp)
        self._swapped = not self._swapped

    @contextmanager
    def averaged_weights(self, pl_module: pl.LightningModule) -> Iterator[None]:
        """The EMA swapped into `pl_module.model` for the body; a no-op before the start."""
        if self._trainer is not None and self._trainer.training:
            self.maybe_update(self._trainer, pl_module)  # a grid drawn before this step's update sees it
        if self.ema is None or self._swapped:
            yield
            return
        if self.progress() < MIN_EMA_PROGRESS:  # still mostly its starting point: grids and evaluations use the weights
            if not self._said_early:
                rank_zero_warn(f"plugins.ema: the EMA has moved only {self.progress():.1%} of the way from its start "
                               f"(decay {self.cfg.step_decay} over {self.last_step - self.start} steps); grids and "
                               "evaluations use the trained weights until it passes 50%")
                self._said_early = True
            yield
            return
        model = pl_module.model
        self._swap(model)
        try:
            yield
        finally:
            self._swap(model)

    # ---- Lightning hooks --------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer
        self.start = self.cfg.start_step(trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else 0)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.maybe_update(trainer, pl_module)  # start=0: the average begins at the initial weights

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.maybe_update(trainer, pl_module)

    # ---- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"start": self.start, "last_step": self.last_step, "num_updates": self.num_updates,
                "started": self.ema is not None, "step_decay": self.cfg.step_decay, "every": self.cfg.every}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_step, self.num_updates = state["last_step"], state["num_updates"]
        if state["started"] and self.ema is None:
            raise RuntimeError("plugins.ema: the checkpoint's EMA had started but its tensors were not found in it")

    def progress(self) -> float:
        """How far the EMA has moved from the weights it started from: 1 - decay^(steps averaged)."""
        return 1.0 - self.cfg.step_decay ** max(self.last_step - self.start, 0)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        if self.ema is None:
            return
        from framework.inference.checkpoint import CKPT_KEY

        checkpoint.setdefault(CKPT_KEY, {})["ema_progress"] = self.progress()  # commands prefer the trained weights below 0.5
        if self._swapped:  # the model holds the EMA right now: its state dict would be the wrong weights
            raise RuntimeError("plugins.ema: a checkpoint was saved while the EMA was swapped into the model")
        if _sharded_save(trainer):
            # Into the DCP state: each rank writes its own shards (DTensors), with the model's.
            checkpoint["state_dict"].update({f"{EMA_KEY}.{n}": t for n, t in self.ema.items()})
            return
        # One file: the denoiser's full state dict with the averaged tensors in it. The other
        # entries are the very tensors of checkpoint['state_dict'], which torch.save writes once.
        full = {n: full_tensor(t).detach().cpu() for n, t in self.ema.items()}  # collective under fsdp
        prefix = "model."
        state = {k[len(prefix):]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
        state.update(full)
        checkpoint.setdefault(CKPT_KEY, {})[EMA_KEY] = state

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        from framework.inference.checkpoint import CKPT_KEY

        mine = (checkpoint.get("callbacks") or {}).get(self.state_key)
        if not mine or not mine.get("started"):
            return
        live = averaged_tensors(pl_module.model, self.cfg.buffers)
        with torch.no_grad():
            self.ema = {n: torch.zeros_like(t) for n, t in live.items()}
        stored = checkpoint.get(CKPT_KEY, {}).get(EMA_KEY)
        if stored is not None:
            _load_full(self.ema, stored)
        else:
            _load_sharded(self.ema, Path(trainer.ckpt_path))


def _sharded_save(trainer: pl.Trainer) -> bool:
    """True when the strategy writes a distributed-checkpoint folder (fsdp, sharded_checkpoint=true)."""
    return bool(getattr(trainer.strategy, "_save_distributed_checkpoint", False))


def _load_full(ema: dict[str, torch.Tensor], stored: dict[str, torch.Tensor]) -> None:
    """Fill EMA tensors (plain or sharded) from full tensors every rank holds: no communication."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    missing = [n for n in ema if n not in stored]
    if missing:
        raise RuntimeError(f"plugins.ema: the checkpoint's EMA lacks {missing[:3]}; was it written for another model?")
    with torch.no_grad():
        for n, t in ema.items():
            src = stored[n].to(device=local_tensor(t).device, dtype=t.dtype)
            if isinstance(t, DTensor):  # src_data_rank=None: each rank cuts its own chunk locally
                src = distribute_tensor(src, t.device_mesh, t.placements, src_data_rank=None).to_local()
            local_tensor(t).copy_(src)


def _load_sharded(ema: dict[str, torch.Tensor], path: Path) -> None:
    """Read this rank's EMA shards from a DCP folder (DCP reshards for another world size)."""
    import torch.distributed.checkpoint as dcp

    state = {"state_dict": {f"{EMA_KEY}.{n}": t for n, t in ema.items()}}
    dcp.load(state, checkpoint_id=str(path))


def build(cfg: EMAConfig, run_cfg: Any) -> EMA:
    return EMA(cfg)


register_plugin("ema", EMAConfig, build)
