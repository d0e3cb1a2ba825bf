"""An adapter run's set-up on the LightningModule: the adapter attached to its model, and a resumed checkpoint checked
against it (framework/models/adapters.py builds, merges and stores the adapters themselves)."""

from __future__ import annotations

from typing import Any

from torch import nn

from framework.models.adapters import AdapterConfig, add_adapter, is_adapter_key


def attach_adapter(module: Any, cfg: AdapterConfig) -> None:
    """adapter=lora|lokr|loha on a LightningModule's `model`: the base (init_from) frozen, the adapter trainable;
    checkpoints hold the adapter's tensors only (a state-dict hook drops the base's, which init_from gives back on
    resume and in every command). Under fsdp the base is built whole on each rank and sharded in configure_model (no
    meta-device build)."""
    from lightning.pytorch.utilities import rank_zero_info
    from torch.nn.parallel import DistributedDataParallel

    base = sum(p.numel() for p in module.model.parameters())
    trained = add_adapter(module.model, cfg)
    rank_zero_info(f"adapter={cfg.kind}: {trained:,} trainable parameters (rank {cfg.rank}) on a frozen base of "
                   f"{base:,} ({trained / base:.2%})")
    module.strict_loading = False  # the base's keys are not in the checkpoint (check_adapter_checkpoint: the adapter's)
    # DDP leaves the frozen base alone: each rank read it from init_from, and an int8 / fp8 one cannot be broadcast.
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        module, [f"model.{n}" for n, p in module.model.named_parameters() if not p.requires_grad])

    def drop_base(owner: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for key in [k for k in state if k.startswith(prefix + "model.") and not is_adapter_key(k)]:
            del state[key]

    module.register_state_dict_post_hook(drop_base)


def check_adapter_checkpoint(module: Any, cfg: AdapterConfig | None, checkpoint: dict[str, Any]) -> None:
    """A resumed checkpoint must hold this run's adapter `cfg` (same kind, rank and targets), every tensor of it; an
    adapter checkpoint is refused by a run without one (cfg None)."""
    from framework.inference.checkpoint import CKPT_KEY

    saved = (checkpoint.get(CKPT_KEY, {}).get("config") or {}).get("adapter") or {"kind": "none"}
    now = {} if cfg is None else vars(cfg)
    fields = ("kind", "rank", "alpha", "targets")
    if saved.get("kind", "none") != now.get("kind", "none") or (
            cfg is not None and any(saved.get(f) != now[f] for f in fields)):
        raise ValueError(f"resuming a checkpoint trained with adapter={ {f: saved.get(f) for f in fields} } in a run "
                         f"with adapter={ {f: now.get(f, 'none' if f == 'kind' else None) for f in fields} }: the "
                         "checkpoint's weights would not fit. Resume with the adapter settings it was trained with "
                         "(or start a new run.dir; init_from= takes a merged export of it)")
    if cfg is None:
        return
    stored = checkpoint.get("state_dict")
    if stored is None:  # a sharded folder, already read into the model (strict_loading off): its names are on file
        from torch.distributed.checkpoint import FileSystemReader

        names = FileSystemReader(str(module.trainer.ckpt_path)).read_metadata().state_dict_metadata
        stored = {k[len("state_dict."):] for k in names if k.startswith("state_dict.")}
    own = [f"model.{k}" for k, p in module.model.named_parameters() if p.requires_grad]
    missing = [k for k in own if k not in stored]
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} of the adapter's tensors ({missing[:3]}): it was not "
                         "written by this adapter run")
