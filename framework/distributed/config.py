"""The `strategy` config group: how the model is spread over devices. Owned here, beside the code that reads it
(framework/distributed/strategy.py builds the Lightning strategy; fsdp.py and sequence.py prepare the model)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StrategyConfig:
    """How the model is spread over devices (built by framework/distributed/strategy.py)."""

    name: str = "single"
    """single (one device), ddp (replicated weights, all-reduced gradients) or fsdp (FSDP2 sharding)."""
    sharding: str = "SHARD_GRAD_OP"
    """fsdp only: SHARD_GRAD_OP (params stay gathered between forward and backward), FULL_SHARD, or HYBRID_SHARD
    (FULL_SHARD within each node, replicated across nodes: parameter all-gathers stay inside a node)."""
    activation_checkpointing: bool = False
    """fsdp/ddp/single: recompute each backbone block's activations in backward (less memory, ~30% more compute)."""
    compile: bool = False
    """torch.compile each backbone block (before sharding under fsdp)."""
    sharded_checkpoint: bool = True
    """fsdp only: write checkpoints as a distributed-checkpoint folder (one file per rank); false: one file."""
    mixed_precision: bool = True
    """fsdp: gather parameters in the dtype of trainer.precision (bf16 for bf16-mixed, fp16 for 16-mixed,
    none for 32-true) with fp32 gradient reduction (FSDP2 MixedPrecisionPolicy); false: always fp32."""
    sequence_parallel: int = 1
    """ddp/fsdp: Ulysses sequence parallelism over groups of this many consecutive ranks (data parallel over
    the groups): each rank holds 1/P of every image's tokens (framework/distributed/sequence.py). 1: off."""
    sequence_parallel_head_groups: int = 1
    """with sequence_parallel > 1: >1 splits each self-attention's all-to-all into this many head groups so
    one group's communication overlaps another's attention (PipeDiT's PipeSP); 1: one all-to-all. Latte: each
    layout switch in this many slices of a rank's positions (ScaleFusion's intra- and inter-layer schedules): the
    spatial block's per-token tail and the temporal block run slice by slice."""
    async_save: bool = False
    """fsdp with sharded_checkpoint: write checkpoints in the background (torch.distributed.checkpoint's
    process-based async_save): each rank's state is copied to shared (on a GPU pinned) host memory while the next
    step's forward and backward run, its optimizer step waits for that copy, and a process of its own writes the
    files; each save waits for the previous one."""
    timeout_s: int = 1800
    """ddp/fsdp: how long a collective may wait for the other ranks before the job fails (the process group's
    timeout); raise it when one rank may be busy much longer (a large checkpoint on a slow filesystem)."""

    def __post_init__(self) -> None:
        if self.async_save and not (self.name == "fsdp" and self.sharded_checkpoint):
            raise ValueError("strategy.async_save=true writes sharded checkpoints in the background: it needs "
                             "strategy=fsdp with strategy.sharded_checkpoint=true")
        if self.name not in STRATEGIES:
            raise ValueError(f"strategy.name={self.name!r} is not available; choose one of {STRATEGIES}")
        if self.sharding not in SHARDINGS:
            raise ValueError(f"strategy.sharding={self.sharding!r}: expected one of {', '.join(SHARDINGS)}")
        if self.timeout_s < 1:
            raise ValueError(f"strategy.timeout_s={self.timeout_s} must be >= 1 (seconds)")
        if self.sequence_parallel < 1 or self.sequence_parallel_head_groups < 1:
            raise ValueError(f"strategy.sequence_parallel={self.sequence_parallel} and strategy."
                             f"sequence_parallel_head_groups={self.sequence_parallel_head_groups} must be >= 1")
        if self.sequence_parallel > 1 and self.name == "single":
            raise ValueError(f"strategy.sequence_parallel={self.sequence_parallel} needs several devices: use "
                             "strategy=ddp or strategy=fsdp with trainer.devices a multiple of it")
        if self.sequence_parallel > 1 and self.compile:
            raise ValueError("strategy.compile with strategy.sequence_parallel > 1 is not supported (the split "
                             "runs through forward hooks and asynchronous collectives); set strategy.compile=false")


STRATEGIES = ("single", "ddp", "fsdp")
SHARDINGS = ("SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD")
