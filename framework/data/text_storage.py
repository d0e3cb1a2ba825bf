"""Reading a row's text embedding back from the storage dataset.json names (`text_storage`; data_prep/storage.py
writes them). Datasets older than the key are fp16.

fp16 and bf16 come back as stored, so the loader's queue and the host-to-device copy move half the bytes of float32;
the training step computes in float32 (`.float()`), which changes none of their values. int8 comes back decoded:
    fp16  float16 as stored
    bf16  bfloat16: the stored uint16 bits reinterpreted (numpy has no bfloat16)
    int8  float32: q * scale, each token's int8 values times its scale, multiplied in float32
A row of caption_layout per_image holds several captions' tokens one after the other (`decode_captions`).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from data_prep.config import TEXT_STORAGES


def decode_text(row: dict[str, Any], storage: str = "fp16") -> torch.Tensor:
    """One row's text embedding (L, D) from its MDS columns."""
    values = np.array(row["text_embeds"])  # a copy: Streaming hands out read-only views of its shard buffers
    if storage == "fp16":
        return torch.from_numpy(values)  # (L, D) float16
    if storage == "bf16":
        return torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)  # (L, D); int16: torch's 16-bit bits
    if storage == "int8":
        scale = torch.from_numpy(np.array(row["text_scale"], dtype=np.float32))  # (L,)
        return torch.from_numpy(values).float() * scale[:, None]  # (L, D) float32
    raise ValueError(f"text_storage={storage!r} in dataset.json: this LatentForge reads {', '.join(TEXT_STORAGES)}; "
                     "upgrade it, or precompute the dataset again with one of these.")


def decode_captions(row: dict[str, Any], storage: str = "fp16") -> list[torch.Tensor]:
    """The embeddings [(L_k, D), ...] of every caption of a per_image row: its tokens split at `text_lengths`."""
    return list(decode_text(row, storage).split([int(n) for n in row["text_lengths"]]))
