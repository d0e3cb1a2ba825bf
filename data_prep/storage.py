"""How the rows store text embeddings (`text_storage`), and what an output weighs on disk.

    text_storage   MDS columns                                       bytes per token of width D
    fp16           text_embeds float16 (L, D)                        2 D   (the default; dataset format 1)
    bf16           text_embeds uint16 (L, D): bfloat16's bits        2 D   float32's range (fp16 tops out at 65504)
    int8           text_embeds int8 (L, D), text_scale float32 (L,)  D + 4 x ~ q * scale, scale = max|x| / 127 per token

numpy has no bfloat16 and MDS stores numpy dtypes only, so the bits travel as uint16 and the reader reinterprets them
with torch. Each token (row of the L x D matrix) gets its own int8 scale, so a token of small values keeps its
precision beside one of large values; the error is at most scale / 2 per element. The reader side is
framework/data/text_storage.py. The size figures (`part_bytes`, `projection`) are docs/data.md's "sizing".
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data_prep.config import TEXT_STORAGES

INT8_MAX = 127  # symmetric: -127..127, so that -x quantizes to -q


# ---------------------------------------------------------------------------------------------
# The row format of each storage
# ---------------------------------------------------------------------------------------------


def text_columns(storage: str) -> dict[str, str]:
    """The MDS columns (name -> encoding) that hold one row's text embedding."""
    if storage == "fp16":
        return {"text_embeds": "ndarray:float16"}
    if storage == "bf16":
        return {"text_embeds": "ndarray:uint16"}
    if storage == "int8":
        return {"text_embeds": "ndarray:int8", "text_scale": "ndarray:float32"}
    raise ValueError(f"text_storage={storage!r}: use one of {', '.join(TEXT_STORAGES)}.")


def encode_text(emb: torch.Tensor, storage: str) -> dict[str, np.ndarray]:
    """One caption's embedding (L, D), any float dtype, -> the row's text columns in `storage`."""
    x = emb.float()  # (L, D); rounding from float32 once, whatever the encoder computed in
    if storage == "fp16":
        with np.errstate(over="ignore"):
            values = x.numpy().astype(np.float16)
        if not np.isfinite(values).all() and torch.isfinite(x).all():
            raise ValueError(f"a text embedding holds {float(x.abs().max()):.4g}, beyond float16's range (65504): "
                             "precompute with text_storage=bf16 (or int8), which keep it.")
        return {"text_embeds": values}
    if storage == "bf16":
        return {"text_embeds": x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)}  # round to nearest even
    if storage == "int8":
        x = x.numpy()
        scale = np.abs(x).max(axis=1) / INT8_MAX  # (L,) float32
        safe = np.where(scale > 0, scale, 1.0).astype(np.float32)  # an all-zero token: q = 0
        q = np.clip(np.rint(x / safe[:, None]), -INT8_MAX, INT8_MAX).astype(np.int8)  # (L, D)
        return {"text_embeds": q, "text_scale": scale.astype(np.float32)}
    raise ValueError(f"text_storage={storage!r}: use one of {', '.join(TEXT_STORAGES)}.")


def concat_text(embs: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Several captions' text columns (encode_text's) as one row's: each column's tokens, caption after caption
    (caption_layout per_image; `token_counts` says where each caption ends)."""
    return {k: np.concatenate([e[k] for e in embs]) for k in embs[0]}


def token_counts(embs: list[dict[str, np.ndarray]]) -> np.ndarray:
    """(K,) int32: the tokens of each caption in `concat_text(embs)`."""
    return np.array([len(e["text_embeds"]) for e in embs], dtype=np.int32)


def nbytes(value: Any) -> int:
    """Bytes of the arrays in an encoded row (one array, or a dict of the row's columns)."""
    if isinstance(value, dict):
        return sum(v.nbytes for v in value.values())
    return value.nbytes


# ---------------------------------------------------------------------------------------------
# Sizes on disk, and the projection from one part
# ---------------------------------------------------------------------------------------------


def part_bytes(folders: list[Path]) -> dict[str, int]:
    """{"disk", "raw"} bytes of the MDS folders of one part: on disk, the shard files as written (compressed when they
    are) plus index.json; raw, the uncompressed .mds shards, from index.json."""
    disk = raw = 0
    for folder in folders:
        index = folder / "index.json"
        if not index.is_file():
            continue  # a bucket this part has no rows in
        for shard in json.loads(index.read_text())["shards"]:
            raw += shard["raw_data"]["bytes"]
            disk += (shard.get("zip_data") or shard["raw_data"])["bytes"]
        disk += index.stat().st_size
    return {"disk": disk, "raw": raw}


def per_sample(rows: int, column_bytes: dict[str, int], sizes: dict[str, int]) -> dict[str, float]:
    """Bytes per row: latents and text (their arrays' bytes, uncompressed), the rest of an uncompressed row (caption,
    key, label, MDS's headers and offsets), and all of it as it lies on disk (after compression)."""
    latents, text = column_bytes.get("latents", 0) / rows, column_bytes.get("text", 0) / rows
    return {"latents": latents, "text": text, "other": sizes["raw"] / rows - latents - text, "disk": sizes["disk"] / rows}


def projection(stats: dict, sizes: dict[str, int], source_records: int | None, num_parts: int) -> dict[str, Any]:
    """What the whole output will weigh, from one finished part: its bytes per row times the rows the source will
    give. The source's record count is its size() when it knows it, else the parts' count times this part's records
    (a webdataset: one part per .tar); rows per record (captions per image, less what was filtered or unusable) are
    this part's."""
    seen = stats["images"] + stats["bad_images"] + stats["missing_captions"] + sum(stats.get("filtered", {}).values())
    records = source_records if source_records is not None else num_parts * seen
    samples = round(records * stats["rows"] / seen)
    each = per_sample(stats["rows"], stats["column_bytes"], sizes)
    return {"samples": samples, "records": records, "bytes": round(samples * each["disk"]),
            "raw_bytes": round(samples * sizes["raw"] / stats["rows"]), "bytes_per_sample": each, "part_rows": stats["rows"]}


def describe(p: dict[str, Any]) -> str:
    """A projection in one line: GB (10^9 bytes) in all, KiB (1024 bytes) per sample."""
    kib = {k: v / 1024 for k, v in p["bytes_per_sample"].items()}
    return (f"projected output: {p['bytes'] / 1e9:.3f} GB for {p['samples']:,} samples ({p['records']:,} records; "
            f"{p['raw_bytes'] / 1e9:.3f} GB decompressed), {kib['disk']:.2f} KiB a sample on disk; uncompressed: "
            f"latents {kib['latents']:.2f} KiB + text {kib['text']:.2f} KiB ({p['text_storage']}) + other "
            f"{kib['other']:.2f} KiB. Measured on part {p['from_part']} ({p['part_rows']} rows); also in projection.json")


def dataset_size(parts: list[list[Path]], stats: list[dict]) -> dict[str, Any]:
    """dataset.json's `size`: the parts' bytes on disk and uncompressed (what Streaming's decompressed copies take, in
    the cache or beside the shards), and per sample. `parts`: the MDS folders of each part that holds rows."""
    sizes = [part_bytes(folders) for folders in parts]
    total = {k: sum(z[k] for z in sizes) for k in ("disk", "raw")}
    column_bytes = {k: sum(s.get("column_bytes", {}).get(k, 0) for s in stats) for k in ("latents", "text")}
    rows = sum(s["rows"] for s in stats)
    return {"bytes": total["disk"], "raw_bytes": total["raw"], "per_sample": per_sample(rows, column_bytes, total)}
