"""Before a training run builds anything: the model config fitted to its dataset, and the checks that need both.

framework.train runs these between composing the config and building the data module and the model:
`fit_model_to_data` sets the model keys the dataset decides (refusing a user's value that contradicts it),
`check_buckets` and `check_encoders` refuse what would fail later, naming the key to change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from framework.cli import launch_rank
from framework.config import TrainConfig
from framework.inference.pipeline import with_encoders


def chosen_model_keys(dcfg: DictConfig) -> set[str]:
    """model.* keys set by the user (command line or experiment file) rather than by the preset in conf/model/."""
    from framework.models.backbones import PRESET_DIR

    preset = PRESET_DIR / f"{dcfg.model.name}.yaml"
    values = OmegaConf.load(preset) if preset.is_file() else {}
    chosen = {k for k in dcfg.model if k in values and dcfg.model[k] != values[k]}
    if HydraConfig.initialized():  # a command-line value equal to the preset's is a choice too (Hydra's own parser)
        from hydra.core.override_parser.overrides_parser import OverridesParser

        keys = [o.key_or_group for o in OverridesParser.create().parse_overrides(list(HydraConfig.get().overrides.task))]
        chosen |= {k.removeprefix("model.") for k in keys if k.startswith("model.")}
    return chosen


def fit_model_to_data(dcfg: DictConfig) -> Any:
    """Set the model keys the dataset decides (channels, latent size, text width) from its dataset.json, and
    return the dataset's info (None when the data config itself is invalid: to_object reports that).

    A model preset names an architecture; the data it trains on fixes its input and caption widths, so the
    user chooses `model=` and `data.path=` and nothing has to be undone (the quickstart's digits included).
    A value the user set (not the preset's) that contradicts the dataset is refused, naming the key.
    """
    from framework.data.datamodule import DataConfig, build_missing, data_model_fields, read_dataset_info

    try:
        data: DataConfig = OmegaConf.to_object(dcfg.data)  # type: ignore[assignment]
    except Exception:
        return None  # config_lib.to_object reports what is wrong with the data config
    rank = launch_rank()
    weights = fit_model_to_weights(dcfg, rank)
    build_missing(data, rank)
    info = read_dataset_info(data.path, data.local)
    from framework.models.families import family_of, names_with

    fam = family_of(dcfg.model.family)
    if info.text_dim == 0 and fam.reads_text:
        raise ValueError(f"data.path={data.path} holds no captions ({info.path}: text_encoder=none, class labels only); "
                         f"model.family={dcfg.model.family} needs caption embeddings: train model.family=dit (a dit "
                         "preset) on it, or precompute the data with a text encoder")
    if (info.num_frames is not None) != fam.video:
        kind = f"video clips ({info.num_frames} latent frames)" if info.num_frames is not None else "images"
        video = ", ".join(names_with(lambda f: f.video))
        raise ValueError(f"data.path={data.path} holds {kind} ({info.path}); model.family={dcfg.model.family} denoises "
                         f"{'video' if fam.video else 'images'}: pick a "
                         f"{'video (' + video + ')' if info.num_frames is not None else 'image'} "
                         "preset for it")
    chosen, changed = chosen_model_keys(dcfg), []
    for key, value in data_model_fields(info, dcfg.model.family).items():
        current = dcfg.model.get(key)
        if current == value:
            continue
        if key in weights:
            raise ValueError(f"init_from={dcfg.init_from} does not fit the dataset at data.path={data.path}: "
                             f"{weights[key]} gives model.{key}={current}, {info.path} has {key}={value}. Precompute the "
                             "data with the encoders these weights were trained with")
        if key in chosen:
            raise ValueError(f"model.{key}={current} does not fit the dataset at data.path={data.path}: {info.path} "
                             f"has {key}={value}. Drop model.{key} (the dataset sets it) or point data.path at a "
                             "dataset built for that model")
        changed.append(f"model.{key}: {current} -> {value}")
        dcfg.model[key] = value
    if changed and rank == 0:
        print(f"model={dcfg.model.name} fitted to {info.path}: " + ", ".join(changed))
    return info


def fit_model_to_weights(dcfg: DictConfig, rank: int = 0) -> dict[str, Path]:
    """init_from= a diffusers folder: set the model keys its config.json fixes (framework/models/released.py), so
    released weights load with the configuration they were trained with. The folder's architecture replaces the
    preset's (a preset picks a family and a size; the weights decide which size); a value the user set (command line
    or experiment file) that contradicts the file is refused, naming both. Returns {key: config.json} for the
    dataset-decided keys the file fixed."""
    from framework.models.backbones import PRESET_DIR
    from framework.models.released import DATA_DECIDED, constructor_default, read_model_fields

    found = read_model_fields(dcfg.init_from, dcfg.model.family) if dcfg.get("init_from") else None
    if found is None:
        return {}
    file, fields = found
    name, family = dcfg.model.name, dcfg.model.family
    chosen, changed = chosen_model_keys(dcfg), []

    def refuse(key: str, current: Any, value: Any) -> None:
        raise ValueError(f"init_from={dcfg.init_from}: {file} has {key}={value!r}, but your config (command line or "
                         f"experiment file) sets model.{key}={current!r}. These weights were trained with {value!r}: "
                         f"drop model.{key}, or choose the model= preset of these weights{matching_preset(fields, family)}")

    kwargs = fields.pop("kwargs")
    for key, value in fields.items():
        current = dcfg.model.get(key)
        if current == value:
            continue
        if key in chosen:
            refuse(key, current, value)
        dcfg.model[key] = value
        changed.append(f"model.{key}: {current} -> {value}")
    own = OmegaConf.to_container(dcfg.model.kwargs) if dcfg.model.get("kwargs") else {}
    preset_file = PRESET_DIR / f"{name}.yaml"
    preset = (OmegaConf.to_container(OmegaConf.load(preset_file)) if preset_file.is_file() else {}).get("kwargs") or {}
    # the user's own kwargs: named on the command line, or set (by an experiment file) to other than the preset's
    mine = {k for k in own if f"kwargs.{k}" in chosen or ("kwargs" in chosen and own[k] != preset.get(k))}
    for key in sorted(set(kwargs) | set(own)):
        value = kwargs.get(key, constructor_default(family, key))
        if key in own and own[key] == value:
            continue
        if key in mine:
            refuse(f"kwargs.{key}", own[key], value)
        changed.append(f"model.kwargs.{key}: {own.get(key)} -> {value}")
        own[key] = value
    dcfg.model.kwargs = own
    if changed and rank == 0:
        print(f"model={name} set from {file}: " + ", ".join(changed))
    return {key: file for key in fields if key in DATA_DECIDED}


def matching_preset(fields: dict[str, Any], family: str) -> str:
    """' (model=NAME matches them)' for the shipped presets whose architecture equals `fields`, else ''."""
    from framework.models.backbones import PRESET_DIR
    from framework.models.released import DATA_DECIDED

    names = []
    for file in sorted(PRESET_DIR.glob("*.yaml")):
        values = OmegaConf.to_container(OmegaConf.load(file))
        if values.get("family") == family and all(values.get(k) == v for k, v in fields.items()
                                                  if k in values and k not in DATA_DECIDED):
            names.append(file.stem)
    return f" (model={' or model='.join(names)} matches them)" if names else ""


def check_buckets(cfg: TrainConfig, buckets: list[dict]) -> None:
    """A dataset of aspect-ratio buckets needs a model that takes any latent height and width, and a sequence-parallel
    split that divides every bucket's tokens: refuse one that does not, naming the bucket."""
    import dataclasses

    from framework.models.families import family_of

    if not family_of(cfg.model).any_aspect:
        raise ValueError(f"data.path={cfg.data.path} holds aspect-ratio buckets, but model.family=dit (diffusers' "
                         "DiTTransformer2DModel) only unpatchifies square latents: use a PixArt, SANA or UNet model, or "
                         "a dataset precomputed without buckets")
    if cfg.strategy.sequence_parallel > 1:
        from data_prep.buckets import bucket_name
        from framework.distributed.sequence import check

        for b in buckets:
            h, w = b["latent_size"]
            frames = {"num_frames": b["latent_frames"]} if "latent_frames" in b else {}
            try:
                check(dataclasses.replace(cfg.model, sample_size=h, sample_width=w, **frames),
                      cfg.strategy.sequence_parallel, cfg.strategy.sequence_parallel_head_groups)
            except ValueError as err:
                raise ValueError(f"bucket {bucket_name(b)} (latents {h}x{w}): {err}") from None


def check_encoders(cfg: TrainConfig, info: dict[str, Any]) -> None:
    """Grids decode with the VAE, and prompts the dataset did not encode need the text encoder (so do the
    built-in evaluations): check now, naming sample.vae / sample.text_encoder, rather than at the first grid."""
    from framework.evaluation.prompts import dataset_kind, grid_prompts

    prompts = cfg.sample.prompts or grid_prompts(info)
    evaluates = bool((cfg.eval.at_end or cfg.eval.every_n_steps) and (dataset_kind(info) or cfg.eval.real))
    if evaluates and cfg.eval.real:  # one's own data: the real images and the metric networks, checked now
        from framework.evaluation.realdata import check_real_eval, check_real_networks
        check_real_eval(cfg.eval)
        check_real_networks(cfg.eval, cfg.model.is_video)
    text = evaluates or not set(prompts) <= set(info.get("prompt_embeds", {}))
    with_encoders(info, cfg.sample.vae, cfg.sample.text_encoder, ("sample.vae", "sample.text_encoder"), text)


def check_accelerator(cfg: TrainConfig) -> None:
    """A Slurm job whose allocation has no GPU trains on the CPU only when asked to: with trainer.accelerator=auto it
    would do so without a word (a forgotten --gpus-per-node, a CPU partition)."""
    import os

    import torch

    from framework.training.checkpointing import slurm_task

    if cfg.trainer.accelerator == "auto" and slurm_task() and not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        raise ValueError(f"this Slurm job sees no GPU (CUDA_VISIBLE_DEVICES={visible}), so trainer.accelerator=auto "
                         "would train on the CPU: request GPUs (sbatch --gpus-per-node=N, or the site's partition) or "
                         "set trainer.accelerator=cpu to train on CPUs on purpose")
