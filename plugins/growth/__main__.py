"""`python -m plugins.growth ckpt=SMALL out=GROWN.ckpt target_layers=N init=constant|cyclic|block_expand`.

Writes the grown model as a checkpoint (framework.training.checkpointing.save_derived) that framework.train
(`init_from=GROWN model.num_layers=N`), sample, eval and export accept. Growing once here and then
training with init_from under fsdp reads only each rank's rows; `plugins=[growth]` grows inside the run.
"""

from __future__ import annotations

from dataclasses import dataclass

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from framework.cli import quiet_hydra
from plugins.growth import GrowthConfig, describe, grow_checkpoint


@dataclass
class GrowCommand(GrowthConfig):
    """Arguments of `python -m plugins.growth` (plus GrowthConfig's init, drop_last, zero_gate, weights)."""

    out: str = "???"
    """The grown checkpoint, a .ckpt file."""
    target_layers: int = 0
    """Blocks of the grown model."""
    seed: int = 0
    """Seed of the fresh blocks' random init."""


ConfigStore.instance().store(name="grow_command", node=GrowCommand)


@hydra.main(version_base="1.3", config_path=None, config_name="grow_command")
def main(cfg: GrowCommand) -> None:
    from framework.training.checkpointing import save_derived

    cmd: GrowCommand = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    state, source, record = grow_checkpoint(cmd.ckpt, cmd.target_layers, cmd, cmd.seed)
    path = save_derived(cmd.out, state, source, {"num_layers": cmd.target_layers}, record)
    print(describe(record))
    print(f"wrote {path}\ntrain on from it with: python -m framework.train init_from={path} "
          f"model.num_layers={cmd.target_layers} ...")


if __name__ == "__main__":
    quiet_hydra()
    main()
