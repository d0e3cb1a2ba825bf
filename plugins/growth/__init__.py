"""`plugins=[growth]` and `python -m plugins.growth`: start a deeper model from a trained shallower one.

SANA-1.5 grows a trained 20-block model to 60 blocks so that the large model starts from what the
small one learned. Three initialisations of the grown stack, named as in SANA's code:

    constant      source blocks 0..N-1-drop_last, then fresh blocks        (SANA's partial preservation)
    cyclic        block j copies source block j mod N
    block_expand  each source block repeated in place: block j copies source block floor(j * N / target)

With `zero_gate` (default) every block that is not the first copy of a source block (the fresh blocks
of `constant`, the repeats of the others) has the output projection of each residual branch zeroed
(framework.models.blocks.silence_block): it adds nothing, so the grown model computes the source's function
(tests/test_growth.py checks equal outputs for every family and init). Its other weights are kept, so
the first optimizer step already gives those projections gradients. `drop_last > 0` drops the last
source blocks as SANA does: then the function changes (said at run time).

Fresh blocks are those of `build_denoiser(target)` under `seed`. The unet has no stack of blocks and
is refused. Framework hooks used: `DiffusionModule.start_from` (whole weights before sharding; under
fsdp each rank keeps its rows) and the registry's plugin callback.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from framework.models.plans import families_with, plan_of
from framework.models.blocks import block_views, restack_state, silence_block, stack_depth
from framework.models.backbones import ModelConfig, build_denoiser, to_model_config
from framework.training.registry import register_plugin

INITS = ("constant", "cyclic", "block_expand")
# Fields that may differ between the source and the grown model (everything else is the same network).
_FREE_FIELDS = {"name", "num_layers", "attention"}

# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


@dataclass
class GrowthConfig:
    """Fields of `plugins.growth.*` (the grown depth is the run's model.num_layers)."""

    ckpt: str = "???"
    """The smaller model's checkpoint: a .ckpt file or a sharded (fsdp) folder."""
    init: str = "constant"
    """constant, cyclic or block_expand (module docstring)."""
    drop_last: int = 0
    """constant only: drop this many of the source's last blocks before appending fresh ones (changes the function)."""
    zero_gate: bool = True
    """Zero the residual output projections of fresh and repeated blocks, so the grown model starts as the source."""
    weights: str = "ema"
    """ema (the source's EMA weights when it has them, else its trained ones) or train."""
    seed: int | None = None
    """Seed of the fresh blocks' random init; null: the run's seed."""

    def __post_init__(self) -> None:
        if self.init not in INITS:
            raise ValueError(f"init={self.init!r}: choose one of {INITS}")
        if self.drop_last < 0:
            raise ValueError(f"drop_last={self.drop_last} must be >= 0")
        if self.drop_last and self.init != "constant":
            raise ValueError(f"drop_last={self.drop_last} applies to init=constant only (init={self.init})")
        if self.weights not in ("ema", "train"):
            raise ValueError(f"weights={self.weights!r}: expected ema or train")


# --------------------------------------------------------------------------------------------
# The grown weights
# --------------------------------------------------------------------------------------------


def layer_plan(n_source: int, n_target: int, init: str, drop_last: int = 0) -> list[tuple[int | None, bool]]:
    """Per grown block: (the source block it copies, or None for a fresh one; whether zero_gate silences it)."""
    if init == "constant":
        kept = n_source - drop_last
        if kept < 1:
            raise ValueError(f"drop_last={drop_last} leaves no block of the source's {n_source}")
        return [(i, False) for i in range(kept)] + [(None, True)] * (n_target - kept)
    if init == "cyclic":
        return [(j % n_source, j >= n_source) for j in range(n_target)]
    if init == "block_expand":
        src = [j * n_source // n_target for j in range(n_target)]
        return [(s, j > 0 and src[j - 1] == s) for j, s in enumerate(src)]
    raise ValueError(f"init={init!r}: choose one of {INITS}")


def check_growable(source: ModelConfig, target: ModelConfig) -> None:
    """One clear error unless `target` is `source` with more blocks, in a family that has a stack."""
    for cfg in (source, target):
        plan = plan_of(cfg.family)
        if not plan.stack:
            raise ValueError(f"growth: model.family={cfg.family} has no stack of transformer blocks to grow "
                             f"({plan.why_not}); growth supports {families_with(lambda p: p.stack)}.")
    a, b = dataclasses.asdict(source), dataclasses.asdict(target)
    differ = [f"{k}: source {a[k]!r} vs target {b[k]!r}" for k in a if k not in _FREE_FIELDS and a[k] != b[k]]
    if differ:
        raise ValueError(f"growth: the source checkpoint's model differs from the grown one in more than depth: "
                         f"{'; '.join(differ)}. Use the model= preset (and overrides) the source was trained with.")
    if target.num_layers <= source.num_layers:
        raise ValueError(f"growth: target {target.num_layers} blocks is not more than the source's "
                         f"{source.num_layers}; set model.num_layers (or target_layers) higher, or shrink with "
                         "python -m plugins.prune.")


def grow(source: dict[str, torch.Tensor], source_cfg: ModelConfig, n_target: int, init: str = "constant",
         drop_last: int = 0, zero_gate: bool = True, seed: int = 0) -> tuple[dict[str, torch.Tensor], list]:
    """(grown Denoiser state dict, its layer plan) from a source model's state dict."""
    target_cfg = dataclasses.replace(source_cfg, num_layers=n_target, attention="sdpa")
    check_growable(source_cfg, target_cfg)
    if stack_depth(source) != source_cfg.num_layers:
        raise ValueError(f"growth: the source weights have {stack_depth(source)} blocks but its config says "
                         f"{source_cfg.num_layers}")
    plan = layer_plan(source_cfg.num_layers, n_target, init, drop_last)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        target = build_denoiser(target_cfg)
    copied = restack_state(source, [src for src, _ in plan])
    missing, unexpected = target.load_state_dict(copied, strict=False)
    fresh = {j for j, (src, _) in enumerate(plan) if src is None}
    assert not unexpected and all(int(k.split(".")[2]) in fresh for k in missing), (missing[:3], unexpected[:3])
    if zero_gate:
        views = block_views(target)
        for j, (_, silenced) in enumerate(plan):
            if silenced:
                silence_block(views[j])
    return target.state_dict(), plan


def grow_checkpoint(path: str, n_target: int, cfg: GrowthConfig, seed: int,
                    target_cfg: ModelConfig | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(grown weights, the source checkpoint, a record of what was done) for the checkpoint at `path`."""
    from framework.inference.checkpoint import CKPT_KEY, model_weights, read_checkpoint, weights_used

    ckpt = read_checkpoint(path)
    source_cfg = to_model_config(ckpt[CKPT_KEY]["config"]["model"])
    if target_cfg is not None:
        check_growable(source_cfg, target_cfg)
    used = weights_used(ckpt, cfg.weights)
    state, plan = grow(model_weights(ckpt, used), source_cfg, n_target, cfg.init, cfg.drop_last, cfg.zero_gate, seed)
    record = {"command": "growth", "source": str(path), "source_step": ckpt.get("global_step"), "weights": used,
              "init": cfg.init, "drop_last": cfg.drop_last, "zero_gate": cfg.zero_gate, "seed": seed,
              "from_layers": source_cfg.num_layers, "to_layers": n_target,
              "plan": [{"source": s, "silenced": bool(z and cfg.zero_gate)} for s, z in plan]}
    return state, ckpt, record


def same_function(record: dict[str, Any]) -> bool:
    """Whether the grown model starts as the source's function (zero_gate on, no source block dropped)."""
    return record["zero_gate"] and not record["drop_last"]


def describe(record: dict[str, Any]) -> str:
    """One line on what a growth did."""
    return (f"growth: {record['from_layers']} -> {record['to_layers']} blocks, init={record['init']}, from "
            f"{record['weights']} weights of {record['source']} (step {record['source_step']}); "
            + ("starts as the same function" if same_function(record) else "starts as a DIFFERENT function (drop_last or zero_gate=false)"))


# --------------------------------------------------------------------------------------------
# The callback
# --------------------------------------------------------------------------------------------


class Growth(pl.Callback):
    """Replaces the module's starting weights with the grown source in setup(): before sharding and before
    the optimizer exists. A resumed run (any checkpoint to resume from) keeps its checkpoint's weights.

    The optimizer and the learning-rate schedule start fresh (warm-up included: optimizer.warmup_steps
    from step 0, as in any new run); an EMA (plugins.ema) starts from the grown weights at step 0.
    """

    def __init__(self, cfg: GrowthConfig, seed: int) -> None:
        self.cfg, self.seed = cfg, seed
        self.record: dict[str, Any] | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if trainer.ckpt_path:
            rank_zero_info(f"growth: resuming from {trainer.ckpt_path}; its weights are used, not a new growth")
            return
        target = to_model_config(pl_module.model_cfg)
        state, _, self.record = grow_checkpoint(self.cfg.ckpt, target.num_layers, self.cfg, self.seed, target)
        pl_module.start_from(state)
        (rank_zero_info if same_function(self.record) else rank_zero_warn)(describe(self.record))


def build(cfg: GrowthConfig, run_cfg: Any) -> Growth:
    if run_cfg.init_from:
        raise ValueError(f"plugins=[growth] sets the starting weights from plugins.growth.ckpt; init_from="
                         f"{run_cfg.init_from} would compete with it. Leave init_from unset.")
    return Growth(cfg, run_cfg.seed if cfg.seed is None else cfg.seed)


register_plugin("growth", GrowthConfig, build)
