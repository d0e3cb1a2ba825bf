"""Block-wise min-max 8-bit quantization, used for CAME-8bit's first moment (SANA-1.5, Sec. 3).

The last dim of a tensor is cut into blocks; each block stores uint8 codes and its own fp32
minimum and step (scale), so x ~= min + code * scale with an error of at most scale / 2.
Per-block ranges keep one outlier from wiping out the precision of the whole tensor. Leading
dims are independent rows: CAME-8bit quantizes each row of a matrix on its own, so a block never
spans two rows (and so never two FSDP shards).
"""

from __future__ import annotations

import math

import torch

LEVELS = 255  # uint8 codes 0..255


def row_blocks(n: int, block_size: int) -> tuple[int, int]:
    """(blocks, block length) for n elements in equal blocks of at most block_size elements.

    Equal lengths rather than full blocks plus a short tail: a 4608-wide row with block_size 2048
    becomes 3 blocks of 1536 with no padding instead of 3 blocks of 2048 with 1536 wasted codes.
    """
    blocks = max(1, math.ceil(n / block_size))
    return blocks, math.ceil(n / blocks)


def quantize_blocks(x: torch.Tensor, codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor) -> None:
    """Quantize fp32 `x` (..., n) into `codes` (..., nb, block) uint8, `lo` (..., nb) and `scale` (..., nb), in place.

    Elements past n (the tail of the last block) are padded with the last value of their row so
    they never widen a block's range.
    """
    *lead, nb, block = codes.shape
    n = x.shape[-1]
    if n > nb * block:
        raise ValueError(f"{n} elements do not fit in {nb} blocks of {block}")
    if x.numel() == 0:  # no rows here (an FSDP rank with an empty shard): nothing to store
        return
    if n < nb * block:  # copy only when there is a tail to pad
        x = torch.cat([x, x[..., -1:].expand(*lead, nb * block - n)], dim=-1)
    blocks = x.reshape(*lead, nb, block)  # (..., nb, block)
    low, high = torch.aminmax(blocks, dim=-1)  # (..., nb), (..., nb)
    lo.copy_(low)
    scale.copy_((high - low) / LEVELS)
    # A constant block has scale 0: dividing by 1 instead maps every element to code 0 = exactly lo.
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    # x >= lo exactly and (x - lo) / scale <= 255 up to rounding, so the codes need no clamping.
    codes.copy_(((blocks - lo[..., None]) / safe[..., None]).round_())  # cast to uint8 by copy_


def dequantize_blocks(codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
    """The first n values of each row's blocks as a new contiguous fp32 tensor (..., n)."""
    *lead, nb, block = codes.shape
    x = torch.addcmul(lo[..., None], codes, scale[..., None])  # (..., nb, block) fp32: uint8 promotes in the kernel
    return x.view(*lead, nb * block)[..., :n].contiguous()  # a copy only when there was a tail
