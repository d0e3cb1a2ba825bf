"""Optimizers and the learning-rate schedule.

The optimizer group is one dataclass for every optimizer; fields an optimizer does not use are
ignored by it. New optimizers register a builder in OPTIMIZERS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch


@dataclass
class OptimizerConfig:
    """Optimizer and learning-rate schedule."""

    name: str = "adamw"
    """adamw (torch.optim.AdamW, fused on GPU)."""
    lr: float = 1e-4
    """Peak learning rate, reached at the end of warm-up."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Moment decay rates."""
    eps: float = 1e-8
    """Denominator epsilon."""
    warmup_steps: int = 0
    """Linear warm-up from 0 to lr over this many optimizer steps."""
    schedule: str = "constant"
    """After warm-up: constant, cosine or linear decay to min_lr_ratio * lr at trainer.max_steps."""
    min_lr_ratio: float = 0.0
    """Final learning rate of the cosine/linear decay, as a fraction of lr."""

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer.name={self.name!r} is unknown; choose one of {sorted(OPTIMIZERS)}")
        if self.lr <= 0:
            raise ValueError(f"optimizer.lr={self.lr} must be > 0")
        if self.schedule not in ("constant", "cosine", "linear"):
            raise ValueError(f"optimizer.schedule={self.schedule!r}: expected constant, cosine or linear")
        if self.warmup_steps < 0:
            raise ValueError(f"optimizer.warmup_steps={self.warmup_steps} must be >= 0")


def _adamw(params: Iterable, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    params = list(params)
    # The fused kernel exists for CUDA tensors only; it runs the whole update in one launch.
    fused = bool(params) and all(p.is_cuda for p in _tensors(params))
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay, fused=fused or None
    )


def _tensors(params: list) -> Iterable[torch.Tensor]:
    for p in params:
        if isinstance(p, dict):
            yield from p["params"]
        else:
            yield p


OPTIMIZERS: dict[str, Callable[[Iterable, OptimizerConfig], torch.optim.Optimizer]] = {"adamw": _adamw}


def build_optimizer(params: Iterable, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    return OPTIMIZERS[cfg.name](params, cfg)


def lr_lambda(cfg: OptimizerConfig, max_steps: int) -> Callable[[int], float]:
    """Multiplier of the peak lr at each optimizer step: linear warm-up, then the chosen decay."""

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant" or max_steps <= cfg.warmup_steps:
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / (max_steps - cfg.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1.0 - progress
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape

    return f
