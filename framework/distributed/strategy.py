"""How the model is spread over devices: `strategy=single|ddp|fsdp`.

single is Lightning's own strategy; ddp is Lightning's DDPStrategy and fsdp its ModelParallelStrategy, each
building the job's one mesh (framework/distributed/mesh.py: replicate x shard x sequence) in place of
Lightning's when the processes exist. fsdp is FSDP2 (`fully_shard`) applied in
DiffusionModule.configure_model on that mesh's FSDP dims (every rank of every node): each backbone block
is one FSDP unit, then the root (the units, the sharding and the meta-device build are in
framework/distributed/fsdp.py). Sequence parallelism takes its groups from the same mesh.

    SHARD_GRAD_OP  reshard_after_forward=False: a block's parameters stay gathered from its forward
                   to its backward (no second all-gather); gradients and optimizer state are sharded.
    FULL_SHARD     reshard_after_forward=True: parameters are freed after each block's forward and
                   gathered again in backward (one more all-gather per block, lowest memory).
    HYBRID_SHARD   FULL_SHARD within each node, replicated across nodes (a 2-D replicate x shard mesh,
                   HSDP): all-gathers and reduce-scatters stay inside a node, gradients are then all-reduced
                   across nodes; each node holds one whole copy of the sharded state.

Lightning writes a sharded (torch.distributed.checkpoint) folder; the gap it leaves is atomicity:
AtomicModelParallelStrategy writes the folder under a temporary name and swaps it in, so a job
killed mid-save keeps its last good checkpoint. What each rank holds is measured by
`python -m framework.bench memory` (framework/bench/suite_memory.py).
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Generator

import torch
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, ParallelStrategy, Strategy

from framework.distributed.config import StrategyConfig
from framework.distributed.fsdp import fsdp_param_dtype
from framework.distributed.mesh import Mesh, ParallelDims

# --------------------------------------------------------------------------------------------
# Lightning strategies
# --------------------------------------------------------------------------------------------


class ShardedSaver:
    """Writes a sharded checkpoint (a torch.distributed.checkpoint folder + meta.pt) under `<name>.tmp` and
    swaps it in, so a job killed mid-save keeps its last good checkpoint.

    async_save="process" (strategy.async_save=true): DCP's process-based async save. Each rank's shards are copied
    in a background thread into shared host memory (pinned, on a GPU, for fast device-to-host copies) while the next
    step's forward and backward run; `wait_staged()` holds the optimizer step until that copy is done, so the step
    never changes what is being saved. A process of its own per rank (started with the run by FSDPStrategy.setup,
    framework/distributed/writer.py, with its own gloo group) then writes the files, off the training process's
    interpreter. "thread": the older thread-based
    async_save, staging into ordinary memory before it returns (kept for `framework.bench checkpoint`'s comparison).
    The swap happens when the write is done, at the next save (each save waits for the previous one) or at
    `finish()`; removals of older checkpoints asked for meanwhile wait for that swap too: until then the previous
    one is the newest complete checkpoint on disk. Torch's async checkpointing fills the gap; the staging wait, the
    swap and the ordering are ours.
    """

    MODES = (None, "thread", "process")

    def __init__(self, rank: int, barrier: Any, async_save: str | None = None) -> None:
        if async_save not in self.MODES:
            raise ValueError(f"async_save={async_save!r}: expected one of {self.MODES}")
        self.rank, self.barrier, self.async_save = rank, barrier, async_save
        self._pending: tuple[Any, Path, Path, Path] | None = None  # (future or None, tmp, path, old)
        self._staging: Any = None  # the copy of the save in flight to host memory (process mode)
        self._stager: Any = None
        self._prestaged = False
        self._removals: list[Path] = []
        self._group: Any = None

    def save(self, state: dict[str, Any], meta: dict[str, Any], path: Path) -> None:
        """`state`: {"state_dict": ..., "optimizer_0": ...} of (D)Tensors; `meta`: the rest (meta.pt, rank 0)."""
        import torch.distributed.checkpoint as dcp
        from lightning.fabric.utilities.load import _METADATA_FILENAME

        self.finish()
        tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
        if self.rank == 0:
            _remove_entry(tmp)
            tmp.mkdir(parents=True)
            torch.save(meta, tmp / _METADATA_FILENAME)
        self.barrier()
        if self.async_save is None:
            dcp.save(state, checkpoint_id=str(tmp))
            self._pending = (None, tmp, path, old)
            self.finish()
            return
        if self.async_save == "thread":
            self._pending = (dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group), tmp, path, old)
            return
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.start_writer()
        response = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group,
                                  async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=self.stager)
        self._staging = response.staging_completion
        self._pending = (response.upload_completion, tmp, path, old)

    @property
    def group(self) -> Any:
        """The background write's gloo group, apart from training's collectives (created on first use: collective)."""
        if self._group is None:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")
        return self._group

    def start_writer(self) -> None:
        """Start this rank's writing process now (collective; framework/distributed/writer.py), rather than in the
        background at the first save."""
        from framework.distributed.writer import start_writer

        start_writer(self.group)

    @property
    def stager(self) -> Any:
        """Stages into shared memory (handed to the writing process without a copy), pinned on a GPU; reused by
        every save of the run, so the host buffers are allocated once."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            gpu = torch.cuda.is_available()
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=True,
                                                        use_async_staging=True, use_non_blocking_copy=gpu))
        return self._stager

    def prestage(self, state: Callable[[], dict[str, Any]]) -> None:
        """Process mode, the first call only: copy `state()` into the staging buffers now, in the background, so that
        the run's first save finds them allocated. Allocating them (shared memory, pinned on a GPU) is most of a first
        save's staging, and it was waited for in the step after that save where a step is too short to hide it. Called
        after each optimizer step (the first has created the optimizer's state); the next optimizer step waits for the
        copy, as after a save. Later saves copy into the same buffers (the stager keeps them per source tensor)."""
        if self.async_save != "process" or self._prestaged:
            return
        self._prestaged = True
        self._staging = self.stager.stage(state())

    def wait_staged(self) -> None:
        """Block until the save in flight holds its own copy of the state: before anything changes the weights."""
        if self._staging is not None:
            self._staging.result()
            self._staging = None

    def remove(self, path: Path) -> bool:
        """Delete an older checkpoint after the save in flight is swapped in; False: none is, the caller deletes."""
        if self._pending is None:
            return False
        self._removals.append(Path(path))
        return True

    def finish(self) -> None:
        """Wait for the save in flight (if any), swap it in on rank 0, then do the removals it held back."""
        self.wait_staged()
        if self._pending is None:
            return
        future, tmp, path, old = self._pending
        self._pending = None
        if future is not None:
            future.result()
        self.barrier()
        if self.rank == 0:
            swap_in(tmp, path, old)
            for stale in self._removals:
                _remove_entry(stale)
        self._removals = []
        self.barrier()

    def close(self) -> None:
        """finish(), then free the staging buffers."""
        self.finish()
        if self._stager is not None:
            self._stager.close()
            self._stager = None


def _job_mesh(strategy: ParallelStrategy, sequence: int, hybrid: bool = False) -> Mesh:
    """The job's mesh over the strategy's processes (num_nodes x num_processes ranks)."""
    dims = ParallelDims.of(strategy.world_size, strategy.num_processes, sequence, hybrid)
    return dims.build(strategy.root_device.type)


class MeshDDPStrategy(DDPStrategy):
    """Lightning's DDP (frozen parameters skipped by the reducer, so no unused-parameter search) that also
    builds the job's mesh for sequence parallelism. Buffers are not broadcast before each forward: a diffusion
    transformer's buffers (position tables, rotary frequencies) are made alike on every rank and never change, and the
    broadcast would be a collective at every forward's start, making each rank wait there for the slowest (as FSDP2,
    which never broadcasts buffers)."""

    def __init__(self, sequence_parallel: int = 1, timeout_s: int = 1800) -> None:
        super().__init__(find_unused_parameters=False, broadcast_buffers=False, timeout=timedelta(seconds=timeout_s))
        self.sequence_parallel = sequence_parallel
        self.mesh: Mesh | None = None

    def setup_environment(self) -> None:
        super().setup_environment()
        self.mesh = _job_mesh(self, self.sequence_parallel)


class FSDPStrategy(ModelParallelStrategy):
    """ModelParallelStrategy on the job's mesh (data parallel x sequence), with swap-in-place sharded checkpoints.

    `param_dtype`: what FSDP2 casts parameters to in forward/backward (fsdp_param_dtype).
    `async_save`: sharded checkpoints written in the background (ShardedSaver).
    """

    def __init__(self, sharding: str, param_dtype: torch.dtype | None, sharded_checkpoint: bool = True,
                 async_save: bool = False, sequence_parallel: int = 1, timeout_s: int = 1800) -> None:
        super().__init__(save_distributed_checkpoint=sharded_checkpoint, timeout=timedelta(seconds=timeout_s))
        self.sharding, self.param_dtype = sharding, param_dtype
        self.async_save = async_save
        self.sequence_parallel = sequence_parallel
        self.mesh: Mesh | None = None
        self._saver: ShardedSaver | None = None

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No gradient reduce-scatter on the micro-batches that only accumulate.

        Lightning calls this around every non-final micro-batch of `accumulate_grad_batches`, but its
        own version only knows DDP's no_sync; FSDP2's switch is set_requires_gradient_sync. Gradients
        then accumulate unsharded and are reduce-scattered once, in the last micro-batch's backward.
        """
        from torch.distributed.fsdp import FSDPModule

        roots = [m for m in self.lightning_module.modules() if isinstance(m, FSDPModule)]
        for m in roots:
            m.set_requires_gradient_sync(False, recurse=False)
        try:
            yield None
        finally:
            for m in roots:
                m.set_requires_gradient_sync(True, recurse=False)

    def setup_environment(self) -> None:
        # ModelParallelStrategy's own would build a (data_parallel, tensor_parallel) mesh: the job's mesh instead.
        ParallelStrategy.setup_environment(self)
        self._setup_distributed()
        self.mesh = _job_mesh(self, self.sequence_parallel, hybrid=self.sharding == "HYBRID_SHARD")
        self._device_mesh = self.mesh.device_mesh
        self.lightning_module._device_mesh = self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """A sampler's split (Streaming's datasets take theirs from the environment): by data-parallel rank."""
        assert self.mesh is not None
        return {"num_replicas": self.mesh.dims.data_parallel, "rank": self.mesh.data_parallel_rank}

    @property
    def saver(self) -> ShardedSaver:
        if self._saver is None:
            self._saver = ShardedSaver(self.global_rank, self.barrier, "process" if self.async_save else None)
        return self._saver

    # A sharded save takes each rank's shards where they are, on their device: DCP's writer, or the async stager in its
    # thread (into pinned shared memory), copies them to host memory itself. Lightning asks for cpu_offload=True,
    # which first copies every shard into pageable host memory in the training thread: a synchronous device-to-host
    # copy of the whole state at every save, async ones included (a no-op on a CPU, where no bench could see it).
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self._save_distributed_checkpoint:
            return super().lightning_module_state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(cpu_offload=False))

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if not self._save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        optimizer = getattr(optimizer, "_optimizer", optimizer)  # (a LightningOptimizer wraps it)
        return get_optimizer_state_dict(self.model, optimizer, options=StateDictOptions(cpu_offload=False))

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        # Write <name>.tmp, then swap: the last good folder survives a kill at any moment
        # (during the swap it is <name>.old, which find_resumable also accepts).
        path = Path(self.broadcast(str(filepath)))
        state = {"state_dict": checkpoint.pop("state_dict")}  # Lightning's layout of a sharded checkpoint
        state.update({f"optimizer_{i}": o for i, o in enumerate(checkpoint.pop("optimizer_states", []))})
        self.saver.save(state, checkpoint, path)

    def remove_checkpoint(self, filepath: Any) -> None:
        if not self.saver.remove(Path(filepath)):
            super().remove_checkpoint(filepath)

    def finish_saves(self) -> None:
        """Block until every checkpoint asked for is complete on disk (the end of training, a preemption)."""
        if self._saver is not None:
            self._saver.finish()

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if self.async_save and self._save_distributed_checkpoint:
            self.saver.start_writer()  # its start-up overlaps nothing here, rather than the first saves

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        # The closure runs this step's forward and backward, which only read the weights: an asynchronous save's copy
        # to host memory overlaps them, and the update waits for it.
        def closure_then_wait() -> Any:
            result = closure()
            if self._saver is not None:
                self._saver.wait_staged()
            return result

        result = super().optimizer_step(optimizer, closure_then_wait, model, **kwargs)
        if self.async_save and self._save_distributed_checkpoint:  # (the state dicts are built once, at the first)
            self.saver.prestage(lambda: {"state_dict": self.lightning_module_state_dict(),
                                         "optimizer_0": self.optimizer_state(optimizer)})
        return result

    def teardown(self) -> None:
        if self._saver is not None:
            self._saver.close()
        super().teardown()


def swap_in(tmp: Path, path: Path, old: Path) -> None:
    """Replace `path` (a file, folder or link) by `tmp`, keeping the previous one as `old` until done."""
    _remove_entry(old)
    if path.exists() or path.is_symlink():
        path.rename(old)
    tmp.rename(path)
    _remove_entry(old)


def _remove_entry(path: Path) -> None:
    """Delete a file, a folder, or a link (never what a link points to: last.ckpt links a numbered checkpoint)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def build_strategy(cfg: StrategyConfig, precision: str) -> Strategy | str:
    """The Lightning strategy for `strategy.name` at the run's resolved `precision`."""
    if cfg.name == "single":
        return "auto"
    if cfg.name == "ddp":
        return MeshDDPStrategy(cfg.sequence_parallel, cfg.timeout_s)
    return FSDPStrategy(cfg.sharding, fsdp_param_dtype(precision, cfg.mixed_precision),
                        sharded_checkpoint=cfg.sharded_checkpoint, async_save=cfg.async_save,
                        sequence_parallel=cfg.sequence_parallel, timeout_s=cfg.timeout_s)


def tasks_per_node() -> int:
    """srun's tasks on this node (SLURM_NTASKS_PER_NODE, e.g. `8` or `8(x2)`); 1 outside Slurm."""
    return int(os.environ.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0])


class TaskGPUAccelerator(CUDAAccelerator):
    """CUDA on Slurm sites that bind one GPU to each task (`--gpus-per-task=1`, `--gpu-bind=single:1`).

    Each task of the node then sees one device, cuda:0. Lightning, given trainer.devices=<tasks per node> as
    launch/train.sbatch passes it, would refuse the count (one GPU visible) and then put local rank k on cuda:k; here
    every local rank takes the one device it sees, while the ranks, the node's task count and Streaming's local ranks
    stay Slurm's. framework.train picks it (lightning_accelerator)."""

    @staticmethod
    def parse_devices(devices: Any) -> list[int]:
        if isinstance(devices, (list, tuple)):
            return list(devices)
        count = tasks_per_node() if str(devices) in ("auto", "-1") else int(devices)
        return list(range(count))

    @staticmethod
    def get_parallel_devices(devices: list[int]) -> list[torch.device]:
        return [torch.device("cuda", 0) for _ in devices]

    @staticmethod
    def auto_device_count() -> int:
        return tasks_per_node()
