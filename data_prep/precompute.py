"""`python -m data_prep.precompute`: encode an image-caption source once into MDS shards.

The source is read in input shards (a .tar each, or `records_per_part` files, rows or records) and each one becomes
a part of the output, encoded by one rank that opens only its own inputs (data_prep/parts.py deals them out):

    out/precompute.json          config fingerprint, written FIRST (refuses a different config later)
    out/parts.json               the source's input shards, in order (refuses a resume over other inputs)
    out/part_000000/...          input shard 0's MDS shards + index.json (an MDSWriter folder)
    out/done/part_000000.json    part 0 finished (written once its writers have closed): its stats
    out/index.json               the parts' indexes merged in part order (streaming.base.util.merge_index)
    out/bucket_<h>x<w>/...       with `buckets=`: one MDS folder per aspect-ratio bucket instead (its part_* folders
                                 and merged index.json), latents at the bucket's shape (data_prep/buckets.py)
    out/projection.json          rank 0's estimate of the whole output's size, from its first part (data_prep/storage.py)
    out/empty_caption.safetensors  the "" caption's embedding, for train-time caption dropout
    out/dataset.json             written LAST: the completion marker the trainer reads

A killed run is resumed by running the same command again, on any number of ranks: parts with a done marker are
kept, the others are encoded again from scratch. Each part's rows are in the source's order, so the dataset is the
same whatever the number of ranks and however often it was resumed.

`out` may be an object store's prefix (out=s3://bucket/prefix, data_prep/location.py): every file above then lives
in the bucket, each written on this machine under `staging` first and uploaded from there (Streaming's MDSWriter
uploads the shards), and the markers in the bucket decide what is done. A webdataset's tars may be remote too
(source.path=s3://bucket/tars/{00000..00099}.tar); a rank downloads those of its own parts only, one at a time.
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
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from PIL import Image

from data_prep import storage
from data_prep.config import PrecomputeConfig, SourceConfig, register_configs
from data_prep.encoders import ImageCodec, TextEncoder, load_image_codec, load_text_encoder
from data_prep.filters import RecordFilter, check_source
from data_prep.location import Location, RemoteLocation, open_output
from data_prep.parts import (
    check_parts, done_name, merge, my_parts, part_folders, part_indexes, remove_partial, wait_for_parts,
)
from data_prep.record import DATASET_FILE, DatasetRecord, latent_frame_count, record_version
from data_prep.sources import Record, get_source

FINGERPRINT_FILE = "precompute.json"
PROJECTION_FILE = "projection.json"
EMPTY_CAPTION_FILE = "empty_caption.safetensors"
PROMPTS_FILE = "prompts.safetensors"  # the grid prompts' embeddings, one tensor per prompt (keys "0", "1", ...)
PHASES = ("decode", "wait", "encode", "write")  # the timed phases of a part (encode_part), in its done marker
GRID_PROMPTS = 8  # captions kept as grid prompts when neither the config nor the source names any


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
    resolve = lambda spec, *builtin: spec if spec in builtin else str(Path(spec).expanduser().resolve())
    source = asdict(cfg.source)
    for field_, reader in (("pairs_per_combination", "digit_pairs"), ("scenes", "shapes")):
        if cfg.source.name != reader:  # a field only that source reads: other datasets keep their fingerprints
            source.pop(field_)
    if source.get("labels") is None:  # likewise when not set
        source.pop("labels", None)
    content = {
        "source": source, "vae": resolve(cfg.vae, "pixel"),
        "text_encoder": resolve(cfg.text_encoder, "minilm", "none"), "resolution": cfg.resolution,
        "image_mode": cfg.image_mode, "posterior": cfg.posterior, "max_tokens": cfg.max_tokens,
        "shard_size": cfg.shard_size, "compression": cfg.compression,
        "format_version": record_version(cfg.text_storage, cfg.caption_layout, cfg.posterior, cfg.num_frames,
                                         clip_buckets=cfg.clip_buckets),
    }
    # Only when set, like the keys below: datasets built without them keep their fingerprints.
    optional = {"text_storage": cfg.text_storage if cfg.text_storage != "fp16" else None, "min_size": cfg.min_size,
                "max_aspect": cfg.max_aspect, "filters": cfg.filters or None,
                "caption_layout": cfg.caption_layout if cfg.caption_layout != "per_caption" else None,
                "text_prefix": cfg.text_prefix or None, "num_frames": cfg.num_frames, "fps": cfg.fps,
                "vae_tile": cfg.vae_tile, "split": [cfg.split, cfg.val_fraction] if cfg.split != "all" else None}
    content.update({k: v for k, v in optional.items() if v is not None})
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
    of 1 and encode every part), else one process."""
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


def to_tensor(img: Image.Image | np.ndarray) -> torch.Tensor:
    """(C, H, W) float32 in [-1, 1], from a PIL image or its uint8 pixels (H, W) / (H, W, C); a clip's frames
    (F, H, W, C) give (F, C, H, W)."""
    arr = np.asarray(img, dtype=np.float32)
    if arr.ndim == 4:
        return torch.from_numpy(arr).permute(0, 3, 1, 2) / 127.5 - 1.0
    arr = arr.reshape(arr.shape[0], arr.shape[1], -1)  # (H, W, C)
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
        # What is kept, and returned, per caption: by default its fp16 array; precompute sets the rows' text columns
        # in the dataset's text_storage (storage.encode_text), so an int8 dataset's cache holds half the bytes.
        self.store: Callable[[torch.Tensor], Any] = lambda emb: emb.numpy().astype(np.float16)
        self.table: OrderedDict[str, Any] = OrderedDict()  # oldest use first
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
                found[c] = self.store(emb)  # (L_i, D) or the row's text columns
                self._keep(c, found[c])
            self.encoded += len(chunk)
        return [found[c] for c in captions]

    def _keep(self, caption: str, emb: Any) -> None:
        self.table[caption] = emb
        self.bytes += storage.nbytes(emb)
        while self.bytes > self.max_bytes and self.table:
            self.bytes -= storage.nbytes(self.table.popitem(last=False)[1])


def _image_buckets(cfg: PrecomputeConfig, buckets: list | None) -> list | None:
    """The buckets of an image dataset, whose rows carry SDXL-style micro-conditioning; None for clips."""
    return None if cfg.num_frames is not None else buckets


def _columns(source, buckets: list[tuple[int, int]] | None, text_storage: str,
             caption_layout: str = "per_caption", posterior: str = "mean", text: bool = True) -> dict[str, str]:
    """The rows' MDS columns; text=False (text_encoder=none): no text embedding columns."""
    columns = {"latents": "ndarray:float16", **(storage.text_columns(text_storage) if text else {})}
    if posterior == "distribution":  # the posterior's std beside its mean (latents): training samples it
        columns["latents_std"] = "ndarray:float16"
    if caption_layout == "per_image":  # every caption's tokens one after the other, and where each ends
        columns.update({"text_lengths": "ndarray:int32", "captions": "json"})
    else:
        columns["caption"] = "str"
    columns["key"] = "str"
    if source.num_classes is not None:
        columns["label"] = "int"
    if buckets is not None:  # SDXL-style micro-conditioning needs the source size and the crop
        columns.update({"bucket": "int", "original_size": "ndarray:int32", "crop_top_left": "ndarray:int32"})
    return columns


# ---------------------------------------------------------------------------------------------
# Decoding: in the encoding process, or in DataLoader workers while it encodes
# ---------------------------------------------------------------------------------------------


@dataclass
class Decoded:
    """One record after decoding: what the encoder needs of it (its pixels at the output size, uint8 (h, w, C), and
    the micro-conditioning), or why it is skipped: ("filtered", filter name), ("bad_images" or "missing_captions",
    the example message). The record travels without its image, back from a worker."""

    record: Record
    bucket: int = -1
    # (h, w, C) uint8: a quarter of float32's bytes through the workers' queue. A numpy array, pickled into the queue:
    # a tensor would pass as a file descriptor over a Unix socket under TMPDIR (framework.data.datamodule's
    # check_socket_room says what a long TMPDIR does to that), one descriptor per image in flight.
    pixels: np.ndarray | None = None
    extra: dict = field(default_factory=dict)
    skip: tuple[str, str] | None = None


def decode_record(r: Record, cfg: PrecomputeConfig, mode: str, buckets: list[tuple[int, int]] | None,
                  keep: RecordFilter) -> Decoded:
    """Read, decode, filter, resize and crop one record: all that happens to it before the encoder."""
    from data_prep.buckets import nearest_bucket

    bare = Record(key=r.key, image=None, captions=r.captions, label=r.label, meta=r.meta)
    # Before the caption: a dropped record is not a bad one (nor one of the other split).
    if (dropped := keep.check_split(r.key) or keep.check_meta(r.meta)) is not None:
        return Decoded(bare, skip=("filtered", dropped))
    if not r.captions:
        return Decoded(bare, skip=("missing_captions", f"{r.key}: missing caption"))
    if cfg.num_frames is not None:
        return decode_clip(r, bare, cfg, mode, keep, buckets)
    try:
        img = open_image(r.image, mode)
        if (dropped := keep.check_decoded(r.meta, img.size[1], img.size[0])) is not None:
            return Decoded(bare, skip=("filtered", dropped))
        if buckets is None:
            b, (h, w) = -1, (cfg.resolution, cfg.width or cfg.resolution)
        else:
            b = nearest_bucket(img.size[1], img.size[0], buckets)
            h, w = buckets[b]
        extra = {"bucket": b, "original_size": np.array([img.size[1], img.size[0]], dtype=np.int32)}
        img, top, left = cover_crop(img, h, w)
        extra["crop_top_left"] = np.array([top, left], dtype=np.int32)
        return Decoded(bare, b, np.array(img, dtype=np.uint8).reshape(h, w, -1), extra)
    except Exception as err:  # unreadable/truncated: skip, count, report
        return Decoded(bare, skip=("bad_images", f"{r.key}: unreadable image ({type(err).__name__}: {err})"))


def decode_clip(r: Record, bare: Record, cfg: PrecomputeConfig, mode: str, keep: RecordFilter,
                buckets: list[tuple[int, int, int]] | None = None) -> Decoded:
    """A video record's clip (data_prep/video.py), each frame cropped like an image: pixels (F, h, w, C). With
    buckets ((frames, h, w)), the clip's bucket: the longest frame count it has, the size nearest its aspect ratio."""
    from data_prep.buckets import nearest_clip_bucket
    from data_prep.video import ShortVideo, read_clip

    counts = cfg.frame_counts
    try:
        frames = read_clip(r.image, counts[-1], cfg.fps, mode, min_frames=counts[0])
    except ShortVideo as err:
        return Decoded(bare, skip=("bad_images", f"{r.key}: too short ({err})"))
    except Exception as err:  # not a video, truncated, no video stream
        return Decoded(bare, skip=("bad_images", f"{r.key}: unreadable video ({type(err).__name__}: {err})"))
    if (dropped := keep.check_decoded(r.meta, frames[0].size[1], frames[0].size[0])) is not None:
        return Decoded(bare, skip=("filtered", dropped))
    if buckets is None:
        b, (h, w) = -1, (cfg.resolution, cfg.width or cfg.resolution)
    else:
        b = nearest_clip_bucket(len(frames), frames[0].size[1], frames[0].size[0], buckets)
        count, h, w = buckets[b]
        frames = frames[:count]
    # No micro-conditioning: the video families take none.
    return Decoded(bare, b, np.stack([np.array(cover_crop(f, h, w)[0], dtype=np.uint8).reshape(h, w, -1) for f in frames]))


def _pixels(d: Decoded, stats: dict) -> tuple[int, torch.Tensor, dict] | None:
    """(bucket, or -1 without buckets; pixels (C, h, w) in [-1, 1]; micro-conditioning) of a decoded record, or None
    when it was filtered out or unusable (counted in stats, here in the encoding process and in the source's order)."""
    if d.skip is None:
        return d.bucket, to_tensor(d.pixels), d.extra
    kind, what = d.skip
    if kind == "filtered":
        stats["filtered"][what] += 1
    else:
        stats[kind] += 1
        stats["examples"].append(what)
    return None


class DecodedBatches(torch.utils.data.IterableDataset):
    """One part's records, `batch_size` at a time as the encoder takes them, each batch decoded: (its Decoded records,
    the seconds spent decoding it).

    In a DataLoader with W workers, worker w decodes batches w, w + W, w + 2W, ... and the loader, which asks its
    workers in turn and returns their answers in the order asked, hands them back in the source's order. That holds
    because every batch is answered, skipped records and all, and worker w has at most one batch more than any
    worker after it: no worker runs dry while another still owes a batch that comes before one of its own.
    Each worker reads the whole part (records are cheap to list; the images it decodes are its own only)."""

    def __init__(self, batches: Callable[[], Iterator[list[Record]]], decode: Callable[[Record], Decoded]) -> None:
        self.batches, self.decode = batches, decode  # the part's records in batches, read anew by each process

    def __iter__(self) -> Iterator[tuple[list[Decoded], float]]:
        info = torch.utils.data.get_worker_info()
        w, n = (0, 1) if info is None else (info.id, info.num_workers)
        for c, batch in enumerate(self.batches()):
            if c % n == w:
                start = time.perf_counter()
                yield [self.decode(r) for r in batch], time.perf_counter() - start


def _as_is(item: Any) -> Any:
    return item  # the loader's default would turn the numpy arrays of `extra` into tensors


def decoded_batches(data: DecodedBatches, workers: int) -> Iterator[tuple[list[Decoded], float]]:
    """The batches of `data`, decoded here (workers=0) or by `workers` DataLoader worker processes."""
    if workers == 0:
        return iter(data)
    # fork: the workers inherit the source and the decode settings as they are, nothing pickled (Python 3.14 makes
    # forkserver the default, which would pickle the dataset and its closures)
    return iter(torch.utils.data.DataLoader(data, batch_size=None, num_workers=workers, collate_fn=_as_is,
                                            prefetch_factor=2, multiprocessing_context="fork"))


def _encode_group(group: list[tuple[Record, torch.Tensor, dict]], codec: ImageCodec, captions: CaptionCache,
                  write: Callable[[dict], None], b: int, columns: dict[str, str], stats: dict, clock: dict) -> None:
    """Encode one batch's images of bucket `b` (b = -1 without buckets) and their captions; write their rows."""
    tick = time.perf_counter()
    pixels = torch.stack([g[1] for g in group])  # (B, C, H, W), or clips (B, F, C, H, W)
    frames = pixels.shape[1] if pixels.ndim == 5 and not codec.is_video else None
    if codec.is_video:  # a video VAE takes clips channels first: (B, C, F, H, W) -> (B, c, f, h, w)
        pixels = pixels.transpose(1, 2)
    elif frames is not None:  # the image VAE encodes every frame: (B * F, C, H, W)
        pixels = pixels.flatten(0, 1)
    if "latents_std" in columns:
        encoded = list(codec.encode_distribution(pixels))
    else:
        encoded = [codec.encode(pixels)]  # (B, c, h, w)
    if frames is not None:  # back to clips, channels first: (B, c, F, h, w)
        encoded = [t.unflatten(0, (-1, frames)).transpose(1, 2) for t in encoded]
    latents, *spread = (t.cpu().numpy().astype(np.float16) for t in encoded)
    stds = spread[0] if spread else None
    clock["encode"] += time.perf_counter() - tick  # the latents copied off the device: the work is done
    for i, ((r, _, extra), lat) in enumerate(zip(group, latents)):
        spread = {} if stds is None else {"latents_std": stds[i]}
        if len(stats["first_captions"]) < GRID_PROMPTS and r.captions[0] not in stats["first_captions"]:
            stats["first_captions"].append(r.captions[0])
        tick = time.perf_counter()
        embs = captions(r.captions)
        clock["encode"] += time.perf_counter() - tick
        stats["captions"] += len(embs)
        # (the row's text columns, its other caption columns): per_image one row, its captions' tokens concatenated
        # column by column; per_caption a row per caption
        if "captions" in columns:
            rows = [(storage.concat_text(embs), {"text_lengths": storage.token_counts(embs), "captions": r.captions,
                                                 "key": r.key})]
        else:
            rows = [(emb, {"caption": caption, "key": f"{r.key}#{j}"}) for j, (caption, emb) in
                    enumerate(zip(r.captions, embs))]
        for text, rest in rows:
            text = text if "text_embeds" in columns else {}  # text_encoder=none: class labels only
            row = {"latents": lat, **spread, **text, **rest}
            if "label" in columns:
                row["label"] = int(r.label)
            if "bucket" in columns:
                row.update(extra)
            tick = time.perf_counter()
            write(row)
            clock["write"] += time.perf_counter() - tick
            stats["rows"] += 1
            stats["column_bytes"]["latents"] += lat.nbytes * (1 + len(spread))
            stats["column_bytes"]["text"] += storage.nbytes(text)
            stats["bucket_rows"][str(b)] = stats["bucket_rows"].get(str(b), 0) + 1
    stats["images"] += len(group)
    stats.setdefault("latent_shape", list(latents.shape[1:]))


def encode_part(cfg: PrecomputeConfig, source, shard: Any, codec: ImageCodec, captions: CaptionCache, mode: str,
                out: Location, index: int, buckets: list[tuple[int, int]] | None, bar, dealt: dict,
                keep: RecordFilter) -> dict:
    """Encode input shard `shard` into part `index` (out/part_<index>, or with buckets each bucket's
    out/bucket_<h>x<w>/part_<index>), rows in the source's order; then mark the part done with its stats."""
    from contextlib import ExitStack

    from streaming import MDSWriter

    folders = part_folders(index, buckets)
    columns = _columns(source, _image_buckets(cfg, buckets), cfg.text_storage, cfg.caption_layout, cfg.posterior,
                       cfg.text_encoder != "none")
    stats = {"records": 0, "images": 0, "rows": 0, "captions": 0, "bad_images": 0, "missing_captions": 0, "examples": [],
             "first_captions": [], "bucket_rows": {}, "filtered": dict.fromkeys(keep.names(), 0),
             "column_bytes": {"latents": 0, "text": 0}}
    # Where the part's time goes (perf_counter sums, in the done marker; python -m framework.bench precompute reads
    # them): decode (the decoding processes' own time), wait (this process waiting for decoded batches), encode (the
    # image codec and text encoder calls, results copied off the device) and write (the MDS writers, closing
    # included). They cost a clock read per call.
    clock = dict.fromkeys(PHASES, 0.0)
    start = time.perf_counter()
    with ExitStack() as stack:
        writers: dict[int, Any] = {}

        def writer(b: int):  # one per bucket (b = -1 without buckets), opened at its first row
            if b not in writers:  # a remote out: (staging folder, remote folder), each shard uploaded once written
                writers[b] = stack.enter_context(MDSWriter(out=out.writer_out(folders[max(b, 0)]), columns=columns,
                                                           compression=cfg.compression, hashes=["xxh64"],
                                                           size_limit=cfg.shard_size))
            return writers[b]

        decode = partial(decode_record, cfg=cfg, mode=mode, buckets=buckets, keep=keep)
        with source.local_shard(shard) as local:  # a remote tar: downloaded once, here, for every worker to read
            data = DecodedBatches(lambda: _batches(source.shard_records(local), cfg.batch_size), decode)
            tick = time.perf_counter()
            batches = decoded_batches(data, cfg.decode_workers)  # the workers start
            clock["wait"] += time.perf_counter() - tick
            while True:
                tick = time.perf_counter()
                if (got := next(batches, None)) is None:
                    break
                decoded, seconds = got
                clock["wait"] += time.perf_counter() - tick  # without workers: the decoding itself
                clock["decode"] += seconds
                groups: dict[int, list[tuple[Record, torch.Tensor, dict]]] = {}
                for d in decoded:
                    if (px := _pixels(d, stats)) is not None:
                        groups.setdefault(px[0], []).append((d.record, px[1], px[2]))
                bar.update(len(decoded))
                stats["records"] += len(decoded)  # usable or not, filtered or not
                for b, group in sorted(groups.items()):
                    _encode_group(group, codec, captions, lambda row, b=b: writer(b).write(row), b, columns, stats,
                                  clock)  # the writer opens at its first row
            del batches  # the workers exit before the shard's download is deleted
        stats["decode_workers"] = cfg.decode_workers
        closing = time.perf_counter()  # the writers close on leaving: their last shards and index.json written
    closed = time.perf_counter()
    clock["write"] += closed - closing
    stats.update(seconds=closed - start, **{f"seconds_{k}": v for k, v in clock.items()})
    stats["examples"] = stats["examples"][:20]
    # Only now have the writers closed (the last shard and the index.json are on disk, or uploaded): the part may be
    # marked done.
    out.write_json(done_name(index), {**stats, **dealt})
    return stats


def encode_rank(cfg: PrecomputeConfig, source, shards: list[Any], mine: list[int], codec: ImageCodec,
                text: TextEncoder, mode: str, out: Location, round_: int, rank: int, world: int,
                buckets: list[tuple[int, int]] | None = None) -> dict:
    """Encode this rank's parts `mine` one after the other, each marked done as it finishes; returns the totals."""
    from tqdm import tqdm

    captions = CaptionCache(text, cfg.batch_size, cfg.caption_cache_mb * 2**20)  # shared by the rank's parts
    captions.store = lambda emb: storage.encode_text(emb, cfg.text_storage)  # kept as the rows hold it
    keep = RecordFilter.from_config(cfg)
    total = source.size()
    bar = tqdm(total=None if total is None else round(total * len(mine) / len(shards)), disable=not cfg.progress,
               desc=f"encode rank {rank}", unit="img")
    totals = {"images": 0, "rows": 0, "seconds": 0.0, **{f"seconds_{k}": 0.0 for k in PHASES}}
    for i in mine:
        remove_partial(out, i, buckets)
        stats = encode_part(cfg, source, shards[i], codec, captions, mode, out, i, buckets, bar,
                            {"part": i, "shard": shards[i], "rank": rank, "round": round_, "world": world}, keep)
        totals = {k: v + stats[k] for k, v in totals.items()}
        if rank == 0 and i == mine[0] and stats["rows"]:  # the size of the whole output, seen after one part
            folders = [out.fetch(name).parent for name in part_indexes(i, buckets, stats["bucket_rows"])]
            estimate = storage.projection(stats, storage.part_bytes(folders), source.size(), len(shards))
            estimate.update(from_part=i, text_storage=cfg.text_storage, compression=cfg.compression)
            out.write_json(PROJECTION_FILE, estimate)
            log(storage.describe(estimate))
    bar.close()
    return totals


# ---------------------------------------------------------------------------------------------
# Finishing: merge the parts, write the empty caption and dataset.json (rank 0 only)
# ---------------------------------------------------------------------------------------------


def usable_totals(cfg: PrecomputeConfig, stats: list[dict]) -> dict:
    """The parts' counts summed; raises when nothing is usable or more than max_bad_fraction is not."""
    total = {k: sum(s[k] for s in stats) for k in ("images", "rows", "bad_images", "missing_captions")}
    total["filtered"] = {n: sum(s.get("filtered", {}).get(n, 0) for s in stats) for n in RecordFilter.from_config(cfg).names()}
    examples = [e for s in stats for e in s["examples"]]
    bad = total["bad_images"] + total["missing_captions"]
    seen = total["images"] + bad  # the filtered records are not counted: dropped by choice, not unusable
    dropped = ", ".join(f"{n}: {c}" for n, c in total["filtered"].items())
    if total["filtered"]:
        log(f"filtered out {sum(total['filtered'].values())} records before encoding ({dropped})")
    if total["images"] == 0:
        raise RuntimeError(f"no usable image-caption pairs in source={cfg.source.name} (path={cfg.source.path}); "
                           f"{bad} unusable: {examples[:5]}" + (f"; filtered out: {dropped}" if dropped else ""))
    if bad:
        log(f"skipped {total['bad_images']} unreadable images and {total['missing_captions']} missing captions of "
            f"{seen}, e.g. {examples[:3]}")
    if bad / seen > cfg.max_bad_fraction:
        raise RuntimeError(
            f"{bad} of {seen} records unusable ({total['bad_images']} unreadable images, {total['missing_captions']} "
            f"missing captions) > max_bad_fraction={cfg.max_bad_fraction}. First ones: {examples[:5]}. Fix the source "
            "or raise max_bad_fraction (a rerun with a higher one keeps the parts encoded so far). No dataset.json "
            "was written, so this output is not treated as complete."
        )
    return total


def first_captions(stats: list[dict]) -> list[str]:
    """The first GRID_PROMPTS distinct captions in the source's order (the parts' own first ones, in part order)."""
    return list(dict.fromkeys(c for s in stats for c in s["first_captions"]))[:GRID_PROMPTS]


def bucket_table(stats: list[dict], buckets: list[tuple[int, ...]], downsample: int,
                 temporal_compression: int = 1) -> list[dict]:
    """dataset.json's `buckets`: each size, its folder, latent size and row count (every part's); a clip bucket's
    frames and latent frames too."""
    from data_prep.buckets import bucket_dir

    rows = lambda b: sum(s["bucket_rows"].get(str(b), 0) for s in stats)
    table = []
    for b, size in enumerate(buckets):
        *frames, h, w = size
        row = {"size": [h, w], "dir": bucket_dir(size), "latent_size": [h // downsample, w // downsample],
               "num_samples": rows(b)}
        if frames:
            row.update(frames=frames[0], latent_frames=latent_frame_count(frames[0], temporal_compression))
        table.append(row)
    return table


def finish(cfg: PrecomputeConfig, fp: dict, source, codec: ImageCodec, text: TextEncoder, mode: str,
           out: Location, world: int, num_parts: int, buckets: list[tuple[int, int]] | None = None) -> DatasetRecord:
    from safetensors.torch import save_file

    from data_prep.buckets import bucket_name, nearest_bucket

    stats = wait_for_parts(out, num_parts, cfg.merge_timeout_s)
    total = usable_totals(cfg, stats)
    if buckets is None:
        merge(out, "", [i for i, s in enumerate(stats) if s["rows"]])
    else:
        table = bucket_table(stats, buckets, codec.downsample, codec.temporal_compression if codec.is_video else 1)
        for b, row in enumerate(table):
            if row["num_samples"]:
                merge(out, row["dir"], [i for i, s in enumerate(stats) if s["bucket_rows"].get(str(b))])
    empty = text.encode([""])[0].to(torch.float16).contiguous()  # (L0, D)
    save_file({"text_embeds": empty}, str(out.local(EMPTY_CAPTION_FILE)))
    out.push(EMPTY_CAPTION_FILE)
    prompts = list(cfg.prompts or source.grid_prompts() or first_captions(stats))
    save_file({str(i): e.to(torch.float16).contiguous() for i, e in enumerate(text.encode(prompts))},
              str(out.local(PROMPTS_FILE)))
    out.push(PROMPTS_FILE)
    latent_shape = next(s["latent_shape"] for s in stats if "latent_shape" in s)
    skipped = {"bad_images": total["bad_images"], "missing_captions": total["missing_captions"]}
    extra: dict[str, Any] = {"skipped": {**skipped, "filtered": total["filtered"]} if total["filtered"] else skipped}
    if buckets is not None:
        # The model's base size (its sample_size): the square bucket's side (PixArt's 256 / 512 / 1024), or that of
        # the square as large as the bucket nearest 1:1, in latents, even (2x2 patches). Clips of one size in frame-count
        # buckets only: that size.
        sizes = list(dict.fromkeys(tuple(b[-2:]) for b in buckets))
        if cfg.buckets is None:
            latent_shape = [latent_shape[0], *(side // codec.downsample for side in sizes[0])]
        else:
            h, w = sizes[nearest_bucket(1, 1, sizes)]
            base = 2 * max(1, round(math.sqrt(h * w) / (2 * codec.downsample)))
            latent_shape = [latent_shape[0], base, base]
        spec = cfg.buckets if isinstance(cfg.buckets, str) else "list" if cfg.buckets is not None else None
        extra.update(buckets=table, bucket_spec=spec)
        log("buckets: " + ", ".join(f"{bucket_name(r)}: {r['num_samples']}" for r in table if r["num_samples"])
            + f" ({sum(1 for r in table if not r['num_samples'])} of {len(table)} empty)")
    record = DatasetRecord(
        format_version=record_version(cfg.text_storage, cfg.caption_layout, codec.posterior, cfg.num_frames,
                                      codec.is_video, cfg.clip_buckets),
        fingerprint=fp["fingerprint"],
        image_codec={"name": cfg.vae, "class": codec.class_name, **({"tile": codec.tile} if codec.tile else {})},
        text_encoder={"name": cfg.text_encoder, "class": text.class_name, "max_tokens": text.max_tokens,
                      **({"prefix": text.prefix} if text.prefix else {})},
        latent_channels=int(latent_shape[0]),
        latent_size=[int(latent_shape[-2]), int(latent_shape[-1])],
        num_frames=cfg.clip_frames,
        fps=cfg.fps if cfg.num_frames is not None else None,
        temporal_compression=codec.temporal_compression if codec.is_video else None,
        downsample=codec.downsample,
        scaling_factor=codec.scaling_factor,
        shift_factor=codec.shift_factor,
        posterior=codec.posterior,
        text_dim=text.dim,
        image_mode=mode,
        resolution=cfg.resolution if buckets is None else latent_shape[1] * codec.downsample,
        width=cfg.width,
        num_samples=total["rows"],
        num_images=total["images"],
        num_classes=source.num_classes,
        empty_caption=EMPTY_CAPTION_FILE,
        prompts={"file": PROMPTS_FILE, "texts": prompts},
        columns=list(_columns(source, _image_buckets(cfg, buckets), cfg.text_storage, cfg.caption_layout, cfg.posterior,
                              cfg.text_encoder != "none")),
        text_storage=cfg.text_storage,
        caption_layout=cfg.caption_layout,
        num_captions=sum(s.get("captions", s["rows"]) for s in stats),  # a part of an older run: a row per caption
        # every part's index.json is on this machine: the merges fetched them
        size=storage.dataset_size([[out.local(f) for f in part_folders(i, buckets)] for i, s in enumerate(stats)
                                   if s["rows"]], stats),
        latents_scaled=False,  # the trainer applies (x - shift_factor) * scaling_factor exactly once
        source={"name": cfg.source.name, "path": cfg.source.path, **source.metadata()},
        world_size=world,
        **extra,
    )
    out.write_json(DATASET_FILE, record.to_json())  # LAST: marks the dataset complete
    return record


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


def _check_existing(out: Location, fp: dict) -> bool:
    """True when a finished dataset with this config exists; raises when `out` holds a different one. An unfinished
    one with this config is resumed, on any number of ranks."""
    if not out.exists(FINGERPRINT_FILE):
        # Another rank of this run may be writing precompute.json this instant: its temporary file does not count.
        if not out.is_empty() and any(not n.startswith(f"{FINGERPRINT_FILE}.tmp") for n in out.names()):
            raise FileExistsError(f"out={out} exists, is not empty and was not written by data_prep.precompute "
                                  "(no precompute.json). Pick an empty or new folder.")
        return False
    old = out.read_json(FINGERPRINT_FILE)
    if old["fingerprint"] != fp["fingerprint"]:
        diff = {k: (old["config"].get(k), v) for k, v in fp["config"].items() if old["config"].get(k) != v}
        raise FileExistsError(f"out={out} holds a dataset made with a different configuration "
                              f"(differences as (existing, requested): {diff}). Use another out= or delete it.")
    return out.exists(DATASET_FILE)


def _scratch(cfg: PrecomputeConfig, rank: int) -> Path | None:
    """This rank's own folder under `staging` (the ranks of a node may share one staging folder), emptied first: what
    a killed run left there (half a part, a downloaded tar) is of no use, since the bucket says what is done."""
    if cfg.staging is None:
        return None
    scratch = Path(cfg.staging).expanduser().resolve() / f"rank_{rank}"
    shutil.rmtree(scratch, ignore_errors=True)
    return scratch


def _encoders(cfg: PrecomputeConfig, source, device: str) -> tuple[ImageCodec, TextEncoder, str, list | None]:
    """(image codec, text encoder, image mode, resolved buckets or None)."""
    if cfg.text_encoder == "none" and cfg.caption_layout != "per_caption":
        raise ValueError("text_encoder=none encodes no captions to choose from: use caption_layout=per_caption")
    if cfg.text_encoder == "none" and source.num_classes is None:
        raise ValueError(f"text_encoder=none encodes no captions, so the rows must carry class labels, and source="
                         f"{cfg.source.name} has none (a manifest needs its label_key column); use a text encoder")
    mode = cfg.image_mode or (source.default_image_mode if cfg.vae == "pixel" else "RGB")
    codec = load_image_codec(cfg.vae, device, cfg.dtype, mode, cfg.posterior, cfg.vae_tile)
    if codec.is_video and cfg.num_frames is None:
        raise ValueError(f"vae={cfg.vae} is a video VAE ({codec.class_name}): it encodes clips; give num_frames= (and a "
                         "video source), or use an image VAE for images")
    if codec.is_video:
        for count in cfg.frame_counts:
            codec.check_frames(count)
    for key, side in (("resolution", cfg.resolution), ("width", cfg.width)):
        if side is not None and side % codec.downsample and cfg.buckets is None:
            raise ValueError(f"{key}={side} is not a multiple of the VAE's downsample factor {codec.downsample}.")
    from data_prep.buckets import clip_buckets, resolve_buckets

    buckets = None if cfg.buckets is None else resolve_buckets(cfg.buckets, 2 * codec.downsample)
    if cfg.clip_buckets:
        buckets = clip_buckets(cfg.frame_counts, buckets or [(cfg.resolution, cfg.width or cfg.resolution)])
    return codec, load_text_encoder(cfg.text_encoder, device, cfg.dtype, cfg.max_tokens, cfg.text_prefix), mode, buckets


def precompute(cfg: Any, rank: int | None = None, world_size: int | None = None) -> Path | str:
    """Build the dataset at cfg.out (or do nothing if it is already there, or finish what a killed run began);
    returns its path (its URL when out is remote).

    rank/world_size default to the launcher's environment (`_world`); pass 0/1 to force one process
    (the data module does, since its prepare_data runs on one rank inside a DDP job).
    """
    cfg = as_config(cfg)
    env_rank, env_world, local_rank = _world()
    rank = env_rank if rank is None else rank
    world = env_world if world_size is None else world_size
    splits = [cfg] if cfg.val_fraction == 0 or cfg.split != "all" else [  # val_fraction: out, then out/val
        replace(cfg, split="train"), replace(cfg, split="val", out=f"{cfg.out.rstrip('/')}/val")]
    written = []
    for part in splits:  # each its own dataset (its parts, fingerprint, dataset.json): no rank waits between them
        scratch = _scratch(part, rank)
        try:
            out = open_output(part.out, None if scratch is None else scratch / "out")
            _build(part, out, rank, world, local_rank, None if scratch is None else scratch / "in")
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)  # what passed through is uploaded, encoded or of no more use
        written.append(out.url if isinstance(out, RemoteLocation) else out.root)
    return written[0]


def _build(cfg: PrecomputeConfig, out: Location, rank: int, world: int, local_rank: int, inputs: Path | None) -> None:
    """precompute's work on this rank; `inputs`: where remote input shards are downloaded."""
    fp = fingerprint(cfg)
    if _check_existing(out, fp):
        log(f"{out} is already complete (dataset.json present, same config); nothing to do.")
        return
    source = get_source(cfg.source)
    source.staging = inputs
    check_source(cfg, source)  # before anything is written: a refused config leaves no folder behind
    shards = source.shards(cfg.records_per_part)  # likewise: a missing input tar is refused before
    # cuda:<local rank>, or the one GPU Slurm left visible to this task (--gpus-per-task=1 binds one to each)
    device = cfg.device or (f"cuda:{local_rank % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu")
    codec, text, mode, buckets = _encoders(cfg, source, device)  # likewise: a VAE the settings do not fit
    if not out.exists(FINGERPRINT_FILE):  # written first; every rank writes the same content
        out.write_json(FINGERPRINT_FILE, fp)
    check_parts(out, shards)
    round_, mine, done = my_parts(out, len(shards), rank, world)
    log(f"rank {rank} of {world}: {done} of {len(shards)} parts already done, {len(mine)} to encode here "
        f"(round {round_})")
    if not mine and rank != 0:
        return
    if mine:
        t = encode_rank(cfg, source, shards, mine, codec, text, mode, out, round_, rank, world, buckets)
        log(f"rank {rank}: {len(mine)} parts, {t['images']} images -> {t['rows']} rows in {t['seconds']:.1f}s "
            f"({t['images'] / max(t['seconds'], 1e-9):.1f} images/s, {device}, decode_workers={cfg.decode_workers}; "
            + ", ".join(f"{what} {t[f'seconds_{k}'] / max(t['seconds'], 1e-9):.0%}" for k, what in
                        (("encode", "encoding"), ("wait", "waiting for decoded images"), ("write", "writing")))
            + " of the time)")
    if rank != 0:
        return
    record = finish(cfg, fp, source, codec, text, mode, out, world, len(shards), buckets)
    log(f"wrote {record.num_samples} samples to {out} (latents {record.latent_channels}x"
        f"{record.latent_size[0]}x{record.latent_size[1]}, text dim {record.text_dim})")


def main() -> None:
    import hydra

    register_configs()

    @hydra.main(version_base="1.3", config_path="../conf", config_name="precompute")
    def _app(cfg) -> None:
        precompute(cfg)

    _app()


if __name__ == "__main__":
    main()
