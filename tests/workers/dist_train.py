"""`python -m tests.workers.dist_train [train overrides]`: framework.train plus a probe callback, for 2-process tests.

Lightning's launcher re-runs this same command for the other ranks, so every rank gets the probe.
Each rank writes run.dir/probe_rank<r>.json: the sample keys of each step's batch and, after the
last step, every parameter's type (DTensor or not), local/global shape, whether it trains, has a
gradient and has optimizer state; the dtypes the first linear layer's weight had in its forward calls and
the dtypes of the stored (master) parameters. PROBE_FREEZE=<prefix> freezes the parameters whose name starts
with it before the model is sharded (a stage that trains only some parameters). It also records,
per micro-batch, how many gradient reduce-scatters its backward ran, per optimizer step whether
it was skipped (gradients dropped after a non-finite loss on some rank) and whether an asynchronous save's
copy to host memory was still in flight at it;
PROBE_POISON=<rank>:<micro-batch> puts a NaN into that rank's micro-batch (a bad sample on one rank).
PROBE_SLOW=<rank>:<seconds> makes that rank's loader sleep in the collation of each batch (a slow loader).
PROBE_BUSY=<rank>:<seconds> makes that rank sleep at the start of each step (a slow device).
PROBE_STALL=<rank>:<step> stalls that rank at the start of that step (it sleeps ten minutes).
PROBE_PAUSE_AT=<step> holds each rank after that optimizer step (writing run.dir/paused_rank<r>)
until run.dir/go exists, so a test can deliver a signal at a known step boundary. A run that starts at
step 0 writes the weights it starts from to run.dir/init_weights.pt (whole tensors, from rank 0), so tests
compare what training changed: the update w - w_init.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl

from framework import train as train_lib
from framework.training.callbacks import SampleGrid


class Probe(pl.Callback):
    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.keys = run_dir, {}
        self.micro, self.reduce_scatters, self.skipped, self.staging_at_step = 0, [], [], []
        self.offloads: list[bool] = []  # per state dict taken for a save: copied to host memory first?
        self._rs_calls = 0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        import torch.distributed as dist

        slow = os.environ.get("PROBE_SLOW")
        if slow and int(slow.split(":")[0]) == trainer.global_rank:  # this rank's loader takes longer per batch
            from framework.data import datamodule

            collate = datamodule.LatentCollate.__call__
            datamodule.LatentCollate.__call__ = lambda *a, **k: time.sleep(float(slow.split(":")[1])) or collate(*a, **k)
        prefix = os.environ.get("PROBE_FREEZE")
        if prefix:
            for name, p in pl_module.model.named_parameters():
                if name.startswith(prefix):
                    p.requires_grad_(False)
        # FSDP2 reduce-scatters gradients through dist.reduce_scatter_single: count the calls.
        original = dist.reduce_scatter_single

        def counted(*args: Any, **kwargs: Any) -> Any:
            self._rs_calls += 1
            return original(*args, **kwargs)

        dist.reduce_scatter_single = counted
        # Whether the state dicts taken for a save asked torch to copy every tensor to host memory first (on a GPU a
        # synchronous device-to-host copy in the training thread; on a CPU a no-op, so it is read off the request).
        from torch.distributed.checkpoint import state_dict as sd

        for fn in ("get_model_state_dict", "get_optimizer_state_dict"):
            original_fn = getattr(sd, fn)

            def recorded(*args: Any, _fn: Any = original_fn, **kwargs: Any) -> Any:
                options = kwargs.get("options")
                self.offloads.append(bool(options is not None and options.cpu_offload))
                return _fn(*args, **kwargs)

            setattr(sd, fn, recorded)
        # the micro-batches that ran the logging step's arrival barrier
        from framework.training import figures

        barrier, self.arrivals = figures.arrival_wait_ms, []
        figures.arrival_wait_ms = lambda *a, **k: self.arrivals.append(self.micro) or barrier(*a, **k)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        import torch

        from framework.distributed.dtensor import full_tensor

        # The dtype a block's linear layer computes with (FSDP2 swaps in the gathered parameters for forward).
        linear = next(m for m in pl_module.model.modules() if isinstance(m, torch.nn.Linear))
        self.forward_dtypes: set[str] = set()
        linear.register_forward_hook(lambda mod, *_: self.forward_dtypes.add(str(mod.weight.dtype)))
        # The job's one mesh: what FSDP2's parameters and the sequence-parallel group were built on.
        from framework.distributed.sequence import group_of

        mesh = getattr(trainer.strategy, "mesh", None)
        param = next(pl_module.model.parameters())
        sp = group_of(pl_module.model)
        self.mesh = None if mesh is None else {
            "dims": [mesh.dims.replicate, mesh.dims.shard, mesh.dims.sequence],
            "param_mesh": list(param.device_mesh.mesh_dim_names) if hasattr(param, "device_mesh") else None,
            "param_mesh_from_job_mesh": hasattr(param, "device_mesh")
            and param.device_mesh._get_root_mesh() is mesh.device_mesh,
            "sequence_group_from_job_mesh": sp is not None and sp.group is mesh.sequence_group()[0],
            "data_parallel": [sp.dp_rank, sp.dp_size] if sp is not None else None,
            "ring": [sp.ring, sp.ring_rank, mesh.dims.ring] if sp is not None else None,
        }
        if trainer.global_step != 0:  # a resumed run: its start is not the run's
            return
        saved = {k[len("model."):] for k in pl_module.state_dict()}  # what checkpoints hold (an adapter run: the adapter)
        init = {n: full_tensor(p.detach()).clone() for n, p in pl_module.model.named_parameters() if n in saved}
        if trainer.global_rank == 0:
            torch.save(init, self.run_dir / "init_weights.pt")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *_: Any) -> None:
        self.keys[trainer.global_step] = list(batch["key"])
        self._rs_in_backward = 0
        busy = os.environ.get("PROBE_BUSY")
        if busy and int(busy.split(":")[0]) == trainer.global_rank:
            time.sleep(float(busy.split(":")[1]))  # inside the step, before its forward: a slow device
        stall = os.environ.get("PROBE_STALL")
        if stall and tuple(map(int, stall.split(":"))) == (trainer.global_rank, trainer.global_step):
            time.sleep(600)  # a rank stalled (a dead GPU, a stuck file system) while the others go on
        poison = os.environ.get("PROBE_POISON")
        if poison and tuple(map(int, poison.split(":"))) == (trainer.global_rank, self.micro):
            batch["latents"][0, 0, 0, 0] = float("nan")

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        self._rs_before = self._rs_calls

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._rs_in_backward = self._rs_calls - self._rs_before

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *_: Any) -> None:
        self.skipped.append(pl_module.step_skipped)  # whether the module dropped this step's gradients
        self.reduce_scatters.append(self._rs_in_backward)
        self.micro += 1
        if os.environ.get("PROBE_PAUSE_AT") != str(trainer.global_step):
            return
        (self.run_dir / f"paused_rank{trainer.global_rank}").touch()
        deadline = time.time() + 120
        while not (self.run_dir / "go").exists() and time.time() < deadline:
            time.sleep(0.05)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        # After backward (parameters resharded, gradients present), before the step; state from earlier steps.
        from torch.distributed.tensor import DTensor

        state = optimizer.state
        # An asynchronous save's copy to host memory still in flight when the weights are about to change?
        saver = getattr(trainer.strategy, "_saver", None)
        self.staging_at_step.append(getattr(saver, "_staging", None) is not None)
        self.params = {
            name: {"dtensor": isinstance(p, DTensor),
                   "local_shape": list(p.to_local().shape if isinstance(p, DTensor) else p.shape),
                   "shape": list(p.shape), "trains": p.requires_grad, "grad": p.grad is not None,
                   "optimizer_state": bool(state.get(p))}
            for name, p in pl_module.model.named_parameters()
        }

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        out = {"world_size": trainer.world_size, "mesh": self.mesh, "keys": self.keys, "params": getattr(self, "params", {}),
               "reduce_scatters": self.reduce_scatters, "skipped": self.skipped, "staging_at_step": self.staging_at_step,
               "offloads": self.offloads,
               "arrivals": self.arrivals,
               "forward_dtypes": sorted(self.forward_dtypes),
               # whether this rank's grid pipeline loaded the image codec (the final grid ran just before this)
               "grid_codec_loaded": next(cb for cb in trainer.callbacks if isinstance(cb, SampleGrid))._pipe._codec is not None,
               "master_dtypes": sorted({str(p.dtype) for p in pl_module.model.parameters()})}
        (self.run_dir / f"probe_rank{trainer.global_rank}.json").write_text(json.dumps(out))


def main_with_probe(probe: Callable[[Path], pl.Callback]) -> None:
    """Run framework.train's Hydra app with `probe(run_dir)` added to the callbacks."""
    import hydra

    base = train_lib.build_callbacks

    def build_callbacks(cfg: Any, run_dir: Path) -> list[pl.Callback]:
        return [*base(cfg, run_dir), probe(run_dir)]

    train_lib.build_callbacks = build_callbacks
    # framework.train's config_path is relative to its own file; from this module give it absolutely.
    conf = str(Path(__file__).resolve().parents[2] / "conf")
    hydra.main(version_base="1.3", config_path=conf, config_name="config")(train_lib.main.__wrapped__)()


if __name__ == "__main__":
    main_with_probe(Probe)
