"""Optimizers and the learning-rate schedule.

The optimizer group is one dataclass of the fields every optimizer reads (lr, weight decay, betas, the
schedule); an optimizer's own fields are its `settings`, typed by the dataclass it registers in
OPTIMIZER_SETTINGS. New optimizers register a builder in OPTIMIZERS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch


@dataclass
class OptimizerConfig:
    """Optimizer and learning-rate schedule."""

    name: str = "adamw"
    """adamw (torch.optim.AdamW, its fused kernel); plugins register more (came, came8bit: plugins/came.py)."""
    lr: float = 1e-4
    """Peak learning rate, reached at the end of warm-up."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Moment decay rates: 2 for adamw; 3 for came/came8bit (update, squared gradient, instability)."""
    eps: float = 1e-8
    """Denominator epsilon (adamw)."""
    settings: Any = field(default_factory=dict)
    """The optimizer's own fields (optimizer.settings.KEY), typed and checked by the dataclass its registrant gives
    (OPTIMIZER_SETTINGS; came / came8bit: plugins/came.py's CameSettings); adamw has none."""
    warmup_steps: int = 0
    """Linear warm-up from 0 to lr over this many optimizer steps."""
    schedule: str = "constant"
    """After warm-up: constant, cosine or linear decay to min_lr_ratio * lr at trainer.max_steps."""
    min_lr_ratio: float = 0.0
    """Final learning rate of the cosine/linear decay, as a fraction of lr."""
    schedule_steps: int | None = None
    """Length of the warm-up + decay schedule in optimizer steps; null: trainer.max_steps. A run that is the first
    part of a longer plan (the small model of a growth experiment) gives the plan's total."""
    schedule_start: int = 0
    """The schedule's step at this run's step 0: a run that continues another run's schedule (a grown model after
    the small one's steps) starts where that one stopped, with no second warm-up."""
    lr_scaling: str = "none"
    """none, sqrt or linear: lr is the rate at lr_reference_batch samples per optimizer step, and the run uses lr x
    (global batch / lr_reference_batch) (linear) or its square root (sqrt), the global batch counted over the job's
    data-parallel ranks and accumulation (PixArt's auto_lr: sqrt over 256). Logged at start; lr-* logs show it."""
    lr_reference_batch: int = 256
    """The global batch that lr is given for (lr_scaling)."""

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer.name={self.name!r} is unknown; choose one of {sorted(OPTIMIZERS)}")
        if self.lr <= 0:
            raise ValueError(f"optimizer.lr={self.lr} must be > 0")
        if self.schedule not in ("constant", "cosine", "linear"):
            raise ValueError(f"optimizer.schedule={self.schedule!r}: expected constant, cosine or linear")
        if self.warmup_steps < 0:
            raise ValueError(f"optimizer.warmup_steps={self.warmup_steps} must be >= 0")
        if self.schedule_start < 0 or (self.schedule_steps is not None and self.schedule_steps < 1):
            raise ValueError(f"optimizer.schedule_start={self.schedule_start} must be >= 0 and optimizer.schedule_steps="
                             f"{self.schedule_steps} >= 1 (or null)")
        if self.lr_scaling not in LR_SCALINGS:
            raise ValueError(f"optimizer.lr_scaling={self.lr_scaling!r}: expected one of {', '.join(LR_SCALINGS)}")
        if self.lr_reference_batch < 1:
            raise ValueError(f"optimizer.lr_reference_batch={self.lr_reference_batch} must be >= 1 (samples per step)")
        # The fields and checks that only make sense for one optimizer live next to it (a plugin registers its own).
        self.settings = optimizer_settings(self.name, self.settings)
        if self.name in OPTIMIZER_CHECKS:
            OPTIMIZER_CHECKS[self.name](self)


LR_SCALINGS = ("none", "sqrt", "linear")


def scaled_lr(cfg: OptimizerConfig, global_batch: int | None) -> float:
    """The peak lr of a run of `global_batch` samples per optimizer step: cfg.lr scaled by cfg.lr_scaling from
    cfg.lr_reference_batch (cfg.lr itself for none)."""
    if cfg.lr_scaling == "none":
        return cfg.lr
    if global_batch is None:
        raise ValueError(f"optimizer.lr_scaling={cfg.lr_scaling} needs the run's global batch, which is known only "
                         "once the trainer and the data module are attached")
    ratio = global_batch / cfg.lr_reference_batch
    return cfg.lr * (math.sqrt(ratio) if cfg.lr_scaling == "sqrt" else ratio)


def optimizer_settings(name: str, given: Any) -> Any:
    """`optimizer.settings` as optimizer `name`'s typed settings (its dataclass in OPTIMIZER_SETTINGS, defaults filled
    in); a misspelled field, a wrong type or a failed check raises, naming the key. An optimizer without settings of
    its own refuses any."""
    from framework.training.registry import typed_fields

    kind = OPTIMIZER_SETTINGS.get(name)
    if kind is None:
        if given:
            raise ValueError(f"optimizer.settings={dict(given)}: optimizer.name={name} has no settings of its own")
        return {}
    if isinstance(given, kind):
        return given
    return typed_fields(kind, given, f"optimizer.settings ({name})")


def fused_adamw(params: list, grad_scaler: bool) -> bool:
    """Whether AdamW runs its fused kernel: the whole update in one call, on CUDA or on the CPU (where torch's default
    loops over the parameters in Python, ten-odd tensor calls each: on the quickstart's 99 parameters 6.5 ms a step
    against about 1.5). It needs every parameter on one kind of device. It unscales a grad scaler's gradients inside
    its own step, after the norm check and clipping have read them (Lightning refuses to clip for it), so a run with
    a grad scaler (16-mixed) goes without it."""
    kinds = {p.device.type for p in _tensors(params)}
    return not grad_scaler and kinds in ({"cuda"}, {"cpu"})


def _adamw(params: Iterable, cfg: OptimizerConfig, grad_scaler: bool = False) -> torch.optim.Optimizer:
    params = list(params)
    fused = fused_adamw(params, grad_scaler)
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
"""Optimizer builders by optimizer.name. Plugins add theirs when `plugins` is imported."""

OPTIMIZER_CHECKS: dict[str, Callable[[OptimizerConfig], None]] = {}
"""Optional per-optimizer checks of the shared fields (e.g. the number of betas), run by OptimizerConfig.__post_init__
(raise ValueError)."""

OPTIMIZER_SETTINGS: dict[str, type] = {}
"""The dataclass of each optimizer's own fields (optimizer.settings), by optimizer.name."""

OPTIMIZER_STATE: dict[str, Callable[[tuple[int, ...], Any], int]] = {"adamw": lambda shape, settings: 8 * math.prod(shape)}
"""The bytes of state an optimizer keeps for one parameter of this shape, given its settings (AdamW: two fp32
moments), by optimizer.name: the memory plan's figure (framework/training/memory.py)."""


def state_bytes(cfg: OptimizerConfig, shapes: Iterable[tuple[int, ...]]) -> int:
    """The optimizer state `cfg`'s optimizer keeps for parameters of these shapes (an unregistered one: AdamW's)."""
    per = OPTIMIZER_STATE.get(cfg.name, OPTIMIZER_STATE["adamw"])
    return sum(per(tuple(shape), cfg.settings) for shape in shapes)


def build_optimizer(params: Iterable, cfg: OptimizerConfig, grad_scaler: bool = False) -> torch.optim.Optimizer:
    """grad_scaler: the run scales its gradients (16-mixed on a GPU): AdamW then goes without its fused kernel
    (fused_adamw)."""
    if cfg.name == "adamw":
        return _adamw(params, cfg, grad_scaler)
    return OPTIMIZERS[cfg.name](params, cfg)


def lr_lambda(cfg: OptimizerConfig, max_steps: int) -> Callable[[int], float]:
    """Multiplier of the peak lr at each optimizer step: linear warm-up, then the chosen decay, over
    cfg.schedule_steps (default max_steps) steps, entered at cfg.schedule_start."""
    total = cfg.schedule_steps or max_steps

    def f(run_step: int) -> float:
        step = run_step + cfg.schedule_start
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant" or total <= cfg.warmup_steps:
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / (total - cfg.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1.0 - progress
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape

    return f


def group_lambda(base: Callable[[int], float], warmup_steps: int = 0) -> Callable[[int], float]:
    """A parameter group's multiplier: the run's schedule ramped in over the group's own `warmup_steps` (new
    blocks of a grown model warm up while the kept ones go on at the schedule's lr)."""
    def f(step: int) -> float:
        ramp = min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0
        return base(step) * ramp

    return f


def configure_optimizers(module: Any) -> dict[str, Any]:
    """DiffusionModule.configure_optimizers: the optimizer over every trainable parameter of `module` (the backbone's,
    or a stage's own: a frozen backbone + router), in a plugin's parameter groups if one gives them, at the peak lr
    scaled to the global batch (optimizer.lr_scaling), stepped by the schedule (lr_lambda) per optimizer step."""
    from framework.training.registry import param_groups_hook

    params = [p for p in module.parameters() if p.requires_grad]
    hook = param_groups_hook(module.trainer) if module._trainer is not None else None
    groups = hook.param_groups(module, params) if hook is not None else [{"params": params}]
    if sorted(map(id, params)) != sorted(id(p) for g in groups for p in g["params"]):
        raise RuntimeError(f"{type(hook).__name__}.param_groups must return each trainable parameter once")
    cfg = module.optimizer_cfg
    scaled = module._trainer is not None and getattr(module.trainer.precision_plugin, "scaler", None) is not None
    lr = module.plan.lr if module.plan is not None else scaled_lr(cfg, None)  # the run plan scaled it
    opt = build_optimizer([{"params": g["params"], "lr": lr * g.get("lr_scale", 1.0)} for g in groups], cfg,
                          grad_scaler=scaled)
    base = lr_lambda(module.optimizer_cfg, module.max_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [group_lambda(base, g.get("warmup_steps", 0)) for g in groups])
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
