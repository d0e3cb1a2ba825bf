"""Plain tensors and FSDP2's DTensors seen the same way: this rank's part, or the whole.

Code that works on parameters and optimizer or EMA state under every strategy (single, ddp, fsdp)
reads and updates `local_tensor(t)`: the local shard of a DTensor (in-place ops on it update the
DTensor), else the tensor itself.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: the local shard of a DTensor, else `t` itself (no copy either way)."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole of `t`; for a DTensor an all-gather, so every rank of its mesh must call it."""
    return t.full_tensor() if isinstance(t, DTensor) else t
