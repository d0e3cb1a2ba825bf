"""`python -m framework.bench sequence`: one rank's peak memory and compute time against sequence length,
whole sequences versus Ulysses sequence parallelism over P ranks (framework/distributed/sequence.py).

One training step (forward and backward, batch `batch_size`, bf16 autocast on a GPU) of a preset at each
latent size. For P > 1 this process is rank 0 of a P-rank group on torch's fake process group: it runs
exactly one rank's computation and allocates every buffer a real rank allocates (all-to-all, gather and
halo outputs), while the collectives themselves move no data. So the memory column is what each rank of a
P-GPU group holds, measured on one GPU; the time column is one rank's compute alone, without communication
(what overlap can hide it behind). Parameters and gradients are the same on every rank (shard them with
fsdp); `activations` is the peak above them.

Under torchrun (`torchrun --standalone --nproc_per_node=P -m framework.bench sequence ...`) the P processes
form one real group instead (nccl with a GPU each; gloo, through host memory, when they share fewer GPUs or
run on CPUs) and rank 0 reports real step times, communication included: the setting in which
`head_groups` > 1 (the overlapped all-to-all) is compared with 1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from framework.cli import print_table
from framework.distributed.env import leave


@dataclass
class SequenceBench:
    """Arguments of `python -m framework.bench sequence`."""

    preset: str = "pixart_xl_2_256"
    """Backbone preset (random weights); its sample_size is raised to the largest latent size."""
    latent_sizes: list[int] = field(default_factory=lambda: [64, 128, 256])
    """Latent sides; tokens = (side / patch_size)^2 (pixart_xl_2 at 256: 16,384 tokens, a 2048 px image)."""
    ranks: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    """Sequence-parallel group sizes P (1: whole sequences)."""
    head_groups: list[int] = field(default_factory=lambda: [1])
    """sequence_parallel_head_groups values to run for each P > 1 (2: the overlapped all-to-all)."""
    batch_size: int = 1
    text_tokens: int = 120
    repeats: int = 3
    """Timed steps after one warm-up; the median is kept."""
    out: str = "bench_sequence.json"


def _fake_group(size: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)


def _step(model: Any, side: int, cfg: Any, bench: SequenceBench, device: torch.device) -> None:
    g = torch.Generator(device=device).manual_seed(0)
    B = bench.batch_size
    x = torch.randn(B, cfg.in_channels, side, side, generator=g, device=device)
    t = torch.rand(B, generator=g, device=device) * 1000
    text = torch.randn(B, bench.text_tokens, cfg.text_dim, generator=g, device=device)
    mask = torch.ones(B, bench.text_tokens, device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        pred = model(x, t, text, mask)
    pred.float().square().mean().backward()


def _measure(model: Any, side: int, cfg: Any, bench: SequenceBench,
             device: torch.device) -> tuple[int | None, int, list[float]]:
    """(peak bytes, bytes before the step: parameters and gradients, step seconds) of `repeats` steps."""
    cuda = device.type == "cuda"
    model.zero_grad(set_to_none=False)
    _step(model, side, cfg, bench, device)  # warm-up; gradients now allocated
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    times = []
    for _ in range(bench.repeats):
        t0 = time.perf_counter()
        _step(model, side, cfg, bench, device)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return (torch.cuda.max_memory_allocated() if cuda else None), base, times


def run(bench: SequenceBench) -> list[dict[str, Any]]:
    from framework.models.backbones import build_denoiser, load_preset
    from framework.distributed.mesh import job_mesh
    from framework.distributed.sequence import init, install

    import os

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    rows = []
    settings = [(1, 1)] + [(p, g) for p in bench.ranks if p > 1 for g in bench.head_groups]
    real = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if real:  # one real group of all torchrun's processes
        world = int(os.environ["WORLD_SIZE"])
        if cuda:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda and torch.cuda.device_count() >= world else "gloo")
        settings = [(world, g) for g in bench.head_groups]
    for P, G in settings:
        torch.manual_seed(0)
        cfg = load_preset(bench.preset, sample_size=max(bench.latent_sizes))
        with device:  # built where it runs (a 1.6B model's CPU init would dominate the suite)
            model = build_denoiser(cfg)
        if P > 1:
            if not real:
                _fake_group(P)
            install(model, init(job_mesh(P, device_type=device.type), G))
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        for side in bench.latent_sizes:
            tokens = (side // cfg.patch_size) ** 2
            row = {"preset": bench.preset, "tokens": tokens, "tokens_per_rank": tokens // P, "sequence_parallel": P,
                   "head_groups": G}
            try:
                peak, base, times = _measure(model, side, cfg, bench, device)
            except torch.OutOfMemoryError:
                model.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                rows.append({**row, "activations_GiB": "OOM", "peak_GiB": "OOM"})
                print(f"P={P} head_groups={G} tokens={tokens}: out of memory", flush=True)
                continue
            rows.append({
                **row, "batch_size": bench.batch_size,
                "params_and_grads_GiB": round(2 * params / 2**30, 2),
                "activations_GiB": None if peak is None else round((peak - base) / 2**30, 2),
                "peak_GiB": None if peak is None else round(peak / 2**30, 2),
                "step_ms": round(1000 * sorted(times)[len(times) // 2], 1),
                "device": torch.cuda.get_device_name() if cuda else "cpu",
                "communication": dist.get_backend() if real else "none (fake process group)",
            })
            if real and dist.get_rank() != 0:
                continue
            print(f"P={P} head_groups={G} tokens={tokens}: activations {rows[-1]['activations_GiB']} GiB, "
                  f"{rows[-1]['step_ms']} ms", flush=True)
        del model
        if cuda:
            torch.cuda.empty_cache()
    rank0 = not real or dist.get_rank() == 0
    leave()
    if not rank0:
        return []
    print_table(rows, ["tokens", "sequence_parallel", "head_groups", "tokens_per_rank", "params_and_grads_GiB",
                       "activations_GiB", "peak_GiB", "step_ms", "communication"])
    return rows
