"""The job's one device mesh: data-parallel replicate x shard, then the sequence-parallel group.

    dim        size                                   what runs over it
    replicate  1 (the node count under hybrid          FSDP2 replicates the shards across it (HSDP)
               sharding)
    shard      the remaining data-parallel ranks       FSDP2 shards parameters over shard x ring x ulysses
    ring       1, or P / G when a sequence group      ring attention across the nodes of one sequence group
               spans P / G whole nodes of G ranks      (framework/distributed/sequence.py `_RingAttention`)
    ulysses    P / ring                               the all-to-all attention of one sequence group (within
                                                      one node)

P = strategy.sequence_parallel. Ranks are laid out row-major, ulysses innermost: a sequence group is P
consecutive ranks, so on a node of G ranks (P dividing G) it never leaves the node; a P that is a multiple of G
takes P / G whole nodes, Ulysses within each and ring attention across them. A replicate slice is one node's
ranks. The P ranks of a sequence group hold the same samples. Two positions of a rank: `data_parallel_rank`, its index
over replicate x shard (for work split by rank order), and `stream_position`, where Streaming puts its
samples in the global batch (nodes innermost), which the training step's noise follows.

Built once per job from the strategy config (`ParallelDims.of(...).build(...)`): the Lightning
strategies build it in setup_environment (framework/distributed/strategy.py), the sampling commands
and benchmarks under torchrun with `job_mesh`; FSDP2 (`fsdp_mesh`) and sequence parallelism
(`sequence_mesh`, `sequence_group`) take their sub-meshes from it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

DIM_NAMES = ("replicate", "shard", "ring", "ulysses")


@dataclass(frozen=True)
class ParallelDims:
    """The sizes of the mesh dims; replicate x shard x sequence = the world size."""

    replicate: int
    shard: int
    sequence: int
    nodes: int = 1
    ring: int = 1
    # the nodes a sequence group spans (1: within one node)

    @classmethod
    def of(cls, world: int, ranks_per_node: int, sequence: int = 1, hybrid: bool = False) -> "ParallelDims":
        """The dims of a job of `world` ranks, `ranks_per_node` on each node; refuses sizes that do not fit.

        hybrid: replicate across nodes, shard within one (strategy.sharding=HYBRID_SHARD).
        """
        if world < 1 or ranks_per_node < 1 or world % ranks_per_node:
            raise ValueError(f"{world} ranks do not split into nodes of {ranks_per_node}")
        if sequence < 1 or world % sequence:
            raise ValueError(f"strategy.sequence_parallel={sequence} does not divide the {world} ranks of this job; "
                             f"use a device count that is a multiple of {sequence}")
        ring = 1
        if ranks_per_node % sequence:
            if sequence % ranks_per_node:
                raise ValueError(f"strategy.sequence_parallel={sequence} neither divides the {ranks_per_node} ranks of a "
                                 f"node nor is a multiple of them: a sequence group is part of one node (Ulysses) or "
                                 f"whole nodes (Ulysses within each, ring attention across them)")
            if hybrid:
                raise ValueError(f"strategy.sharding=HYBRID_SHARD replicates the shards across nodes, and "
                                 f"strategy.sequence_parallel={sequence} spans {sequence // ranks_per_node} nodes of "
                                 f"{ranks_per_node} ranks: use FULL_SHARD or SHARD_GRAD_OP")
            ring = sequence // ranks_per_node
        nodes = world // ranks_per_node
        replicate = nodes if hybrid else 1
        return cls(replicate, world // (replicate * sequence), sequence, nodes, ring)

    @property
    def world(self) -> int:
        return self.replicate * self.shard * self.sequence

    @property
    def data_parallel(self) -> int:
        """How many different sample slices the job trains on per step (sequence groups count once)."""
        return self.replicate * self.shard

    def stream_position(self, rank: int) -> int:
        """Where `rank`'s samples sit in Streaming's deal of a global batch: rows p, p + D, p + 2D, ... for
        D = data_parallel. Streaming orders its ranks nodes innermost, p = (index on the node) x nodes + node, which is
        not the rank on more than one node. With sequence groups (Streaming's `replication`) it deals to the groups as
        ranks of a world it builds itself (streaming.base.world.World.replicate): W / P ranks, on W / P / G nodes of G
        when G divides W / P, else on one node; a group's ranks share one position. The training step draws each
        sample's noise by its global row (framework.training.draws.StepDraws)."""
        per_node = self.world // self.nodes
        groups = self.world // self.sequence
        nodes = groups // per_node if groups % per_node == 0 else 1
        node, local = divmod(rank // self.sequence, groups // nodes)
        return local * nodes + node

    def build(self, device_type: str) -> "Mesh":
        """The DeviceMesh over the running process group (a collective: every rank calls it)."""
        from torch.distributed.device_mesh import init_device_mesh

        device_mesh = init_device_mesh(device_type, (self.replicate, self.shard, self.ring, self.sequence // self.ring),
                                       mesh_dim_names=DIM_NAMES)
        return Mesh(self, device_mesh)


@dataclass
class Mesh:
    """A job's ParallelDims and the DeviceMesh built from them, with the sub-meshes each user takes."""

    dims: ParallelDims
    device_mesh: Any  # torch.distributed.device_mesh.DeviceMesh with DIM_NAMES
    _fsdp: Any = field(default=None, repr=False)
    _sequence: Any = field(default=None, repr=False)

    @property
    def rank(self) -> int:
        return self.device_mesh.get_rank()

    @property
    def data_parallel_rank(self) -> int:
        """This rank's index over replicate x shard: its (and its group's) share of work split by rank order, such as
        prompts to generate or a sampler's slice. Not where its training samples sit: see stream_position."""
        return self.rank // self.dims.sequence

    @property
    def stream_position(self) -> int:
        """This rank's position in Streaming's deal of the global batch (ParallelDims.stream_position)."""
        return self.dims.stream_position(self.rank)

    def fsdp_mesh(self) -> Any:
        """What fully_shard takes: shard x ring x ulysses flattened into one dim, with replicate in front when the
        job replicates across nodes (2-D, HSDP); otherwise 1-D over every rank. Built on first use (a collective)."""
        if self._fsdp is None:
            if self.dims.replicate == 1:
                self._fsdp = self.device_mesh[DIM_NAMES]._flatten("fsdp")
            else:
                self.device_mesh[DIM_NAMES[1:]]._flatten("fsdp_shard")
                self._fsdp = self.device_mesh["replicate", "fsdp_shard"]
        return self._fsdp

    def sequence_mesh(self) -> Any:
        """ring x ulysses: the sequence group as diffusers' context-parallel config takes it."""
        return self.device_mesh["ring", "ulysses"]

    def sequence_group(self) -> tuple[Any, int]:
        """(the ProcessGroup of this rank's whole sequence group, ring x ulysses, this rank's index in it): the
        token bands follow this index. Built on first use when the group spans nodes (a collective)."""
        if self.dims.ring == 1:
            return self.ulysses_group()
        if self._sequence is None:
            self._sequence = self.device_mesh["ring", "ulysses"]._flatten("sequence")
        return self._sequence.get_group(), self._sequence.get_local_rank()

    def ulysses_group(self) -> tuple[Any, int]:
        """(the ProcessGroup of the sequence group's ranks on this node, this rank's index in it)."""
        ulysses = self.device_mesh["ulysses"]
        return ulysses.get_group(), ulysses.get_local_rank()

    def ring_group(self) -> tuple[Any, int]:
        """(the ProcessGroup of the sequence group's ranks with this rank's index on their nodes, one per node, this
        rank's index in it: which node of the group it is on)."""
        ring = self.device_mesh["ring"]
        return ring.get_group(), ring.get_local_rank()


def job_mesh(sequence: int = 1, hybrid: bool = False, device_type: str | None = None) -> Mesh:
    """The mesh of a job torchrun (or srun) started outside Lightning, over its running process group:
    WORLD_SIZE ranks, LOCAL_WORLD_SIZE per node."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    return ParallelDims.of(world, per_node, sequence, hybrid).build(device_type)
