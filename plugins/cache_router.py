"""The cache router: Learning-to-Cache as a frozen-weight distillation stage (`experiment=cache_router`).

Learning-to-Cache (Ma et al., NeurIPS 2024, arXiv:2406.01733) learns, for one sampler and step count,
which residual branches of a diffusion transformer may reuse their output from the previous sampling
step. Here it is a training stage of the transformer families (PixArt, SANA, DiT; Latte's spatial and temporal
blocks and Wan's 3D blocks alike, each a block of its own): the backbone loaded with
`init_from` is frozen, and the only trainable parameters are the router's logits, one per
(cache step, block, branch). beta = sigmoid(logit). As in the paper, the cache steps are every other
step (1, 3, 5, ...) and the steps between them compute everything, so a reused output is one step old.

One training step (the `TrainingLoss` hook of framework/training/registry.py), as sampling runs:
  1. draw a cache step k (the odd steps; each follows a full step) and the state the sampler is in before step
     k-1: `start=trajectory` (the default) samples from the batch's noise with the full model, guided as in
     sampling, for steps 0 .. k-2; `start=data` noises the batch's latents to t_{k-1} (cheaper; the states a
     sampler visits differ from forward-noised data, most at the first steps);
  2. teacher, full: the frozen model at t_{k-1} (every branch output kept as the cache), one guided sampler
     step to x_k, then the frozen model at t_k;
  3. student: the model at t_k where every branch returns beta * fresh + (1 - beta) * cached, cached
     being that branch's output at t_{k-1} before its adaLN gate (`hard=true`: the decision beta > threshold
     in the forward and beta's gradient in the backward, straight through);
  4. loss = MSE(student, teacher) + sparsity * sum(cost * beta_k) on the guided predictions (uncond +
     guidance * (cond - uncond), both halves in one batch sharing one cache, as in sampling): the penalty
     pushes beta down wherever the cache costs the sampled image little.
     `cost` weighs each branch by its share of the model's work
     (`plugins.cache_router.cost`: its forward FLOPs, or its measured time on this device; mean 1), so the
     router does not buy a cheap cross-attention with an expensive MLP; `none` weighs them alike (the paper's).
Captions and labels are dropped as in training; a dropped caption's guided prediction is the unconditional one.
The schedule recomputes branch (k, block, branch) of a cache step when beta > threshold; it is written to
run.dir/cache_schedule.json (with a heat map, cache_schedule.png) at every checkpoint and at the end,
and `cache_schedule=PATH` in framework.sample / framework.eval samples with it (framework/inference/caching.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from framework.models.families import families_with, plan_of
from framework.inference.caching import SCHEDULE_FILE, BranchRunner, CacheSchedule, model_signature
from framework.models.objectives import DEFAULT_SAMPLER, SAMPLERS, check_sampler
from framework.training.registry import register_plugin

TRAINABLE_SAMPLERS = ("ddim", "flow_euler")  # one step of these is a function of (x, t, prediction) alone
COSTS = ("flops", "time", "none")
STARTS = ("trajectory", "data")


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


@dataclass
class CacheRouterConfig:
    """Fields of plugins.cache_router (conf/plugins/cache_router.yaml)."""

    sampler: str | None = None
    """ddim or flow_euler: the sampler the schedule is for; null: the objective's default (flow_euler for flow)."""
    steps: int = 20
    """Sampling steps the schedule is for (10, 20, 50, ...)."""
    sparsity: float = 3e-3
    """lambda of the penalty lambda * sum(beta) per step: larger reuses more branches."""
    threshold: float = 0.5
    """A branch is recomputed at a step when its beta > threshold."""
    init_logit: float = 2.0
    """Starting router logit (sigmoid(2) = 0.88: the student starts close to the full model)."""
    cost: str = "flops"
    """Weight of each branch's beta in the penalty: flops (its share of the forward FLOPs, counted), time (its share
    of the forward time on this device, measured once and kept in the checkpoint) or none (all alike)."""
    guidance: float | None = None
    """Classifier-free guidance of the distilled prediction and of the sampler steps; null: the run's eval.guidance
    (the guidance the schedule will sample with); 1: the conditional prediction alone (one forward per step)."""
    start: str = "trajectory"
    """Where step k's state comes from: trajectory (full-model sampling from the batch's noise, as at sampling
    time) or data (the batch's latents noised to t_{k-1}; k-2 fewer forwards)."""
    hard: bool = False
    """Straight-through: the student's forward uses the schedule's decision (beta > threshold), its backward beta's
    gradient, so training sees exactly the cached forward that sampling will run."""
    out: str | None = None
    """Where the schedule is written; null: run.dir/cache_schedule.json (the heat map beside it, .png)."""

    def __post_init__(self) -> None:
        if self.steps < 2:
            raise ValueError(f"plugins.cache_router.steps={self.steps}: need >= 2 (step 1 is the first that can reuse step 0)")
        if self.sparsity < 0:
            raise ValueError(f"plugins.cache_router.sparsity={self.sparsity} must be >= 0")
        if not 0 < self.threshold < 1:
            raise ValueError(f"plugins.cache_router.threshold={self.threshold} must lie in (0, 1)")
        if self.cost not in COSTS:
            raise ValueError(f"plugins.cache_router.cost={self.cost!r}: choose one of {COSTS}")
        if self.start not in STARTS:
            raise ValueError(f"plugins.cache_router.start={self.start!r}: choose one of {STARTS}")
        if self.guidance is not None and self.guidance < 1:
            raise ValueError(f"plugins.cache_router.guidance={self.guidance} must be >= 1 (1: unguided)")


# --------------------------------------------------------------------------------------------
# The router
# --------------------------------------------------------------------------------------------


class Router(nn.Module):
    """One logit per (cache step, block, branch); blocks with fewer branches leave theirs unused.

    Cache steps are the odd steps 1, 3, 5, ...: as in Learning-to-Cache, every cache step follows a full
    step, so the cache a branch reuses is always one step old, in training and in sampling alike.
    One tensor rather than a parameter per step: each batch trains one step's row, and DDP needs every
    parameter to take part in every backward (the other rows get zero gradients).
    """

    def __init__(self, steps: int, branches: list[list[str]], init_logit: float) -> None:
        super().__init__()
        self.steps, self.cache_steps = steps, list(range(1, steps, 2))
        width = max(len(b) for b in branches)
        self.logits = nn.Parameter(torch.full((len(self.cache_steps), len(branches), width), float(init_logit)))
        present = torch.zeros(len(branches), width, dtype=torch.bool)
        for i, kinds in enumerate(branches):
            present[i, : len(kinds)] = True
        self.register_buffer("present", present, persistent=False)  # (blocks, width)
        # (blocks, width) weight of each branch in the sparsity penalty, mean 1 over the present ones; kept in the
        # checkpoint, so a resumed run weighs as the run it continues (a measured time would differ)
        self.register_buffer("cost", present.float() * present.numel() / present.sum())

    def beta(self, step: int) -> torch.Tensor:
        """(blocks, width) mixing weights of a cache step; absent branches 0 (never used)."""
        if step not in self.cache_steps:
            raise ValueError(f"step {step} is not a cache step (the odd steps below {self.steps})")
        return torch.sigmoid(self.logits[(step - 1) // 2]) * self.present

    def computed_fraction(self, threshold: float) -> torch.Tensor:
        """Share of all (step, block, branch) evaluations the schedule at `threshold` computes."""
        cached_kept = ((torch.sigmoid(self.logits.detach()) > threshold) & self.present).sum()
        n = self.present.sum()
        return (cached_kept + (self.steps - len(self.cache_steps)) * n) / (self.steps * n)

    def schedule(self, cfg: CacheRouterConfig, sampler: str, signature: dict[str, Any],
                 source: dict[str, Any]) -> CacheSchedule:
        """The static schedule: full steps compute everything; a cache step recomputes where beta > threshold."""
        beta = torch.ones(self.steps, *self.logits.shape[1:])
        beta[self.cache_steps] = torch.sigmoid(self.logits.detach().float().cpu())
        b = [[[round(float(beta[s, i, j]), 4) for j in range(len(kinds))] for i, kinds in enumerate(signature["branches"])]
             for s in range(self.steps)]
        compute = [[[s not in self.cache_steps or v > cfg.threshold for v in block] for block in step]
                   for s, step in enumerate(b)]
        return CacheSchedule(sampler, cfg.steps, signature, compute, kind="learned", beta=b,
                             threshold=cfg.threshold, source=source)


# --------------------------------------------------------------------------------------------
# What each branch costs
# --------------------------------------------------------------------------------------------


def _example(model: nn.Module) -> tuple:
    """A batch of 2 shaped like the model's inputs (16 caption tokens), for counting and timing a forward."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, cfg.in_channels, *cfg.latent_shape, generator=g)  # (2, C, h, w), clips (2, C, F, h, w)
    text = torch.randn(2, 16, cfg.text_dim or 1, generator=g) if cfg.text_dim else None
    mask = torch.ones(2, 16, dtype=torch.bool) if cfg.text_dim else None
    labels = torch.zeros(2, dtype=torch.long) if cfg.num_classes is not None else None
    device = next(model.parameters()).device
    move = lambda t: None if t is None else t.to(device)
    return move(x), torch.full((2,), 500.0, device=device), move(text), move(mask), move(labels)


def branch_costs(model: nn.Module, how: str) -> torch.Tensor:
    """(blocks, width) cost of each residual branch of `model` in one forward: counted FLOPs or measured seconds
    (the median of 3 timed forwards; the GPU synchronised around each branch); 0 for absent branches."""
    import statistics
    import time

    from framework.models.blocks import block_views
    from framework.models.flops import forward_flops_by_module

    views = block_views(model)
    width = max(len(v.branches) for v in views)
    cost = torch.zeros(len(views), width, dtype=torch.float64)
    args = _example(model)
    if how == "flops":
        counts = forward_flops_by_module(model, *args)
        for i, v in enumerate(views):
            for j, b in enumerate(v.branches):
                cost[i, j] = counts.get(f"{type(model).__name__}.net.{v.name}.{b.attr}", 0)
        return cost
    sync = torch.cuda.synchronize if args[0].is_cuda else (lambda: None)
    times: dict[tuple[int, int], list[float]] = {}
    hooks = []
    for i, v in enumerate(views):
        for j, b in enumerate(v.branches):
            def before(*_: Any, key=(i, j)) -> None:
                sync()
                times.setdefault(key, []).append(-time.perf_counter())

            def after(*_: Any, key=(i, j)) -> None:
                sync()
                times[key][-1] += time.perf_counter()
            hooks += [b.module.register_forward_pre_hook(before), b.module.register_forward_hook(after)]
    try:
        with torch.no_grad():
            for _ in range(4):  # the first warms up and is dropped
                model(*args)
    finally:
        for h in hooks:
            h.remove()
    for (i, j), ts in times.items():
        cost[i, j] = statistics.median(ts[1:])
    return cost


# --------------------------------------------------------------------------------------------
# The heat map
# --------------------------------------------------------------------------------------------


def plot_schedule(schedule: CacheSchedule, path: str | Path) -> Path:
    """Steps x (block, branch) heat map of beta (or of compute), reused cells marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    kinds = schedule.model["branches"]
    labels = [f"{i}.{k.replace('_attn', '')}" for i, ks in enumerate(kinds) for k in ks]
    values = schedule.beta if schedule.beta is not None else schedule.compute
    grid = np.array([[float(v) for block in step for v in block] for step in values]).T  # (branches, steps)
    reused = np.array([[not c for block in step for c in block] for step in schedule.compute]).T
    fig, ax = plt.subplots(figsize=(1.2 + 0.32 * schedule.steps, 1.2 + 0.24 * len(labels)))
    im = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
    ys, xs = np.nonzero(reused)
    ax.scatter(xs, ys, marker="x", color="white", s=18, linewidths=1.0)
    ax.set_xticks(range(schedule.steps))
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.set_xlabel("sampling step (0 = pure noise);  x = reused from the step before")
    ax.set_ylabel("block.branch")
    ax.set_title(f"{schedule.describe()}", fontsize=9)
    fig.colorbar(im, ax=ax, label="beta" if schedule.beta is not None else "computed")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------
# The callback: freezes the backbone, owns the router, computes the loss, writes the schedule
# --------------------------------------------------------------------------------------------


class CacheRouterStage(pl.Callback):
    """Frozen backbone + router (plugins=[cache_router]); the loss of every training step."""

    def __init__(self, cfg: CacheRouterConfig, sampler: str, objective: str, out: Path, init_from: str) -> None:
        self.cfg, self.sampler, self.objective_name, self.out, self.init_from = cfg, sampler, objective, out, init_from
        self.runner: BranchRunner | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or hasattr(pl_module, "router"):
            return
        model = pl_module.model
        if not plan_of(model.cfg.family).routed:
            raise ValueError(f"plugins=[cache_router]: model.family={model.cfg.family}: "
                             f"{plan_of(model.cfg.family).why_not}; the cache router handles "
                             f"{families_with(lambda p: p.routed)}")
        model.requires_grad_(False)  # frozen: no gradients, so no optimizer state either
        branches = model_signature(model, self.objective_name)["branches"]
        router = Router(self.cfg.steps, branches, self.cfg.init_logit)  # trained, checkpointed, DDP-synced
        if self.cfg.cost != "none":
            cost = branch_costs(model, self.cfg.cost).float()
            cost = trainer.strategy.broadcast(cost, 0)  # a measured time differs between ranks: rank 0's for all
            router.cost.copy_(cost / cost[router.present].mean() * router.present)
        pl_module.router = router
        self.runner = BranchRunner(model)
        rank_zero_info(f"cache_router: backbone frozen ({sum(p.numel() for p in model.parameters()):,} parameters); "
                       f"router {pl_module.router.logits.numel()} logits for {self.sampler}, {self.cfg.steps} steps")

    def training_loss(self, pl_module: pl.LightningModule, x0: torch.Tensor, noise: torch.Tensor,
                      text: torch.Tensor, text_mask: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        # The sampling step: from the module's step generator, so the same on every rank and after a resume.
        router = pl_module.router
        g = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,), generator=pl_module.step_generator())))
        k = router.cache_steps[int(torch.randint(len(router.cache_steps), (1,), generator=g))]
        mse, beta = self.distill(pl_module, k, x0, noise, text, text_mask, labels)
        loss = mse + self.cfg.sparsity * (router.cost * beta).sum()
        pl_module.log_dict({"cache/distill_mse": mse.detach(), "cache/beta_mean": beta.detach().sum() / router.present.sum(),
                            "cache/computed": router.computed_fraction(self.cfg.threshold)},
                           on_step=True, batch_size=x0.shape[0], sync_dist=pl_module.trainer.world_size > 1)
        return loss

    def distill(self, pl_module: pl.LightningModule, k: int, x0: torch.Tensor, noise: torch.Tensor,
                text: torch.Tensor | None, text_mask: torch.Tensor | None,
                labels: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(MSE(student, teacher), beta of step k) for sampling step k of a batch (x0: clean scaled latents;
        noise: the sampler's starting noise with start=trajectory, the forward noise with start=data)."""
        model, runner = pl_module.model, self.runner
        model.eval()  # the teacher is deterministic (no dropout), and so the student
        predict = self.guided(pl_module, text, text_mask, labels)
        with runner.installed():
            x_k, t_k = self.state(pl_module, k, x0, noise, predict)  # the cache holds step k-1's branch outputs
            beta = pl_module.router.beta(k)  # (blocks, branches)
            mixed = beta
            if self.cfg.hard:  # forward: the schedule's 0 / 1; backward: d/d beta (straight through)
                mixed = beta + ((beta > self.cfg.threshold).to(beta) - beta).detach()
            with runner.mix(mixed):
                student = predict(x_k, t_k)  # (B, C, h, w)
        with torch.no_grad():
            teacher = predict(x_k, t_k)  # the full model at step k
        return F.mse_loss(student, teacher), beta

    def guided(self, pl_module: pl.LightningModule, text: torch.Tensor | None, text_mask: torch.Tensor | None,
               labels: torch.Tensor | None) -> Any:
        """predict(x, t) -> the prediction the sampler uses (float32): with guidance g != 1, conditional and
        unconditional halves in one batch (one branch cache, as framework/inference/pipeline.py samples) and
        uncond + g * (cond - uncond)."""
        from framework.models.conditioning import guidance_batch, guide

        model, g = pl_module.model, self.cfg.guidance or 1.0
        if g != 1:
            text, text_mask, labels = guidance_batch(model, text, text_mask, labels, pl_module.empty_text)

        def predict(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            if g == 1:
                return model(x, t.expand(x.shape[0]).float(), text, text_mask, labels).float()
            return guide(model(torch.cat([x, x]), t.expand(2 * x.shape[0]).float(), text, text_mask, labels), g)

        return predict

    def state(self, pl_module: pl.LightningModule, k: int, x0: torch.Tensor, noise: torch.Tensor,
              predict: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(x_k, t_k): the sampler's state at step k, reached with full-model steps from where `start` puts it;
        the last of them (step k-1) leaves every branch's output in the runner's cache."""
        objective = pl_module.objective
        scheduler = objective.sampler(self.sampler)  # a fresh one: DDIM and flow-Euler need no history
        scheduler.set_timesteps(self.cfg.steps, device=x0.device)
        ts = scheduler.timesteps
        if self.cfg.start == "trajectory":
            first, x = 0, noise.float() * getattr(scheduler, "init_noise_sigma", 1.0)
        else:
            first, x = k - 1, objective.noise_to(x0, noise, ts[k - 1]).float()
        with torch.no_grad():
            for i in range(first, k):
                x_in = scheduler.scale_model_input(x, ts[i]) if hasattr(scheduler, "scale_model_input") else x
                x = scheduler.step(predict(x_in.to(x0.dtype), ts[i]), ts[i], x).prev_sample
        x_k = scheduler.scale_model_input(x, ts[k]) if hasattr(scheduler, "scale_model_input") else x
        return x_k.to(x0.dtype), ts[k]

    # ---- the schedule on disk -----------------------------------------------------------

    def write_schedule(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> CacheSchedule | None:
        router = getattr(pl_module, "router", None)
        if router is None or trainer.global_rank != 0:
            return None
        source = {"init_from": str(self.init_from), "router_step": trainer.global_step,
                  "sparsity": self.cfg.sparsity, "guidance": self.cfg.guidance, "start": self.cfg.start,
                  "hard": self.cfg.hard, "cost": self.cfg.cost}
        schedule = router.schedule(self.cfg, self.sampler, model_signature(pl_module.model, self.objective_name), source)
        schedule.save(self.out)
        plot_schedule(schedule, self.out.with_suffix(".png"))
        return schedule

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        self.write_schedule(trainer, pl_module)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.write_schedule(trainer, pl_module)  # evaluations during the run (eval.every_n_steps) read it
        trainer.strategy.barrier()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        schedule = self.write_schedule(trainer, pl_module)
        if schedule is not None:
            rank_zero_info(f"cache_router: {schedule.describe()}; wrote {self.out} and {self.out.with_suffix('.png')}")
        trainer.strategy.barrier()  # every rank's final evaluation reads the finished file


def build(cfg: CacheRouterConfig, run_cfg: Any) -> CacheRouterStage:
    if not run_cfg.init_from:
        raise ValueError("plugins=[cache_router] distils a trained model: give its checkpoint with init_from=PATH "
                         "(python -m framework.train experiment=cache_router init_from=runs/quickstart/checkpoints/last.ckpt)")
    if run_cfg.strategy.name == "fsdp":
        raise ValueError("plugins=[cache_router] trains only the router on a frozen backbone, which fits any device "
                         "that samples it: use strategy=ddp (or single) instead of strategy=fsdp")
    if run_cfg.strategy.compile:
        raise ValueError("plugins=[cache_router] swaps branch modules during each step, which torch.compile'd "
                         "blocks do not allow: set strategy.compile=false")
    objective = run_cfg.objective.name
    sampler = cfg.sampler or DEFAULT_SAMPLER[objective]
    check_sampler(objective, sampler)
    if sampler not in TRAINABLE_SAMPLERS:
        ok = [s for s in TRAINABLE_SAMPLERS if objective in SAMPLERS[s]]
        raise ValueError(f"plugins.cache_router.sampler={sampler}: the router trains for one of {TRAINABLE_SAMPLERS} "
                         f"(a multistep solver's step depends on earlier steps); set plugins.cache_router.sampler={ok[0]}")
    if cfg.guidance is None:  # the guidance the schedule will be sampled with
        cfg = dataclasses.replace(cfg, guidance=float(run_cfg.eval.guidance))
    out = Path(cfg.out) if cfg.out else Path(run_cfg.run.dir) / SCHEDULE_FILE
    return CacheRouterStage(cfg, sampler, objective, out.resolve(), run_cfg.init_from)


register_plugin("cache_router", CacheRouterConfig, build)
