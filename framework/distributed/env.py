"""Joining the process group a launcher describes, for commands that are not Lightning runs (sample, eval,
benchmarks, test workers): torchrun's RANK / WORLD_SIZE / MASTER_* variables."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_from_env() -> int:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, ...): gloo on CPUs, nccl on GPUs.
    Returns the world size (1 when not launched by torchrun)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        gpu = torch.cuda.is_available()
        if gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if gpu else "gloo")
    return dist.get_world_size() if dist.is_initialized() else 1
