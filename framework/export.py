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


# The stock diffusers pipeline of each family, and its backbone's component name. A PixArt-Sigma model (a
# pixart_sigma_* preset, or a run of a pixart_sigma_* experiment) is written as a PixArtSigmaPipeline.
PIPELINES = {"pixart": ("PixArtAlphaPipeline", "transformer"), "dit": ("DiTPipeline", "transformer"),
             "sana": ("SanaPipeline", "transformer"), "unet": ("StableDiffusionPipeline", "unet"),
             "latte": ("LattePipeline", "transformer"), "wan": ("WanPipeline", "transformer")}


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
    family = denoiser.cfg.family
    pipeline_name, backbone = PIPELINES[family]
    info = with_encoders(extra["dataset"], cmd.vae, cmd.text_encoder, text=family != "dit")
    if family == "pixart" and "sigma" in f"{denoiser.cfg.name} {extra['config'].get('name', '')}":
        # A PixArt-Sigma preset or experiment: the same transformer, whose stock pipeline reads prompts up to Sigma's
        # 300 tokens (PixArtAlphaPipeline would cut them at 120) and bins sizes up to 2048 px.
        pipeline_name = "PixArtSigmaPipeline"
    objective = Objective(ObjectiveConfig(**extra["config"]["objective"]))
    parts: dict[str, Any] = {backbone: denoiser.net, "scheduler": objective.sampler(cmd.sampler or "dpm++")}
    # The codec the dataset was encoded with (a folder, a pipeline folder's vae/, KL or DC), loaded as sampling does.
    parts["vae"] = getattr(load_image_codec(info["image_codec"]), "vae", None)
    if family == "sana" and parts["vae"] is not None and type(parts["vae"]).__name__ != "AutoencoderDC":
        # SanaPipeline reads the DC-AE's config when it is built; any other VAE fails there.
        raise ValueError(f"export format=diffusers: diffusers' SanaPipeline takes an AutoencoderDC (DC-AE, the VAE SANA "
                         f"is trained with); this model's latents come from an {type(parts['vae']).__name__}. Export "
                         f"format=safetensors for the transformer alone, or encode the data with a DC-AE.")
    if family == "unet" and denoiser.cfg.size_conditioning:
        raise ValueError("export format=diffusers: this UNet is size-conditioned (model.size_conditioning=true), and "
                         "stock StableDiffusionPipeline passes no size ids to it; export format=safetensors for the UNet "
                         "alone, or sample with framework.sample")
    check_video_pipeline(denoiser.cfg, parts["vae"])
    if family == "dit" and denoiser.cfg.num_classes != 1000:
        print(f"export: stock {pipeline_name} guides with class 1000 as the null class (ImageNet's); this model has "
              f"{denoiser.cfg.num_classes} classes: sample it with guidance_scale=1 there, or with framework.sample")
    if family == "sana" and not info.get("text_settings", {}).get("prefix"):
        print(f"export: stock {pipeline_name} puts Gemma-2's instruction text before each prompt; this model was trained "
              "on its captions as they are: call the pipeline with complex_human_instruction=None")
    elif family == "sana":
        print(f"export: this model was trained with precompute's text_prefix before each caption: call stock "
              f"{pipeline_name} with complex_human_instruction set to its lines (its default is its own instruction) "
              f"and max_sequence_length={info['text_settings'].get('max_tokens')}")
    if family == "latte":
        print(f"export: stock {pipeline_name} guides with the empty prompt padded to the prompt's length, padding "
              "attended; framework.sample guides with the dataset's empty caption alone: their guided samples differ, "
              "unguided ones (guidance_scale=1) are the same")
    if family == "wan":
        print(f"export: call stock {pipeline_name} with max_sequence_length={denoiser.cfg.text_len} (this model's "
              "model.text_len; its default is Wan's 512)")
    if info.get("vae_tile"):
        print(f"export: the clips were encoded in tiles of {info['vae_tile']} pixels, and framework.sample decodes so; "
              "stock pipelines decode whole frames unless you call pipe.vae.enable_tiling()")
    if family == "unet":
        print(f"export: stock {pipeline_name} pads prompts to the tokenizer's length and attends to the padding; "
              "LatentForge trained on each caption's own tokens (masked), so its images can differ from framework.sample's")
    if parts["vae"] is None:
        print("export: the dataset's pixel codec is not a diffusers VAE; the pipeline has none: load it with "
              "from_pretrained(folder, vae=None) and sample with output_type='latent'")
    elif not isinstance(info.get("shift_factor"), list) and abs(float(info.get("shift_factor", 0.0))) > 0:
        # (a list is a video VAE's latents_mean, which its stock pipeline reads from the VAE's config)
        print(f"export: the VAE has shift_factor={info['shift_factor']}; stock {pipeline_name} decodes without it")
    if family != "dit":
        text = load_text_encoder(info["text_encoder"], **info.get("text_settings", {}))
        parts.update(text_encoder=text.model, tokenizer=text.tokenizer)
    if family == "unet":
        parts.update(safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe = getattr(diffusers, pipeline_name)(**parts)
    pipe.save_pretrained(out, safe_serialization=True)
    return out


# Where stock diffusers loads a LoRA file into a pipeline of the family: pipe.load_lora_weights(folder) (a LoRA loader
# mixin) or, for the families whose pipelines have none, through peft on the backbone (docs/finetune.md).
STOCK_LORA_LOADERS = {"sana": "SanaPipeline", "wan": "WanPipeline", "unet": "StableDiffusionPipeline"}


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
    pipeline_name, component = PIPELINES[model.cfg.family]
    saver = getattr(diffusers, STOCK_LORA_LOADERS.get(model.cfg.family, ""), SanaLoraLoaderMixin)
    metadata = adapter.peft_config(model.cfg.family).to_dict()
    metadata["target_modules"] = sorted(metadata["target_modules"])
    saver.save_lora_weights(out, **{f"{component}_lora_layers": layers, f"{component}_lora_adapter_metadata": metadata})
    if model.cfg.family in STOCK_LORA_LOADERS:
        print(f"export: load it into a stock {pipeline_name} of the base with pipe.load_lora_weights({str(out)!r}, "
              "weight_name='pytorch_lora_weights.safetensors')")
    else:
        print(f"export: stock {pipeline_name} has no LoRA loader; load it into pipe.{component} with peft "
              "(docs/finetune.md), or export format=lora merge=true for a merged pipeline")
    return out / "pytorch_lora_weights.safetensors"


def check_video_pipeline(cfg: Any, vae: Any) -> None:
    """Refuse a video model that its stock pipeline would sample wrongly: LattePipeline keeps the first half of the
    prediction's channels (it assumes Latte's learned sigma) unless the scheduler says the variance is learned, and
    decodes frame by frame with an image VAE; the WanPipeline decodes with an AutoencoderKLWan's latent statistics,
    which an image VAE has not."""
    if cfg.family == "latte" and not cfg.learned_sigma and cfg.in_channels > 1:
        raise ValueError(f"export format=diffusers: stock LattePipeline keeps the first half of the transformer's output "
                         f"channels (Latte predicts a variance too), and this model predicts {cfg.in_channels} channels "
                         "alone (model.learned_sigma=false): its samples would be wrong. Export format=safetensors, or "
                         "train with model.learned_sigma=true")
    if cfg.family == "latte" and vae is not None and type(vae).__name__ != "AutoencoderKL":
        raise ValueError(f"export format=diffusers: stock LattePipeline decodes each frame with an image VAE "
                         f"(AutoencoderKL); this model's latents come from an {type(vae).__name__}. Export "
                         "format=safetensors for the transformer alone, or sample with framework.sample")
    if cfg.family == "wan" and vae is not None and type(vae).__name__ != "AutoencoderKLWan":
        raise ValueError(f"export format=diffusers: stock WanPipeline decodes with an AutoencoderKLWan (its latents' mean "
                         f"and std); this model's latents come from an {type(vae).__name__}. Export format=safetensors "
                         "for the transformer alone, or encode the clips with the Wan VAE")


@hydra.main(version_base="1.3", config_path=None, config_name="export_command")
def main(cfg: ExportCommand) -> None:
    cmd: ExportCommand = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    print(f"wrote {export(cmd)}")


if __name__ == "__main__":
    quiet_hydra()
    main()
