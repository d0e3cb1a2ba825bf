"""Typed run configuration: one dataclass per config group, registered with Hydra's ConfigStore.

Every YAML file in conf/ is merged into these dataclasses, so a misspelled key or a wrong type
fails when the config is composed, and `validate()` adds the checks that span several groups.
Each component owns its config class; this file only assembles them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from framework.data.datamodule import DataConfig
from framework.distributed.config import StrategyConfig
from framework.evaluation.settings import EvalSettings
from framework.models.adapters import AdapterConfig
from framework.models.backbones import ModelConfig
from framework.models.families import family_of
from framework.models.objectives import SAMPLERS, ObjectiveConfig, check_sampler
from framework.training.optim import OptimizerConfig

# --------------------------------------------------------------------------------------------
# Groups owned by the training entry point
# --------------------------------------------------------------------------------------------


@dataclass
class TrainerConfig:
    """Lightning Trainer arguments plus the run's checkpoint and safety settings."""

    max_steps: int = 1000
    """Optimizer steps to train for."""
    devices: Any = "auto"
    """Devices per node (an int, a list, or auto)."""
    num_nodes: int = 1
    """Nodes in the job."""
    accelerator: str = "auto"
    """auto, cpu, gpu or cuda."""
    precision: str | None = None
    """null: bf16-mixed on a GPU, 32-true on a CPU; or any Lightning precision string."""
    accumulate_grad_batches: int = 1
    """Micro-batches per optimizer step."""
    log_every_n_steps: int = 10
    """How often train/loss and throughput are logged."""
    val_check_interval: Any = None
    """Only null: training runs no validation loop (quality is measured by eval.at_end and framework.eval).
    Kept so that configs and scripts that pass trainer.val_check_interval=null still compose."""
    gradient_clip_val: float | None = 1.0
    """Clip the global gradient norm to this value (null: no clipping)."""
    checkpoint_every_n_steps: int = 500
    """Write checkpoints/last.ckpt (and a numbered copy) every this many steps, and at the end."""
    keep_checkpoints: int = 3
    """Numbered checkpoints (checkpoints/stepNNNNNNN.ckpt) kept besides last.ckpt: the newest N (0: none)."""
    checkpoint_dir: str | None = None
    """Object storage for the checkpoints besides run.dir/checkpoints, s3://bucket/prefix: each one is uploaded once
    complete (global rank 0, in the background; the end of training waits for the last), the newest keep_checkpoints
    stay there, and resume=auto continues from there when it holds a newer one than run.dir
    (framework/training/remote.py). null: run.dir only."""
    grace_check: bool = True
    """Under Slurm (sbatch / srun): time a step and a probe save at each job's second step and refuse the run when
    they do not fit in Slurm's KillWait, the time SIGTERM (scancel, preemption) leaves before SIGKILL. false: train
    anyway; a save cut by SIGKILL falls back to the last periodic checkpoint."""
    skip_nonfinite: bool = False
    """Skip optimizer steps whose loss is NaN/inf instead of stopping the run."""
    allow_global_batch_change: bool = False
    """Resume a checkpoint whose global batch (batch_size x data-parallel ranks x accumulation) differs from this run's;
    refused otherwise."""
    enable_progress_bar: bool = True
    """Show the progress bar."""
    hang_timeout_s: float | None = None
    """A rank that waits longer than this in one training step, one fetch of the data loader or one checkpoint save
    ends the job, printing its host and every thread's stack (framework/training/watchdog.py), so that the job's
    failure handling (requeue) takes over instead of every rank idling until strategy.timeout_s; it must be below
    that. Timed from the end of the first micro-batch; sampling and evaluation are not timed. null: a third of
    strategy.timeout_s (600 s by default); 0: no watch."""
    memory_limit_gb: float | None = None
    """The memory a rank may use: a run predicted to need more is refused at start-up with the prediction and the keys
    that lower it (framework/training/memory.py); null: the GPU's memory, or the host's RAM on a CPU; 0: no check."""

    def __post_init__(self) -> None:
        if self.max_steps <= 0:
            raise ValueError(f"trainer.max_steps={self.max_steps} must be > 0")
        if self.accumulate_grad_batches < 1:
            raise ValueError(f"trainer.accumulate_grad_batches={self.accumulate_grad_batches} must be >= 1")
        if self.memory_limit_gb is not None and self.memory_limit_gb < 0:
            raise ValueError(f"trainer.memory_limit_gb={self.memory_limit_gb} must be >= 0 (0: no check; null: the "
                             "device's memory)")
        if self.hang_timeout_s is not None and self.hang_timeout_s < 0:
            raise ValueError(f"trainer.hang_timeout_s={self.hang_timeout_s} must be >= 0 (seconds; 0: no watch)")
        if self.checkpoint_dir:
            from framework.training.remote import check_url

            check_url(self.checkpoint_dir)
        if self.keep_checkpoints < 0:
            raise ValueError(f"trainer.keep_checkpoints={self.keep_checkpoints} must be >= 0 "
                             "(how many numbered checkpoints to keep besides last.ckpt; 0 keeps only last.ckpt)")
        if self.val_check_interval is not None:
            raise ValueError(f"trainer.val_check_interval={self.val_check_interval}: training runs no validation loop,"
                             " so it would do nothing; remove it (or set it to null) and measure quality with"
                             " eval.at_end=true or `python -m framework.eval`")


@dataclass
class LoggerConfig:
    """Where metrics go (chosen with logger=csv|wandb|tensorboard|none), and the W&B run's identity."""

    kind: str = "csv"
    """csv (run.dir/metrics.csv), wandb, tensorboard (run.dir/tensorboard/) or none; set by the group choice
    logger=..."""
    mode: str = "offline"
    """wandb: online (needs an API key: `wandb login` or WANDB_API_KEY) or offline (`wandb sync run.dir/wandb/
    offline-run-*` later). Chosen here, never guessed from the environment."""
    name: str | None = None
    """wandb: the run's display name; null: the run's `name` (the experiment's)."""
    group: str | None = None
    """wandb: run group (e.g. one sweep or one ablation)."""
    tags: list[str] = field(default_factory=list)
    """wandb: run tags."""
    project: str = "latentforge"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user)."""

    def __post_init__(self) -> None:
        if self.kind not in ("csv", "wandb", "tensorboard", "none"):
            raise ValueError(f"logger={self.kind!r}: expected csv, wandb, tensorboard or none")
        if self.mode not in ("online", "offline"):
            raise ValueError(f"logger.mode={self.mode!r}: expected online or offline")


@dataclass
class RunConfig:
    """Where the run lives on disk. Keep it stable across restarts so resume=auto finds the checkpoint."""

    dir: str = "runs/${name}"
    """Run directory: config.yaml, checkpoints/, samples/, metrics.csv."""


@dataclass
class SampleConfig:
    """Sample grids drawn during training and at its end."""

    every_n_steps: int = 0
    """Draw a grid every this many steps (0: only at the end)."""
    prompts: list[str] | None = None
    """Prompts of the grid, one column each; null: the ones the dataset encoded at precompute (dataset.json), so
    grids need no text encoder."""
    per_prompt: int = 2
    """Images per prompt (rows)."""
    steps: int = 20
    """Sampler steps."""
    guidance: float = 4.0
    """Classifier-free guidance scale (1: none)."""
    sampler: str | None = None
    """ddim, dpm++ or flow_euler; null: the objective's default."""
    seed: int = 0
    """Seed of the grid's noise, fixed so grids are comparable across steps."""
    vae: str | None = None
    """Image decoder for grids and evaluations: pixel or a local VAE folder; null: the one dataset.json records
    (the precompute machine's path). Checked when training starts."""
    text_encoder: str | None = None
    """Text encoder for grid and evaluation prompts: minilm or a local folder; null: the one dataset.json records."""

    def __post_init__(self) -> None:
        if self.sampler is not None and self.sampler not in SAMPLERS:
            raise ValueError(f"sample.sampler={self.sampler!r}: choose one of {sorted(SAMPLERS)}")


@dataclass
class EvalConfig(EvalSettings):
    """Evaluation after training (the quickstart); the same settings as `python -m framework.eval`."""

    at_end: bool = False
    """Evaluate the final weights when training ends and print the summary."""
    every_n_steps: int = 0
    """Also evaluate at the first step and every this many steps (eval/* in the logs: curves); 0: never."""
    val_every_n_steps: int = 0
    """The validation loss (val/loss, val/loss_t0..3) on data.val_path (or data.path/val) at fixed noise and noise
    levels, at the first step and every this many steps (framework/training/validation.py); 0: never."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.every_n_steps < 0:
            raise ValueError(f"eval.every_n_steps={self.every_n_steps} must be >= 0 (0: no evaluation during training)")
        if self.val_every_n_steps < 0:
            raise ValueError(f"eval.val_every_n_steps={self.val_every_n_steps} must be >= 0 (0: no validation loss)")


@dataclass
class TrainConfig:
    """The whole run."""

    name: str = "run"
    """Run name; the default run.dir is runs/<name>."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    run: RunConfig = field(default_factory=RunConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    """Parameter-efficient fine-tuning (adapter=lora|lokr|loha): a frozen init_from base and a trained adapter."""
    plugins: dict[str, Any] = field(default_factory=dict)
    """Plugin callbacks by name, each with its own fields (plugins=[ema,...])."""
    resume: str | None = None
    """auto: continue from run.dir/checkpoints/last.ckpt when it exists; or a checkpoint path."""
    init_from: str | None = None
    """Load weights only: a checkpoint, a .safetensors file or a diffusers folder."""
    seed: int = 0
    """Global seed: the same seed and data give the same run."""


def register() -> None:
    """Register the schema so conf/config.yaml can extend it (`defaults: [train_schema, ...]`), and the `lf.rank_zero`
    resolver: `${lf.rank_zero:A,B}` is A in the process that writes the run directory (global rank 0) and B in the other
    ranks, read when Hydra sets up each process's outputs (conf/config.yaml's hydra.output_subdir, the train.log handler
    of conf/hydra/job_logging/latentforge.yaml)."""
    from framework.cli import writes_run_dir

    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    OmegaConf.register_new_resolver("lf.rank_zero", lambda on_zero, elsewhere: on_zero if writes_run_dir() else elsewhere,
                                    replace=True)


# --------------------------------------------------------------------------------------------
# Validation across groups
# --------------------------------------------------------------------------------------------


def to_object(cfg: DictConfig) -> TrainConfig:
    """Instantiate the dataclasses (running each __post_init__) and check cross-group rules."""
    try:
        obj: TrainConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    except Exception as e:  # OmegaConf wraps the __post_init__ error; show the user only the message
        cause = e.__cause__ or e
        raise ValueError(f"invalid config: {cause}") from None
    validate(obj)
    return obj


def check_plugins(plugins: Any) -> None:
    """Each selected plugin's fields (plugins.<name>.*) against its own dataclass: a misspelled field, a wrong type or
    a failed check raises, naming the plugin. The plugins must be registered (`import plugins`, as the commands do);
    framework.train runs this before anything else, so a typo costs no dataset build."""
    from framework.training.registry import plugin_config

    for name, fields in (plugins or {}).items():
        plugin_config(name, fields)


# Plugins that replace the weights an adapter would sit on (growth) or train a stage of their own (cache_router).
NOT_WITH_ADAPTER = ("growth", "cache_router")


def check_adapter(cfg: TrainConfig) -> None:
    """adapter=lora|lokr|loha fine-tunes given weights: it needs init_from and no plugin that rebuilds the model."""
    if not cfg.init_from:
        raise ValueError(f"adapter={cfg.adapter.kind} trains an adapter on frozen weights: give them with init_from= (a "
                         "diffusers folder, a .safetensors file or a checkpoint of ours); every checkpoint of the run "
                         "holds the adapter alone and names init_from as its base")
    if cfg.adapter.base_dtype in ("int8", "fp8") and cfg.strategy.name == "fsdp":
        raise ValueError(f"adapter.base_dtype={cfg.adapter.base_dtype} with strategy=fsdp: torchao's quantized weights "
                         "cannot be sharded by fully_shard; use strategy=ddp (each rank holds the quantized base, about a "
                         "quarter of its fp32 bytes) or adapter.base_dtype=bf16 under fsdp")
    s = cfg.strategy
    if cfg.adapter.offload_blocks and (not s.activation_checkpointing or s.name == "fsdp" or s.compile or
                                       not family_of(cfg.model).offloads_blocks):
        raise ValueError("adapter.offload_blocks=true copies each block's frozen weights to the device for its forward "
                         "and again for its recomputation in backward: it needs strategy.activation_checkpointing=true "
                         "(without it every copy stays alive until backward), strategy=single or ddp (fsdp shards the "
                         "base instead), no strategy.compile (the copies would be new inputs to each compiled block) "
                         "and a transformer family (the UNet checkpoints layers inside its blocks, which would be "
                         f"recomputed without their weights); this run has activation_checkpointing="
                         f"{s.activation_checkpointing}, strategy={s.name}, compile={s.compile}, family={cfg.model.family}")
    if cfg.adapter.base_dtype == "bf16" and cfg.trainer.precision not in (None, "bf16-mixed", "16-mixed"):
        raise ValueError(f"adapter.base_dtype=bf16 with trainer.precision={cfg.trainer.precision}: the bf16 base computes "
                         "under mixed precision's autocast; use trainer.precision=bf16-mixed (or base_dtype=fp32)")
    clash = [name for name in NOT_WITH_ADAPTER if name in (cfg.plugins or {})]
    if clash:
        raise ValueError(f"adapter={cfg.adapter.kind} with plugins={clash}: the growth plugin replaces the weights the "
                         "adapter sits on and cache_router trains its own stage; run them without an adapter")


def validate(cfg: TrainConfig) -> None:
    """Checks that need more than one group, and the plugins' own fields."""
    check_plugins(cfg.plugins)
    m = cfg.model
    t = cfg.trainer
    if t.hang_timeout_s is not None and t.hang_timeout_s >= cfg.strategy.timeout_s:
        raise ValueError(f"trainer.hang_timeout_s={t.hang_timeout_s:g} must be below strategy.timeout_s="
                         f"{cfg.strategy.timeout_s} (the process group's own timeout, which would end a hung job "
                         "first, without saying where): lower it, or raise strategy.timeout_s")
    n_devices = len(t.devices) if isinstance(t.devices, (list, tuple)) else t.devices
    if cfg.strategy.name == "single" and ((isinstance(n_devices, int) and n_devices > 1) or t.num_nodes > 1):
        raise ValueError(f"strategy=single runs on one device but trainer.devices={t.devices}, "
                         f"trainer.num_nodes={t.num_nodes}; use strategy=ddp or strategy=fsdp for several devices")
    if cfg.strategy.name == "fsdp":
        from framework.distributed.fsdp import fsdp_param_dtype

        fsdp_param_dtype(t.precision, cfg.strategy.mixed_precision)  # refuses a precision fsdp cannot follow
    sp = cfg.strategy.sequence_parallel
    if sp > 1:
        from framework.distributed.sequence import check

        world = n_devices * t.num_nodes if isinstance(n_devices, int) and n_devices > 0 else None
        if not m.unset_data_fields():  # else checked once the dataset has set the latent sizes
            check(m, sp, cfg.strategy.sequence_parallel_head_groups, world)
        if world is not None:
            from framework.distributed.mesh import ParallelDims

            ParallelDims.of(world, n_devices, sp)  # refuses a sequence group over parts of nodes
    if cfg.data.global_batch_size is not None:
        if t.accumulate_grad_batches != 1:
            raise ValueError(f"data.global_batch_size={cfg.data.global_batch_size} and trainer.accumulate_grad_batches="
                             f"{t.accumulate_grad_batches} are both set: the global batch derives the accumulation "
                             "from the device count; drop trainer.accumulate_grad_batches")
        if isinstance(n_devices, int) and n_devices > 0:  # known now: refuse before any data is read
            from framework.training.plan import resolve

            resolve(cfg, n_devices * t.num_nodes)
    if cfg.sample.sampler is not None:
        check_sampler(cfg.objective.name, cfg.sample.sampler)
    if cfg.eval.sampler is not None:
        check_sampler(cfg.objective.name, cfg.eval.sampler)
    if cfg.adapter.on:
        check_adapter(cfg)
    elif cfg.adapter.base_dtype != "fp32" or cfg.adapter.offload_blocks:
        raise ValueError(f"adapter.base_dtype={cfg.adapter.base_dtype}, adapter.offload_blocks="
                         f"{cfg.adapter.offload_blocks} hold a frozen base, and this run has none (adapter=none trains "
                         "every weight): choose an adapter (adapter=lora) or leave them at fp32 / false")
    if not family_of(m).reads_text and cfg.objective.caption_dropout > 0 and not m.num_classes:
        raise ValueError("model.num_classes must be set for the class-conditional dit family")
