"""Shared set-up of the small Hydra commands (sample, eval, export, bench)."""

from __future__ import annotations

import os
import sys

import torch

# These commands write where their `out=` says; Hydra's own outputs/<date>/ folder and log files
# would only litter the working directory.
QUIET = ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]


def quiet_hydra() -> None:
    """Append the QUIET overrides to sys.argv unless the user set those keys."""
    given = {a.split("=", 1)[0].lstrip("+~") for a in sys.argv[1:]}
    sys.argv += [q for q in QUIET if q.split("=", 1)[0] not in given]


def resolve_device(name: str) -> str:
    """`auto`: a GPU when present, else the CPU; any other name as given."""
    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


def uses_gpu(accelerator: str) -> bool:
    """Whether a Lightning `accelerator` setting ends up on a GPU."""
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


def share_cpu_threads(ranks_per_machine: int) -> int:
    """Several CPU ranks on one machine: give each its share of the cores, as torchrun does.

    Each process would otherwise start one OpenMP thread per core, so 2 ranks on 2 cores run 4 busy
    threads that wait on each other. An OMP_NUM_THREADS set by the user wins. Returns the thread count.
    """
    if ranks_per_machine > 1 and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // ranks_per_machine))
    return torch.get_num_threads()
