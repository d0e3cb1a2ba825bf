"""`python -m framework.export ckpt=PATH out=PATH format=safetensors|diffusers|lora`: weights for other tools.

Any checkpoint of ours, one file or a sharded (fsdp) folder, becomes either one .safetensors file
with the backbone's diffusers state dict (the model config in its metadata; `init_from=` loads it)
or a whole diffusers pipeline folder that `DiffusionPipeline.from_pretrained` loads and samples with:
the backbone, a scheduler configured for the training objective, and the VAE and text encoder of the
dataset (or `vae=` / `text_encoder=` folders on this machine). The backbone alone is in its subfolder
(`transformer/`, `unet/`), which the family's class loads. EMA weights when the checkpoint has them,
unless weights=train.

A run with an adapter (adapter=lora|lokr|loha) is exported merged into its base (its init_from) by
format=safetensors and diffusers; format=lora writes the LoRA alone as diffusers' LoRA file
(`pytorch_lora_weights.safetensors` in the folder `out`), which a stock pipeline of the base loads with
`pipe.load_lora_weights(out)` (docs/finetune.md), and format=lora merge=true the merged pipeline.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

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
    """safetensors (one file), diffusers (a save_pretrained folder) or lora (diffusers' LoRA file of an adapter=lora
    run, in the folder out)."""
    merge: bool = False
    """format=lora: write the pipeline with the LoRA merged into its base instead (as format=diffusers)."""
    weights: str = "ema"
    """ema (when the checkpoint has EMA weights) or train."""
    vae: str | None = None
    """format=diffusers: the VAE folder to include; null: the one the checkpoint's dataset recorded."""
    text_encoder: str | None = None
    """format=diffusers: the text-encoder folder to include; null: the one the checkpoint's dataset recorded."""
    sampler: str | None = None
    """format=diffusers: the scheduler written for the objective (ddim, dpm++, flow_euler); null: dpm++ where the
    family's pipeline can run it, else the objective's default."""

    def __post_init__(self) -> None:
        if self.format not in ("safetensors", "diffusers", "lora"):
            raise ValueError(f"format={self.format!r}: expected safetensors, diffusers or lora")
        if self.merge and self.format != "lora":
            raise ValueError(f"merge=true goes with format=lora (format={self.format} always writes whole weights)")
        if self.weights not in ("ema", "train"):
            raise ValueError(f"weights={self.weights!r}: expected ema or train")


ConfigStore.instance().store(name="export_command", node=ExportCommand)


def export(cmd: ExportCommand) -> Path:
    """Write the checkpoint's backbone weights as asked; returns the written path."""
    from safetensors.torch import save_file

    from framework.inference.checkpoint import build_model, read_checkpoint, weights_used

    ckpt = read_checkpoint(cmd.ckpt)
    if cmd.format == "lora" and not cmd.merge:
        return save_lora(ckpt, cmd, Path(cmd.out))
    # Every key checked, so the file always fits its own config; an adapter run's adapter merged into its base.
    denoiser = build_model(ckpt, weights_used(ckpt, cmd.weights), cmd.ckpt)
    model_cfg = denoiser.cfg
    out = Path(cmd.out)
    if cmd.format in ("diffusers", "lora"):  # format=lora here: merge=true
        return save_pipeline(denoiser, ckpt, cmd, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in denoiser.net.state_dict().items()}  # bare diffusers keys
    save_file(state, str(out), metadata={"latentforge_model": json.dumps(asdict(model_cfg)), "weights": cmd.weights})
    return out


def save_pipeline(denoiser: Any, ckpt: dict[str, Any], cmd: ExportCommand, out: Path) -> Path:
    """A DiffusionPipeline folder: backbone, objective's scheduler, the dataset's VAE and text encoder.

    Parts diffusers cannot hold are left out with a message: the quickstart's pixel codec is no diffusers
    VAE (the pipeline then returns latents: output_type="latent"); the dit family reads no captions.
    """
    import diffusers

    from data_prep.encoders import load_image_codec, load_text_encoder
    from framework.inference.checkpoint import CKPT_KEY
    from framework.models.objectives import Objective, ObjectiveConfig
    from framework.inference.pipeline import with_encoders

    extra = ckpt[CKPT_KEY]
    fam = denoiser.family  # its stock pipeline (the component holding the backbone: fam.subfolder)
    pipeline_name = fam.pipeline_name(denoiser.cfg, extra["config"].get("name", ""))
    info = with_encoders(extra["dataset"], cmd.vae, cmd.text_encoder, text=fam.reads_text)
    objective = Objective(ObjectiveConfig(**extra["config"]["objective"]))
    parts: dict[str, Any] = {fam.subfolder: denoiser.net, "scheduler": objective.sampler(cmd.sampler or "dpm++")}
    # The codec the dataset was encoded with (a folder, a pipeline folder's vae/, KL or DC), loaded as sampling does.
    parts["vae"] = getattr(load_image_codec(info["image_codec"]), "vae", None)
    check_pipeline(denoiser.cfg, parts["vae"])
    for note in fam.pipeline_notes(denoiser.cfg, info, pipeline_name):
        print(note)
    if info.get("vae_tile"):
        print(f"export: the clips were encoded in tiles of {info['vae_tile']} pixels, and framework.sample decodes so; "
              "stock pipelines decode whole frames unless you call pipe.vae.enable_tiling()")
    if parts["vae"] is None:
        print("export: the dataset's pixel codec is not a diffusers VAE; the pipeline has none: load it with "
              "from_pretrained(folder, vae=None) and sample with output_type='latent'")
    elif not isinstance(info.get("shift_factor"), list) and abs(float(info.get("shift_factor", 0.0))) > 0:
        # (a list is a video VAE's latents_mean, which its stock pipeline reads from the VAE's config)
        print(f"export: the VAE has shift_factor={info['shift_factor']}; stock {pipeline_name} decodes without it")
    if fam.reads_text:
        text = load_text_encoder(info["text_encoder"], **info.get("text_settings", {}))
        parts.update(text_encoder=text.model, tokenizer=text.tokenizer)
    parts.update(fam.pipeline_extras)
    pipe = getattr(diffusers, pipeline_name)(**parts)
    pipe.save_pretrained(out, safe_serialization=True)
    return out


def save_lora(ckpt: dict[str, Any], cmd: ExportCommand, out: Path) -> Path:
    """diffusers' LoRA file of an adapter=lora run: `out/pytorch_lora_weights.safetensors`, keys `<component>.<layer>.
    lora_A.weight` / `lora_B.weight` and the LoraConfig in its metadata (rank, alpha, targets), written by diffusers'
    own save_lora_weights. Needs no base weights: the adapter is read onto a meta-device model of the config."""
    import diffusers
    import torch
    from diffusers.loaders.lora_pipeline import SanaLoraLoaderMixin
    from peft.utils import get_peft_model_state_dict

    from framework.inference.checkpoint import CKPT_KEY, model_weights, weights_used
    from framework.models.adapters import add_adapter, to_adapter_config
    from framework.models.backbones import ModelConfig, build_denoiser

    cfg = ckpt[CKPT_KEY]["config"]
    adapter = to_adapter_config(cfg.get("adapter"))
    if adapter.kind != "lora":
        raise ValueError(f"format=lora: ckpt={cmd.ckpt} was trained with adapter={adapter.kind}, and diffusers' LoRA "
                         "loaders read LoRA alone; export it merged into its base instead: format=lora merge=true (a "
                         "pipeline), format=diffusers or format=safetensors")
    with torch.device("meta"):
        model = build_denoiser(ModelConfig(**cfg["model"]))
        add_adapter(model, adapter)
    own = model.state_dict().keys()
    state = {k: v for k, v in model_weights(ckpt, weights_used(ckpt, cmd.weights)).items() if k in own}
    model.load_state_dict(state, strict=False, assign=True)
    layers = {k: v.contiguous() for k, v in get_peft_model_state_dict(model.net).items()}
    # Stock diffusers loads the file with pipe.load_lora_weights(folder) where the family's pipeline has a LoRA loader
    # mixin (fam.lora_loader), else through peft on the backbone (docs/finetune.md).
    fam = model.family
    pipeline_name, component = fam.pipeline_class, fam.subfolder
    saver = getattr(diffusers, fam.lora_loader or "", SanaLoraLoaderMixin)
    metadata = adapter.peft_config(model.cfg.family).to_dict()
    metadata["target_modules"] = sorted(metadata["target_modules"])
    saver.save_lora_weights(out, **{f"{component}_lora_layers": layers, f"{component}_lora_adapter_metadata": metadata})
    if fam.lora_loader is not None:
        print(f"export: load it into a stock {pipeline_name} of the base with pipe.load_lora_weights({str(out)!r}, "
              "weight_name='pytorch_lora_weights.safetensors')")
    else:
        print(f"export: stock {pipeline_name} has no LoRA loader; load it into pipe.{component} with peft "
              "(docs/finetune.md), or export format=lora merge=true for a merged pipeline")
    return out / "pytorch_lora_weights.safetensors"


def check_pipeline(cfg: Any, vae: Any) -> None:
    """Refuse a model that its family's stock pipeline would build or sample wrongly (each family's check_pipeline:
    SANA's DC-AE, a size-conditioned UNet, Latte's learned sigma and image VAE, the Wan VAE's latent statistics)."""
    from framework.models.families import family_of

    family_of(cfg).check_pipeline(cfg, vae)


check_video_pipeline = check_pipeline  # its earlier name, when only the video families had checks


@hydra.main(version_base="1.3", config_path=None, config_name="export_command")
def main(cfg: ExportCommand) -> None:
    cmd: ExportCommand = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    print(f"wrote {export(cmd)}")


if __name__ == "__main__":
    quiet_hydra()
    main()
