"""The LightningModule: one diffusion training step on precomputed latents.

Everything random in a step (noise, noise level, caption dropout) is keyed by sample (framework/training/draws.py):
the same on any world size and after a resume. Around the step, elsewhere: the per-step figures beyond train/loss
(framework/training/figures.py), adapter wiring (framework/models/adapters.py), FSDP building and sharding
(framework/distributed/fsdp.py).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from framework.inference.checkpoint import CKPT_KEY
from framework.training.adapter_run import AdapterConfig, attach_adapter, check_adapter_checkpoint
from framework.models.conditioning import drop_captions
from framework.models.backbones import Denoiser, ModelConfig
from framework.models.objectives import Objective, ObjectiveConfig
from framework.training.draws import StepDraws
from framework.training import figures
from framework.training.figures import logged
from framework.training.finite import FiniteGuard, NonFiniteLossError  # noqa: F401  (the module's error)
from framework.training.checkpointing import check_global_batch
from framework.training.optim import OptimizerConfig, configure_optimizers
from framework.training.plan import RunPlan
from framework.training.registry import logging_step, training_loss_hook
from framework.distributed.config import StrategyConfig
from framework.distributed.fsdp import build_model, configure


class DiffusionModule(pl.LightningModule):
    """Denoiser + objective + optimizer; the loss lives in training_step."""

    def __init__(
        self,
        model: ModelConfig,
        objective: ObjectiveConfig,
        optimizer: OptimizerConfig,
        max_steps: int,
        seed: int = 0,
        skip_nonfinite: bool = False,
        allow_global_batch_change: bool = False,
        config: dict[str, Any] | None = None,
        strategy: StrategyConfig | None = None,
        init_from: str | None = None,
        adapter: AdapterConfig | None = None,
        plan: RunPlan | None = None,
    ) -> None:
        super().__init__()
        self.model_cfg, self.optimizer_cfg = model, optimizer
        self.init_from = init_from  # weights only: a checkpoint, a .safetensors file or a diffusers folder
        self._start_state: dict[str, torch.Tensor] | None = None  # set by start_from() under fsdp
        self.adapter_cfg = adapter if adapter is not None and adapter.on else None
        # Under fsdp (no adapter) no rank holds the whole model: a meta-device build, sharded in configure_model.
        meta = strategy is not None and strategy.name == "fsdp" and self.adapter_cfg is None
        self.model: Denoiser
        self.model, self._init_rng_state = build_model(model, meta, init_from)
        if self.adapter_cfg is not None:
            attach_adapter(self, self.adapter_cfg)
        self.objective = Objective(objective)
        self.max_steps, self.seed = max_steps, seed
        self.finite = FiniteGuard(skip_nonfinite)  # trainer.skip_nonfinite: the non-finite checks of every step
        # Samples of the whole job trained on so far, kept in checkpoints: continues across resumes and Slurm requeues
        # (Lightning's counters restart with each job) and counts each step at the global batch it had.
        self.images_seen = 0
        self._interval_loss: torch.Tensor | None = None  # the losses summed since the last logged step, and their count
        self._interval_batches = 0
        self.arrival_ms = 0.0  # the last logging step's wait for the slowest rank (figures.arrival_wait_ms)
        self.allow_global_batch_change = allow_global_batch_change  # trainer.allow_global_batch_change
        self.plan = plan  # the run's global batch and peak lr (framework/training/plan.py), None outside a run
        self.config = config or {}  # the resolved run config, stored in every checkpoint
        self.strategy_cfg = strategy  # block preparation and sharding in configure_model
        # Set from the dataset in setup(); kept in checkpoints so sampling needs no dataset.
        self.empty_text: torch.Tensor | None = None
        self.dataset_info: dict[str, Any] = {}
        self._step_at_start = 0  # trainer.global_step when the current batch began
        self._configured = False  # configure_model ran (Lightning may call it again)
        # Counted on the first real batch; Lightning's ThroughputMonitor turns it into TFLOP/s and MFU.
        self.flops_per_batch: int | None = None
        self._batch_flops: dict[tuple[int, ...], int] = {}  # latent shape -> FLOPs of a batch (batch_flops)

    # ---- set-up -------------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        dm = getattr(self.trainer, "datamodule", None)
        if dm is None:
            return
        from framework.data.datamodule import check_compatible

        info, m = dm.info, self.model_cfg
        check_compatible(info, m.in_channels, m.latent_hw, m.text_dim, m.num_frames)
        self.empty_text = info.empty_text_embeds.float()
        self.dataset_info = info.summary()

    def configure_model(self) -> None:
        """Activation checkpointing / compile per block, then FSDP2 sharding under strategy=fsdp
        (framework.distributed.fsdp.configure).

        Lightning calls this once the processes exist; under ModelParallelStrategy `device_mesh` is
        set and the model is sharded here, before the optimizer is built from its (DTensor) parameters.
        The meta-device model built under fsdp gets its real shards (fresh or init_from) right after.
        """
        if self.strategy_cfg is None or self._configured:
            return
        self._configured = True
        start = self._start_state if self._start_state is not None else self.init_from
        configure(self.model, self.strategy_cfg, self.trainer.strategy, self._init_rng_state, start)
        self._init_rng_state, self._start_state = None, None

    def start_from(self, state: dict[str, torch.Tensor]) -> None:
        """Start training from these whole weights (Denoiser keys) instead of the fresh or init_from ones.

        For plugins that compute the starting weights in their setup() (plugins/growth). Under fsdp the
        model is still on the meta device then: each rank takes its rows in configure_model.
        """
        from framework.models.backbones import check_fits

        check_fits(state, self.model, "the plugin's starting weights")
        if self._init_rng_state is not None:
            self._start_state = state
        else:
            self.model.load_state_dict(state)

    def on_fit_start(self) -> None:
        if self.adapter_cfg is not None and self.adapter_cfg.offload_blocks:  # once the model is on its device
            from framework.distributed.fsdp import shard_units
            from framework.models.adapters import offload_frozen_blocks

            offload_frozen_blocks(shard_units(self.model), self.device)

    def on_train_start(self) -> None:
        for logger in self.trainer.loggers:  # the resolved run config as the run's config (W&B) / hparams.yaml
            logger.log_hyperparams(self.config)

    def on_train_batch_start(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._step_at_start = self.global_step  # on_train_batch_end: a batch that moved it took an optimizer step
        flops = self.batch_flops(batch)  # counted here on every rank, once per shape
        if self.flops_per_batch is None:
            self.flops_per_batch = flops

    def batch_flops(self, batch: dict[str, Any]) -> int:
        """The training FLOPs of `batch`, counted once per latent shape (framework.training.figures.batch_flops)."""
        return figures.batch_flops(self, batch)

    def configure_optimizers(self) -> dict[str, Any]:
        return configure_optimizers(self)  # framework/training/optim.py

    # ---- the training step --------------------------------------------------------------

    def step_generator(self) -> torch.Generator:
        """CPU generator for this micro-batch, independent of rank count and of restarts."""
        return StepDraws.of(self.trainer, self.seed).generator()

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor | dict[str, torch.Tensor]:
        x0 = batch["latents"]  # (B, C, h, w), already scaled by the data module
        noise, u, drop = StepDraws.of(self.trainer, self.seed).noise(x0, self.objective.cfg.caption_dropout,
                                                                      self.objective.levels)
        # (B, L, D) fp16 from the loader, as a float32 copy of the step's own, (B, L)
        text, mask = batch["text_embeds"].to(torch.float32, copy=True), batch["text_mask"]
        text, mask = drop_captions(text, mask, self.empty_text.to(text), drop, inplace=True)
        labels = batch.get("label")
        if labels is not None and self.model_cfg.num_classes is not None:
            drop = drop.to(labels.device, non_blocking=True)
            labels = torch.where(drop, self.model.null_labels(x0.shape[0]).to(labels), labels)
        else:
            labels = None

        hook, extra = training_loss_hook(self.trainer), {}
        if hook is not None:  # a distillation stage (plugins/cache_router.py) computes its own loss
            loss = hook.training_loss(self, x0, noise, text, mask, labels)
        else:
            xt, t, target = self.objective.corrupt(x0, noise, u)
            pred = self.model(xt, t, text, mask, labels, size_ids=batch.get("size_ids"))  # (B, C, h, w)
            loss = F.mse_loss(pred.float(), target.float())
            if logged(self.trainer):  # train/loss_t0..3 (framework/training/figures.py): (B,) each
                extra = {"sample_loss": figures.sample_losses(pred, target), "t": t}

        self.finite.add_loss(loss)  # checked with this step's gradient norm before the optimizer step
        # train/loss: the mean over the micro-batches since the last logged step, summed on the device (no sync)
        self._interval_loss = loss.detach() + (self._interval_loss if self._interval_loss is not None else 0.0)
        self._interval_batches += 1
        if logging_step(self.trainer):
            if figures.times_arrival(self.trainer, batch_idx):
                self.arrival_ms = figures.arrival_wait_ms(self.device)  # before this step's first collective
            # Only on logging steps (the progress bar refreshes on those): averaged over ranks (the global batch's
            # loss whatever the world size), a synchronisation the other steps do without.
            self.log("train/loss", self._interval_loss / self._interval_batches, prog_bar=True, on_step=True,
                     batch_size=x0.shape[0], sync_dist=self.trainer.world_size > 1)
        return {"loss": loss, **extra} if extra else loss

    # ---- finiteness: the losses and the gradient norm, once per optimizer step ----------------

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The step's losses and global gradient norm checked together (framework/training/finite.py)."""
        self.finite.before_step(list(self.parameters()), optimizer, self.global_step, self.trainer.world_size,
                                self.device)
        self.images_seen += self.global_batch() or 0
        if logging_step(self.trainer):  # this step's train/loss is logged: the next interval starts
            self._interval_loss, self._interval_batches = None, 0

    @property
    def step_skipped(self) -> bool:
        """trainer.skip_nonfinite: whether the last optimizer step was skipped."""
        return self.finite.step_skipped

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Clip by the norm on_before_optimizer_step computed (one pass over the gradients, not two)."""
        norm = self.finite.take_grad_norm()
        if not gradient_clip_val or norm is None or gradient_clip_algorithm not in (None, "norm"):
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        params = [p for p in self.parameters() if p.grad is not None]
        torch.nn.utils.clip_grads_with_norm_(params, gradient_clip_val, norm)

    def on_train_batch_end(self, *args: Any) -> None:
        if logged(self.trainer, stepped=self.global_step != self._step_at_start):
            self.finite.check()

    def on_train_end(self) -> None:
        self.finite.check()

    # ---- checkpoints --------------------------------------------------------------------

    def global_batch(self) -> int | None:
        """Samples per optimizer step over the whole job (the run plan's; None for a module outside a run)."""
        return self.plan.global_batch if self.plan is not None else None

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.finite.check()  # never save weights that a non-finite step produced
        # update, not replace: callbacks' on_save_checkpoint ran first (plugins/ema.py adds ema_state).
        checkpoint.setdefault(CKPT_KEY, {}).update({
            "global_batch": self.global_batch(),
            "images_seen": self.images_seen,
            "config": self.config,
            "dataset": self.dataset_info,
            "empty_text": None if self.empty_text is None else self.empty_text.cpu(),
        })

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        check_adapter_checkpoint(self, self.adapter_cfg, checkpoint)
        extra = checkpoint.get(CKPT_KEY, {})
        saved, now = extra.get("global_batch"), self.global_batch()
        check_global_batch(saved, now, self.allow_global_batch_change)
        # Checkpoints from before the counter: every step so far at the saved global batch.
        self.images_seen = extra.get("images_seen", checkpoint.get("global_step", 0) * (saved or 0))
        if extra.get("empty_text") is not None:
            self.empty_text = extra["empty_text"]
