"""`python -m framework.export ckpt=PATH out=PATH format=safetensors|diffusers`: weights for other tools.

Any checkpoint of ours, one file or a sharded (fsdp) folder, becomes either one .safetensors file
with the backbone's diffusers state dict (the model config in its metadata; `init_from=` loads it)
or a diffusers folder that the family's `from_pretrained` loads (PixArtTransformer2DModel, ...).
EMA weights when the checkpoint has them, unless weights=train.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from framework.cli import quiet_hydra


@dataclass
class ExportCommand:
    """Arguments of `python -m framework.export`."""

    ckpt: str = "???"
    """Checkpoint: a .ckpt file or a sharded checkpoint folder."""
    out: str = "???"
    """Output: a .safetensors file (format=safetensors) or a folder (format=diffusers)."""
    format: str = "safetensors"
    """safetensors (one file) or diffusers (a save_pretrained folder)."""
    weights: str = "ema"
    """ema (when the checkpoint has EMA weights) or train."""

    def __post_init__(self) -> None:
        if self.format not in ("safetensors", "diffusers"):
            raise ValueError(f"format={self.format!r}: expected safetensors or diffusers")
        if self.weights not in ("ema", "train"):
            raise ValueError(f"weights={self.weights!r}: expected ema or train")


ConfigStore.instance().store(name="export_command", node=ExportCommand)


def export(cmd: ExportCommand) -> Path:
    """Write the checkpoint's backbone weights as asked; returns the written path."""
    from safetensors.torch import save_file

    from framework.models import ModelConfig, build_denoiser
    from framework.module import CKPT_KEY
    from framework.pipeline import model_weights, read_checkpoint

    ckpt = read_checkpoint(cmd.ckpt)
    model_cfg = ModelConfig(**ckpt[CKPT_KEY]["config"]["model"])
    denoiser = build_denoiser(model_cfg)
    # load_state_dict(strict) fails on any mismatch, so the file always fits its own config.
    denoiser.load_state_dict(model_weights(ckpt, cmd.weights))
    out = Path(cmd.out)
    if cmd.format == "diffusers":
        denoiser.net.save_pretrained(out, safe_serialization=True)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in denoiser.net.state_dict().items()}  # bare diffusers keys
    save_file(state, str(out), metadata={"latentforge_model": json.dumps(asdict(model_cfg)), "weights": cmd.weights})
    return out


@hydra.main(version_base="1.3", config_path=None, config_name="export_command")
def main(cfg: ExportCommand) -> None:
    cmd: ExportCommand = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    print(f"wrote {export(cmd)}")


if __name__ == "__main__":
    quiet_hydra()
    main()
