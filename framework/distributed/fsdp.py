"""FSDP2 preparation: the units, per-block speed switches, sharding, and building without a whole model.

shard_units / prepare_blocks / shard / reshard are what DiffusionModule.configure_model (and the
benchmarks) apply under strategy=fsdp; the Lightning strategies around them live in
framework/distributed/strategy.py.

strategy=fsdp builds no whole model on any rank: build on the meta device, materialise only local shards.

The ordinary path (single, ddp) builds the full fp32 model on the CPU: a 4.8B-parameter model is
19 GB of host memory, on each of a node's 8 ranks. Under fsdp, DiffusionModule builds the model on
the meta device (shapes, no storage); configure_model shards it (`shard`, below) and
then `materialize` gives every parameter this rank's rows and every buffer its value:

  fresh init  Each rank re-runs the ordinary constructor from the CPU RNG state the ordinary path
              would have started from, so every random number is drawn exactly as there; but a
              module's parameters are cut down to this rank's rows the moment the module is
              registered in its parent (torch's global module-registration hook), and the full
              tensors are freed (and malloc's heap trimmed). Peak host memory: about one layer plus
              this rank's shards. No communication; each rank spends the CPU time of initialising
              the whole model once (30-40 s for 1.6B parameters on one core here).
  init_from   This rank's rows are sliced out of the file: safetensors slices, or a memory-mapped
              .ckpt (framework/models/backbones.py `open_weights`), so no rank reads the whole model.

Buffers are not sharded: they come whole from the fresh build (non-persistent ones such as sin-cos
positional tables) or, for persistent ones under init_from, from the file as `load_weights` does.
The sharded tensors are put in place with load_state_dict(assign=True), FSDP2's recipe for meta
init (its load hook re-pads uneven shards).

The gap this fills: torch's set_model_state_dict(..., broadcast_from_rank0=True) still needs the
whole model on rank 0, and re-running `reset_parameters` on a meta model draws other random
numbers than the constructor did (and misses parameters made with torch.randn in an __init__,
like PixArt's and SANA's scale_shift_table).

Why cutting at registration is exact: diffusers' constructors finish initialising a module before
assigning it to its parent and never touch it afterwards (a later in-place init would land on the
meta stand-in and be lost); tests/test_fsdp_init.py checks every family against the ordinary build.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook

from framework.models import init as reference_init
from framework.models.backbones import Denoiser, ModelConfig, build_denoiser, check_fits, open_weights

TRIM_EVERY_BYTES = 256 * 2**20  # see _trim_heap

# --------------------------------------------------------------------------------------------
# Units: what becomes one FSDP unit / one activation-checkpointed piece
# --------------------------------------------------------------------------------------------


def shard_units(denoiser: Denoiser) -> list[nn.Module]:
    """The backbone's FSDP2 units in forward order, as its family's plan names them (framework/models/plans.py)."""
    from framework.models.families import plan_of

    return plan_of(denoiser.cfg.family).units(denoiser.net)


def prepare_blocks(denoiser: Denoiser, activation_checkpointing: bool, compile: bool) -> None:
    """Activation checkpointing and torch.compile per block (both before any sharding).

    diffusers already recomputes each block in backward when gradient checkpointing is on (and
    keeps parameter names unchanged, so checkpoints stay loadable without it). `Module.compile`
    compiles in place, so state-dict keys keep no `_orig_mod` prefix either.
    """
    if activation_checkpointing:
        denoiser.net.enable_gradient_checkpointing()
    if compile:
        for unit in shard_units(denoiser):
            unit.compile()


# Lightning precision -> the dtype FSDP2 casts parameters to for forward/backward (None: no cast).
_PARAM_DTYPES: dict[str, torch.dtype | None] = {
    "32-true": None, "32": None, "64-true": None, "64": None,
    "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16,
    # "-true" precisions already convert the parameters themselves; there is nothing left to cast.
    "bf16-true": None, "16-true": None,
}


def fsdp_param_dtype(precision: str | None, mixed_precision: bool = True) -> torch.dtype | None:
    """The compute dtype of sharded parameters for `trainer.precision`, so fsdp computes as one device would.

    bf16-mixed / 16-mixed: parameters are gathered in bf16 / fp16 (half the all-gather traffic) while
    the sharded fp32 master weights and the optimizer stay fp32; 32-true: fp32 throughout.
    strategy.mixed_precision=false keeps fp32 parameters under autocast (autocast still casts per op).
    """
    key = str(precision or "32-true")
    if key not in _PARAM_DTYPES:
        raise ValueError(f"trainer.precision={precision!r} is not supported with strategy=fsdp; "
                         f"use one of {sorted(_PARAM_DTYPES)}")
    return _PARAM_DTYPES[key] if mixed_precision else None


def shard(denoiser: Denoiser, mesh: Any, sharding: str, param_dtype: torch.dtype | None) -> Denoiser:
    """fully_shard every block, then the root, on `mesh` (in place): the job mesh's fsdp_mesh()."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": sharding in ("FULL_SHARD", "HYBRID_SHARD")}
    if param_dtype is not None:
        # Gradients are reduced in fp32 so that summing many ranks' low-precision gradients loses nothing.
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for unit in shard_units(denoiser):
        fully_shard(unit, **kwargs)
    fully_shard(denoiser, **kwargs)
    return denoiser


def reshard(model: nn.Module) -> None:
    """Put FSDP2 modules back to their sharded parameters (a no-op without FSDP2).

    After a forward without backward (a sample grid, an evaluation) under reshard_after_forward=False,
    FSDP2 keeps the gathered parameters and would reuse those inference-time copies in the next
    training forward; anything that edits the shards must drop them first.
    """
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()

# --------------------------------------------------------------------------------------------
# Rows of one rank
# --------------------------------------------------------------------------------------------


def local_rows(t: Any, rank: int, world: int) -> torch.Tensor:
    """This rank's dim-0 rows of `t` (a tensor, or a file entry with `.shape` and slicing).

    fully_shard places parameters as Shard(0) on its 1-D mesh, split like torch.chunk: ceil(n / world)
    rows per rank, the last ranks taking fewer (or none).
    """
    if len(t.shape) == 0:
        return t[...]
    n = t.shape[0]
    size = math.ceil(n / world)
    start = min(rank * size, n)
    return t[start:min(start + size, n)]


# --------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------


def build_meta(cfg: ModelConfig) -> Denoiser:
    """The denoiser with every parameter and buffer on the meta device (no storage, no RNG drawn)."""
    with torch.device("meta"):
        return build_denoiser(cfg)


def _trim_heap() -> None:
    """Hand the freed pages inside malloc's heap back to the OS (glibc's malloc_trim; elsewhere nothing).

    Whole layers freed one after another leave holes that small allocations then split, so malloc
    cannot reuse or return them: without this, sana_1600m_1024 kept 1.4 GB more resident per rank.
    """
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


def fresh_shards(cfg: ModelConfig, rank: int, world: int,
                 keep_params: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(this rank's rows of every parameter, every buffer whole) of `build_denoiser(cfg)` with the current RNG, then
    model.init's reference init (framework/models/init.py) when it is on and the parameters are kept, as the regular
    from-scratch build does.

    Draws the same random numbers as `build_denoiser(cfg)` and leaves the RNG where it would, but
    never holds more than one layer's parameters whole. keep_params=False drops the rows (init_from
    replaces them; the buffers are still needed).
    """
    rows: dict[torch.Tensor, torch.Tensor | None] = {}  # meta stand-in -> rows (tensors hash by identity)
    freed = [0]  # bytes of whole tensors freed since the heap was last trimmed

    def cut(module: nn.Module) -> None:
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_meta:
                continue  # already cut (a shared parameter)
            stand_in = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            rows[stand_in] = local_rows(p.detach(), rank, world).clone() if keep_params else None
            module.register_parameter(name, stand_in)  # the whole tensor is freed here
            freed[0] += p.numel() * p.element_size()
        if freed[0] > TRIM_EVERY_BYTES:
            _trim_heap()
            freed[0] = 0

    handle = register_module_module_registration_hook(lambda parent, name, child: cut(child) if child is not None else None)
    try:
        model = build_denoiser(cfg)
    finally:
        handle.remove()
    for m in model.modules():  # the root's own parameters were never registered in a parent
        cut(m)
    if keep_params and cfg.init == "reference":  # as init_weights does after the regular build, a tensor at a time
        seed, stand_ins = reference_init.draw_seed(), dict(model.named_parameters())
        for name, rule in reference_init.rules(model, cfg.family).items():
            p = stand_ins[name]
            rows[p] = local_rows(reference_init.value(rule, name, p.shape, seed, p.dtype), rank, world).clone()
    _trim_heap()
    params = {name: rows[p] for name, p in model.named_parameters()} if keep_params else {}
    return params, dict(model.named_buffers())


def file_shards(path: str | Path | Mapping[str, torch.Tensor], denoiser: Denoiser, rank: int,
                world: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(this rank's rows of every parameter, every persistent buffer) read from `path` (init_from), or
    cut from a whole state dict in memory (weights a plugin computed in setup, e.g. plugins/growth).

    `denoiser` is the (meta, possibly sharded) model: its state dict gives the expected names and
    global shapes, checked with the same clear error as `load_weights`.
    """
    state = dict(path) if isinstance(path, Mapping) else open_weights(path, denoiser)
    check_fits(state, denoiser, path)
    names = {name for name, _ in denoiser.named_parameters()}
    # clone: a slice of a memory-mapped checkpoint would otherwise keep pointing into the file.
    params = {k: local_rows(state[k], rank, world).clone() for k in names}
    buffers = {k: state[k][...].clone() for k in state if k not in names}
    return params, buffers


# --------------------------------------------------------------------------------------------
# Materialising a sharded meta model
# --------------------------------------------------------------------------------------------


def _mesh_position(denoiser: Denoiser) -> tuple[Any, int, int]:
    """(mesh, rank along its shard dim, that dim's size) of the sharded parameters; every one must be placed as
    fully_shard does: Shard(0) on a 1-D mesh, or (Replicate(), Shard(0)) on a 2-D one (HYBRID_SHARD)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    meshes = set()
    for name, p in denoiser.named_parameters():
        if not isinstance(p, DTensor) or p.placements not in ((Shard(0),), (Replicate(), Shard(0))):
            raise RuntimeError(f"{name} is not sharded as fully_shard does (Shard(0), with Replicate() before it on "
                               "a 2-D mesh): materialize runs after framework.distributed.fsdp.shard.")
        meshes.add(p.device_mesh)
    if len(meshes) != 1:
        raise RuntimeError(f"the parameters are sharded over {len(meshes)} meshes; expected one data-parallel mesh.")
    mesh = meshes.pop()
    return mesh, mesh.get_local_rank(mesh.ndim - 1), mesh.size(mesh.ndim - 1)


def materialize(denoiser: Denoiser, rng_state: torch.Tensor, device: torch.device,
                init_from: str | Mapping[str, torch.Tensor] | None = None) -> None:
    """Give the fully_shard'ed meta `denoiser` real local shards and buffers on `device`, in place.

    rng_state is the CPU RNG state at the moment the ordinary path would have built the model: the
    fresh weights then equal `build_denoiser` (then `load_weights(init_from)`) with that state. The
    global RNG is left as it was.
    """
    from torch.distributed.tensor import DTensor

    mesh, rank, world = _mesh_position(denoiser)
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(rng_state)
        params, buffers = fresh_shards(denoiser.cfg, rank, world, keep_params=not init_from)
    if init_from:
        params, file_buffers = file_shards(init_from, denoiser, rank, world)
        buffers.update(file_buffers)

    def take(table: dict[str, torch.Tensor], name: str, like: torch.Tensor) -> torch.Tensor:
        if name not in table:
            raise RuntimeError(f"{name} is not in a fresh build of model {denoiser.cfg.name!r}: under strategy=fsdp "
                               "the model is materialised from one in configure_model, so model surgery before it "
                               "(a plugin's setup) may change classes and flags but not add or reshape tensors.")
        return table.pop(name).to(device=device, dtype=like.dtype)  # a file's dtype becomes the model's, as copy_ would

    state: dict[str, torch.Tensor] = {}
    for name, p in denoiser.named_parameters():
        local = take(params, name, p)
        if local.shape != p.to_local().shape:
            raise RuntimeError(f"{name}: rows {tuple(local.shape)} for rank {rank} of {world}, but fully_shard "
                               f"expects {tuple(p.to_local().shape)}.")
        state[name] = DTensor.from_local(local, mesh, p.placements, shape=p.shape, stride=p.stride())
    persistent = denoiser.state_dict().keys()
    for name, b in denoiser.named_buffers():
        if name in persistent:
            state[name] = take(buffers, name, b)
        else:  # not in the state dict: set on its module, staying non-persistent
            owner, _, leaf = name.rpartition(".")
            denoiser.get_submodule(owner).register_buffer(leaf, take(buffers, name, b), persistent=False)
    # assign=True: the meta tensors cannot be copied into; FSDP2's load hook adopts the new shards.
    denoiser.load_state_dict(state, strict=True, assign=True)
    left = [n for n, t in [*denoiser.named_parameters(), *denoiser.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"still on the meta device after materialize: {left[:3]}")


def build_model(cfg: ModelConfig, meta: bool, init_from: str | None) -> tuple[Denoiser, torch.Tensor | None]:
    """DiffusionModule's denoiser and, under fsdp (`meta`), the CPU RNG state its shards are drawn from later.

    meta: no rank holds the whole model, so shapes only now, this rank's shards in `configure` (from the RNG state
    the ordinary build would have started from). Otherwise the ordinary build: init_from's weights (a checkpoint, a
    .safetensors file or a diffusers folder), or model.init's (reference: as the family's reference code initialises).
    """
    from framework.models.backbones import load_weights, to_model_config

    if meta:
        rng_state = torch.get_rng_state()
        return build_meta(to_model_config(cfg)), rng_state
    model = build_denoiser(cfg)
    if init_from:
        load_weights(model, init_from)
    else:
        reference_init.init_weights(model)
    return model, None


def configure(model: Denoiser, s: Any, strategy: Any, rng_state: torch.Tensor | None,
              start: str | Mapping[str, torch.Tensor] | None) -> None:
    """DiffusionModule.configure_model under strategy `s` (a StrategyConfig): sequence-parallel hooks, activation
    checkpointing / compile per block, then FSDP2 sharding under fsdp, on the job's one mesh (framework/distributed/
    mesh.py: ddp and fsdp). A meta-device model (rng_state given) gets its real shards right after: fresh, or from
    `start` (init_from, or a plugin's starting weights)."""
    mesh = getattr(strategy, "mesh", None)
    if s.sequence_parallel > 1:  # hooks and processors only: before sharding, on the meta model under fsdp
        from framework.distributed.sequence import init, install

        install(model, init(mesh, s.sequence_parallel_head_groups))
    prepare_blocks(model, s.activation_checkpointing, s.compile)
    if s.name == "fsdp":
        shard(model, mesh.fsdp_mesh(), s.sharding, strategy.param_dtype)
        if rng_state is not None:
            materialize(model, rng_state, strategy.root_device, start)
