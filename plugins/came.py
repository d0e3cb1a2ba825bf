"""CAME and CAME-8bit: confidence-guided, memory-efficient adaptive optimizers (`optimizer=came|came8bit`).

CAME (Luo et al., ACL 2023, https://arxiv.org/abs/2307.02047) keeps Adafactor's factored second
moment -- row and column moving averages, O(rows + cols) per matrix -- and replaces Adam's plain
first-moment step with one scaled by a factored "confidence": the moving average of the
instability (u - m)^2 between the current update u and its running mean m. SANA-1.5
(https://arxiv.org/abs/2501.18427) also stores m in 8 bits, block-wise, for large matrices, which
brings optimizer state to about 1 byte per parameter (AdamW: 8).

Gap filled: torch has no CAME; came-pytorch (the test reference) has neither the 8-bit state nor
FSDP2 support -- SANA's version breaks on DTensor parameters (Sana issue 260). Here, a parameter
row-sharded by `fully_shard` keeps its row statistics local to the shard, while column statistics,
mean(r) and the clipping RMS are summed over the shard group (3 small all-reduces per matrix), so
2 ranks reproduce one process. States that follow the rows are DTensors like the parameter, so
torch.distributed.checkpoint saves each rank's piece.

The 8-bit layout does not depend on the number of ranks: each row of the (rows, cols) matrix is
cut into the same equal blocks of at most `block_size` elements (`quant8.row_blocks`), and a block
never spans two rows. The codes (rows, blocks, block) and the per-block minimum and scale
(rows, blocks) are then sharded on dim 0 exactly like the parameter, under any `fully_shard`
split (torch.chunk of the rows, short or empty last ranks included): every rank quantizes its own
rows, and the saved global tensors have the same shape and content on 1, 2 or 16 ranks, so a
sharded checkpoint resumes on any number of ranks. The price of never crossing a row is one min
and scale per row even for rows shorter than block_size: for 1152-wide rows 8/1152 bytes per
element instead of 8/2048 (`python -m framework.bench optimizer`: 1.024 bytes/param on
pixart_xl_2_256, against 1.022 when blocks ran across rows and so depended on the shard split).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from framework.distributed.dtensor import local_tensor
from framework.training.optim import OPTIMIZER_CHECKS, OPTIMIZER_SETTINGS, OPTIMIZER_STATE, OPTIMIZERS, OptimizerConfig
from plugins.quant8 import dequantize_blocks, quantize_blocks, row_blocks

# --------------------------------------------------------------------------------------------
# Sharding: which rows of a parameter this process holds and whom to sum with
# --------------------------------------------------------------------------------------------


@dataclass
class _Shard:
    """How a parameter is spread: `rows` of dim 0 in total, summed over `groups` (empty: one process)."""

    rows: int
    groups: tuple
    param: torch.Tensor

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a small local tensor over the shards holding the other rows (no-op on one process)."""
        for g in self.groups:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=g)
        return t

    def row_means(self, x: torch.Tensor, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Means over all rows: of x (rows_l, C) -> (C,), and of row (rows_l,) -> scalar."""
        if not self.groups:  # torch's own means: bit-identical to the reference implementation
            return x.mean(dim=0), row.mean()
        # One all-reduce for both: the column sums of x and the sum of row.
        sums = self.sum(torch.cat([x.sum(dim=0), row.sum().reshape(1)]))  # (C + 1,)
        return sums[:-1] / self.rows, sums[-1] / self.rows

    def norm(self, u: torch.Tensor) -> torch.Tensor:
        """The 2-norm of the whole parameter-shaped u from this shard's piece."""
        if not self.groups:
            return u.norm(2)
        return self.sum((u * u).sum()).sqrt()

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, sharded: bool) -> torch.Tensor:
        """A state tensor: sharded on dim 0 like the parameter (a DTensor), or the same on every rank."""
        p = self.param
        if not isinstance(p, DTensor) or not sharded:
            return torch.zeros(shape, dtype=dtype, device=local_tensor(p).device)
        # Shard(0) splits dim 0 like torch.chunk, as fully_shard does, so row states line up with rows.
        return torch.distributed.tensor.zeros(shape, dtype=dtype, device_mesh=p.device_mesh, placements=p.placements)


def _shard_of(p: torch.Tensor) -> _Shard:
    rows = p.shape[0] if p.dim() else 1
    if not isinstance(p, DTensor):
        return _Shard(rows, (), p)
    groups = []
    for dim, placement in enumerate(p.placements):
        if placement.is_shard(0):
            groups.append(p.device_mesh.get_group(dim))
        elif not placement.is_replicate():
            raise ValueError(
                f"CAME supports parameters that are replicated or sharded on dim 0 (FSDP2 fully_shard);"
                f" got placements {p.placements}. Shard the model with fully_shard or use optimizer=adamw."
            )
    return _Shard(rows, tuple(groups), p)


# --------------------------------------------------------------------------------------------
# State layout: one function decides every state tensor, for the optimizer and the benchmark
# --------------------------------------------------------------------------------------------

F32, U8 = torch.float32, torch.uint8


def is_factored(shape: Iterable[int]) -> bool:
    """2-D weights and 1x1 convolutions (viewed as out x in) get factored statistics.

    Other tensors (biases, norms, k x k convolutions) keep a full second moment: factoring a kernel
    over its spatial taps, as came-pytorch does for any >= 2-D tensor, has no meaning, and they are small.
    """
    shape = tuple(shape)
    return len(shape) == 2 or (len(shape) == 4 and shape[2:] == (1, 1))


def is_8bit(shape: Iterable[int], min_8bit_size: int) -> bool:
    """Whether CAME-8bit keeps this parameter's first moment in 8 bits."""
    return is_factored(shape) and math.prod(shape) >= min_8bit_size


def state_shapes(
    shape: Iterable[int], *, quantize: bool, block_size: int, min_8bit_size: int
) -> dict[str, tuple[tuple[int, ...], torch.dtype, bool]]:
    """name -> (global shape, dtype, sharded on dim 0 like the parameter) of each state tensor.

    Every shape depends on the parameter's shape only, never on how many ranks share it: the
    8-bit blocks lie within rows, so their dim 0 is the parameter's rows and shards with them.
    """
    shape = tuple(shape)
    if not is_factored(shape):
        return {"exp_avg": (shape, F32, True), "exp_avg_sq": (shape, F32, True)}
    rows, cols = shape[0], math.prod(shape[1:])
    out = {
        "exp_avg_sq_row": ((rows,), F32, True),
        "exp_avg_sq_col": ((cols,), F32, False),
        "exp_avg_res_row": ((rows,), F32, True),
        "exp_avg_res_col": ((cols,), F32, False),
    }
    if quantize and is_8bit(shape, min_8bit_size):
        nb, block = row_blocks(cols, block_size)  # per row
        out["exp_avg_q"] = ((rows, nb, block), U8, True)
        out["exp_avg_min"] = ((rows, nb), F32, True)
        out["exp_avg_scale"] = ((rows, nb), F32, True)
    else:
        out["exp_avg"] = (shape, F32, True)
    return out


# --------------------------------------------------------------------------------------------
# The update, piece by piece (all on this process's rows; `shard.sum` completes the reductions)
# --------------------------------------------------------------------------------------------


def _factored_rsqrt(
    x: torch.Tensor, row: torch.Tensor, col: torch.Tensor, beta: float, shard: _Shard
) -> torch.Tensor:
    """Update the row/column averages of x (rows_l, C) and return 1/sqrt(r c^T / mean(r)) (rows_l, C)."""
    row_l = local_tensor(row)  # (rows_l,)
    row_l.mul_(beta).add_(x.mean(dim=1), alpha=1 - beta)
    col_mean, row_mean = shard.row_means(x, row_l)  # (C,), ()
    col.mul_(beta).add_(col_mean, alpha=1 - beta)
    return (row_l / row_mean).rsqrt_().unsqueeze(1) * col.rsqrt().unsqueeze(0)  # (rows_l, C)


def _clip_by_rms(u: torch.Tensor, threshold: float, numel: int, shard: _Shard) -> torch.Tensor:
    """Scale u down so that its RMS over the whole parameter is at most `threshold` (in place)."""
    rms = shard.norm(u) / numel**0.5
    return u.div_((rms / threshold).clamp_(min=1.0))


_QUANT_KEYS = ("exp_avg_q", "exp_avg_min", "exp_avg_scale")  # uint8 codes, fp32 block minimum and scale


def _read_exp_avg(state: dict[str, Any], shape: torch.Size) -> torch.Tensor:
    """The first moment of this shard in fp32, (rows_l, C) or the parameter's local shape."""
    if "exp_avg_q" in state:  # 8-bit: a fresh fp32 copy of this one parameter only
        codes, lo, scale = (local_tensor(state[k]) for k in _QUANT_KEYS)  # (rows_l, nb, block), (rows_l, nb) x 2
        return dequantize_blocks(codes, lo, scale, shape[-1])  # (rows_l, C)
    return local_tensor(state["exp_avg"]).view(shape)  # fp32: the state itself, updated in place


def _write_exp_avg(state: dict[str, Any], m: torch.Tensor) -> None:
    if "exp_avg_q" in state:
        quantize_blocks(m, *(local_tensor(state[k]) for k in _QUANT_KEYS))  # m: (rows_l, C)


def _check_8bit_layout(state: dict[str, Any], shape: torch.Size, group: dict[str, Any]) -> None:
    """A loaded 8-bit first moment must have the global shapes this optimizer would allocate."""
    layout = state_shapes(shape, quantize=True, block_size=group["block_size"], min_8bit_size=group["min_8bit_size"])
    want = {k: layout[k][0] for k in _QUANT_KEYS}
    got = {k: tuple(state[k].shape) for k in _QUANT_KEYS}
    if got != want:
        raise ValueError(
            f"CAME-8bit state of a parameter of shape {tuple(shape)} has block shapes {got}; with block_size="
            f"{group['block_size']} it should be {want}. The checkpoint was probably written by an older"
            f" version that laid the 8-bit blocks out per rank: resume it with that version, or load the weights"
            f" only (init_from=CKPT) and start the optimizer fresh."
        )


# --------------------------------------------------------------------------------------------
# The optimizer
# --------------------------------------------------------------------------------------------


class CAME(torch.optim.Optimizer):
    """CAME (quantize=False) or CAME-8bit (quantize=True); every argument may be set per parameter group."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-4,
        betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
        eps: tuple[float, float] = (1e-30, 1e-16),
        clip_threshold: float = 1.0,
        weight_decay: float = 0.0,
        quantize: bool = False,
        block_size: int = 2048,
        min_8bit_size: int = 16384,
    ) -> None:
        if lr <= 0:
            raise ValueError(f"CAME lr={lr} must be > 0")
        if len(betas) != 3 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"CAME betas={betas}: expected 3 values in [0, 1) (update, squared gradient, instability)")
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=tuple(eps), clip_threshold=clip_threshold, weight_decay=weight_decay,
            quantize=quantize, block_size=block_size, min_8bit_size=min_8bit_size,
        )
        super().__init__(params, defaults)

    def _init_state(self, p: torch.Tensor, group: dict[str, Any], shard: _Shard) -> None:
        shapes = state_shapes(
            p.shape, quantize=group["quantize"], block_size=group["block_size"], min_8bit_size=group["min_8bit_size"]
        )
        for name, (shape, dtype, sharded) in shapes.items():
            self.state[p][name] = shard.zeros(shape, dtype, sharded)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 (torch's signature)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # One parameter at a time: at most one fp32 copy of one 8-bit first moment exists at once.
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        if p.grad.is_sparse:
            raise RuntimeError("CAME does not support sparse gradients")
        shard = _shard_of(p)
        state = self.state[p]
        if not state:
            self._init_state(p, group, shard)
        beta1, beta2, beta3 = group["betas"]
        eps1, eps2 = group["eps"]
        factored = is_factored(p.shape)

        g = local_tensor(p.grad).to(torch.float32)
        if factored:
            g = g.reshape(g.shape[0], math.prod(p.shape[1:]))  # (rows_l, C): a 1x1 conv squeezed to out x in
        # Second moment -> the normalised update u = g / sqrt(V), clipped by its RMS.
        if factored:
            v_row, v_col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
            u = _factored_rsqrt(g.square().add_(eps1), v_row, v_col, beta2, shard).mul_(g)
        else:
            v = local_tensor(state["exp_avg_sq"])
            v.mul_(beta2).add_(g.square().add_(eps1), alpha=1 - beta2)
            u = v.rsqrt().mul_(g)
        _clip_by_rms(u, group["clip_threshold"], p.numel(), shard)

        # First moment m of the clipped update; matrices step with m / sqrt(S), S the instability average.
        m = _read_exp_avg(state, u.shape)
        m.mul_(beta1).add_(u, alpha=1 - beta1)
        if factored:
            res = (u - m).square_().add_(eps2)
            step = _factored_rsqrt(res, state["exp_avg_res_row"], state["exp_avg_res_col"], beta3, shard).mul_(m)
        else:
            step = m
        _write_exp_avg(state, m)

        w = local_tensor(p)
        w32 = w if w.dtype == torch.float32 else w.float()  # low-precision weights update in fp32
        if group["weight_decay"] != 0:  # decoupled, as in AdamW
            w32.add_(w32, alpha=-group["weight_decay"] * group["lr"])
        w32.sub_(step.view_as(w32) * group["lr"])
        if w32 is not w:
            w.copy_(w32)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch casts every state tensor to the parameter's dtype (uint8 codes, and fp32 statistics of
        # bf16 weights, included); CAME's state keeps its saved dtypes, so put the saved tensors back.
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        for group, saved_group in zip(self.param_groups, state_dict["param_groups"]):
            for i, p in zip(saved_group["params"], group["params"]):
                for k, v in saved.get(i, {}).items():
                    if torch.is_tensor(v):
                        self.state[p][k] = v.to(device=p.device)
                if "exp_avg_q" in self.state[p]:
                    _check_8bit_layout(self.state[p], p.shape, group)


# --------------------------------------------------------------------------------------------
# Registration with the framework's optimizer group
# --------------------------------------------------------------------------------------------


@dataclass
class CameSettings:
    """CAME's own fields, `optimizer.settings.*` under optimizer=came / came8bit."""

    eps: list[float] = field(default_factory=lambda: [1e-30, 1e-16])
    """Constants added to the squared gradient and to the instability."""
    clip_threshold: float = 1.0
    """The normalised update is scaled down until its RMS is at most this."""
    block_size: int = 2048
    """came8bit: at most this many elements per quantization block of the 8-bit first moment (one fp32 min and
    scale each); each matrix row is cut into equal blocks, so the layout is the same on any number of ranks."""
    min_8bit_size: int = 16384
    """came8bit: matrices of this many elements or more keep their first moment in 8 bits (SANA-1.5: 16K or more);
    smaller stay fp32."""

    def __post_init__(self) -> None:
        if len(self.eps) != 2 or min(self.eps) < 0:
            raise ValueError(f"optimizer.settings.eps={list(self.eps)}: expected 2 values >= 0, e.g. [1e-30,1e-16]")
        if self.clip_threshold <= 0:
            raise ValueError(f"optimizer.settings.clip_threshold={self.clip_threshold} must be > 0 (CAME's default is 1.0)")
        if self.block_size <= 0:
            raise ValueError(f"optimizer.settings.block_size={self.block_size} must be > 0 (SANA-1.5 uses 2048)")
        if self.min_8bit_size < 0:
            raise ValueError(f"optimizer.settings.min_8bit_size={self.min_8bit_size} must be >= 0")


def build_came(params: Iterable, cfg: OptimizerConfig, quantize: bool = False) -> CAME:
    """CAME from the `optimizer` config group (came8bit: quantize=True)."""
    s: CameSettings = cfg.settings
    return CAME(
        params, lr=cfg.lr, betas=tuple(cfg.betas), eps=tuple(s.eps), clip_threshold=s.clip_threshold,
        weight_decay=cfg.weight_decay, quantize=quantize, block_size=s.block_size, min_8bit_size=s.min_8bit_size,
    )


def check_came_betas(cfg: OptimizerConfig) -> None:
    """CAME reads three betas from the shared field."""
    if len(cfg.betas) != 3 or not all(0.0 <= b < 1.0 for b in cfg.betas):
        raise ValueError(
            f"optimizer.betas={list(cfg.betas)}: {cfg.name} needs 3 rates in [0, 1) for the update, the squared"
            f" gradient and the instability, e.g. optimizer.betas=[0.9,0.999,0.9999]"
        )


def came_state_bytes(shape: tuple[int, ...], settings: CameSettings, quantize: bool) -> int:
    """The bytes of CAME's state for one parameter of this shape: what state_shapes allocates."""
    layout = state_shapes(shape, quantize=quantize, block_size=settings.block_size, min_8bit_size=settings.min_8bit_size)
    return sum(math.prod(dims) * dtype.itemsize for dims, dtype, _ in layout.values())


OPTIMIZERS["came"] = build_came
OPTIMIZERS["came8bit"] = lambda params, cfg: build_came(params, cfg, quantize=True)
OPTIMIZER_CHECKS["came"] = OPTIMIZER_CHECKS["came8bit"] = check_came_betas
OPTIMIZER_SETTINGS["came"] = OPTIMIZER_SETTINGS["came8bit"] = CameSettings
OPTIMIZER_STATE["came"] = lambda shape, settings: came_state_bytes(shape, settings, quantize=False)
OPTIMIZER_STATE["came8bit"] = lambda shape, settings: came_state_bytes(shape, settings, quantize=True)
