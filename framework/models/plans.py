"""What FSDP2, sequence parallelism, growth, pruning and the cache router need to know of a family: its parallel
plan. Each family's plan is the `plan` of its file in framework/models/families/ (`plan_of(name)` there), so their
code reads the plan and never branches on family names. A plan has:
- `required_blocks`: blocks other parts of the net read (pruning keeps them);
- `units`: the modules FSDP2 shards one by one, in forward order (activation checkpointing and compile
  wrap the same units);
- `stack`: whether its blocks are one replaceable stack of layers (`net.transformer_blocks`, Wan's `net.blocks`,
  Latte's spatial and temporal blocks side by side: growth, pruning) or not, and why not;
- `routed`: whether the cache router's stage trains on its block views;
- `sequence`: where its tokens are made and leave the stack and how its self-attention splits across
  ranks, or None (sequence parallelism refused, with the reason).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn


@dataclass(frozen=True)
class SequencePlan:
    """How a family's token sequence is split over a sequence-parallel group (framework/distributed/sequence.py)."""

    embed: str
    """The net's submodule whose output is the token sequence (B, N, D): each rank keeps its band after it (with
    `split_input`, the submodule whose first input is: Wan's tokens are flattened in the net's forward, not a module)."""
    out: str
    """The net's submodule whose output is gathered back to all N tokens."""
    attention: str
    """softmax: Ulysses all-to-all, each rank attends with whole heads (padded to a multiple of the group); linear:
    SANA's linear attention, every head kept on every rank and the key-value sums all-reduced; switch: an ST-DiT's
    spatial blocks sharded by frame and temporal blocks by position, an all-to-all switching between them (Latte)."""
    rows_arg: int | None = None
    """Index of the blocks' positional `height` argument when a block mixes neighbouring token rows (SANA's
    Mix-FFN convolution): ranks then hold whole rows and exchange edge rows (a halo); None: tokens are independent."""
    split_input: bool = False
    """`embed`'s first input is split, not its output."""
    rope: str | None = None
    """The net's submodule whose outputs are per-token rotary tables (1, N, 1, D) (Wan's 3D RoPE): each rank keeps the
    rows of its own tokens, so every block rotates its band's queries and keys by their own positions."""


@dataclass(frozen=True)
class ParallelPlan:
    units: Callable[[nn.Module], list[nn.Module]]
    """net -> its FSDP2 units in forward order."""
    stack: bool
    """One replaceable stack of layers in the net's `stack_attrs` (growth and depth pruning rebuild it)."""
    sequence: SequencePlan | None
    """None: sequence parallelism is refused."""
    why_not: str = ""
    """Why a family has no stack or no sequence plan (the end of the refusal's message)."""
    required_blocks: tuple[int, ...] = ()
    """Blocks that the rest of the net reads besides the stack's own flow (pruning never drops them)."""
    stack_attrs: tuple[str, ...] = ("transformer_blocks",)
    """The net's ModuleLists that hold the stack, side by side: layer i is block i of each (Latte's spatial and
    temporal block i); growth and pruning copy and drop whole layers."""
    routed: bool = True
    """The cache router's stage trains on its block views (each branch's output cached from step to step; blocks of
    any shape, so a video family's spatial, temporal and 3D blocks too)."""
