"""Random numbers keyed by sample: a batch's draws as one set of tensor ops, each sample's a function of its key.

A training sample's noise, noise level, caption-drop flag, caption choice, posterior sample and flip must be the same
on any number of ranks and after a resume, so they are functions of (seed, micro-batch, the sample's row in the global
batch, what is drawn), not of a generator's state (framework/training/draws.py). One seeded torch.Generator per
sample gives that at a host call per sample; here a sample's key starts a SplitMix64 sequence (Steele, Lea and Flood,
"Fast splittable pseudorandom number generators", OOPSLA 2014), whose j-th number is a function of (key, j) alone.
So a batch draws with a fixed handful of integer tensor ops, whatever its size, on the device that holds the batch.
The integer part is exact on every device; the floats made from it (the normal's inverse CDF) agree to rounding.
"""

from __future__ import annotations

from typing import Iterable

import torch

GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment (the golden ratio's fraction in 64 bits)
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # its finaliser's multipliers


def _int64(x: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits (torch's int64 arithmetic wraps modulo 2**64)."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch shifts int64 arithmetically: the sign bits are masked off)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def keys(seed: int, micro: int, rows: Iterable[int], tag: int) -> torch.Tensor:
    """(B,) int64 keys on the host, one a row: Python's hash of (seed, micro-batch, row, tag), which is the same in
    every process (integers and tuples of them are not salted). `tag` keeps one kind of draw apart from another."""
    return torch.tensor([hash((seed, micro, row, tag)) for row in rows], dtype=torch.int64)


def bits(keys: torch.Tensor, n: int) -> torch.Tensor:
    """(B, n) int64: the first n outputs of each key's SplitMix64 sequence (the key as its state), on keys' device."""
    z = keys[:, None] + torch.arange(1, n + 1, dtype=torch.int64, device=keys.device) * _int64(GAMMA)
    z = (z ^ _shr(z, 30)) * _int64(MIX1)
    z = (z ^ _shr(z, 27)) * _int64(MIX2)
    return z ^ _shr(z, 31)


def unit(b: torch.Tensor) -> torch.Tensor:
    """float32 in (0, 1) from int64 bits: the top 23 bits and a half, times 2**-23, so 2**-24 to 1 - 2**-24.
    Every step is exact in float32; with 24 bits the half rounds to even above 2**23 and all-ones bits give 1.0,
    whose inverse CDF is inf (the video quickstart's non-finite loss at step 213: one noise draw in 2**24)."""
    return _shr(b, 41).float().add_(0.5).mul_(2.0 ** -23)


def uniforms(keys: torch.Tensor, n: int) -> torch.Tensor:
    """(B, n) float32 uniform on (0, 1), symmetric about 1/2: `unit` of each key's first n outputs."""
    return unit(bits(keys, n))


def normals(keys: torch.Tensor, n: int) -> torch.Tensor:
    """(B, n) float32 standard normals: the normal's inverse CDF of `uniforms`, finite and |z| <= 5.29 (the smallest
    uniform being 2**-24: 1 draw in 10**7 would be beyond it)."""
    return torch.special.ndtri(uniforms(keys, n))
