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
             schedule, uniform:K at the same cost and fewer steps at the same latency (the quality-vs-speed curve is a
             study: python -m framework.studies cache_curve)
  decode     (under torchrun) generation with a denoiser and an SD-architecture VAE: one rank, every rank
             doing both (SplitRanks), and denoising / decoding ranks (decode_ranks), with and without Aco
  roles      each role's peak memory in decoupled video generation at a real clip size (Wan 1.3B, 81 frames at
             480x832): a denoising rank's step and a decoding rank's tiled clip, each in a fresh process
  checkpoint seconds (the training loop blocked / until complete) and bytes per sharded save on CPU ranks,
             synchronous vs strategy.async_save (framework.distributed.strategy.ShardedSaver)
  overhead   the framework's own cost per step: framework.train against a hand-written loop (same shards, model,
             batch, objective, AdamW, clipping, threads), alternating child processes; prints framework / loop
  gpu        the README's GPU table in one run: per family at real size (batch filled to the GPU) samples/s, MFU,
             peak memory; EMA, CAME-8bit, low-precision norms, compile, activation checkpointing on one preset
  sequence   one rank's peak memory and compute time against sequence length, whole sequences vs Ulysses
             sequence parallelism over P ranks (framework/distributed/sequence.py; P ranks simulated on one device)
  precompute where data_prep.precompute's time goes (decode / encode / write images/s, the share of time the encoder
             is busy) per number of decode workers and of ranks, on synthetic 256-px JPEGs and a debug-size VAE
  finetune   peak memory and samples/s of full fine-tuning vs a LoRA vs a LoRA on a bf16 base (framework/models/adapters.py),
             each beside the memory framework.train predicts for it (framework/training/memory.py)
  startup    a job's start-up against its rank count (8 / 32 / 64 CPU ranks): rendezvous, the shard check on every
             rank vs once per job vs a requeue's kept verdict, the dataset's index
  cost       a recipe's training in GPU-hours and days (experiment=NAME or its phases in order): samples seen from its
             config, throughput per GPU given (samples_per_s=) or from its counted FLOPs at an MFU (mfu=, gpu=)
  overlap    sequence parallelism's exposed communication per head-group count, forward and backward: one rank's
             recorded step replayed with calibrated stand-in collectives (nvlink / infiniband presets, gloo measured)
Each prints a table and writes one JSON row per configuration to `out`. Studies (what a method buys, over training
runs: cache_curve, buckets, growth) are `python -m framework.studies`.
"""

from __future__ import annotations

from typing import Any, Callable

from framework.bench import (suite_cache, suite_checkpoint, suite_cost, suite_data, suite_decode, suite_ema, suite_finetune,
                             suite_gpu, suite_init_memory, suite_memory, suite_norm, suite_optimizer, suite_overhead,
                             suite_overlap, suite_precompute, suite_roles, suite_sequence, suite_startup, suite_train)
from framework.cli import named_command

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
    "decode": (suite_decode.DecodeBench, suite_decode.run),
    "roles": (suite_roles.RolesBench, suite_roles.run),
    "overhead": (suite_overhead.OverheadBench, suite_overhead.run),
    "sequence": (suite_sequence.SequenceBench, suite_sequence.run),
    "overlap": (suite_overlap.OverlapBench, suite_overlap.run),
    "precompute": (suite_precompute.PrecomputeBench, suite_precompute.run),
    "checkpoint": (suite_checkpoint.CheckpointBench, suite_checkpoint.run),
    "gpu": (suite_gpu.GPUBench, suite_gpu.run),
    "finetune": (suite_finetune.FinetuneBench, suite_finetune.run),
    "startup": (suite_startup.StartupBench, suite_startup.run),
    "cost": (suite_cost.CostBench, suite_cost.run),
}


def main() -> None:
    studies = {"cache_curve": "framework.studies", "buckets": "framework.studies"}  # suites once, studies now
    named_command("framework.bench", SUITES, "SUITE", elsewhere=studies)


if __name__ == "__main__":
    main()
