"""`python -m framework.bench SUITE key=value ...`: benchmarks. They measure; tests assert behaviour.

Suites (one file each, framework/bench/suite_<name>.py):
  train      the real training step (Lightning fit of DiffusionModule) for a preset: samples/s, step
             time, counted FLOPs, TFLOP/s, MFU, peak memory; comparisons precomputed vs online
             encoders, fp32 vs bf16-mixed, SDPA vs xformers, torch.compile, activation checkpointing
  data       the Streaming data module's samples/s from local shards, and bytes per sample
  memory     per-rank parameter + gradient + optimizer bytes under single / fsdp (framework/distributed/fsdp.py)
  init_memory  peak host memory per rank building + sharding a preset under fsdp: meta path vs whole
             builds (framework/distributed/fsdp.py)
  optimizer  optimizer-state bytes per parameter, AdamW vs CAME vs CAME-8bit (plugins/came.py)
  ema        EMA cost per step before and after its start (plugins/ema.py)
  norm       low-precision norms' effect on step time and peak memory (plugins/low_precision_norm.py)
  cache      cached sampling (framework/inference/caching.py): images/s, accuracy and fd of full sampling, a learned
             schedule, uniform:K at the same cost and fewer steps at the same latency
  cache_curve  quality (fd, accuracy, paired error to the full sampler, bootstrap intervals) against measured speed:
             routers trained per sparsity and read at several thresholds, uniform:K, fewer steps; cache_curve.png
  buckets    aspect-ratio buckets against square crops on synthetic mixed-aspect scenes: whether the blocks a held-out
             caption names near the edges are drawn (framework/evaluation/shapes.py); buckets.png
  decode     (under torchrun) generation with a denoiser and an SD-architecture VAE: one rank, every rank
             doing both (SplitRanks), and denoising / decoding ranks (decode_ranks)
  checkpoint seconds (the training loop blocked / until complete) and bytes per sharded save on CPU ranks,
             synchronous vs strategy.async_save (framework.distributed.strategy.ShardedSaver)
  overhead   the framework's own cost per step: framework.train against a hand-written loop (same shards, model,
             batch, objective, AdamW, clipping, threads), alternating child processes; prints framework / loop
  gpu        the README's GPU table in one run: per family at real size (batch filled to the GPU) samples/s, MFU,
             peak memory; EMA, CAME-8bit, low-precision norms, compile, activation checkpointing on one preset
  sequence   one rank's peak memory and compute time against sequence length, whole sequences vs Ulysses
             sequence parallelism over P ranks (framework/distributed/sequence.py; P ranks simulated on one device)
  overlap    sequence parallelism's exposed communication per head-group count, forward and backward: one rank's
             recorded step replayed with calibrated stand-in collectives (nvlink / infiniband presets, gloo measured)
Each prints a table and writes one JSON row per configuration to `out`.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from framework.bench import (suite_buckets, suite_cache, suite_cache_curve, suite_checkpoint, suite_data, suite_decode,
                             suite_ema, suite_gpu, suite_init_memory, suite_memory, suite_norm, suite_optimizer,
                             suite_overhead, suite_overlap, suite_sequence, suite_train)
from framework.bench.harness import write_json
from framework.cli import quiet_hydra

# name -> (the suite's config dataclass, run(cfg) -> JSON rows)
SUITES: dict[str, tuple[type, Callable[[Any], list[dict[str, Any]]]]] = {
    "train": (suite_train.TrainBench, suite_train.run),
    "data": (suite_data.DataBench, suite_data.run),
    "memory": (suite_memory.MemoryBench, suite_memory.run),
    "init_memory": (suite_init_memory.InitMemoryBench, suite_init_memory.run),
    "optimizer": (suite_optimizer.OptimizerBench, suite_optimizer.run),
    "ema": (suite_ema.EMABench, suite_ema.run),
    "norm": (suite_norm.NormBench, suite_norm.run),
    "cache": (suite_cache.CacheBench, suite_cache.run),
    "cache_curve": (suite_cache_curve.CacheCurveBench, suite_cache_curve.run),
    "buckets": (suite_buckets.BucketsBench, suite_buckets.run),
    "decode": (suite_decode.DecodeBench, suite_decode.run),
    "overhead": (suite_overhead.OverheadBench, suite_overhead.run),
    "sequence": (suite_sequence.SequenceBench, suite_sequence.run),
    "overlap": (suite_overlap.OverlapBench, suite_overlap.run),
    "checkpoint": (suite_checkpoint.CheckpointBench, suite_checkpoint.run),
    "gpu": (suite_gpu.GPUBench, suite_gpu.run),
}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in SUITES:
        raise SystemExit(f"usage: python -m framework.bench SUITE [key=value ...]; SUITE is one of {sorted(SUITES)}")
    suite = sys.argv.pop(1)
    config, run = SUITES[suite]
    ConfigStore.instance().store(name=f"bench_{suite}", node=config)
    quiet_hydra()

    @hydra.main(version_base="1.3", config_path=None, config_name=f"bench_{suite}")
    def _run(cfg: Any) -> None:
        obj = OmegaConf.to_object(cfg)
        rows = run(obj)
        if rows:  # under torchrun (suite decode) only rank 0 has rows to write
            write_json(rows, obj.out)

    _run()


if __name__ == "__main__":
    main()
