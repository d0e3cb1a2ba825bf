"""`python -m data_prep.precompute`: encode an image-caption source once into MDS shards.

Layout of the output folder (every rank writes its own sub-folder, also when there is only one):

    out/precompute.json          config fingerprint, written FIRST (refuses a different config later)
    out/rank_00000/...           this rank's MDS shards + index.json + done.json (rank finished)
    out/index.json               merged index (streaming.base.util.merge_index)
    out/bucket_<h>x<w>/...       with `buckets=`: one MDS folder per aspect-ratio bucket instead (its rank_* folders
                                 and merged index.json), latents at the bucket's shape (data_prep/buckets.py)
    out/empty_caption.safetensors  the "" caption's embedding, for train-time caption dropout
    out/dataset.json             written LAST: the completion marker the trainer reads
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
import shutil
import time
from collections import OrderedDict
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from PIL import Image

from data_prep.config import PrecomputeConfig, SourceConfig, register_configs
from data_prep.encoders import ImageCodec, TextEncoder, load_image_codec, load_text_encoder
from data_prep.record import DATASET_FILE, FORMAT_VERSION, DatasetRecord, write_json_atomic
from data_prep.sources import Record, get_source

FINGERPRINT_FILE = "precompute.json"
EMPTY_CAPTION_FILE = "empty_caption.safetensors"
PROMPTS_FILE = "prompts.safetensors"  # the grid prompts' embeddings, one tensor per prompt (keys "0", "1", ...)
GRID_PROMPTS = 8  # captions kept as grid prompts when neither the config nor the source names any
RANK_DONE_FILE = "done.json"


def log(msg: str) -> None:
    print(f"[precompute] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# Config plumbing
# ---------------------------------------------------------------------------------------------


def as_config(cfg: Any) -> PrecomputeConfig:
    """Accept a PrecomputeConfig, a Hydra DictConfig or a plain dict (DataConfig.prepare)."""
    if isinstance(cfg, PrecomputeConfig):
        return cfg
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True)
    cfg = dict(cfg)
    source = cfg.pop("source", {}) or {}
    if isinstance(source, str):  # prepare: {source: digits}
        source = {"name": source}
    return PrecomputeConfig(source=SourceConfig(**source), **cfg)


def fingerprint(cfg: PrecomputeConfig) -> dict:
    """What determines the dataset's content. Batch size, device and progress bars do not."""
    resolve = lambda spec, builtin: spec if spec == builtin else str(Path(spec).expanduser().resolve())
    source = asdict(cfg.source)
    for field_, reader in (("pairs_per_combination", "digit_pairs"), ("scenes", "shapes")):
        if cfg.source.name != reader:  # a field only that source reads: other datasets keep their fingerprints
            source.pop(field_)
    content = {
        "source": source, "vae": resolve(cfg.vae, "pixel"),
        "text_encoder": resolve(cfg.text_encoder, "minilm"), "resolution": cfg.resolution,
        "image_mode": cfg.image_mode, "posterior": cfg.posterior, "max_tokens": cfg.max_tokens,
        "shard_size": cfg.shard_size, "compression": cfg.compression, "format_version": FORMAT_VERSION,
    }
    if cfg.width is not None:
        content["width"] = cfg.width
    if cfg.prompts:  # only when given: datasets built without them keep their fingerprints
        content["prompts"] = list(cfg.prompts)
    if cfg.buckets is not None:  # likewise
        content["buckets"] = cfg.buckets if isinstance(cfg.buckets, str) else [list(map(int, s)) for s in cfg.buckets]
    digest = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]
    return {"fingerprint": digest, "config": content}


def _world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from the launcher: torchrun's RANK / WORLD_SIZE / LOCAL_RANK, else srun's
    SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID (srun sets no RANK: without these its tasks would each be rank 0
    of 1 and write the same rank_00000 folder), else one process."""
    env = os.environ
    if "RANK" in env or "SLURM_PROCID" not in env:
        return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))
    return int(env["SLURM_PROCID"]), int(env.get("SLURM_NTASKS", 1)), int(env.get("SLURM_LOCALID", 0))


# ---------------------------------------------------------------------------------------------
# Images
# ---------------------------------------------------------------------------------------------


def open_image(image: Any, mode: str) -> Image.Image:
    """bytes / path / uint8 array -> a decoded PIL image in `mode`; raises on bad input."""
    if image is None:
        raise ValueError("no image in the record")
    if isinstance(image, np.ndarray):
        img = Image.fromarray(image)
    else:
        img = Image.open(io.BytesIO(image) if isinstance(image, bytes) else image)
        img.load()  # decode now: truncated files raise here, not later inside the encoder
    return img.convert(mode)


def cover_crop(img: Image.Image, out_h: int, out_w: int) -> tuple[Image.Image, int, int]:
    """Scale to cover out_h x out_w, then centre-crop to it: (image, crop top, crop left), the crop's corner in the
    scaled image (SDXL's crop coordinates)."""
    if img.size == (out_w, out_h):
        return img, 0, 0
    w, h = img.size
    s = max(out_w / w, out_h / h)
    img = img.resize((max(out_w, round(w * s)), max(out_h, round(h * s))), Image.BICUBIC)
    w, h = img.size
    left, top = (w - out_w) // 2, (h - out_h) // 2
    return img.crop((left, top, left + out_w, top + out_h)), top, left


def to_tensor(img: Image.Image) -> torch.Tensor:
    """(C, H, W) float32 in [-1, 1]."""
    arr = np.asarray(img, dtype=np.float32).reshape(img.size[1], img.size[0], -1)  # (H, W, C)
    return torch.from_numpy(arr).permute(2, 0, 1) / 127.5 - 1.0


def load_pixels(image: Any, mode: str, resolution: int, width: int | None = None) -> torch.Tensor:
    """bytes / path / uint8 array -> (C, resolution, width or resolution) float32 in [-1, 1]; raises on bad input."""
    return to_tensor(cover_crop(open_image(image, mode), resolution, width or resolution)[0])


def _batches(records: Iterator[Record], size: int) -> Iterator[list[Record]]:
    batch: list[Record] = []
    for r in records:
        batch.append(r)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


# ---------------------------------------------------------------------------------------------
# One rank's work
# ---------------------------------------------------------------------------------------------


class CaptionCache:
    """Caption embeddings kept for reuse, at most `max_bytes` of them, the least recently used dropped first.

    A caption seen again (digits has only 50; web data repeats stock captions) is not encoded again while it is
    kept. Per-token embeddings are large (T5-XXL: 4096 x fp16 a token, about 1 MB for a long caption), so an
    unbounded table would grow with the number of distinct captions, hundreds of GiB over millions of them.
    """

    def __init__(self, encoder: TextEncoder, batch_size: int, max_bytes: float = float("inf")) -> None:
        self.encoder, self.batch_size, self.max_bytes = encoder, batch_size, max_bytes
        self.table: OrderedDict[str, np.ndarray] = OrderedDict()  # oldest use first
        self.bytes = 0
        self.encoded = 0  # captions sent to the encoder so far

    def __call__(self, captions: list[str]) -> list[np.ndarray]:
        unique = dict.fromkeys(captions)
        found = {c: self.table[c] for c in unique if c in self.table}
        for c in found:
            self.table.move_to_end(c)
        todo = [c for c in unique if c not in found]
        for i in range(0, len(todo), self.batch_size):
            chunk = todo[i:i + self.batch_size]
            for c, emb in zip(chunk, self.encoder.encode(chunk)):
                found[c] = emb.numpy().astype(np.float16)  # (L_i, D)
                self._keep(c, found[c])
            self.encoded += len(chunk)
        return [found[c] for c in captions]

    def _keep(self, caption: str, emb: np.ndarray) -> None:
        self.table[caption] = emb
        self.bytes += emb.nbytes
        while self.bytes > self.max_bytes and self.table:
            self.bytes -= self.table.popitem(last=False)[1].nbytes


def encode_rank(cfg: PrecomputeConfig, source, codec: ImageCodec, text: TextEncoder, mode: str,
                rank_dir: Path, rank: int, world: int, buckets: list[tuple[int, int]] | None = None) -> dict:
    """Encode this rank's share (records i with i % world == rank) into rank_dir (with buckets: into each
    bucket's folder, out/bucket_<h>x<w>/rank_<r>); returns its stats."""
    from contextlib import ExitStack

    from streaming import MDSWriter
    from tqdm import tqdm

    from data_prep.buckets import bucket_dir, nearest_bucket

    columns = {"latents": "ndarray:float16", "text_embeds": "ndarray:float16", "caption": "str", "key": "str"}
    if source.num_classes is not None:
        columns["label"] = "int"
    if buckets is not None:  # SDXL-style micro-conditioning needs the source size and the crop
        columns.update({"bucket": "int", "original_size": "ndarray:int32", "crop_top_left": "ndarray:int32"})
    captions = CaptionCache(text, cfg.batch_size, cfg.caption_cache_mb * 2**20)
    stats = {"images": 0, "rows": 0, "bad_images": 0, "missing_captions": 0, "examples": [], "first_captions": [],
             "bucket_rows": {}}
    total = source.size()
    bar = tqdm(total=None if total is None else -(-total // world) if world > 1 else total,
               disable=not cfg.progress, desc=f"encode rank {rank}", unit="img")
    start = time.perf_counter()
    mine = (r for i, r in enumerate(source.records()) if i % world == rank)
    with ExitStack() as stack:
        writers: dict[int, Any] = {}

        def writer(b: int):  # one per bucket (b = -1 without buckets), opened at its first image
            if b not in writers:
                out = rank_dir if b < 0 else rank_dir.parent / bucket_dir(buckets[b]) / rank_dir.name
                writers[b] = stack.enter_context(MDSWriter(out=str(out), columns=columns, compression=cfg.compression,
                                                           hashes=["xxh64"], size_limit=cfg.shard_size))
            return writers[b]

        if buckets is None:
            writer(-1)  # the single folder exists even when every record is bad (the error below names them)
        for batch in _batches(mine, cfg.batch_size):
            groups: dict[int, list[tuple[Record, torch.Tensor, dict]]] = {}
            for r in batch:
                if not r.captions:
                    stats["missing_captions"] += 1
                    stats["examples"].append(f"{r.key}: missing caption")
                    continue
                try:
                    img = open_image(r.image, mode)
                    if buckets is None:
                        b, (h, w) = -1, (cfg.resolution, cfg.width or cfg.resolution)
                    else:
                        b = nearest_bucket(img.size[1], img.size[0], buckets)
                        h, w = buckets[b]
                    extra = {"bucket": b, "original_size": np.array([img.size[1], img.size[0]], dtype=np.int32)}
                    img, top, left = cover_crop(img, h, w)
                    extra["crop_top_left"] = np.array([top, left], dtype=np.int32)
                    groups.setdefault(b, []).append((r, to_tensor(img), extra))
                except Exception as err:  # unreadable/truncated: skip, count, report
                    stats["bad_images"] += 1
                    stats["examples"].append(f"{r.key}: unreadable image ({type(err).__name__}: {err})")
            bar.update(len(batch))
            for b, group in sorted(groups.items()):
                latents = codec.encode(torch.stack([g[1] for g in group])).cpu().numpy().astype(np.float16)  # (B, c, h, w)
                for (r, _, extra), lat in zip(group, latents):
                    if len(stats["first_captions"]) < GRID_PROMPTS and r.captions[0] not in stats["first_captions"]:
                        stats["first_captions"].append(r.captions[0])
                    for j, (caption, emb) in enumerate(zip(r.captions, captions(r.captions))):
                        row = {"latents": lat, "text_embeds": emb, "caption": caption, "key": f"{r.key}#{j}"}
                        if "label" in columns:
                            row["label"] = int(r.label)
                        if buckets is not None:
                            row.update(extra)
                        writer(b).write(row)
                        stats["rows"] += 1
                        stats["bucket_rows"][str(b)] = stats["bucket_rows"].get(str(b), 0) + 1
                stats["images"] += len(group)
                stats.setdefault("latent_shape", list(latents.shape[1:]))
    bar.close()
    stats["seconds"] = time.perf_counter() - start
    seen = stats["images"] + stats["bad_images"] + stats["missing_captions"]
    bad = stats["bad_images"] + stats["missing_captions"]
    if seen == 0 or stats["images"] == 0:
        raise RuntimeError(f"rank {rank}: no usable image-caption pairs in source={cfg.source.name} "
                           f"(path={cfg.source.path}); {bad} unusable: {stats['examples'][:5]}")
    if bad:
        log(f"rank {rank}: skipped {stats['bad_images']} unreadable images and {stats['missing_captions']} "
            f"missing captions of {seen}, e.g. {stats['examples'][:3]}")
    if bad / seen > cfg.max_bad_fraction:
        raise RuntimeError(
            f"rank {rank}: {bad} of {seen} records unusable ({stats['bad_images']} unreadable images, "
            f"{stats['missing_captions']} missing captions) > max_bad_fraction={cfg.max_bad_fraction}. "
            f"First ones: {stats['examples'][:5]}. Fix the source or raise max_bad_fraction. "
            f"No dataset.json was written, so this output is not treated as complete."
        )
    stats["examples"] = stats["examples"][:20]
    return stats


# ---------------------------------------------------------------------------------------------
# Finishing: merge ranks, write the empty caption and dataset.json (rank 0 only)
# ---------------------------------------------------------------------------------------------


def _wait_for_ranks(out: Path, world: int, timeout: float) -> list[dict]:
    deadline = time.monotonic() + timeout
    done = [out / f"rank_{r:05d}" / RANK_DONE_FILE for r in range(world)]
    while not all(p.is_file() for p in done):
        if time.monotonic() > deadline:
            missing = [str(p.parent) for p in done if not p.is_file()]
            raise TimeoutError(f"ranks did not finish within merge_timeout_s={timeout}: {missing}")
        time.sleep(1.0)
    return [json.loads(p.read_text()) for p in done]


def _merge(root: Path, world: int) -> None:
    """root/index.json from the ranks' root/rank_*/index.json (a rank with no rows there has none)."""
    from streaming.base.util import merge_index

    (root / "index.json").unlink(missing_ok=True)  # a stale merge from an interrupted run; merge_index won't overwrite
    parts = [root / f"rank_{r:05d}" / "index.json" for r in range(world)]
    merge_index([str(p) for p in parts if p.is_file()], str(root))


def bucket_table(stats: list[dict], buckets: list[tuple[int, int]], downsample: int) -> list[dict]:
    """dataset.json's `buckets`: each size, its folder, latent size and row count (every rank's)."""
    from data_prep.buckets import bucket_dir

    rows = lambda b: sum(s["bucket_rows"].get(str(b), 0) for s in stats)
    return [{"size": [h, w], "dir": bucket_dir((h, w)), "latent_size": [h // downsample, w // downsample],
             "num_samples": rows(b)} for b, (h, w) in enumerate(buckets)]


def finish(cfg: PrecomputeConfig, fp: dict, source, codec: ImageCodec, text: TextEncoder, mode: str,
           out: Path, world: int, buckets: list[tuple[int, int]] | None = None) -> DatasetRecord:
    from safetensors.torch import save_file

    from data_prep.buckets import nearest_bucket

    stats = _wait_for_ranks(out, world, cfg.merge_timeout_s)
    if buckets is None:
        _merge(out, world)
    else:
        table = bucket_table(stats, buckets, codec.downsample)
        for row in table:
            if row["num_samples"]:
                _merge(out / row["dir"], world)
    empty = text.encode([""])[0].to(torch.float16).contiguous()  # (L0, D)
    save_file({"text_embeds": empty}, str(out / EMPTY_CAPTION_FILE))
    prompts = list(cfg.prompts or source.grid_prompts() or stats[0]["first_captions"])
    save_file({str(i): e.to(torch.float16).contiguous() for i, e in enumerate(text.encode(prompts))},
              str(out / PROMPTS_FILE))
    latent_shape = stats[0]["latent_shape"]
    extra: dict[str, Any] = {}
    if buckets is not None:
        # The model's base size (its sample_size): the square bucket's side (PixArt's 256 / 512 / 1024), or that of
        # the square as large as the bucket nearest 1:1, in latents, even (2x2 patches).
        h, w = buckets[nearest_bucket(1, 1, buckets)]
        base = 2 * max(1, round(math.sqrt(h * w) / (2 * codec.downsample)))
        latent_shape = [latent_shape[0], base, base]
        extra = {"buckets": table, "bucket_spec": cfg.buckets if isinstance(cfg.buckets, str) else "list"}
        log("buckets: " + ", ".join(f"{r['size'][0]}x{r['size'][1]}: {r['num_samples']}" for r in table if r["num_samples"])
            + f" ({sum(1 for r in table if not r['num_samples'])} of {len(table)} empty)")
    record = DatasetRecord(
        format_version=FORMAT_VERSION,
        fingerprint=fp["fingerprint"],
        image_codec={"name": cfg.vae, "class": codec.class_name},
        text_encoder={"name": cfg.text_encoder, "class": text.class_name, "max_tokens": text.max_tokens},
        latent_channels=int(latent_shape[0]),
        latent_size=[int(latent_shape[1]), int(latent_shape[2])],
        downsample=codec.downsample,
        scaling_factor=codec.scaling_factor,
        shift_factor=codec.shift_factor,
        posterior=codec.posterior,
        text_dim=text.dim,
        image_mode=mode,
        resolution=cfg.resolution if buckets is None else latent_shape[1] * codec.downsample,
        width=cfg.width,
        num_samples=sum(s["rows"] for s in stats),
        num_images=sum(s["images"] for s in stats),
        skipped={"bad_images": sum(s["bad_images"] for s in stats),
                 "missing_captions": sum(s["missing_captions"] for s in stats)},
        num_classes=source.num_classes,
        empty_caption=EMPTY_CAPTION_FILE,
        prompts={"file": PROMPTS_FILE, "texts": prompts},
        columns=["latents", "text_embeds", "caption", "key"] + (["label"] if source.num_classes else [])
        + (["bucket", "original_size", "crop_top_left"] if buckets is not None else []),
        latents_scaled=False,  # the trainer applies (x - shift_factor) * scaling_factor exactly once
        source={"name": cfg.source.name, "path": cfg.source.path, **source.metadata()},
        world_size=world,
        **extra,
    )
    record.write(out)  # LAST: marks the dataset complete
    return record


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


def _check_existing(out: Path, fp: dict, world: int) -> bool:
    """True when a finished dataset with this config exists; raises when `out` holds a different one."""
    marker = out / FINGERPRINT_FILE
    if not marker.is_file():
        if out.is_dir() and any(out.iterdir()):
            raise FileExistsError(f"out={out} exists, is not empty and was not written by data_prep.precompute "
                                  "(no precompute.json). Pick an empty or new folder.")
        return False
    old = json.loads(marker.read_text())
    if old["fingerprint"] != fp["fingerprint"]:
        diff = {k: (old["config"].get(k), v) for k, v in fp["config"].items() if old["config"].get(k) != v}
        raise FileExistsError(f"out={out} holds a dataset made with a different configuration "
                              f"(differences as (existing, requested): {diff}). Use another out= or delete it.")
    if (out / DATASET_FILE).is_file():
        return True
    if old.get("world_size") != world:
        raise FileExistsError(f"out={out}: an interrupted run with WORLD_SIZE={old.get('world_size')} is there; "
                              f"rerun with that many ranks or delete the folder (now WORLD_SIZE={world}).")
    return False


def precompute(cfg: Any, rank: int | None = None, world_size: int | None = None) -> Path:
    """Build the dataset at cfg.out (or do nothing if it is already there); returns its path.

    rank/world_size default to the RANK/WORLD_SIZE environment; pass 0/1 to force one process
    (the data module does, since its prepare_data runs on one rank inside a DDP job).
    """
    cfg = as_config(cfg)
    out = Path(cfg.out).expanduser().resolve()
    env_rank, env_world, local_rank = _world()
    rank = env_rank if rank is None else rank
    world = env_world if world_size is None else world_size
    fp = fingerprint(cfg)
    if _check_existing(out, fp, world):
        log(f"{out} is already complete (dataset.json present, same config); nothing to do.")
        return out
    out.mkdir(parents=True, exist_ok=True)
    if not (out / FINGERPRINT_FILE).is_file():  # written first; every rank writes the same content
        write_json_atomic(out / FINGERPRINT_FILE, {**fp, "world_size": world})

    source = get_source(cfg.source)
    device = cfg.device or (f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    mode = cfg.image_mode or (source.default_image_mode if cfg.vae == "pixel" else "RGB")
    codec = load_image_codec(cfg.vae, device, cfg.dtype, mode, cfg.posterior)
    for key, side in (("resolution", cfg.resolution), ("width", cfg.width)):
        if side is not None and side % codec.downsample and cfg.buckets is None:
            raise ValueError(f"{key}={side} is not a multiple of the VAE's downsample factor {codec.downsample}.")
    buckets = None
    if cfg.buckets is not None:
        from data_prep.buckets import resolve_buckets

        buckets = resolve_buckets(cfg.buckets, 2 * codec.downsample)
    text = load_text_encoder(cfg.text_encoder, device, cfg.dtype, cfg.max_tokens)

    rank_dir = out / f"rank_{rank:05d}"
    if (rank_dir / RANK_DONE_FILE).is_file():
        log(f"rank {rank}: {rank_dir} already finished; skipping to merge.")
    else:
        shutil.rmtree(rank_dir, ignore_errors=True)  # an interrupted run restarts this rank from scratch
        for stale in out.glob(f"bucket_*/{rank_dir.name}"):
            shutil.rmtree(stale, ignore_errors=True)
        stats = encode_rank(cfg, source, codec, text, mode, rank_dir, rank, world, buckets)
        rank_dir.mkdir(parents=True, exist_ok=True)  # with buckets it holds no shards, only this marker
        write_json_atomic(rank_dir / RANK_DONE_FILE, stats)
        log(f"rank {rank}: {stats['images']} images -> {stats['rows']} rows in {stats['seconds']:.1f}s "
            f"({stats['images'] / max(stats['seconds'], 1e-9):.1f} images/s, {device})")
    if rank != 0:
        return out
    record = finish(cfg, fp, source, codec, text, mode, out, world, buckets)
    log(f"wrote {record.num_samples} samples to {out} (latents {record.latent_channels}x"
        f"{record.latent_size[0]}x{record.latent_size[1]}, text dim {record.text_dim})")
    return out


def main() -> None:
    import hydra

    register_configs()

    @hydra.main(version_base="1.3", config_path="../conf", config_name="precompute")
    def _app(cfg) -> None:
        precompute(cfg)

    _app()


if __name__ == "__main__":
    main()
