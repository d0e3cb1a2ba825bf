"""Block-wise min-max 8-bit quantization, used for CAME-8bit's first moment (SANA-1.5, Sec. 3).

A flat tensor is cut into blocks of `block` elements; each block stores uint8 codes and its own
fp32 minimum and step (scale), so x ~= min + code * scale with an error of at most scale / 2.
Per-block ranges keep one outlier from wiping out the precision of the whole tensor.
"""

from __future__ import annotations

import torch

LEVELS = 255  # uint8 codes 0..255


def quantize_blocks(x: torch.Tensor, codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor) -> None:
    """Quantize the flat fp32 `x` (n,) into `codes` (nb, block) uint8, `lo` (nb,) and `scale` (nb,), in place.

    Elements past n (the tail of the last block, and whole blocks a short shard does not fill) are
    padded with the last value of x so they never widen a block's range.
    """
    nb, block = codes.shape
    n = x.numel()
    if n > nb * block:
        raise ValueError(f"{n} elements do not fit in {nb} blocks of {block}")
    if n == 0:  # an empty shard (FSDP rank with no rows): all blocks constant zero
        codes.zero_(), lo.zero_(), scale.zero_()
        return
    flat = x.reshape(-1)
    if n < nb * block:  # copy only when there is a tail to pad
        flat = torch.cat([flat, flat[-1:].expand(nb * block - n)])
    padded = flat.view(nb, block)  # (nb, block)
    low, high = torch.aminmax(padded, dim=1)  # (nb,), (nb,)
    lo.copy_(low)
    scale.copy_((high - low) / LEVELS)
    # A constant block has scale 0: dividing by 1 instead maps every element to code 0 = exactly lo.
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    # x >= lo exactly and (x - lo) / scale <= 255 up to rounding, so the codes need no clamping.
    codes.copy_(((padded - lo[:, None]) / safe[:, None]).round_())  # (nb, block), cast to uint8 by copy_


def dequantize_blocks(codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
    """The first n values of the blocks as a new flat fp32 tensor (n,)."""
    x = torch.addcmul(lo[:, None], codes, scale[:, None])  # (nb, block) fp32: uint8 codes promote in the kernel
    return x.view(-1)[:n]  # a contiguous prefix: later .view(rows, cols) works
