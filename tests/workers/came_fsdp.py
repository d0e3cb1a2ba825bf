"""One rank of the multi-process CAME tests: FSDP2 (fully_shard, gloo, CPU) training and checkpoint resume.

Started by tests/test_came.py with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set; runs each
TASK and writes the results as `NAME_rank<r>.pt` into OUT_DIR.

- `came`, `came8bit`: train STEPS steps, save a DCP (sharded) checkpoint and a single-file full
  checkpoint, train STEPS more, then resume two fresh sharded copies from the two checkpoints and
  train them STEPS steps: all three must end equal. The test compares the first STEPS steps with
  one process on the same global batch.
- `save`: CAME-8bit on a model whose rows do not split evenly: train STEPS steps, save a DCP
  checkpoint `reshard_w<WORLD_SIZE>`, train STEPS more (the uninterrupted run).
- `load:W`: resume that model from the checkpoint saved on W ranks and train STEPS steps.

    python tests/workers/came_fsdp.py OUT_DIR NAME TASK [TASK ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from framework.distributed.env import leave  # noqa: E402
from plugins.came import CAME, is_8bit  # noqa: E402

STEPS = 4
GLOBAL_BATCH = 8
# Tiny sizes make quantization and uneven shards happen: 33 rows split 17/16, 1 row split 1/0.
OPT_KW = dict(lr=1e-2, weight_decay=0.1, block_size=64, min_8bit_size=0)
# For the resume on another world size: several blocks per row, a padded row tail, one fp32 matrix.
RESHARD_KW = dict(lr=1e-2, weight_decay=0.1, block_size=10, min_8bit_size=64)

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


def build_reshard_model() -> nn.Sequential:
    """Linear 16->13 and 13->7 (8-bit; rows split 7/6 and 4/3 on 2 ranks), linear 7->1 (fp32 state).

    With RESHARD_KW a 16-wide row is 2 blocks of 8, a 13-wide row 2 blocks of 7 (one padded code).
    """
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 13), nn.Tanh(), nn.Linear(13, 7), nn.Tanh(), nn.Linear(7, 1))


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


def _sharded(quantize: bool, reshard: bool = False) -> tuple[nn.Module, CAME]:
    from torch.distributed.fsdp import fully_shard

    model = build_reshard_model() if reshard else build_model()
    for layer in model:
        if list(layer.parameters()):  # the linear and conv layers
            fully_shard(layer)
    fully_shard(model)
    return model, CAME(model.parameters(), quantize=quantize, **(RESHARD_KW if reshard else OPT_KW))


def _check_state(opt: CAME, quantize: bool) -> None:
    """After a resume the state must still be sharded DTensors / plain tensors of the saved dtypes."""
    from torch.distributed.tensor import DTensor

    min_8bit_size = opt.param_groups[0]["min_8bit_size"]
    for p, state in opt.state.items():
        for k, v in state.items():
            assert v.dtype == (torch.uint8 if k == "exp_avg_q" else torch.float32), (k, v.dtype)
            assert isinstance(v, DTensor) == (not k.endswith("_col")), k
        assert ("exp_avg_q" in state) == (quantize and is_8bit(p.shape, min_8bit_size))


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().detach().clone() for k, v in model.named_parameters()}


def _full_state(model: nn.Module, opt: CAME) -> dict[str, torch.Tensor]:
    """Every optimizer state tensor as the global tensor, keyed `param_name.state_name`."""
    from torch.distributed.tensor import DTensor

    return {f"{name}.{k}": (v.full_tensor() if isinstance(v, DTensor) else v).clone()
            for name, p in model.named_parameters() for k, v in opt.state[p].items() if torch.is_tensor(v)}


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


# --------------------------------------------------------------------------------------------
# CAME-8bit saved on one world size, resumed on another
# --------------------------------------------------------------------------------------------


def _dcp_state(model: nn.Module, opt: CAME) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def save_reshard(out: Path, rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    import torch.distributed.checkpoint as dcp

    model, opt = _sharded(quantize=True, reshard=True)
    train_steps(model, opt, 0, STEPS, rank, world)
    dcp.save(_dcp_state(model, opt), checkpoint_id=str(out / f"reshard_w{world}"))
    saved = _full_state(model, opt)
    train_steps(model, opt, STEPS, STEPS, rank, world)
    return {"saved_state": saved, "continuous": _full_params(model)}


def load_reshard(out: Path, saved_world: int, rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    model, opt = _sharded(quantize=True, reshard=True)
    state = _dcp_state(model, opt)
    dcp.load(state, checkpoint_id=str(out / f"reshard_w{saved_world}"))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    _check_state(opt, quantize=True)
    loaded = _full_state(model, opt)
    train_steps(model, opt, STEPS, STEPS, rank, world)
    return {"loaded_state": loaded, "resumed": _full_params(model)}


def run_task(task: str, out: Path, rank: int, world: int) -> dict:
    if task in ("came", "came8bit"):
        return run_variant(out, task == "came8bit", rank, world)
    if task == "save":
        return save_reshard(out, rank, world)
    if task.startswith("load:"):
        return load_reshard(out, int(task.removeprefix("load:")), rank, world)
    raise ValueError(f"unknown task {task!r}: expected came, came8bit, save or load:W")


def main() -> None:
    import torch.distributed as dist

    out, name, tasks = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {task: run_task(task, out, rank, world) for task in tasks}
    torch.save(results, out / f"{name}_rank{rank}.pt")
    leave()  # not destroy_process_group alone: see framework/distributed/env.py


if __name__ == "__main__":
    main()
