"""Shared set-up of the small Hydra commands (sample, eval, export, bench, studies): quiet Hydra, devices, ranks,
child training runs, the table and JSON rows a measurement prints and writes, and `named_command`, the
`python -m PACKAGE NAME key=value ...` dispatcher of framework.bench and framework.studies."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

# These commands write where their `out=` says; Hydra's own outputs/<date>/ folder and log files
# would only litter the working directory.
QUIET = ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]


def add_overrides(overrides: list[str]) -> None:
    """Append `overrides` to sys.argv, each unless the user set its key."""
    given = {a.split("=", 1)[0].lstrip("+~") for a in sys.argv[1:]}
    sys.argv += [o for o in overrides if o.split("=", 1)[0] not in given]


def quiet_hydra() -> None:
    """Append the QUIET overrides to sys.argv unless the user set those keys."""
    add_overrides(QUIET)


def writes_run_dir() -> bool:
    """Whether this process writes the run directory's config and Hydra files: global rank 0 only. Under srun or
    torchrun every rank runs the whole command (launch_rank); ranks that Lightning's own launcher starts have
    LOCAL_RANK > 0."""
    return launch_rank() == 0 and int(os.environ.get("LOCAL_RANK", "0")) == 0


def resolve_device(name: str) -> str:
    """`auto`: a GPU when present, else the CPU; any other name as given. Under a launcher that starts one process
    per GPU (torchrun's or srun's LOCAL_RANK), `auto` and `cuda` mean this rank's own GPU, cuda:LOCAL_RANK (modulo
    the visible count), so that no two ranks load their model onto GPU 0."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    local = os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID"))
    if name == "cuda" and local is not None and torch.cuda.is_available():
        return f"cuda:{int(local) % torch.cuda.device_count()}"
    return name


def uses_gpu(accelerator: str) -> bool:
    """Whether a Lightning `accelerator` setting ends up on a GPU."""
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


def launch_rank() -> int:
    """This process's global rank as the launcher set it (torchrun's RANK, srun's SLURM_PROCID), before Lightning
    or torch.distributed know it; 0 for a plain process (Lightning's own launcher starts ranks > 0 inside fit)."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))


def share_cpu_threads(ranks_per_machine: int) -> int:
    """Several CPU ranks on one machine: give each its share of the cores, as torchrun does.

    Each process would otherwise start one OpenMP thread per core, so 2 ranks on 2 cores run 4 busy
    threads that wait on each other. An OMP_NUM_THREADS set by the user wins. Returns the thread count.
    """
    if ranks_per_machine > 1 and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // ranks_per_machine))
    return torch.get_num_threads()


@dataclass
class RankSharing:
    """How the sample and eval commands share generation between torchrun's ranks."""

    decode_ranks: Any = 0
    """Under torchrun: the last K ranks decode while the others denoise (framework/inference/decoupled.py), and only
    they load the VAE, only the others the denoiser; auto: K from the first batch's measured stage times; 0: off."""
    aco: Any = 0.0
    """With decode_ranks: a decoding rank with nothing to decode computes this share of each self-attention's heads
    for the denoiser whose latents it waits for (PipeDiT's attention co-processing; 0.5: half); auto: PipeDiT's
    N_decode / N, the decoding ranks' share of all ranks; 0: off."""
    sequence_parallel: int = 1
    """Under torchrun: Ulysses sequence parallelism over groups of this many ranks, the groups sharing the
    prompts (framework/distributed/sequence.py); 1: off."""
    sequence_parallel_head_groups: Any = 1
    """With sequence_parallel: overlap each all-to-all with attention in this many head groups; 1: off; auto: the G
    of the shortest attention layer predicted from the token count, the link and this device's measured attention
    (framework/distributed/head_groups.py; rank 0 prints the choice and its figures)."""

    def sharing(self) -> Any:
        """The framework/inference/sharing.py object these settings name (after share_ranks has joined the job)."""
        import torch.distributed as dist

        from framework.inference.sharing import DecodeRanks, OneProcess, SplitRanks

        if self.decode_ranks:
            return DecodeRanks(self.decode_ranks, self.aco)
        # in torchrun's group the ranks (or the sequence-parallel groups) share the prompts; alone, one process draws all
        return SplitRanks() if dist.is_initialized() else OneProcess()


@dataclass
class EncoderPaths:
    """Encoders for the sample and eval commands when the ones dataset.json records are not on this machine."""

    vae: str | None = None
    """Image decoder: pixel or a local VAE folder; null: the one the checkpoint's dataset recorded."""
    text_encoder: str | None = None
    """Prompt encoder: minilm or a local text-encoder folder; null: the one the checkpoint's dataset recorded."""


def auto_head_groups(pipe: Any, cfg: RankSharing) -> int:
    """sequence_parallel_head_groups=auto for this generation (framework/distributed/head_groups.py): every rank times
    one attention of the size it will draw (guided: both halves), the slowest time is taken by all (so every rank
    chooses the same G), and rank 0 prints what was chosen and why. Softmax (Ulysses) families only."""
    import math

    import torch.distributed as dist

    from framework.distributed import head_groups as hg
    from framework.distributed.sequence import check
    from framework.models.families import plan_of

    mcfg, size = pipe.model.cfg, cfg.sequence_parallel
    check(mcfg, size)
    kind = plan_of(mcfg.family).sequence.attention
    if kind != "softmax":
        raise ValueError(f"sequence_parallel_head_groups=auto models Ulysses softmax attention; model.family="
                         f"{mcfg.family}'s sequence parallelism is {kind!r}: give a number of head groups")
    shape = pipe.latent_size(getattr(cfg, "height", None), getattr(cfg, "width", None), getattr(cfg, "aspect", None),
                             getattr(cfg, "num_frames", None))
    tokens = math.prod(shape[:-2]) * math.prod(side // mcfg.patch_size for side in shape[-2:])
    batch = 2 * int(getattr(cfg, "batch_size", None) or 64)  # a guided forward (both halves) of the commands' batch
    heads, head_dim = mcfg.num_heads, mcfg.head_dim
    dtype = next(pipe.model.parameters()).dtype
    per_group = sorted({math.ceil(heads / (g * size)) for g in hg.groups_to_try(heads, size)}, reverse=True)
    seconds = [hg.measure_attention(batch, n, tokens, head_dim, pipe.device, dtype) for n in per_group]
    slowest = torch.tensor(seconds, dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # every rank the same figures, so the same choice
    link = hg.link_of(pipe.device, size, int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())))
    layer = hg.layer_of(batch, tokens, heads, head_dim, size, torch.finfo(dtype).bits // 8,
                        dict(zip(per_group, slowest.tolist())))
    chosen, times = hg.choose(layer, *hg.LINKS[link])
    if dist.get_rank() == 0:
        print(f"sequence_parallel_head_groups=auto: {chosen} ({tokens} tokens, {heads} heads of {head_dim} over "
              f"{size} ranks, batch {batch}; {link} link; attention measured "
              + ", ".join(f"{n} heads {t * 1e3:.3g} ms" for n, t in layer.attention_s.items())
              + "; predicted per layer " + ", ".join(f"G={g} {t * 1e3:.3g} ms" for g, t in times.items()) + ")",
              flush=True)
    return chosen


def share_ranks(pipe: Any, cfg: RankSharing) -> bool:
    """Join torchrun's process group: for `cfg`'s decode_ranks / sequence_parallel (splitting the pipeline's model for
    the latter: on the denoising ranks only, in groups of consecutive ranks, when both are set), else for the ranks to
    share the images; returns whether this rank writes and prints (rank 0, or the only process)."""
    import torch.distributed as dist

    if cfg.decode_ranks != "auto" and (not isinstance(cfg.decode_ranks, int) or cfg.decode_ranks < 0):
        raise ValueError(f"decode_ranks={cfg.decode_ranks!r}: a number of ranks (0: off) or auto")
    share_ok = cfg.aco == "auto" or (isinstance(cfg.aco, (int, float)) and 0 < cfg.aco < 1)
    if cfg.aco and not (share_ok and cfg.decode_ranks and cfg.sequence_parallel == 1):
        raise ValueError(f"aco={cfg.aco}: the share of each self-attention's heads (between 0 and 1, or auto: the "
                         "decoding ranks' share of all ranks) an idle decoding rank computes; it needs decode_ranks "
                         "and sequence_parallel=1")
    if cfg.decode_ranks == "auto" and cfg.sequence_parallel > 1:
        raise ValueError("decode_ranks=auto with sequence_parallel: give the number of decoding ranks (the others must "
                         "form whole sequence-parallel groups)")
    groups = cfg.sequence_parallel_head_groups
    if groups != "auto" and (not isinstance(groups, int) or groups < 1):
        raise ValueError(f"sequence_parallel_head_groups={groups!r}: a number of head groups (1: off) or auto")
    if groups == "auto" and cfg.sequence_parallel == 1:
        raise ValueError("sequence_parallel_head_groups=auto needs sequence_parallel > 1 (head groups split "
                         "sequence parallelism's exchanges)")
    if cfg.decode_ranks:
        from framework.inference.decoupled import join, split_denoisers

        join(cfg.decode_ranks)  # refuses too few processes
        if cfg.sequence_parallel > 1:
            groups = auto_head_groups(pipe, cfg) if groups == "auto" else groups
            split_denoisers(pipe, cfg.decode_ranks, cfg.sequence_parallel, groups)
    elif cfg.sequence_parallel > 1:
        from framework.distributed.sequence import split_for_sampling

        if groups == "auto":
            from framework.distributed.env import init_from_env

            init_from_env()
            groups = auto_head_groups(pipe, cfg)
        split_for_sampling(pipe.model, cfg.sequence_parallel, groups)
    else:  # plain torchrun: every rank draws its share of the images (SplitRanks)
        from framework.distributed.env import init_from_env

        init_from_env()
    return not dist.is_initialized() or dist.get_rank() == 0


def run_complete(run: Path) -> bool:
    """Whether a framework.train run reached its last step (its final checkpoint is written)."""
    from omegaconf import OmegaConf

    from framework.inference.checkpoint import checkpoint_step

    last = run / "checkpoints" / "last.ckpt"
    if not last.exists() or not (run / "config.yaml").exists():
        return False
    return checkpoint_step(last) == OmegaConf.load(run / "config.yaml").trainer.max_steps


def train_child(args: list[str], label: str, run: Path) -> None:
    """`python -m framework.train ARGS` in a child process (its own memory, Streaming state and seed), printed first
    under `label`; a failure raises naming the run folder."""
    import subprocess

    print(f"{label}: python -m framework.train {' '.join(args)}", flush=True)
    proc = subprocess.run([sys.executable, "-m", "framework.train", *args])
    if proc.returncode != 0:
        raise RuntimeError(f"{label} failed (exit {proc.returncode}); its folder: {run}")


def train_unless_complete(args: list[str], label: str, run: Path) -> Path:
    """A study's run: `python -m framework.train ARGS` into `run` (train_child) unless it already reached its last
    step, so that a study stopped and started again keeps what it finished."""
    if run_complete(run):
        print(f"{label}: complete, kept")
    else:
        train_child(args, label, run)
    return run


# --------------------------------------------------------------------------------------------
# Measurements: a table on screen, JSON rows on disk, one command per suite or study
# --------------------------------------------------------------------------------------------


def print_table(rows: list[dict[str, Any]], cols: list[str]) -> None:
    """`cols` of `rows` as left-aligned columns; floats to 4 significant digits, None as '-'."""
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "-" if v is None else str(v)

    cells = [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def write_json(rows: list[dict[str, Any]], out: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(rows, indent=2))
    print(f"wrote {out}")


def named_command(package: str, table: dict[str, tuple[type, Callable[[Any], Any]]], noun: str = "NAME",
                  elsewhere: dict[str, str] | None = None) -> None:
    """`python -m PACKAGE NAME key=value ...`: NAME's config dataclass (`table[NAME][0]`) read by Hydra from the
    arguments, then `table[NAME][1](config)`; rows it returns are written to the config's `out` as JSON (under
    torchrun only rank 0 returns rows). `elsewhere` maps a name that moved to the command that has it now."""
    import hydra
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    name = sys.argv[1] if len(sys.argv) > 1 else None
    if name in (elsewhere or {}):
        raise SystemExit(f"{name} moved: python -m {elsewhere[name]} {name} [key=value ...]")
    if name not in table:
        raise SystemExit(f"usage: python -m {package} {noun} [key=value ...]; {noun} is one of {sorted(table)}")
    sys.argv.pop(1)
    config, run = table[name]
    ConfigStore.instance().store(name=f"{package}_{name}", node=config)
    quiet_hydra()

    @hydra.main(version_base="1.3", config_path=None, config_name=f"{package}_{name}")
    def _run(cfg: Any) -> None:
        obj = OmegaConf.to_object(cfg)
        rows = run(obj)
        if rows:
            write_json(rows, obj.out)

    _run()
