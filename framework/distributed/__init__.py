"""Parallelism: the Lightning strategies (strategy), FSDP2 (fsdp), Ulysses sequence parallelism (sequence),
DTensor helpers (dtensor) and joining torchrun's process group (env). Imports models and data.
"""
