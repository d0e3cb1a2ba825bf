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
        if gpu:  # the GPU framework.cli.resolve_device gave this rank
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        dist.init_process_group("nccl" if gpu else "gloo")
    return dist.get_world_size() if dist.is_initialized() else 1


def leave() -> None:
    """End this process's part in the process group while the interpreter is still whole (call it once the work is
    done, on every rank; not after a failure, when a peer may be stuck in a collective).

    FSDP2 states and device meshes hold process groups in reference cycles, so destroy_process_group() alone can
    leave a gloo group alive until the interpreter's final garbage collection; its worker threads then end while
    Python is being torn down and the process aborts ("terminate called without an active exception", seen about
    once in 60 two-rank torchrun runs of tests/workers/came_fsdp.py on a loaded 2-core machine). Collecting first
    lets the last references go while everything still works.
    """
    import gc

    if not dist.is_initialized():
        return
    gc.collect()
    dist.destroy_process_group()
    gc.collect()
