"""Training data: MDS latent shards (written by data_prep.precompute) -> padded, scaled batches.

The dataset's layout, columns and storage options are described in docs/data.md.
The trainer never runs a VAE or a text encoder. Each batch is a dict:
    latents      float32 (B, C, h, w)  scaled ONCE here: (raw - shift_factor) * scaling_factor
    text_embeds  (B, L, D)             zero-padded to the longest caption in the batch; decoded from the dataset's
                                       text_storage (framework/data/text_storage.py): float16, bfloat16 or float32
    text_mask    bool    (B, L)        True on real tokens
    label        int64   (B,)          only when the dataset has a `label` column
    latents_std  float32 (B, C, h, w)  only for a posterior=distribution dataset: the posterior's std, scaled alike;
                                       on_before_batch_transfer replaces latents by a draw of the posterior
    caption, key list[str]
A dataset of caption_layout per_image (a row per image with all its captions) gives every caption instead of
text_embeds / text_mask / caption: caption_embeds (N, L, D) and caption_mask (N, L) over the batch's N captions,
sample after sample, caption_counts int64 (B,) and captions list[str] (N); on_before_batch_transfer keeps the caption
drawn for each sample in this step (framework.training.draws.StepDraws.captions): the training step gets the
batch above.
Caption dropout is not done here (it would freeze the dropped rows into the loader's shuffle);
the LightningModule calls `drop_captions` per step.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
import numpy as np
import torch

from data_prep.config import TEXT_STORAGES
from data_prep.location import is_remote
from data_prep.record import DATASET_FILE, DatasetRecord, scale_latents
from framework.models.conditioning import pad_and_stack
from framework.data.shards import VALIDATE_MODES, check_shards_once, open_streaming
from framework.data.text_storage import decode_captions, decode_text

SHUFFLE_ALGOS = ("py1e", "py1br", "py1s", "py2s", "naive")  # streaming.base.shuffle's algorithms

# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------


@dataclass
class DataConfig:
    """Where the latent shards are and how to stream them.

    `validate` is the start-up check of the shard files on disk (framework/data/shards.py), run in setup()
    on every rank before Streaming reads anything. It covers every file present in the dataset folder
    and in the `local` cache, the .mds.zstd and the .mds that Streaming decompresses from it (which
    Streaming itself never re-checks), against index.json. A bad file fails with its path and the cure.
      auto  (default) "hash" while the present shard files total at most 4 GiB, else "size"
      hash  size, .mds header and the xxh64 recorded by the writer: catches any changed byte
      size  size and .mds header (sample count, offset table): catches truncation and header damage
            by reading 4 bytes per sample, but not bytes flipped inside sample data
      none  no check
    """

    path: str = "data/digits"  # dataset folder or any remote Streaming supports (s3://, gs://, ...)
    local: Optional[str] = None  # local cache folder; required for remote paths, optional for local ones
    batch_size: int = 32  # per-device micro-batch; with global_batch_size, the largest one a device may take
    # Samples per optimizer step over the whole job; null: batch_size x data-parallel ranks x
    # trainer.accumulate_grad_batches. When set, each device's micro-batch and the accumulation are derived from the
    # data-parallel ranks (split_global_batch: the fewest micro-batches of at most batch_size), so one config keeps its
    # global batch on any number of GPUs; refused when the ranks do not divide it.
    global_batch_size: Optional[int] = None
    num_workers: int = 0  # DataLoader worker processes
    shuffle: bool = True  # shuffle samples (Streaming's py1e block shuffle)
    shuffle_seed: Optional[int] = None  # null = the run seed
    drop_last: bool = True  # keep every step's batch the same size
    predownload: Optional[int] = None  # samples to fetch ahead per worker; null = Streaming's 8 * batch_size
    cache_limit: Optional[str] = None  # cap on the local cache for remote data ("10gb"); null = no cap
    # Streaming's scale knobs (docs/training.md). num_canonical_nodes: the sample space is split into this many
    # partitions, dealt out to the physical nodes; when one count divides the other each node reads only its own
    # partitions' shards (else Streaming's relaxed partition reads across nodes). `auto` (the shipped real-data
    # config) takes the largest of CANONICAL_NODES (15360, 7680, 3840, ..., 120, 48, ...) that leaves every partition
    # at least SAMPLES_PER_PARTITION samples: 3,840 for 15,360 samples or more (node counts 1-6, 8, 10, 12, 15, 16,
    # ..., 64, ..., 256 divide it), 960 for the 4,314 digits, 12 for 72 images; it depends on the dataset alone, so a
    # resume on any node count gets the same. The run plan prints it and refuses a job whose node count it does not
    # fit. null = the first run's node count (Streaming's default).
    num_canonical_nodes: Any = None
    shuffle_algo: str = "py1e"  # Streaming's shuffle: py1e (default), py1br, py1s, py2s, naive
    shuffle_block_size: Optional[int] = None  # samples per shuffle block; null = Streaming's max(4e6 / nodes, 2^18)
    download_retry: int = 2  # remote shards: extra attempts per shard download
    download_timeout: float = 60.0  # remote shards: seconds one shard download may take
    persistent_workers: bool = False  # keep workers alive between epochs (needs num_workers > 0)
    validate: str = "auto"  # start-up shard check: auto, hash, size or none (see above)
    # Mirror each sample left-right with probability 1/2, drawn per sample and step from the run's seed (so the same
    # on any world size and after a resume). The stored latents are flipped, in the host batch before the copy to the
    # device, rather than the image flipped and encoded again: exact for the pixel codec, close to it for a VAE whose
    # latents mirror with the image (docs/training.md). Precompute's crops are centred, so a mirrored sample's crop
    # corner (the size conditioning of a bucketed dataset) is its own.
    hflip: bool = False
    prepare: Optional[dict[str, Any]] = None  # a data_prep PrecomputeConfig: build `path` if it is missing
    # The held-out latents of the validation loss (eval.val_every_n_steps; framework/training/validation.py), a local
    # dataset folder; null: data.path/val when precompute wrote one (val_fraction=).
    val_path: Optional[str] = None

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"data.batch_size={self.batch_size}: must be >= 1 (it is the per-device batch).")
        if self.global_batch_size is not None and self.global_batch_size < 1:
            raise ValueError(f"data.global_batch_size={self.global_batch_size}: must be >= 1 (samples per optimizer "
                             "step over the job), or null.")
        if self.num_workers < 0:
            raise ValueError(f"data.num_workers={self.num_workers}: must be >= 0.")
        if self.validate not in VALIDATE_MODES:
            raise ValueError(f"data.validate={self.validate!r}: use one of {', '.join(VALIDATE_MODES)}.")
        if is_remote(self.path) and not self.local:
            raise ValueError(f"data.path={self.path} is remote: set data.local=DIR as the local cache.")
        if self.persistent_workers and self.num_workers == 0:
            raise ValueError("data.persistent_workers=true needs data.num_workers > 0.")
        if self.shuffle_algo not in SHUFFLE_ALGOS:
            raise ValueError(f"data.shuffle_algo={self.shuffle_algo!r}: use one of {', '.join(SHUFFLE_ALGOS)}.")
        ncn = self.num_canonical_nodes
        if ncn is not None and ncn != "auto" and (isinstance(ncn, bool) or not isinstance(ncn, int) or ncn < 1):
            raise ValueError(f"data.num_canonical_nodes={ncn!r}: an integer >= 1, auto (chosen from the dataset's "
                             "size) or null (Streaming's default: the first run's node count).")
        if self.shuffle_block_size is not None and self.shuffle_block_size < 1:
            raise ValueError(f"data.shuffle_block_size={self.shuffle_block_size}: must be >= 1 (or null for "
                             "Streaming's default).")
        if self.download_retry < 0 or self.download_timeout <= 0:
            raise ValueError(f"data.download_retry={self.download_retry} must be >= 0 and data.download_timeout="
                             f"{self.download_timeout} > 0.")


def split_global_batch(global_batch: int, data_parallel: int, max_micro: int) -> tuple[int, int]:
    """(micro-batch per device, micro-batches per step) that give `global_batch` samples per step on `data_parallel`
    ranks: the fewest micro-batches of at most `max_micro` samples that split a rank's share evenly."""
    if global_batch % data_parallel:
        raise ValueError(f"data.global_batch_size={global_batch} does not divide over {data_parallel} data-parallel "
                         f"ranks: choose a multiple of {data_parallel}, or run on a number of devices that divides it")
    share = global_batch // data_parallel
    accumulate = next(a for a in range(-(-share // max_micro), share + 1) if share % a == 0)
    return share // accumulate, accumulate


@dataclass
class DatasetInfo:
    """What dataset.json says, plus the empty-caption embedding; the model must fit it."""

    latent_channels: int
    latent_size: tuple[int, int]
    text_dim: int
    scaling_factor: float | list[float]  # a list: one per latent channel (a video VAE's)
    shift_factor: float | list[float]
    num_classes: Optional[int]
    image_codec: str
    text_encoder: str
    image_mode: str
    resolution: int
    path: str  # the dataset.json file this came from (named in error messages)
    num_samples: int
    empty_text_embeds: torch.Tensor  # (L0, D) float32
    downsample: int = 1
    posterior: str = "none"
    record: Optional[DatasetRecord] = None  # the whole dataset.json
    # aspect-ratio buckets (data_prep/buckets.py): [{"size": [h, w], "dir", "latent_size", "num_samples"}]; empty:
    # every latent is latent_size
    buckets: list = field(default_factory=list)
    prompt_embeds: dict[str, torch.Tensor] = field(default_factory=dict)  # grid prompt -> (L, D) fp16, precomputed
    text_storage: str = "fp16"  # how the rows hold text (framework/data/text_storage.py)
    caption_layout: str = "per_caption"  # per_image: a row per image with all its captions
    num_frames: Optional[int] = None  # video clips: latents (C, num_frames, h, w), latent frames; None: images
    fps: Optional[float] = None  # video clips: the rate their frames were taken at (None: the source's own)
    vae_tile: Optional[int] = None  # a tiled video VAE's tile side in pixels (sampling decodes with the same)

    def summary(self) -> dict:
        """What generation needs to know (the Pipeline's `info`); plain values, so checkpoints load with weights_only."""
        return {
            "path": self.path, "source": self.record.source if self.record else None, "image_codec": self.image_codec,
            "text_encoder": self.text_encoder, "image_mode": self.image_mode, "scaling_factor": self.scaling_factor,
            "shift_factor": self.shift_factor, "num_classes": self.num_classes,
            "latent_channels": self.latent_channels, "latent_size": list(self.latent_size), "text_dim": self.text_dim,
            "prompts": list(self.prompt_embeds), "prompt_embeds": dict(self.prompt_embeds),
            "downsample": self.downsample, "buckets": [bucket_shape(b) for b in self.buckets],
            "num_frames": self.num_frames, "fps": self.fps, "vae_tile": self.vae_tile,
            "temporal_compression": self.record.temporal_compression if self.record else None,
            # how prompts are encoded as the captions were (load_text_encoder's max_tokens and prefix)
            "text_settings": {k: v for k, v in (self.record.text_encoder if self.record else {}).items()
                              if k in ("max_tokens", "prefix")},
        }


# ---------------------------------------------------------------------------------------------
# dataset.json and compatibility
# ---------------------------------------------------------------------------------------------


def _fetch(path: str, name: str, local: Optional[str]) -> Path:
    """A file of the dataset as a local Path (downloaded into `local` for remote datasets)."""
    if not is_remote(path):
        return Path(path).expanduser() / name
    from streaming.base.storage.download import CloudDownloader

    dest = Path(local).expanduser() / name
    if not dest.is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        url = f"{path.rstrip('/')}/{name}"
        try:
            CloudDownloader.direct_download(url, str(dest))
        except Exception as err:
            raise remote_error(url, err) from None
    return dest


def remote_error(url: str, err: Exception) -> Exception:
    """The error to raise for a failed fetch of `url`, naming what to fix: the store's address, the credentials, or
    data.path (botocore's errors are told apart by class name, so botocore need not be importable here)."""
    kind, text = type(err).__name__, str(err)
    if kind in ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError", "ReadTimeoutError"):
        endpoint = os.environ.get("S3_ENDPOINT_URL")
        return ConnectionError(f"could not reach the object store for {url} ({text}): check S3_ENDPOINT_URL "
                               f"({'= ' + endpoint if endpoint else 'unset: the provider default'}) and that every "
                               f"node can reach it")
    if kind in ("NoCredentialsError", "PartialCredentialsError") or any(
            code in text for code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "Forbidden")):
        return PermissionError(f"no access to {url} ({text}): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
                               f"AWS_PROFILE) on every node, with read access to the bucket")
    if "not found" in text.lower() or "NoSuchBucket" in text or "NoSuchKey" in text or "404" in text:
        return FileNotFoundError(f"{url} does not exist: check data.path (the bucket and the folder that holds "
                                 f"dataset.json and index.json)")
    return FileNotFoundError(f"could not fetch {url}: {kind}: {text}")


def read_dataset_info(path: str, local: Optional[str] = None) -> DatasetInfo:
    """Read dataset.json (+ the empty-caption file) with one clear error for each way it can be wrong."""
    from safetensors.torch import load_file

    file = _fetch(path, DATASET_FILE, local)
    if not file.is_file():
        if (file.parent / "precompute.json").is_file():
            raise FileNotFoundError(f"{file} is missing: the precompute run into {path} did not finish. "
                                    "Re-run the same `python -m data_prep.precompute ...` to complete it.")
        raise FileNotFoundError(f"{file} not found: {path} is not a LatentForge dataset. Build one with "
                                f"`python -m data_prep.precompute out={path}` (or set data.prepare).")
    rec = DatasetRecord.read(file)
    if rec.text_storage not in TEXT_STORAGES:
        raise ValueError(f"{file}: text_storage={rec.text_storage!r}, but this LatentForge reads "
                         f"{', '.join(TEXT_STORAGES)}; upgrade it, or precompute the dataset again with one of these.")
    empty_file = _fetch(path, rec.empty_caption, local)
    try:
        empty = load_file(str(empty_file))["text_embeds"].float()  # (L0, D)
    except Exception as err:
        raise ValueError(f"{empty_file} (the empty-caption embedding named in {file}) is missing or corrupt: "
                         f"{err}") from None
    if empty.ndim != 2 or empty.shape[1] != rec.text_dim:
        raise ValueError(f"{empty_file}: shape {tuple(empty.shape)} does not match text_dim={rec.text_dim} "
                         f"in {file}.")
    prompt_embeds: dict[str, torch.Tensor] = {}
    if rec.prompts:  # datasets written before grid prompts were encoded have none
        tensors = load_file(str(_fetch(path, rec.prompts["file"], local)))
        prompt_embeds = {text: tensors[str(i)] for i, text in enumerate(rec.prompts["texts"])}
    return DatasetInfo(
        latent_channels=int(rec.latent_channels), latent_size=tuple(rec.latent_size),
        text_dim=int(rec.text_dim), scaling_factor=_factor(rec.scaling_factor),
        shift_factor=_factor(rec.shift_factor), num_classes=rec.num_classes,
        image_codec=rec.image_codec["name"], text_encoder=rec.text_encoder["name"],
        image_mode=rec.image_mode, resolution=int(rec.resolution), path=str(file),
        num_samples=int(rec.num_samples), empty_text_embeds=empty, downsample=int(rec.downsample),
        posterior=rec.posterior, record=rec, prompt_embeds=prompt_embeds,
        buckets=[b for b in rec.buckets or [] if b["num_samples"] > 0], text_storage=rec.text_storage,
        caption_layout=rec.caption_layout, num_frames=rec.latent_frames, fps=rec.fps,
        vae_tile=rec.image_codec.get("tile"),
    )


def _factor(value: Any) -> float | list[float]:
    """A scaling or shift factor of dataset.json: a float, or one per latent channel."""
    return [float(v) for v in value] if isinstance(value, list) else float(value)


def build_missing(cfg: DataConfig, rank: int = 0, timeout_s: float = 3600.0) -> None:
    """Build the dataset when it is missing and `data.prepare` names a recipe for this path.

    framework.train calls it before the model is built (its channels, latent size and text width come from
    dataset.json), so it cannot wait for Lightning's prepare_data: global rank 0 builds, the other ranks wait
    for dataset.json.
    A recipe builds only the folder it names (`prepare.out`): a mistyped data.path fails here instead of
    silently training on the built-in digits. A remote data.path (s3://bucket/prefix) is built in the bucket, through
    the recipe's `staging` folder, and counts as missing while the bucket has no dataset.json.
    """
    import time

    prep = cfg.prepare
    target = (prep or {}).get("out")
    builds_here = bool(prep) and (target is None or _same_place(target, cfg.path))
    if builds_here and is_remote(cfg.path) and not prep.get("staging"):
        raise ValueError(f"data.path={cfg.path} is remote: data.prepare builds it through a local folder, "
                         "data.prepare.staging=DIR (e.g. +data.prepare.staging=/scratch/staging)")
    if builds_here and not _is_complete(cfg.path):
        if rank == 0:
            from data_prep.precompute import precompute

            # One process builds it, even inside a DDP job whose RANK/WORLD_SIZE say otherwise.
            precompute({**dict(prep), "out": cfg.path}, rank=0, world_size=1)
        else:
            deadline = time.monotonic() + timeout_s
            while not _is_complete(cfg.path):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {rank} waited {timeout_s:.0f} s for rank 0 to build {cfg.path}")
                time.sleep(1.0)


# The model keys a dataset fixes, and how each is read off dataset.json.
def data_model_fields(info: DatasetInfo, family: str) -> dict[str, Any]:
    """model.* values that dataset.json decides: latent channels, latent height (and width when it differs), a clip's
    latent frames, and the caption width (not for the class-conditional dit, which reads no captions)."""
    h, w = info.latent_size
    fields: dict[str, Any] = {"in_channels": info.latent_channels, "sample_size": h, "sample_width": None if w == h else w,
                              "num_frames": info.num_frames}
    from framework.models.families import family_of

    if family_of(family).reads_text:
        fields["text_dim"] = info.text_dim
    return fields


def latent_size_keys(height: int, width: int) -> str:
    """The model keys for latents of height x width, as a user writes them in an override."""
    return f"model.sample_size={height}" + ("" if width == height else f" model.sample_width={width}")


def check_compatible(info: DatasetInfo, in_channels: int, latent_hw: tuple[int, int], text_dim: Optional[int],
                     num_frames: Optional[int] = None) -> None:
    """Raise ValueError naming the model key, the dataset value and dataset.json when they do not fit (num_frames: the
    model's latent frames, None for an image model)."""
    from framework.models.backbones import VIDEO_FAMILIES

    if (num_frames is None) != (info.num_frames is None):
        what = (f"video clips of {info.num_frames} latent frames, which model.family={'|'.join(VIDEO_FAMILIES)} "
                "denoises" if info.num_frames is not None else "images, which the image families denoise")
        raise ValueError(f"the model does not fit the dataset described by {info.path}: it holds {what}. Pick a "
                         "model= preset of that kind, or point data.path at a dataset built for this one.")
    problems = []
    if num_frames is not None and num_frames != info.num_frames:
        problems.append(f"model.num_frames={num_frames} but the clips have {info.num_frames} latent frames")
    if in_channels != info.latent_channels:
        problems.append(f"model.in_channels={in_channels} but the latents have {info.latent_channels} channels")
    if tuple(latent_hw) != tuple(info.latent_size):
        h, w = info.latent_size
        problems.append(f"{latent_size_keys(*latent_hw)} but the latents are {h}x{w} (set {latent_size_keys(h, w)})")
    if text_dim is not None and text_dim != info.text_dim:
        problems.append(f"model.text_dim={text_dim} but the text embeddings have dim {info.text_dim} "
                        f"(text encoder {info.text_encoder})")
    if problems:
        raise ValueError(f"the model does not fit the dataset described by {info.path}: " + "; ".join(problems)
                         + ". Change the model config or point data.path at a dataset built for it.")


# ---------------------------------------------------------------------------------------------
# Batching and caption dropout
# ---------------------------------------------------------------------------------------------


def bucket_shape(bucket: dict) -> list[int]:
    """A bucket's latents after the channels: [h, w], or a clip bucket's [latent frames, h, w]."""
    return ([bucket["latent_frames"]] if "latent_frames" in bucket else []) + list(bucket["latent_size"])


class LatentCollate:
    """Stack latents and scale them (the one place scaling happens); pad text and build the mask. Samples of
    aspect-ratio buckets also give `size_ids` (B, 6): their original size and crop corner (over the codec's
    `downsample`) and the latents' size, what a size-conditioned UNet is fed (framework.models.backbones.SIZE_IDS)."""

    def __init__(self, scaling_factor: float | list[float], shift_factor: float | list[float], downsample: int = 1,
                 text_storage: str = "fp16", caption_layout: str = "per_caption") -> None:
        self.scaling_factor, self.shift_factor, self.downsample = scaling_factor, shift_factor, downsample
        self.text_storage, self.caption_layout = text_storage, caption_layout

    def __call__(self, samples: list[dict]) -> dict[str, Any]:
        latents = torch.from_numpy(np.stack([s["latents"] for s in samples])).float()  # (B, C, h, w)
        latents = scale_latents(latents, self.scaling_factor, self.shift_factor)
        # fp16 and bf16 as stored: half the bytes of float32 through the loader's queue and the host-to-device copy;
        # the training step converts them on the device. int8 rows come dequantized, in float32.
        batch: dict[str, Any] = {"latents": latents, "key": [s.get("key", "") for s in samples]}
        if "latents_std" in samples[0]:  # posterior distribution: its std, in the scaled latents' units
            std = torch.from_numpy(np.stack([s["latents_std"] for s in samples])).float()
            batch["latents_std"] = scale_latents(std, self.scaling_factor, 0.0)
        if self.caption_layout == "per_image":  # every caption; the module draws one per sample and step
            embeds = [decode_captions(s, self.text_storage) for s in samples]  # [[(L_k, D), ...], ...]
            batch["caption_embeds"], batch["caption_mask"] = pad_and_stack([e for each in embeds for e in each])
            batch["caption_counts"] = torch.tensor([len(each) for each in embeds], dtype=torch.long)
            batch["captions"] = [c for s in samples for c in s["captions"]]
        elif "text_embeds" not in samples[0]:  # text_encoder=none (class labels only): one empty token a sample
            text, mask = torch.zeros(len(samples), 1, 0), torch.ones(len(samples), 1, dtype=torch.bool)
            batch.update(text_embeds=text, text_mask=mask, caption=[s["caption"] for s in samples])
        else:
            text, mask = pad_and_stack([decode_text(s, self.text_storage) for s in samples])  # (B, L, D), (B, L)
            batch.update(text_embeds=text, text_mask=mask, caption=[s["caption"] for s in samples])
        if "label" in samples[0]:
            batch["label"] = torch.tensor([int(s["label"]) for s in samples], dtype=torch.long)
        if "original_size" in samples[0]:
            corner = np.stack([np.concatenate([s["original_size"], s["crop_top_left"]]) for s in samples])  # (B, 4)
            target = torch.tensor(latents.shape[-2:], dtype=torch.float32).expand(len(samples), 2)
            batch["size_ids"] = torch.cat([torch.from_numpy(corner).float() / self.downsample, target], dim=1)
        return batch


def choose_captions(batch: dict[str, Any], chosen: torch.Tensor) -> dict[str, Any]:
    """The batch of a per_image dataset with one caption per sample, its `chosen` (B,)-th: text_embeds (B, L, D) and
    text_mask (B, L), padded to the longest chosen caption, and caption (B); the other keys as they were."""
    counts = batch["caption_counts"]  # (B,)
    if bool((chosen < 0).any() or (chosen >= counts).any()):
        raise ValueError(f"caption choice {chosen.tolist()} out of range for samples of {counts.tolist()} captions")
    rows = torch.cumsum(counts, 0) - counts + chosen  # (B,) each chosen caption's row in caption_embeds
    mask = batch["caption_mask"][rows]  # (B, L)
    length = int(mask.sum(1).max())
    out = {k: v for k, v in batch.items() if k not in ("caption_embeds", "caption_mask", "caption_counts", "captions")}
    out.update(text_embeds=batch["caption_embeds"][rows, :length], text_mask=mask[:, :length],
               caption=[batch["captions"][i] for i in rows.tolist()])
    return out


# ---------------------------------------------------------------------------------------------
# The data module
# ---------------------------------------------------------------------------------------------


# The longest path a Unix socket may have (sun_path's 108 bytes, the terminating NUL included)
UNIX_SOCKET_PATH_MAX = 107


def check_socket_room() -> None:
    """Refuse a temp folder too deep for the data loader's workers. A worker hands each batch's tensors to the main
    process through multiprocessing's resource sharer, which listens on a Unix socket at TMPDIR/pymp-XXXXXXXX/
    listener-XXXXXXXX; a longer path than a socket may have fails in the worker's queue thread, which drops the batch,
    and the main process waits for it forever."""
    import tempfile

    tmp = tempfile.gettempdir()
    longest = len(os.path.join(tmp, "pymp-xxxxxxxx", "listener-xxxxxxxx"))
    if longest > UNIX_SOCKET_PATH_MAX:
        room = UNIX_SOCKET_PATH_MAX - (longest - len(tmp))
        raise ValueError(f"the temp folder {tmp} is {len(tmp)} characters long: data loader workers "
                         f"(data.num_workers > 0) pass batches over a Unix socket under it, whose path may be at "
                         f"most {UNIX_SOCKET_PATH_MAX} characters; set TMPDIR to a folder of at most {room} "
                         "characters, or data.num_workers=0")


# What data.num_canonical_nodes=auto chooses from, largest first, and the fewest samples it leaves a partition. From
# 120 up, 15 x 2^k: every node count 2^a, 3 x 2^a, 5 x 2^a or 15 x 2^a up to it divides it (3,840: 1-6, 8, 10, 12, 15,
# 16, 20, 24, 30, 32, 40, 48, 60, 64, ..., 128, ..., 256 nodes; 7, 9, 11, 13, 14 do not), and every multiple of it
# above it is a count it divides; below 120, multiples of 2 and 3 for the few nodes a small dataset is trained on.
CANONICAL_NODES = (15360, 7680, 3840, 1920, 960, 480, 240, 120, 48, 24, 12, 6, 2, 1)
SAMPLES_PER_PARTITION = 4


def fitting_nodes(ncn: int, most: int) -> list[int]:
    """The node counts up to `most` that Streaming can start with `ncn` canonical nodes (one divides the other)."""
    return [n for n in range(1, most + 1) if ncn % n == 0 or n % ncn == 0]


def check_canonical_nodes(setting: Any, ncn: Optional[int], nodes: int, num_samples: int) -> None:
    """Refuse a num_canonical_nodes that a job of `nodes` nodes cannot start with (Streaming needs one of the two to
    divide the other), naming the node counts that can and the key to set."""
    if ncn is None or ncn % nodes == 0 or nodes % ncn == 0:
        return
    near = sorted(sorted(fitting_nodes(ncn, 2 * ncn), key=lambda n: (abs(n - nodes), n))[:4])
    how = f"auto chose it for {num_samples} samples" if setting == "auto" else "as set"
    raise ValueError(f"data.num_canonical_nodes={ncn} ({how}) cannot start a job of {nodes} nodes: Streaming needs "
                     f"one of the two to divide the other. Run on {', '.join(map(str, near[:-1]))} or {near[-1]} nodes, or set "
                     f"data.num_canonical_nodes to a number {nodes} divides (e.g. {nodes * max(1, ncn // nodes)}); a "
                     "resume on another node count then keeps that run's sample order")


def canonical_nodes(setting: Any, num_samples: int) -> Optional[int]:
    """data.num_canonical_nodes as Streaming gets it: `auto` resolved from the dataset's size (see DataConfig),
    an integer or null as given."""
    if setting != "auto":
        return setting
    return next((c for c in CANONICAL_NODES if num_samples >= SAMPLES_PER_PARTITION * c), 1)


def _is_complete(path: str) -> bool:
    """The dataset at `path` is finished: its dataset.json is in the folder, or in the bucket (asked of the store)."""
    if not is_remote(path):
        return (Path(path).expanduser() / DATASET_FILE).is_file()
    import tempfile

    from data_prep.location import RemoteLocation

    with tempfile.TemporaryDirectory() as staging:  # nothing is staged: the store is only asked what it holds
        return RemoteLocation(path, Path(staging), key="data.path").exists(DATASET_FILE)


def _same_place(a: str, b: str) -> bool:
    """Two dataset paths name the same folder or the same prefix of a bucket."""
    if is_remote(a) or is_remote(b):
        return str(a).rstrip("/") == str(b).rstrip("/")
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def timed_loader() -> type:
    """StreamingDataLoader whose iterator adds the time each batch took to come to `fetch_s` (per-rank figures,
    framework/training/figures.py). Made on first use: Streaming is imported only where data is read."""
    import time

    from streaming import StreamingDataLoader

    class TimedStreamingLoader(StreamingDataLoader):
        fetch_s = 0.0

        def __iter__(self):  # noqa: ANN204
            batches = super().__iter__()
            while True:
                start = time.perf_counter()
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                self.fetch_s += time.perf_counter() - start
                yield batch

    return TimedStreamingLoader


class LatentDataModule(L.LightningDataModule):
    """StreamingDataset + StreamingDataLoader over precomputed latents, one shard partition per rank."""

    def __init__(self, cfg: DataConfig, seed: int = 0, replication: int = 1,
                 draws: Callable[[L.Trainer, int], Any] | None = None, plan: Any = None) -> None:
        super().__init__()
        # draws(trainer, seed): the step's per-sample draws (framework.training.draws.StepDraws.of), given by the
        # training so that this layer never imports it
        self.cfg, self.seed, self.draws = cfg, seed, draws
        self.replication = replication  # consecutive ranks that read the same samples (sequence parallelism)
        # plan: the run's (framework.training.plan.RunPlan): its data-parallel size and partitions are read, not
        # recomputed; without one (a data module on its own) they follow from the trainer and the config
        self.plan = plan
        # Build a missing dataset once, on global rank 0 only: on a shared filesystem two nodes'
        # local rank 0 would otherwise write the same folder at once.
        self.prepare_data_per_node = False
        self.info: Optional[DatasetInfo] = None
        self.dataset = None
        self.loader = None  # the last training loader made (its fetch_s: this rank's wait for batches)
        self.num_canonical_nodes: Optional[int] = None  # data.num_canonical_nodes resolved (setup)
        self.buckets: list[dict] = []  # the aspect-ratio buckets read (setup)

    def prepare_data(self) -> None:
        build_missing(self.cfg)  # a no-op when framework.train built it before the model

    def setup(self, stage: Optional[str] = None) -> None:
        if self.dataset is not None:
            return
        if self.trainer is not None:
            # Streaming partitions samples by these variables; Lightning knows them before
            # torch.distributed may even be initialised (and they are absent on a single device).
            t = self.trainer
            os.environ.update(RANK=str(t.global_rank), WORLD_SIZE=str(t.world_size),
                              LOCAL_RANK=str(t.local_rank), LOCAL_WORLD_SIZE=str(t.num_devices))
        self.info = read_dataset_info(self.cfg.path, self.cfg.local)
        if self.plan is not None:
            data_parallel, setting = self.plan.data_parallel, self.plan.num_canonical_nodes
        else:
            world = self.trainer.world_size if self.trainer is not None else 1
            data_parallel, setting = max(world // self.replication, 1), self.cfg.num_canonical_nodes
        global_batch = self.cfg.batch_size * data_parallel
        if self.info.buckets:
            self.buckets = self._usable_buckets(global_batch)
            self.info.buckets = self.buckets  # what the checkpoint records as the sizes the model was trained at
        if self.cfg.drop_last and self.info.num_samples < global_batch:
            # Streaming would deal every rank less than one batch and the run would end at step 0, silently.
            raise ValueError(f"the dataset at data.path={self.cfg.path} has {self.info.num_samples} samples, fewer than "
                             f"one global batch ({self.cfg.batch_size} per rank x {global_batch // self.cfg.batch_size}"
                             f" data-parallel ranks = {global_batch}); lower data.batch_size")
        # auto: the run plan resolved it, printed the choice and checked it against the job's node count
        ncn = self.num_canonical_nodes = canonical_nodes(setting, self.info.num_samples)
        if ncn is not None and self.info.num_samples <= ncn:
            raise ValueError(f"the dataset at data.path={self.cfg.path} has {self.info.num_samples} samples, not more "
                             f"than data.num_canonical_nodes={ncn} (Streaming's partitions): lower "
                             f"data.num_canonical_nodes (a number the node counts you will run on divide)")
        self.dataset = self._build_dataset()

    def _usable_buckets(self, global_batch: int) -> list[dict]:
        """The buckets training reads. Every global batch comes from one bucket (Streaming's per-stream batching),
        so each epoch leaves out the remainder of each bucket's samples modulo the global batch, and a bucket smaller
        than one global batch entirely; both are said here rather than dropped in silence."""
        from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

        used = [b for b in self.info.buckets if b["num_samples"] >= global_batch]
        small = [b for b in self.info.buckets if b["num_samples"] < global_batch]
        from data_prep.buckets import bucket_name as name

        kind = "clip" if any("frames" in b for b in self.info.buckets) else "aspect-ratio"
        if not used:
            raise ValueError(f"every {kind} bucket of {self.cfg.path} has fewer samples than one global batch "
                             f"({global_batch}): " + ", ".join(f"{name(b)}: {b['num_samples']}" for b in small)
                             + "; lower data.batch_size or precompute with fewer buckets")
        if small:
            lost = sum(b["num_samples"] for b in small)
            rank_zero_warn(f"data: {len(small)} {kind} buckets have fewer samples than a global batch ({global_batch}) "
                           f"and are left out ({lost} of {self.info.num_samples} samples): "
                           + ", ".join(f"{name(b)}: {b['num_samples']}" for b in small))
        remainder = sum(b["num_samples"] % global_batch for b in used)
        rank_zero_info(f"data: {len(used)} {kind} buckets, each global batch from one; each epoch leaves about "
                       f"{remainder} samples out (each bucket's count modulo {global_batch}), different ones each epoch")
        return used

    def _build_dataset(self):
        from framework.data.shards import ShardDataset  # a StreamingDataset whose failures are raised

        cfg = self.cfg
        if is_remote(cfg.path) or cfg.local:
            remote, local = cfg.path, cfg.local  # Streaming copies/downloads shards into `local`
        else:
            remote, local = None, cfg.path
        dataset = None if is_remote(cfg.path) else Path(cfg.path).expanduser()
        cache = Path(cfg.local).expanduser() if cfg.local else None
        if cache is not None and dataset is not None and cache.resolve() == dataset.resolve():
            cache = None  # data.local = data.path: read in place
        # With buckets: one Streaming stream per bucket folder, batches drawn per stream.
        subdirs = [b["dir"] for b in self.buckets] or [None]
        join = lambda root, sub: root if sub is None or root is None else f"{str(root).rstrip('/')}/{sub}"
        for sub in subdirs:
            check_shards_once(None if dataset is None else Path(join(dataset, sub)),
                              None if cache is None else Path(join(cache, sub)), cfg.path, cfg.validate)
        try:
            where: dict[str, Any] = {"remote": remote, "local": str(Path(local).expanduser()) if local else local}
            if self.buckets:
                from streaming import Stream

                where = {"streams": [Stream(remote=join(remote, sub), local=join(where["local"], sub)) for sub in subdirs],
                         "batching_method": "per_stream"}
            make = lambda: ShardDataset(  # noqa: E731
                **where,
                batch_size=cfg.batch_size, shuffle=cfg.shuffle,
                shuffle_seed=self.seed if cfg.shuffle_seed is None else cfg.shuffle_seed,
                predownload=cfg.predownload, cache_limit=cfg.cache_limit,
                num_canonical_nodes=self.num_canonical_nodes, shuffle_algo=cfg.shuffle_algo,
                shuffle_block_size=cfg.shuffle_block_size, download_retry=cfg.download_retry,
                download_timeout=cfg.download_timeout,
                replication=self.replication if self.replication > 1 else None,
            )
            return open_streaming(make)
        except Exception as err:
            raise RuntimeError(f"could not open the shards of {cfg.path} (local cache {local}): "
                               f"{type(err).__name__}: {err}") from err

    def train_dataloader(self):
        if self.dataset is None:
            self.setup("fit")
        if self.cfg.num_workers:
            check_socket_room()
        # A StreamingDataLoader has state_dict/load_state_dict, so Lightning's fit loop stores it in
        # checkpoints ("combined_loader") and restores it on resume; because the loader has a
        # length, Lightning does not prefetch a batch ahead, so the saved sample count is exact.
        self.loader = timed_loader()(
            self.dataset, batch_size=self.cfg.batch_size, num_workers=self.cfg.num_workers,
            collate_fn=LatentCollate(self.info.scaling_factor, self.info.shift_factor, self.info.downsample,
                                     self.info.text_storage, self.info.caption_layout),
            drop_last=self.cfg.drop_last, persistent_workers=self.cfg.persistent_workers,
            pin_memory=torch.cuda.is_available(),  # lets Lightning copy batches to the GPU asynchronously
        )
        return self.loader

    def fetch_seconds(self) -> float:
        """The time this rank's training loader has spent producing batches so far (its own wait: not a peer's)."""
        return self.loader.fetch_s if self.loader is not None else 0.0

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """What is drawn per sample and step, here on the host before the copy to the device, from the run's seed
        (`draws`, as the training step draws its noise): a per_image dataset's batch keeps the caption drawn for each
        sample; a posterior=distribution dataset's latents become a draw of each posterior, and data.hflip mirrors
        the samples it draws."""
        if not isinstance(batch, dict) or not ("caption_counts" in batch or "latents_std" in batch or self.cfg.hflip):
            return batch
        if self.draws is None:
            raise ValueError("this batch needs per-sample draws (a caption per image, a posterior sample or a flip): "
                             "give LatentDataModule draws=, as framework.train does (framework.training.draws)")
        draws = self.draws(self.trainer, self.seed)
        if "caption_counts" in batch:
            batch = choose_captions(batch, draws.captions(batch["caption_counts"]))
        if "latents_std" in batch or self.cfg.hflip:
            batch = dict(batch)
            batch["latents"] = draws.latents(batch["latents"], batch.pop("latents_std", None), self.cfg.hflip)
        return batch

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """The batch's tensors to the device; its captions and keys (lists of strings) stay as they are, without
        Lightning's walk over every element of every list (a millisecond a step at batch 64)."""
        if not isinstance(batch, dict):
            return super().transfer_batch_to_device(batch, device, dataloader_idx)
        return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
