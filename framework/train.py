"""`python -m framework.train [key=value ...]`: compose the config, build data, module, callbacks
and trainer, and fit. With no arguments this is the quickstart (conf/experiment/quickstart.yaml).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Sequence

import hydra
import lightning.pytorch as pl
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, TQDMProgressBar
from omegaconf import DictConfig, OmegaConf

import plugins  # noqa: F401  (registers plugin callbacks and optimizers)
from framework import config as config_lib
from data_prep.record import write_json_atomic
from framework.evaluation.watch import ENDED_FILE
from framework.training.callbacks import LoggedStepThroughput, PeriodicEval, SampleGrid, evaluate_module, module_pipeline
from framework.training.draws import StepDraws
from framework.training.figures import StepFigures
from framework.cli import launch_rank, share_cpu_threads, uses_gpu, writes_run_dir
from framework.config import TrainConfig
from framework.data.datamodule import LatentDataModule
from framework.training.loggers import RunCSVLogger, tensorboard_logger, wandb_logger
from framework.training.module import DiffusionModule
from framework.training.plan import RunPlan, resolve
from framework.preflight import check_accelerator, check_buckets, check_encoders, fit_model_to_data
from framework.training.registry import build_plugin_callbacks

config_lib.register()


# --------------------------------------------------------------------------------------------
# Pieces
# --------------------------------------------------------------------------------------------


def build_logger(cfg: TrainConfig, run_dir: Path) -> Any:
    if cfg.logger.kind == "none":
        return False
    if cfg.logger.kind == "csv":
        return RunCSVLogger(run_dir)
    if cfg.logger.kind == "tensorboard":
        return tensorboard_logger(run_dir)
    return wandb_logger(run_dir, cfg.logger, cfg.name, launch_rank())


def build_callbacks(cfg: TrainConfig, run_dir: Path) -> list[pl.Callback]:
    cbs: list[pl.Callback] = [
        ModelCheckpoint(
            dirpath=run_dir / "checkpoints",
            filename="step{step:07d}",
            auto_insert_metric_name=False,
            every_n_train_steps=cfg.trainer.checkpoint_every_n_steps,
            # The newest keep_checkpoints numbered files: "step" ranks them, highest kept.
            monitor="step",
            mode="max",
            save_top_k=cfg.trainer.keep_checkpoints,
            # last.ckpt is a relative symbolic link to the numbered checkpoint saved at the same step (a file or a
            # sharded folder), so one save writes the model once; with keep_checkpoints=0 it is a real file.
            save_last="link",
            # A resumed run overwrites last.ckpt (written by FinalCheckpoint) instead of adding last-v1.ckpt.
            enable_version_counter=False,
        ),
        SampleGrid(cfg.sample, run_dir / "samples"),
        *build_plugin_callbacks(cfg.plugins, cfg),
    ]
    if cfg.eval.every_n_steps:
        cbs.append(PeriodicEval(cfg.eval, run_dir, cfg.sample.vae, cfg.sample.text_encoder))
    if cfg.eval.val_every_n_steps:
        cbs.append(validation_callback(cfg))
    if cfg.logger.kind != "none":
        cbs.append(LearningRateMonitor(logging_interval="step"))
        # Rates (samples/s, TFLOP/s, MFU) since the previous logging step, without a per-step GPU wait.
        cbs.append(LoggedStepThroughput())
        cbs.append(StepFigures())  # train/loss_t0..3, train/grad_norm, train/data_wait_ms, ... (figures.py)
    return cbs


def validation_callback(cfg: TrainConfig) -> pl.Callback:
    """eval.val_every_n_steps: the validation loss on data.val_path, or on the val split precompute wrote."""
    from framework.training.validation import ValidationLoss, val_folder

    path = val_folder(cfg.data.val_path, cfg.data.path)
    if path is None:
        raise ValueError(f"eval.val_every_n_steps={cfg.eval.val_every_n_steps} needs held-out latents: give "
                         f"data.val_path=DIR (a precomputed dataset), or precompute data.path={cfg.data.path} with "
                         "val_fraction=F, which writes its val split to data.path/val")
    return ValidationLoss(path, cfg.eval.val_every_n_steps, cfg.data.batch_size, cfg.seed)


def default_precision(cfg: TrainConfig) -> str:
    if cfg.trainer.precision:
        return cfg.trainer.precision
    return "bf16-mixed" if uses_gpu(cfg.trainer.accelerator) else "32-true"


def build_plugins(cfg: TrainConfig) -> list[Any]:
    """Atomic single-file checkpoints, and Slurm: Lightning's SLURMEnvironment when running under srun.

    Lightning's own requeue handler stays off (auto_requeue=False): it would save inside the signal
    handler, on each rank at a different point; checkpointing.preemption_callbacks handles it instead.
    """
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    from framework.training.checkpointing import AtomicCheckpointIO, slurm_task

    lightning_plugins: list[Any] = [AtomicCheckpointIO()]
    if slurm_task():
        lightning_plugins.append(SLURMEnvironment(auto_requeue=False))
    return lightning_plugins


def lightning_accelerator(accelerator: str) -> Any:
    """`trainer.accelerator` as Lightning takes it: on a Slurm site that binds one GPU to each task (the task sees one
    device while the node runs several tasks), TaskGPUAccelerator puts every task on the GPU it sees."""
    from framework.distributed.strategy import TaskGPUAccelerator, tasks_per_node
    from framework.training.checkpointing import slurm_task

    if slurm_task() and uses_gpu(accelerator) and torch.cuda.device_count() == 1 and tasks_per_node() > 1:
        return TaskGPUAccelerator()
    return accelerator


def lightning_devices(devices: Any) -> Any:
    """`trainer.devices` as Lightning takes it: under Slurm each task is one rank, so `auto` means the node's task count
    (Lightning refuses any other; on CPU nodes its own `auto` would be 1), as launch/train.sbatch passes it and as a
    submitit job (hydra/launcher=slurm tasks_per_node=N) needs it."""
    from framework.distributed.strategy import tasks_per_node
    from framework.training.checkpointing import slurm_task

    return tasks_per_node() if devices == "auto" and slurm_task() else devices


def build_trainer(cfg: TrainConfig, run_dir: Path, callbacks: list[pl.Callback]) -> pl.Trainer:
    from framework.training.checkpointing import FinalCheckpoint, PruneHpcCheckpoints, preemption_callbacks
    from framework.distributed.strategy import build_strategy

    t = cfg.trainer
    # FinalCheckpoint first: the final state is on disk before any grid or plugin runs at the end, so a
    # failure there cannot lose the run. PruneHpcCheckpoints after it: it compares with the final last.ckpt.
    callbacks = [FinalCheckpoint(run_dir / "checkpoints" / "last.ckpt"), PruneHpcCheckpoints(run_dir), *callbacks,
                 *preemption_callbacks(run_dir, t.grace_check)]
    if t.checkpoint_dir:  # after FinalCheckpoint: the end of training uploads the final state too
        from framework.training.remote import UploadCheckpoints

        callbacks.insert(1, UploadCheckpoints(t.checkpoint_dir, run_dir / "checkpoints", t.keep_checkpoints))
    hang_s = cfg.strategy.timeout_s / 3 if t.hang_timeout_s is None else t.hang_timeout_s
    if hang_s:  # first: a step is timed from before any other callback's start-of-batch work
        from framework.training.watchdog import HangWatchdog

        callbacks.insert(0, HangWatchdog(hang_s, run_dir))
    return pl.Trainer(
        strategy=build_strategy(cfg.strategy, default_precision(cfg)),
        plugins=build_plugins(cfg),
        max_steps=t.max_steps,
        devices=lightning_devices(t.devices),
        num_nodes=t.num_nodes,
        accelerator=lightning_accelerator(t.accelerator),
        precision=default_precision(cfg),
        accumulate_grad_batches=t.accumulate_grad_batches,
        log_every_n_steps=t.log_every_n_steps,
        limit_val_batches=0,
        gradient_clip_val=t.gradient_clip_val,
        enable_progress_bar=t.enable_progress_bar,
        logger=build_logger(cfg, run_dir),
        # The bar reads the logged values when it refreshes (a host synchronisation): on logging steps only.
        callbacks=[*callbacks, TQDMProgressBar(refresh_rate=t.log_every_n_steps)] if t.enable_progress_bar else callbacks,
        default_root_dir=str(run_dir),
        enable_model_summary=False,
    )


def check_memory(cfg: TrainConfig, trainer: pl.Trainer, plan: RunPlan) -> None:
    """Refuse, before anything is trained, a run predicted to need more memory than a rank has
    (framework/training/memory.py; trainer.memory_limit_gb)."""
    from lightning.pytorch.utilities import rank_zero_info

    from framework.training import memory

    limit = cfg.trainer.memory_limit_gb
    if limit == 0:
        return
    plan = memory.plan_run(cfg, trainer.world_size, default_precision(cfg), trainer.strategy.root_device.type == "cuda",
                           micro_batch=plan.micro_batch)
    if limit is None:
        available, what = memory.available_bytes(trainer.strategy.root_device)
    else:
        available, what = limit * memory.GIB, "trainer.memory_limit_gb ="
    rank_zero_info(f"memory: predicted peak {plan.total / memory.GIB:.1f} GiB of {available / memory.GIB:.1f} a rank "
                   f"({plan.describe()})")
    memory.check(plan, available, what)


def resume_path(cfg: TrainConfig, run_dir: Path) -> str | None:
    path = _resume_path(cfg, run_dir)
    if cfg.trainer.checkpoint_dir and cfg.resume != "auto":  # auto starts at the newer of run.dir's and `latest`
        from framework.inference.checkpoint import checkpoint_step
        from framework.training.remote import check_start

        check_start(cfg.trainer.checkpoint_dir, run_dir / "checkpoints", checkpoint_step(Path(path)) if path else 0)
    return path


def _resume_path(cfg: TrainConfig, run_dir: Path) -> str | None:
    if cfg.resume in (None, "", "null"):
        return None
    from framework.inference.checkpoint import is_sharded
    from framework.training.checkpointing import find_resumable

    if cfg.resume == "auto":
        found = find_resumable(run_dir)  # newest of checkpoints/last.ckpt and Slurm's hpc_ckpt_*.ckpt
        if cfg.trainer.checkpoint_dir:  # or object storage's, where newer (downloaded into run.dir/checkpoints)
            from framework.inference.checkpoint import checkpoint_step
            from framework.training.remote import fetch_newer

            fetched = fetch_newer(cfg.trainer.checkpoint_dir, run_dir / "checkpoints",
                                  checkpoint_step(found) if found else None, writes_run_dir(), cfg.strategy.timeout_s)
            found = fetched or found
        path = str(found) if found else None
    elif not Path(cfg.resume).exists():
        raise FileNotFoundError(f"resume={cfg.resume} does not exist; give a checkpoint path, auto or null")
    else:
        path = cfg.resume
    if path and is_sharded(path) and cfg.strategy.name != "fsdp":
        raise ValueError(f"resume: {path} is a sharded (fsdp) checkpoint folder; resume it with strategy=fsdp "
                         "(any number of devices, 1 included), or convert the weights with framework.export")
    return path


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def checked_config(dcfg: DictConfig) -> tuple[TrainConfig, tuple[str, ...], int | None]:
    """The typed config of `dcfg`, its model fitted to the dataset (which may build it: data.prepare), after every
    check that needs no trainer: plugins' fields, the accelerator, the dataset's encoders and buckets, the adapter's
    precision. Nothing is written before these pass. Returns it with the lines saying which model keys the dataset and
    the weights set (the run plan prints them) and the dataset's sample count."""
    config_lib.check_plugins(dcfg.get("plugins"))  # before fitting the model may build the dataset
    info, fitted = fit_model_to_data(dcfg)
    cfg = config_lib.to_object(dcfg)
    check_accelerator(cfg)
    if info is not None:
        check_encoders(cfg, info.summary())
        if info.buckets:
            check_buckets(cfg, info.buckets)
    if cfg.adapter.base_dtype == "bf16" and default_precision(cfg) not in ("bf16-mixed", "16-mixed"):
        raise ValueError(f"adapter.base_dtype=bf16: this run's precision is {default_precision(cfg)} (the default on a "
                         "CPU); the bf16 base computes under mixed precision's autocast: set trainer.precision=bf16-mixed")
    return cfg, fitted, info.num_samples if info is not None else None


def open_run_dir(cfg: TrainConfig, dcfg: DictConfig) -> Path:
    """run.dir (a sweep job's own folder under -m), created, with the resolved config.yaml in it."""
    run_dir = Path(cfg.run.dir).resolve()
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        # A sweep (-m) gives each job its own folder, run.dir/<job number> (hydra.sweep in
        # conf/config.yaml), stable across Slurm requeues; a shared run.dir would resume each other.
        run_dir = Path(HydraConfig.get().runtime.output_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    if writes_run_dir():  # one writer: every rank of an srun or torchrun job runs this
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(dcfg, resolve=True))
        (run_dir / ENDED_FILE).unlink(missing_ok=True)  # training again: a watching evaluation waits for the end
    return run_dir


def written_files(run_dir: Path, grid: SampleGrid) -> dict[str, Any]:
    """What a finished fit wrote: the run folder, its config, the last checkpoint (FinalCheckpoint, added by
    build_trainer, writes the final state), the sample grids (or why they failed) and metrics.csv."""
    written: dict[str, Any] = {"run_dir": str(run_dir), "config": str(run_dir / "config.yaml"),
                               "checkpoint": str(run_dir / "checkpoints" / "last.ckpt")}
    if grid.paths:
        written["samples"] = [str(p) for p in grid.paths]
    if grid.failed:
        written["grid failed"] = grid.failed
    if (run_dir / "metrics.csv").exists():
        written["metrics"] = str(run_dir / "metrics.csv")
    return written


def train(dcfg: DictConfig, extra_callbacks: Sequence[pl.Callback] = ()) -> dict[str, Any]:
    """Run training (and the final evaluation when eval.at_end); returns what was written.

    `extra_callbacks`: Lightning callbacks added to the run's own (a notebook's, or a benchmark's timer)."""
    cfg, fitted, num_samples = checked_config(dcfg)
    run_dir = open_run_dir(cfg, dcfg)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    # TF32 tensor cores for the matmuls that stay in fp32 under bf16-mixed (norms' neighbours, fp32 runs).
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision("high")

    devices = cfg.trainer.devices
    if not uses_gpu(cfg.trainer.accelerator) and isinstance(devices, int):
        share_cpu_threads(devices)

    callbacks = [*build_callbacks(cfg, run_dir), *extra_callbacks]
    trainer = build_trainer(cfg, run_dir, callbacks)
    # the batch, the lr, the fitted keys and the data's partitions: decided here, once, before any model is built
    plan = resolve(cfg, trainer.world_size, fitted, trainer.num_nodes, num_samples)
    trainer.accumulate_grad_batches = plan.accumulation
    if trainer.global_rank == 0:
        print(plan.describe())
    check_memory(cfg, trainer, plan)  # before the model is built: a run that cannot fit is refused, not killed
    # Every rank of a sequence-parallel group reads the same samples (Streaming's replication).
    dm = LatentDataModule(dataclasses.replace(cfg.data, batch_size=plan.micro_batch), seed=cfg.seed,
                          replication=plan.sequence_parallel, draws=StepDraws.of, plan=plan)
    module = DiffusionModule(
        cfg.model,
        cfg.objective,
        cfg.optimizer,
        max_steps=cfg.trainer.max_steps,
        seed=cfg.seed,
        skip_nonfinite=cfg.trainer.skip_nonfinite,
        allow_global_batch_change=cfg.trainer.allow_global_batch_change,
        config=OmegaConf.to_container(dcfg, resolve=True),
        strategy=cfg.strategy,
        init_from=cfg.init_from,
        adapter=cfg.adapter,
        plan=plan,
    )
    # weights_only: restoring a checkpoint runs no pickled code (ours hold only tensors and plain values).
    trainer.fit(module, datamodule=dm, ckpt_path=resume_path(cfg, run_dir), weights_only=True)
    written = written_files(run_dir, next(cb for cb in callbacks if isinstance(cb, SampleGrid)))
    if trainer.global_rank == 0 and not trainer.interrupted and trainer.global_step >= cfg.trainer.max_steps:
        # its last checkpoint is written (FinalCheckpoint): `framework.eval watch=` ends once it has evaluated it
        write_json_atomic(run_dir / ENDED_FILE, {"step": trainer.global_step, "checkpoint": written["checkpoint"]})
    if cfg.eval.at_end:
        # Every rank takes part: a sharded model needs all of them in each forward (and they share the work).
        metrics = final_eval(cfg, module, run_dir, trainer)
        if metrics and trainer.global_rank == 0:
            written["eval"] = metrics
    finish_loggers(trainer)
    return written


def final_eval(cfg: TrainConfig, module: DiffusionModule, run_dir: Path, trainer: pl.Trainer) -> dict[str, Any]:
    """Evaluate the final weights on every rank; rank 0 writes run.dir/eval/ and logs the metrics."""
    pipe = module_pipeline(module, cfg.sample.vae, cfg.sample.text_encoder)
    return evaluate_module(cfg.eval, trainer, module, pipe, run_dir / "eval")


def finish_loggers(trainer: pl.Trainer) -> None:
    """Close the W&B run, so its files are complete now and a later run in this process starts its own."""
    from lightning.pytorch.loggers import WandbLogger

    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger) and trainer.global_rank == 0 and logger._experiment is not None:
            logger.experiment.finish()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(dcfg: DictConfig) -> None:
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    from framework.distributed.env import leave

    written = train(dcfg)
    leave()  # every rank of a multi-process run, before the interpreter exits (Lightning's atexit handler is later)
    if rank_zero_only.rank != 0:  # one summary per job, from rank 0
        return
    metrics = written.pop("eval", None)
    print("\nwrote:")
    for k, v in written.items():
        for p in v if isinstance(v, list) else [v]:
            print(f"  {k:<10} {p}")
    if metrics:
        print(f"  {'eval':<10} {Path(written['run_dir']) / 'eval'}")
        from framework.evaluation.evaluate import eval_summary

        print("\n" + eval_summary(metrics))
        print(json.dumps(metrics))


if __name__ == "__main__":
    main()
