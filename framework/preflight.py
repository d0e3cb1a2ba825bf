"""Before a training run builds anything: the model config fitted to its dataset, and the checks that need both.

framework.train runs these between composing the config and building the data module and the model:
`fit_model_to_data` sets the model keys the dataset decides (null in the presets; a value that contradicts the
dataset is refused), `check_buckets` and `check_encoders` refuse what would fail later, naming the key to change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from framework.cli import launch_rank
from framework.config import TrainConfig
from framework.inference.pipeline import with_encoders


def preset_changes(dcfg: DictConfig) -> set[str]:
    """model.* keys whose composed value is not the preset's (conf/model/<name>.yaml): an experiment file or the
    command line set them. ("kwargs.K" for a constructor argument.)"""
    from framework.models.backbones import PRESET_DIR

    preset = PRESET_DIR / f"{dcfg.model.name}.yaml"
    values = OmegaConf.to_container(OmegaConf.load(preset)) if preset.is_file() else {}
    changed = {k for k in dcfg.model if k != "kwargs" and dcfg.model[k] != values.get(k)}
    own, theirs = dcfg.model.get("kwargs") or {}, values.get("kwargs") or {}
    return changed | {f"kwargs.{k}" for k in own if own[k] != theirs.get(k)}


def fit_model_to_data(dcfg: DictConfig) -> tuple[Any, tuple[str, ...]]:
    """Set the model keys the dataset decides (channels, latent size, frames, text width; null in the presets) from
    its dataset.json, and return the dataset's info (None when the data config itself is invalid: to_object reports
    that) with one line per key set, saying from where (the run plan prints them).

    A model preset names an architecture; the data it trains on fixes its input and caption widths, so the user
    chooses `model=` and `data.path=` and nothing has to be undone. A value given for one of them (by the user, or
    by init_from's config.json) that contradicts the dataset is refused, naming both.
    """
    from framework.data.datamodule import DataConfig, build_missing, data_model_fields, read_dataset_info

    try:
        data: DataConfig = OmegaConf.to_object(dcfg.data)  # type: ignore[assignment]
    except Exception:
        return None, ()  # config_lib.to_object reports what is wrong with the data config
    rank = launch_rank()
    weights, fitted = fit_model_to_weights(dcfg)
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
    from_data: list[str] = []
    for key, value in data_model_fields(info, dcfg.model.family).items():
        current = dcfg.model.get(key)
        if current == value:
            continue
        if key in weights:
            raise ValueError(f"init_from={dcfg.init_from} does not fit the dataset at data.path={data.path}: "
                             f"{weights[key]} gives model.{key}={current}, {info.path} has {key}={value}. Precompute the "
                             "data with the encoders these weights were trained with")
        if current is not None:
            raise ValueError(f"model.{key}={current} does not fit the dataset at data.path={data.path}: {info.path} "
                             f"has {key}={value}. Drop model.{key} (null: the dataset sets it) or point data.path at "
                             "a dataset built for that model")
        dcfg.model[key] = value  # null here: the dataset's
        from_data.append(f"model.{key}={value}")
    return info, tuple(fitted + ([f"{', '.join(from_data)} from {info.path}"] if from_data else []))


def fit_model_to_weights(dcfg: DictConfig) -> tuple[dict[str, Path], list[str]]:
    """init_from= a diffusers folder: set the model keys its config.json fixes (framework/models/released.py), so
    released weights load with the configuration they were trained with. The folder's architecture replaces the
    preset's (a preset picks a family and a size; the weights decide which size); a value the experiment file or the
    command line set (other than the preset's) that contradicts the file is refused, naming both. Returns
    ({key: config.json} for the data-decided keys the file fixed, one line per key set)."""
    from framework.models.backbones import DATA_FIELDS
    from framework.models.released import constructor_default, read_model_fields

    found = read_model_fields(dcfg.init_from, dcfg.model.family) if dcfg.get("init_from") else None
    if found is None:
        return {}, []
    file, fields = found
    family, mine, changed = dcfg.model.family, preset_changes(dcfg), []

    def take(key: str, current: Any, value: Any) -> None:
        """The file's value for model.`key`, refused when the user set another."""
        if key in mine and current is not None:
            raise ValueError(f"init_from={dcfg.init_from}: {file} has {key}={value!r}, but your config (command line or "
                             f"experiment file) sets model.{key}={current!r}. These weights were trained with {value!r}: "
                             f"drop model.{key}, or choose the model= preset of these weights"
                             f"{matching_preset(fields, family)}")
        changed.append(f"model.{key}={value}")

    kwargs = fields.pop("kwargs")
    for key, value in fields.items():
        current = dcfg.model.get(key)
        if current != value:
            take(key, current, value)
            dcfg.model[key] = value
    own = OmegaConf.to_container(dcfg.model.kwargs) if dcfg.model.get("kwargs") else {}
    for key in sorted(set(kwargs) | set(own)):
        value = kwargs.get(key, constructor_default(family, key))
        if key not in own or own[key] != value:
            take(f"kwargs.{key}", own.get(key), value)
            own[key] = value
    dcfg.model.kwargs = own
    return {key: file for key in fields if key in DATA_FIELDS}, [f"{', '.join(changed)} from {file}"] if changed else []


def matching_preset(fields: dict[str, Any], family: str) -> str:
    """' (model=NAME matches them)' for the shipped presets whose architecture equals `fields`, else ''."""
    from framework.models.backbones import DATA_FIELDS, PRESET_DIR

    names = []
    for file in sorted(PRESET_DIR.glob("*.yaml")):
        values = OmegaConf.to_container(OmegaConf.load(file))
        if values.get("family") == family and all(values.get(k) == v for k, v in fields.items()
                                                  if k in values and k not in DATA_FIELDS):
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
