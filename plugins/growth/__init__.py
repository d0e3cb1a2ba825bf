"""`plugins=[growth]` and `python -m plugins.growth`: start a deeper model from a trained shallower one.

SANA-1.5 grows a trained 20-block model to 60 blocks so that the large model starts from what the
small one learned. Three initialisations of the grown stack, the paper's three (the names are ours):

    constant      source blocks 0..N-1-drop_last, then fresh blocks        (partial preservation)
    cyclic        block j copies source block j mod N                      (cyclic replication)
    block_expand  each source block repeated in place: block j copies source block floor(j * N / target)
                                                                           (block replication)

The new blocks are those that are not the first copy of a source block: the fresh blocks of `constant`,
the repeats of the others. Fresh blocks get linear and convolution weights N(0, 0.02), biases 0, norms'
weights 1, the per-block adaLN table N(0, 0.02) (our choice; the paper gives no sigma). `drop_last` drops the
source's last blocks first (the paper's v4 drops two). zero_gate=false gives the paper's pure copies. With
`zero_gate` (default) every new block starts as the identity, so the grown model computes the source's function
(tests/test_growth.py checks equal outputs for every family and init), in the way its family allows
gradients to reach it at the first step:
    pixart, sana  each residual branch's output projection zeroed, and the block's own adaLN scale-shift
                  table zeroed (a repeat then takes its modulation from the shared timestep embedding
                  alone, not its source's); the branch inputs keep their weights
    dit           the adaLN-Zero modulation (norm1.linear) zeroed: every gate 0, as DiT initialises its
                  blocks; the output projections keep their weights, so the gates get gradients
`drop_last > 0` drops the last source blocks: then the function changes (said at run time). A model without QK-norm
(which the paper calls crucial for every initialisation) is grown with a warning naming the key that adds it.

Training a grown model (the callback): `new_lr_scale` multiplies the new blocks' learning rate and
`new_warmup_steps` ramps it in, while the kept blocks go on at the schedule's lr (with
optimizer.schedule_start / schedule_steps the grown run continues the small run's schedule). On logging
steps the run logs each new block's output-projection norm (`growth/out_norm_<j>`) and its block
importance on the training batch (`growth/bi_<j>`, 1 - cos(block input, block output), as plugins.prune).

The unet has no stack of blocks and is refused. Framework hooks used: `DiffusionModule.start_from` (whole
weights before sharding; under fsdp each rank keeps its rows), the registry's plugin callback and its
ParamGroups hook.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from framework.models.families import families_with, plan_of
from framework.models.blocks import layer_views, restack_state, silence_block, stack_depth
from framework.models.backbones import ModelConfig, build_denoiser, to_model_config
from framework.training.registry import logging_step, register_plugin

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
    """Start fresh and repeated blocks as the identity (their residual output projections zeroed), so the grown model
    starts as the source's function; false: the paper's pure copies (docs/growth.md argues the default)."""
    weights: str = "ema"
    """ema (the source's EMA weights when it has them, else its trained ones) or train."""
    seed: int | None = None
    """Seed of the fresh blocks' random init; null: the run's seed."""
    new_lr_scale: float = 1.0
    """The new blocks' learning rate as a multiple of the run's (its schedule included)."""
    new_warmup_steps: int = 0
    """A linear ramp of the new blocks' learning rate over their first steps (0: none)."""

    def __post_init__(self) -> None:
        if self.init not in INITS:
            raise ValueError(f"init={self.init!r}: choose one of {INITS}")
        if self.drop_last < 0:
            raise ValueError(f"drop_last={self.drop_last} must be >= 0")
        if self.drop_last and self.init != "constant":
            raise ValueError(f"drop_last={self.drop_last} applies to init=constant only (init={self.init})")
        if self.weights not in ("ema", "train"):
            raise ValueError(f"weights={self.weights!r}: expected ema or train")
        if self.new_lr_scale <= 0 or self.new_warmup_steps < 0:
            raise ValueError(f"new_lr_scale={self.new_lr_scale} must be > 0 and new_warmup_steps="
                             f"{self.new_warmup_steps} >= 0")


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


def fresh_init(block: torch.nn.Module, generator: torch.Generator) -> None:
    """A fresh block's initialisation: linear / convolution weights N(0, 0.02), biases 0, norm weights 1, other
    parameters of its own (the adaLN table) N(0, 0.02). Ours: SANA-1.5 draws new layers from N(0, sigma^2) without
    giving sigma."""
    with torch.no_grad():
        for module in block.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
                module.weight.normal_(0.0, 0.02, generator=generator)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, (torch.nn.LayerNorm, torch.nn.GroupNorm)) or "RMSNorm" in type(module).__name__:
                if getattr(module, "weight", None) is not None:
                    module.weight.fill_(1.0)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
        for param in block.parameters(recurse=False):
            param.normal_(0.0, 0.02, generator=generator)


def make_identity(view: Any) -> None:
    """Start a new block as the identity, keeping a path for gradients (module docstring): a block with its own
    adaLN-Zero modulation (DiT's) gets zero gates; the others zero output projections and their adaLN table."""
    from diffusers.models.normalization import AdaLayerNormZero

    norm = getattr(view.module, "norm1", None)
    if isinstance(norm, AdaLayerNormZero):  # every gate 0, the projections kept
        torch.nn.init.zeros_(norm.linear.weight)
        torch.nn.init.zeros_(norm.linear.bias)
        return
    silence_block(view)
    table = getattr(view.module, "scale_shift_table", None)
    if table is not None:
        torch.nn.init.zeros_(table)


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


def has_qk_norm(model: torch.nn.Module) -> bool:
    """Whether the model's attention normalises its queries and keys (diffusers' norm_q / norm_k)."""
    return any(getattr(m, "norm_q", None) is not None for m in model.modules())


def qk_norm_advice(cfg: ModelConfig) -> str:
    """The warning for a grown model without QK-norm, with the key that adds it where the family's class has one."""
    import inspect

    from framework.models.families import family_of

    takes = "qk_norm" in inspect.signature(family_of(cfg).diffusers_class.__init__).parameters
    how = ("model.kwargs.qk_norm=rms_norm_across_heads (in the source model too) adds it" if takes else
           f"the {cfg.family} family's diffusers class has no such option")
    return (f"growth: model={cfg.name} has no QK normalisation in its attention; SANA-1.5 reports QK-norm as crucial "
            f"for stable training with every growth initialisation (large attention logits otherwise); {how}")


def grow(source: dict[str, torch.Tensor], source_cfg: ModelConfig, n_target: int, init: str = "constant",
         drop_last: int = 0, zero_gate: bool = True, seed: int = 0) -> tuple[dict[str, torch.Tensor], list]:
    """(grown Denoiser state dict, its layer plan) from a source model's state dict."""
    target_cfg = dataclasses.replace(source_cfg, num_layers=n_target, attention="sdpa")
    check_growable(source_cfg, target_cfg)
    if stack_depth(source, source_cfg.family) != source_cfg.num_layers:
        raise ValueError(f"growth: the source weights have {stack_depth(source, source_cfg.family)} blocks but its config says "
                         f"{source_cfg.num_layers}")
    plan = layer_plan(source_cfg.num_layers, n_target, init, drop_last)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        target = build_denoiser(target_cfg)
    if not has_qk_norm(target):
        rank_zero_warn(qk_norm_advice(target_cfg))
    copied = restack_state(source, [src for src, _ in plan], source_cfg.family)
    missing, unexpected = target.load_state_dict(copied, strict=False)
    fresh = {j for j, (src, _) in enumerate(plan) if src is None}
    assert not unexpected and all(int(k.split(".")[2]) in fresh for k in missing), (missing[:3], unexpected[:3])
    layers = layer_views(target)  # a layer's blocks: one, or Latte's spatial and temporal block
    g = torch.Generator().manual_seed(seed)
    for j in sorted(fresh):
        for view in layers[j]:
            fresh_init(view.module, g)
    if zero_gate:
        for j, (_, new) in enumerate(plan):
            if new:
                for view in layers[j]:
                    make_identity(view)
    return target.state_dict(), plan


def grow_checkpoint(path: str, n_target: int, cfg: GrowthConfig, seed: int,
                    target_cfg: ModelConfig | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(grown weights, the source checkpoint, a record of what was done) for the checkpoint at `path`."""
    from framework.inference.checkpoint import CKPT_KEY, build_model, read_checkpoint, weights_used

    ckpt = read_checkpoint(path)
    source_cfg = to_model_config(ckpt[CKPT_KEY]["config"]["model"])
    if target_cfg is not None:
        check_growable(source_cfg, target_cfg)
    used = weights_used(ckpt, cfg.weights)
    whole = build_model(ckpt, used, path).state_dict()  # an adapter run's adapter merged into its base
    state, plan = grow(whole, source_cfg, n_target, cfg.init, cfg.drop_last, cfg.zero_gate, seed)
    record = {"command": "growth", "source": str(path), "source_step": ckpt.get("global_step"), "weights": used,
              "init": cfg.init, "drop_last": cfg.drop_last, "zero_gate": cfg.zero_gate, "seed": seed,
              "from_layers": source_cfg.num_layers, "to_layers": n_target,
              "plan": [{"source": s, "new": bool(z), "silenced": bool(z and cfg.zero_gate)} for s, z in plan]}
    return state, ckpt, record


def same_function(record: dict[str, Any]) -> bool:
    """Whether the grown model starts as the source's function (zero_gate on, no source block dropped)."""
    return record["zero_gate"] and not record["drop_last"]


def describe(record: dict[str, Any]) -> str:
    """One line on what a growth did."""
    return (f"growth: {record['from_layers']} -> {record['to_layers']} blocks, init={record['init']}, from "
            f"{record['weights']} weights of {record['source']} (step {record['source_step']}); "
            + ("starts as the same function" if same_function(record)
               else "starts as a DIFFERENT function (drop_last or zero_gate=false)"))


# --------------------------------------------------------------------------------------------
# The callback
# --------------------------------------------------------------------------------------------


class Growth(pl.Callback):
    """Replaces the module's starting weights with the grown source in setup(): before sharding and before
    the optimizer exists. A resumed run (any checkpoint to resume from) keeps its checkpoint's weights.

    The optimizer starts fresh, with the new blocks in a parameter group of their own (new_lr_scale,
    new_warmup_steps); the lr schedule is the run's (optimizer.*: warm-up from step 0 unless it continues the
    source's schedule with optimizer.schedule_start); an EMA (plugins.ema) starts from the grown weights at step 0.
    """

    def __init__(self, cfg: GrowthConfig, seed: int) -> None:
        self.cfg, self.seed = cfg, seed
        self.record: dict[str, Any] | None = None
        self.new_blocks: list[int] = []  # indices of the grown stack's new blocks
        self._hooks: list[Any] = []
        self._bi: dict[int, list[torch.Tensor]] = {}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        target = to_model_config(pl_module.model_cfg)
        if trainer.ckpt_path:
            rank_zero_info(f"growth: resuming from {trainer.ckpt_path}; its weights are used, not a new growth")
            from framework.inference.checkpoint import CKPT_KEY, read_checkpoint

            n_source = read_checkpoint(self.cfg.ckpt)[CKPT_KEY]["config"]["model"]["num_layers"]
            plan = layer_plan(n_source, target.num_layers, self.cfg.init, self.cfg.drop_last)
        else:
            state, _, self.record = grow_checkpoint(self.cfg.ckpt, target.num_layers, self.cfg, self.seed, target)
            pl_module.start_from(state)
            (rank_zero_info if same_function(self.record) else rank_zero_warn)(describe(self.record))
            plan = [(r["source"], r["new"]) for r in self.record["plan"]]
        self.new_blocks = [j for j, (_, new) in enumerate(plan) if new]

    # ---- the new blocks' parameter group (framework.training.registry.ParamGroups) ----------------

    def param_groups(self, pl_module: pl.LightningModule, params: list[Any]) -> list[dict[str, Any]]:
        layers = layer_views(pl_module.model)
        new = {id(p) for j in self.new_blocks for view in layers[j] for p in view.module.parameters()}
        groups = [{"params": [p for p in params if id(p) not in new]},
                  {"params": [p for p in params if id(p) in new], "lr_scale": self.cfg.new_lr_scale,
                   "warmup_steps": self.cfg.new_warmup_steps}]
        return [g for g in groups if g["params"]]

    # ---- what the new blocks do, on logging steps -------------------------------------------------

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self.new_blocks or not (trainer.loggers and logging_step(trainer)) or self._hooks:
            return
        layers = layer_views(pl_module.model)
        for j in self.new_blocks:  # a layer's BI: the mean of its blocks'
            self._hooks += [view.module.register_forward_hook(self._recorder(j), with_kwargs=True) for view in layers[j]]

    def _recorder(self, j: int) -> Any:
        def hook(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
            x = args[0] if args else kwargs["hidden_states"]  # (B, N, D)
            y = output[0] if isinstance(output, tuple) else output
            cos = torch.nn.functional.cosine_similarity(x.detach().float().flatten(0, -2),
                                                        y.detach().float().flatten(0, -2), dim=-1)
            self._bi.setdefault(j, []).append(1.0 - cos.mean())
        return hook

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self._hooks:
            return
        for h in self._hooks:
            h.remove()
        self._hooks = []
        layers = layer_views(pl_module.model)
        for j in self.new_blocks:
            norm = sum(_full(b.out_proj.weight).float().norm() for view in layers[j] for b in view.branches)
            pl_module.log(f"growth/out_norm_{j}", norm, on_step=True, on_epoch=False)
            if self._bi.get(j):
                pl_module.log(f"growth/bi_{j}", torch.stack(self._bi[j]).mean(), on_step=True, on_epoch=False,
                              sync_dist=trainer.world_size > 1)
        self._bi = {}


def _full(t: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value (an FSDP2 shard is gathered: every rank calls this on logging steps)."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def build(cfg: GrowthConfig, run_cfg: Any) -> Growth:
    if run_cfg.init_from:
        raise ValueError(f"plugins=[growth] sets the starting weights from plugins.growth.ckpt; init_from="
                         f"{run_cfg.init_from} would compete with it. Leave init_from unset.")
    return Growth(cfg, run_cfg.seed if cfg.seed is None else cfg.seed)


register_plugin("growth", GrowthConfig, build)
