"""One rank of the 2-process CAME test: FSDP2 (fully_shard, gloo, CPU) training and checkpoint resume.

Started by tests/test_came.py with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set; writes
`rank<r>.pt` into OUT_DIR. For each variant (came, came8bit) it trains STEPS steps, saves a DCP
(sharded) checkpoint and a single-file full checkpoint, trains STEPS more, then resumes two fresh
sharded copies from the two checkpoints and trains them STEPS steps: all three must end equal.
The test compares the first STEPS steps with one process on the same global batch.

    python tests/came_fsdp_worker.py OUT_DIR
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plugins.came import CAME  # noqa: E402

STEPS = 4
GLOBAL_BATCH = 8
# Tiny sizes make quantization and uneven shards happen: 33 rows split 17/16, 1 row split 1/0.
OPT_KW = dict(lr=1e-2, weight_decay=0.1, block_size=64, min_8bit_size=0)

# --------------------------------------------------------------------------------------------
# Shared with the single-process reference in the test
# --------------------------------------------------------------------------------------------


def build_model() -> nn.Sequential:
    """Linear 16->33 (528 weights), 1x1 conv 33->40, linear 40->1: uneven and empty shards on 2 ranks."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 33), nn.Tanh(), nn.Unflatten(1, (33, 1, 1)), nn.Conv2d(33, 40, 1), nn.Tanh(),
        nn.Flatten(), nn.Linear(40, 1),
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: x (GLOBAL_BATCH, 16), y (GLOBAL_BATCH, 1)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 16, generator=g)
    return x, x[:, :1].sin() + 0.1 * torch.randn(GLOBAL_BATCH, 1, generator=g)


def train_steps(
    model: nn.Module, opt: torch.optim.Optimizer, start: int, n: int, rank: int = 0, world: int = 1
) -> None:
    """n optimizer steps; each rank takes its slice of the global batch (FSDP averages the gradients)."""
    per = GLOBAL_BATCH // world
    for step in range(start, start + n):
        x, y = batch(step)
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


# --------------------------------------------------------------------------------------------
# The distributed run
# --------------------------------------------------------------------------------------------


def _sharded(quantize: bool) -> tuple[nn.Module, CAME]:
    from torch.distributed.fsdp import fully_shard

    model = build_model()
    for layer in (model[0], model[3], model[6]):
        fully_shard(layer)
    fully_shard(model)
    return model, CAME(model.parameters(), quantize=quantize, **OPT_KW)


def _check_state(opt: CAME, quantize: bool) -> None:
    """After a resume the state must still be sharded DTensors / plain tensors of the saved dtypes."""
    from torch.distributed.tensor import DTensor

    for state in opt.state.values():
        for k, v in state.items():
            assert v.dtype == (torch.uint8 if k == "exp_avg_q" else torch.float32), (k, v.dtype)
            assert isinstance(v, DTensor) == (not k.endswith("_col")), k
        assert ("exp_avg_q" in state) == (quantize and "exp_avg_sq_row" in state)


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().detach().clone() for k, v in model.named_parameters()}


def run_variant(out: Path, quantize: bool, rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
        set_optimizer_state_dict,
    )

    tag = "came8bit" if quantize else "came"
    model, opt = _sharded(quantize)
    train_steps(model, opt, 0, STEPS, rank, world)
    first = _full_params(model)
    # Sharded (DCP) checkpoint, then a single-file full one gathered on rank 0.
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=str(out / f"dcp_{tag}"))
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd = {"model": get_model_state_dict(model, options=full),
          "optim": get_optimizer_state_dict(model, opt, options=full)}
    if rank == 0:
        torch.save(sd, out / f"full_{tag}.pt")
    dist.barrier()
    train_steps(model, opt, STEPS, STEPS, rank, world)
    result = {"first": first, "continuous": _full_params(model)}

    # Resume from the DCP checkpoint into a fresh sharded copy.
    model_b, opt_b = _sharded(quantize)
    state = {"model": get_model_state_dict(model_b), "optim": get_optimizer_state_dict(model_b, opt_b)}
    dcp.load(state, checkpoint_id=str(out / f"dcp_{tag}"))
    set_model_state_dict(model_b, state["model"])
    set_optimizer_state_dict(model_b, opt_b, state["optim"])
    _check_state(opt_b, quantize)
    train_steps(model_b, opt_b, STEPS, STEPS, rank, world)
    result["dcp"] = _full_params(model_b)

    # Resume from the single file: every rank reads it and keeps its own shard.
    model_c, opt_c = _sharded(quantize)
    sd = torch.load(out / f"full_{tag}.pt", weights_only=False)
    load = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model_c, sd["model"], options=load)
    set_optimizer_state_dict(model_c, opt_c, sd["optim"], options=load)
    _check_state(opt_c, quantize)
    train_steps(model_c, opt_c, STEPS, STEPS, rank, world)
    result["full"] = _full_params(model_c)
    return result


def main() -> None:
    import torch.distributed as dist

    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {tag: run_variant(out, q, rank, world) for tag, q in (("came", False), ("came8bit", True))}
    torch.save(results, out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
