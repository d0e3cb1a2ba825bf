"""A training run decided once: its batch over the job, its peak learning rate, and the model keys its dataset and
weights set.

framework.train resolves the typed config and the job's size into a `RunPlan` after the trainer knows its ranks and
before the data module and the model are built; it is printed once (rank 0) and then only read: the data module takes
its micro-batch, data-parallel size and partitions, the trainer its accumulation, the step its global batch
(images_seen, checkpoints) and the optimizer its peak lr. The config stays as the user composed it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from framework.data.datamodule import (SAMPLES_PER_PARTITION, canonical_nodes, check_canonical_nodes, fitting_nodes,
                                         split_global_batch)
from framework.training.optim import scaled_lr


@dataclass(frozen=True)
class RunPlan:
    world_size: int
    sequence_parallel: int  # ranks that share each sample (strategy.sequence_parallel)
    micro_batch: int  # samples a device takes per forward
    accumulation: int  # micro-batches per optimizer step
    lr: float  # peak lr, after optimizer.lr_scaling
    why: tuple[str, ...] = ()  # how each figure was chosen, one line each (describe)
    # Streaming's partitions: data.num_canonical_nodes with auto resolved (still "auto" if the dataset's size was unknown)
    num_canonical_nodes: Any = None

    @property
    def data_parallel(self) -> int:
        """Ranks that read different samples: the world over the sequence-parallel groups."""
        return self.world_size // self.sequence_parallel

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over the whole job."""
        return self.micro_batch * self.data_parallel * self.accumulation

    def describe(self) -> str:
        """The plan as the run prints it once: the figures, then why each was chosen."""
        sp = f" x {self.sequence_parallel} sequence-parallel" if self.sequence_parallel > 1 else ""
        head = (f"run: {self.world_size} rank(s) = {self.data_parallel} data-parallel{sp}; global batch "
                f"{self.global_batch} = {self.micro_batch} per device x {self.data_parallel} x {self.accumulation} "
                f"micro-batch(es); peak lr {self.lr:.4g}")
        return "\n".join([head, *(f"  {line}" for line in self.why)])


def resolve(cfg: Any, world_size: int, fitted: tuple[str, ...] = (), nodes: int = 1,
            num_samples: int | None = None) -> RunPlan:
    """The plan of a typed TrainConfig `cfg` on `world_size` ranks over `nodes` nodes; `fitted`: the lines saying
    which model keys the dataset or the weights set (framework/preflight.py); `num_samples`: the dataset's (None: not
    known yet, the data's partitions unchecked). Refuses a global batch the job cannot split and Streaming partitions
    its node count cannot start with."""
    sp = cfg.strategy.sequence_parallel
    if world_size % sp:
        raise ValueError(f"strategy.sequence_parallel={sp} does not divide the job's {world_size} ranks")
    data_parallel, why = world_size // sp, list(fitted)
    asked = cfg.data.global_batch_size
    if asked is None:
        micro, accumulation = cfg.data.batch_size, cfg.trainer.accumulate_grad_batches
    else:
        micro, accumulation = split_global_batch(asked, data_parallel, cfg.data.batch_size)
        why.append(f"data.global_batch_size={asked} on {data_parallel} data-parallel rank(s): the fewest micro-batches "
                   f"of at most data.batch_size={cfg.data.batch_size}")
    opt, global_batch = cfg.optimizer, micro * data_parallel * accumulation
    lr = scaled_lr(opt, global_batch)
    if opt.lr_scaling != "none":
        factor = "sqrt" if opt.lr_scaling == "sqrt" else ""
        why.append(f"optimizer.lr_scaling={opt.lr_scaling}: optimizer.lr={opt.lr:g} x {factor}("
                   f"{global_batch}/{opt.lr_reference_batch}) (optimizer.lr_reference_batch)")
    setting = ncn = cfg.data.num_canonical_nodes
    if num_samples is not None:
        ncn = canonical_nodes(setting, num_samples)
        check_canonical_nodes(setting, ncn, nodes, num_samples)
        if setting == "auto":
            why.append(f"data.num_canonical_nodes=auto: {ncn} for {num_samples} samples (at least "
                       f"{SAMPLES_PER_PARTITION} a partition); node counts it fits: {listed(fitting_nodes(ncn, 256))}")
    return RunPlan(world_size, sp, micro, accumulation, lr, tuple(why), ncn)


def listed(counts: list[int], first: int = 12) -> str:
    """`counts` as the plan prints them: the first few, then the last."""
    return ", ".join(map(str, counts[:first])) + (f", ... {counts[-1]}" if len(counts) > first else "")
