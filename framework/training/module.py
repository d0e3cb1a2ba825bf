"""The LightningModule: one diffusion training step on precomputed latents.

Everything random in a step (noise, noise level, caption dropout) is a function of (seed, micro-batch counter, the
sample's row in the *global* batch), drawn for the whole batch at once (framework/training/keyed.py), and each rank
draws its own rows only. So a run is reproducible, resumes exactly from any checkpoint, and a 2-rank run draws the
same numbers for the same samples as a 1-rank run with the same global batch (Streaming gives the rank at position r
the global rows r, r+W, r+2W, ... and _draw draws the same rows). The caption a sample of a per_image dataset trains
on in a step, its posterior sample and its flip are drawn the same way (draw_captions, draw_latents).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
import torch
import torch.nn.functional as F

from framework.inference.checkpoint import CKPT_KEY
from framework.models.adapters import AdapterConfig, add_adapter, is_adapter_key
from framework.models.conditioning import drop_captions
from framework.models.backbones import Denoiser, ModelConfig, build_denoiser, load_weights, to_model_config
from framework.models.init import init_weights
from framework.models.objectives import Objective, ObjectiveConfig
from framework.training import keyed
from framework.training.finite import FiniteGuard, NonFiniteLossError  # noqa: F401  (the module's error)
from framework.training.optim import OptimizerConfig, build_optimizer, group_lambda, lr_lambda, scaled_lr
from framework.training.registry import logging_step, param_groups_hook, training_loss_hook
from framework.distributed.config import StrategyConfig
from framework.distributed.mesh import ParallelDims

LEVEL_BUCKETS = 4  # train/loss_t0..3: the loss per quarter of the noise-level range (t0: least noise)
# The kinds of a step's keyed draws (the tag in keyed.keys), so that no two kinds share numbers:
NOISE_DRAW, DROP_DRAW, CAPTION_DRAW, LATENT_DRAW, FLIP_DRAW = range(5)


def _to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; to a GPU from pinned memory, so that the copy does not wait for the GPU's queue."""
    return (x.pin_memory() if device.type == "cuda" else x).to(device, non_blocking=True)


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
    ) -> None:
        super().__init__()
        self.model_cfg, self.optimizer_cfg = model, optimizer
        self.init_from = init_from  # weights only: a checkpoint, a .safetensors file or a diffusers folder
        self._start_state: dict[str, torch.Tensor] | None = None  # set by start_from() under fsdp
        self.adapter_cfg = adapter if adapter is not None and adapter.on else None
        if strategy is not None and strategy.name == "fsdp" and self.adapter_cfg is None:
            # No rank holds the whole model: shapes only now, this rank's shards in configure_model,
            # drawn from the RNG state the ordinary build would have started from (framework/distributed/fsdp.py).
            from framework.distributed.fsdp import build_meta

            self._init_rng_state: torch.Tensor | None = torch.get_rng_state()
            self.model: Denoiser = build_meta(to_model_config(model))
        else:
            self._init_rng_state = None
            self.model = build_denoiser(model)
            if init_from:
                load_weights(self.model, init_from)
            else:
                init_weights(self.model)  # model.init=reference: as the family's reference code initialises
        if self.adapter_cfg is not None:
            self._add_adapter(self.adapter_cfg)
        self.objective = Objective(objective)
        self.max_steps, self.seed = max_steps, seed
        self.finite = FiniteGuard(skip_nonfinite)  # trainer.skip_nonfinite: the non-finite checks of every step
        # Samples of the whole job trained on so far, kept in checkpoints: continues across resumes and Slurm requeues
        # (Lightning's counters restart with each job) and counts each step at the global batch it had.
        self.images_seen = 0
        self._interval_loss: torch.Tensor | None = None  # the losses summed since the last logged step, and their count
        self._interval_batches = 0
        self.allow_global_batch_change = allow_global_batch_change  # trainer.allow_global_batch_change
        self.config = config or {}  # the resolved run config, stored in every checkpoint
        self.strategy_cfg = strategy  # block preparation and sharding in configure_model
        # Set from the dataset in setup(); kept in checkpoints so sampling needs no dataset.
        self.empty_text: torch.Tensor | None = None
        self.dataset_info: dict[str, Any] = {}
        self._batch_end: float | None = None  # when the last step ended: the next one's data wait starts there
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

        info = dm.info
        m = self.model_cfg
        check_compatible(info, m.in_channels, m.latent_hw, m.text_dim, m.num_frames)
        self.empty_text = info.empty_text_embeds.float()
        self.dataset_info = info.summary()

    def configure_model(self) -> None:
        """Activation checkpointing / compile per block, then FSDP2 sharding under strategy=fsdp.

        Lightning calls this once the processes exist; under ModelParallelStrategy `device_mesh` is
        set and the model is sharded here, before the optimizer is built from its (DTensor) parameters.
        The meta-device model built under fsdp gets its real shards (fresh or init_from) right after.
        """
        from framework.distributed.fsdp import prepare_blocks, shard

        s = self.strategy_cfg
        if s is None or self._configured:
            return
        self._configured = True
        strategy = self.trainer.strategy
        mesh = getattr(strategy, "mesh", None)  # the job's one mesh (framework/distributed/mesh.py): ddp and fsdp
        if s.sequence_parallel > 1:  # hooks and processors only: before sharding, on the meta model under fsdp
            from framework.distributed.sequence import init, install

            install(self.model, init(mesh, s.sequence_parallel_head_groups))
        prepare_blocks(self.model, s.activation_checkpointing, s.compile)
        if s.name == "fsdp":
            shard(self.model, mesh.fsdp_mesh(), s.sharding, strategy.param_dtype)
            if self._init_rng_state is not None:
                from framework.distributed.fsdp import materialize

                start = self._start_state if self._start_state is not None else self.init_from
                materialize(self.model, self._init_rng_state, strategy.root_device, start)
                self._init_rng_state, self._start_state = None, None

    def _add_adapter(self, cfg: AdapterConfig) -> None:
        """adapter=lora|lokr|loha: the base (init_from) frozen, the adapter trainable; checkpoints hold the adapter's
        tensors only (a state-dict hook drops the base's, which init_from gives back on resume and in every command).
        Under fsdp the base is built whole on each rank and sharded in configure_model (no meta-device build)."""
        base = sum(p.numel() for p in self.model.parameters())
        trained = add_adapter(self.model, cfg)
        rank_zero_info(f"adapter={cfg.kind}: {trained:,} trainable parameters (rank {cfg.rank}) on a frozen base of "
                       f"{base:,} ({trained / base:.2%})")
        self.strict_loading = False  # the base's keys are not in the checkpoint; on_load_checkpoint checks the adapter's
        # DDP leaves the frozen base alone: each rank read it from init_from, and an int8 / fp8 one cannot be broadcast.
        from torch.nn.parallel import DistributedDataParallel

        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            self, [f"model.{n}" for n, p in self.model.named_parameters() if not p.requires_grad])

        def drop_base(module: torch.nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
            for key in [k for k in state if k.startswith(prefix + "model.") and not is_adapter_key(k)]:
                del state[key]

        self.register_state_dict_post_hook(drop_base)

    def _check_adapter_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A resumed checkpoint must hold this run's adapter (same kind, rank and targets), every tensor of it; an
        adapter checkpoint is refused by a run without one."""
        saved = (checkpoint.get(CKPT_KEY, {}).get("config") or {}).get("adapter") or {"kind": "none"}
        now = {} if self.adapter_cfg is None else vars(self.adapter_cfg)
        fields = ("kind", "rank", "alpha", "targets")
        if saved.get("kind", "none") != now.get("kind", "none") or (
                self.adapter_cfg is not None and any(saved.get(f) != now[f] for f in fields)):
            raise ValueError(f"resuming a checkpoint trained with adapter={ {f: saved.get(f) for f in fields} } in a run "
                             f"with adapter={ {f: now.get(f, 'none' if f == 'kind' else None) for f in fields} }: the "
                             "checkpoint's weights would not fit. Resume with the adapter settings it was trained with "
                             "(or start a new run.dir; init_from= takes a merged export of it)")
        if self.adapter_cfg is None:
            return
        stored = checkpoint.get("state_dict")
        if stored is None:  # a sharded folder, already read into the model (strict_loading off): its names are on file
            from torch.distributed.checkpoint import FileSystemReader

            names = FileSystemReader(str(self.trainer.ckpt_path)).read_metadata().state_dict_metadata
            stored = {k[len("state_dict."):] for k in names if k.startswith("state_dict.")}
        own = [f"model.{k}" for k, p in self.model.named_parameters() if p.requires_grad]
        missing = [k for k in own if k not in stored]
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} of the adapter's tensors ({missing[:3]}): it was not "
                             "written by this adapter run")

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

    # ---- what a logged step records --------------------------------------------------------

    def _logging_step(self, stepped: bool = False) -> bool:
        """Whether this step's values reach a logger (framework.training.registry.logging_step, with a logger).
        The extra per-step figures are computed on those steps only: each costs a host synchronisation."""
        return bool(self.trainer.loggers) and logging_step(self.trainer, stepped)

    def on_fit_start(self) -> None:
        if self.adapter_cfg is not None and self.adapter_cfg.offload_blocks:  # once the model is on its device
            from framework.distributed.fsdp import shard_units
            from framework.models.adapters import offload_frozen_blocks

            offload_frozen_blocks(shard_units(self.model), self.device)

    def on_train_start(self) -> None:
        for logger in self.trainer.loggers:  # the resolved run config as the run's config (W&B) / hparams.yaml
            logger.log_hyperparams(self.config)

    def _log_step_figures(self) -> None:
        """train/data_wait_ms: time from the end of the last step to the start of this one (the loader's fetch
        and Lightning's transfer); train/peak_mem_gib: the device's peak allocation so far (GPUs only)."""
        import time

        if self._batch_end is not None:
            self.log("train/data_wait_ms", (time.perf_counter() - self._batch_end) * 1e3, on_step=True, on_epoch=False)
        if self.device.type == "cuda":
            self.log("train/peak_mem_gib", torch.cuda.max_memory_allocated(self.device) / 2**30, on_step=True,
                     on_epoch=False)

    def _log_loss_by_level(self, pred: torch.Tensor, target: torch.Tensor, t: torch.Tensor) -> None:
        """train/loss_t{k}: the mean loss of the global batch's samples whose noise level t / T falls in bucket k
        of LEVEL_BUCKETS (where a model is weak shows here, not in the mean)."""
        per = (pred.detach().float() - target.float()).pow(2).flatten(1).mean(1)  # (B,)
        k = (t.float() / self.objective.cfg.num_train_timesteps * LEVEL_BUCKETS).long().clamp(0, LEVEL_BUCKETS - 1)
        sums = per.new_zeros(LEVEL_BUCKETS).index_add_(0, k, per)
        counts = per.new_zeros(LEVEL_BUCKETS).index_add_(0, k, torch.ones_like(per))
        if self.trainer.world_size > 1:
            both = self.trainer.strategy.reduce(torch.cat([sums, counts]), reduce_op="sum")
            sums, counts = both[:LEVEL_BUCKETS], both[LEVEL_BUCKETS:]
        for i, (total, n) in enumerate(zip(sums.tolist(), counts.tolist())):
            if n > 0:
                self.log(f"train/loss_t{i}", total / n, on_step=True, on_epoch=False)

    def on_train_batch_start(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._step_at_start = self.global_step  # on_train_batch_end: a batch that moved it took an optimizer step
        if self._logging_step():
            self._log_step_figures()
        flops = self.batch_flops(batch)  # counted here on every rank, once per shape
        if self.flops_per_batch is None:
            self.flops_per_batch = flops

    def batch_flops(self, batch: dict[str, Any]) -> int:
        """The training FLOPs of `batch`, counted once per latent shape: the buckets of a dataset (sizes, clip lengths)
        cost differently. A count set from outside before training (the bench's, whose batches may be pixels) stands
        for its one shape."""
        shape = tuple(batch["latents"].shape) if "latents" in batch else ()
        if shape not in self._batch_flops:
            if self.flops_per_batch is not None and not self._batch_flops:
                self._batch_flops[shape] = self.flops_per_batch
            else:
                from framework.models.flops import count_train_flops_per_sample

                self._batch_flops[shape] = count_train_flops_per_sample(self.model, batch) * shape[0]
        return self._batch_flops[shape]

    def configure_optimizers(self) -> dict[str, Any]:
        # Every trainable parameter of the module: the backbone's, or a stage's own (a frozen backbone + router).
        params = [p for p in self.parameters() if p.requires_grad]
        hook = param_groups_hook(self.trainer) if self._trainer is not None else None
        groups = hook.param_groups(self, params) if hook is not None else [{"params": params}]
        if sorted(map(id, params)) != sorted(id(p) for g in groups for p in g["params"]):
            raise RuntimeError(f"{type(hook).__name__}.param_groups must return each trainable parameter once")
        cfg = self.optimizer_cfg
        scaled = self._trainer is not None and getattr(self.trainer.precision_plugin, "scaler", None) is not None
        lr = scaled_lr(cfg, self.global_batch() if self._trainer is not None else None)
        if cfg.lr_scaling != "none":
            rank_zero_info(f"optimizer.lr_scaling={cfg.lr_scaling}: peak lr {lr:.4g} = {cfg.lr:g} at "
                           f"{cfg.lr_reference_batch} samples per step, for this run's {self.global_batch()}")
        opt = build_optimizer([{"params": g["params"], "lr": lr * g.get("lr_scale", 1.0)} for g in groups], cfg,
                              grad_scaler=scaled)
        base = lr_lambda(self.optimizer_cfg, self.max_steps)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, [group_lambda(base, g.get("warmup_steps", 0)) for g in groups])
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ---- the training step --------------------------------------------------------------

    def _micro_batch(self) -> int:
        """The index of this micro-batch in the run, the same on every rank and after a resume. (Read before the loop
        counts the batch as ready, in draw_captions, it numbers the micro-batches of a step otherwise, as uniquely.)"""
        accumulate = self.trainer.accumulate_grad_batches
        return self.global_step * accumulate + self.trainer.fit_loop.epoch_loop.batch_progress.current.ready % accumulate

    def _stream_slots(self) -> tuple[int, int]:
        """(r, W): this rank holds rows r, r + W, r + 2W, ... of the global batch (see _draw)."""
        t = self.trainer
        dims = getattr(t.strategy, "mesh", None)  # the job's mesh (ddp, fsdp); a single process has none
        if dims is None:
            dims = ParallelDims.of(t.world_size, t.num_devices, 1)
            return dims.stream_position(t.global_rank), dims.data_parallel
        return dims.stream_position, dims.dims.data_parallel

    def step_generator(self) -> torch.Generator:
        """CPU generator for this micro-batch, independent of rank count and of restarts."""
        return torch.Generator().manual_seed(hash((self.seed, self._micro_batch())) & 0x7FFF_FFFF_FFFF)

    def _row_keys(self, n: int, tag: int) -> torch.Tensor:
        """(n,) int64 host keys of this rank's n samples for one kind of draw (keyed.keys): (seed, micro-batch, the
        sample's row in the global batch, tag), so a sample draws the same on any world size and after a resume."""
        (r, W), micro = self._stream_slots(), self._micro_batch()
        return keyed.keys(self.seed, micro, range(r, r + n * W, W), tag)

    def _draw(self, x0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Noise, noise level and caption-drop flag for each of this rank's samples.

        Keyed by sample (_row_keys): a rank draws only its own rows (host time O(local batch) whatever the world size)
        and a sample gets the same numbers on any world size and after a resume. Streaming deals a global batch out
        round-robin over W data-parallel ranks, nodes innermost: the rank at position r = local_rank * nodes +
        node_rank holds global rows r, r+W, r+2W, ... (tests/test_distributed.py checks this against a 1-process run
        with the same global batch, on 1 node and on 2); a sequence-parallel group of P ranks draws as one rank
        (Streaming's replication). The noise and the normal behind the noise level are drawn on the batch's device,
        the drop flags (B,) on the host: whether any row drops needs no device read.
        """
        B, n = x0.shape[0], x0[0].numel()
        drop = keyed.uniforms(self._row_keys(B, DROP_DRAW), 1)[:, 0] < self.objective.cfg.caption_dropout
        z = keyed.normals(_to_device(self._row_keys(B, NOISE_DRAW), x0.device), n + 1)  # the noise, then the level's
        return z[:, :n].reshape(x0.shape), self.objective.levels(z[:, n]), drop

    def draw_latents(self, latents: torch.Tensor, std: torch.Tensor | None, hflip: bool) -> torch.Tensor:
        """The latents (B, C, h, w) each sample trains on in this step: a draw latents + std * N(0, 1) of its VAE
        posterior when the dataset stores the std (posterior=distribution), mirrored left-right with probability 1/2
        when hflip. Keyed by sample (_row_keys); the data module calls it on the host
        (LatentDataModule.on_before_batch_transfer)."""
        B, out = latents.shape[0], latents
        if std is not None:
            out = latents + std * keyed.normals(self._row_keys(B, LATENT_DRAW), latents[0].numel()).view(latents.shape)
        if hflip:
            flip = keyed.uniforms(self._row_keys(B, FLIP_DRAW), 1).view(B, *[1] * (latents.ndim - 1)) < 0.5
            out = torch.where(flip, out.flip(-1), out)
        return out

    def draw_captions(self, counts: torch.Tensor) -> torch.Tensor:
        """For a batch of a caption_layout per_image dataset, whose samples have counts (B,) captions: which one each
        trains on in this step, (B,) int64, uniform over its captions. Keyed by sample as _draw draws, so the same on
        any world size and after a resume. The data module calls it on the host, before the batch's copy to the
        device (LatentDataModule.on_before_batch_transfer), which then moves one caption a sample."""
        u = keyed.uniforms(self._row_keys(len(counts), CAPTION_DRAW), 1)[:, 0]
        return (u.double() * counts).long()  # in float64 u * count stays below count

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor | None:
        x0 = batch["latents"]  # (B, C, h, w), already scaled by the data module
        noise, u, drop = self._draw(x0)
        # (B, L, D) fp16 from the loader, as a float32 copy of the step's own, (B, L)
        text, mask = batch["text_embeds"].to(torch.float32, copy=True), batch["text_mask"]
        text, mask = drop_captions(text, mask, self.empty_text.to(text), drop, inplace=True)
        labels = batch.get("label")
        if labels is not None and self.model_cfg.num_classes is not None:
            drop = drop.to(labels.device, non_blocking=True)
            labels = torch.where(drop, self.model.null_labels(x0.shape[0]).to(labels), labels)
        else:
            labels = None

        hook = training_loss_hook(self.trainer)
        if hook is not None:  # a distillation stage (plugins/cache_router.py) computes its own loss
            loss = hook.training_loss(self, x0, noise, text, mask, labels)
        else:
            xt, t, target = self.objective.corrupt(x0, noise, u)
            pred = self.model(xt, t, text, mask, labels, size_ids=batch.get("size_ids"))  # (B, C, h, w)
            loss = F.mse_loss(pred.float(), target.float())
            if self._logging_step():
                self._log_loss_by_level(pred, target, t)

        self.finite.add_loss(loss)  # checked with this step's gradient norm before the optimizer step
        # train/loss is the mean over every micro-batch since the last logged step, not one batch's loss: summed on
        # the device (no synchronisation), reset once a logged step has taken its optimizer step.
        self._interval_loss = loss.detach() + (self._interval_loss if self._interval_loss is not None else 0.0)
        self._interval_batches += 1
        if logging_step(self.trainer):
            # Only on logging steps (and then to the progress bar too, which refreshes on those steps): the
            # average over ranks and its read on the host are a synchronisation the other steps do without.
            # Averaged over ranks, so the logged loss is the global batch's whatever the world size.
            self.log("train/loss", self._interval_loss / self._interval_batches, prog_bar=True, on_step=True,
                     batch_size=x0.shape[0], sync_dist=self.trainer.world_size > 1)
        return loss

    # ---- finiteness: the losses and the gradient norm, once per optimizer step ----------------

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The step's losses and global gradient norm checked together (framework/training/finite.py)."""
        norm = self.finite.before_step(list(self.parameters()), optimizer, self.global_step, self.trainer.world_size,
                                       self.device)
        self.images_seen += self.global_batch() or 0
        if logging_step(self.trainer):  # this step's train/loss is logged: the next interval starts
            self._interval_loss, self._interval_batches = None, 0
        if self._logging_step():
            self.log("train/grad_norm", norm.detach().float(), on_step=True, on_epoch=False)
            self.log("trainer/images_seen", float(self.images_seen), on_step=True, on_epoch=False)

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
        import time

        if self._logging_step(stepped=self.global_step != self._step_at_start):
            self.finite.check()
        self._batch_end = time.perf_counter()

    def on_train_end(self) -> None:
        self.finite.check()

    # ---- checkpoints --------------------------------------------------------------------

    def global_batch(self) -> int | None:
        """Samples per optimizer step over the whole job: per-device batch x data-parallel ranks x accumulation."""
        dm = getattr(self.trainer, "datamodule", None)
        if dm is None:
            return None
        sequence = self.strategy_cfg.sequence_parallel if self.strategy_cfg is not None else 1
        return dm.cfg.batch_size * (self.trainer.world_size // sequence) * self.trainer.accumulate_grad_batches

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
        self._check_adapter_checkpoint(checkpoint)
        extra = checkpoint.get(CKPT_KEY, {})
        saved, now = extra.get("global_batch"), self.global_batch()
        if saved is not None and now is not None and saved != now and not self.allow_global_batch_change:
            raise ValueError(
                f"resuming a run whose global batch was {saved} samples per step with {now} (data.batch_size x "
                f"data-parallel ranks x trainer.accumulate_grad_batches): the data order, the noise drawn per sample "
                f"and the learning-rate schedule's meaning of a step would change mid-run. Resume with the same global "
                f"batch (e.g. raise trainer.accumulate_grad_batches on fewer ranks), or set "
                f"trainer.allow_global_batch_change=true to continue anyway."
            )
        # Checkpoints from before the counter: every step so far at the saved global batch.
        self.images_seen = extra.get("images_seen", checkpoint.get("global_step", 0) * (saved or 0))
        if extra.get("empty_text") is not None:
            self.empty_text = extra["empty_text"]
