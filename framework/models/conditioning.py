"""Text conditioning as the backbones take it: per-token caption embeddings padded into a batch with a mask,
and caption dropout for classifier-free guidance (the empty caption's embedding in place of a dropped one).
Shared by the training step (framework/training/module.py), the data loader's collate and sampling.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def pad_and_stack(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad (L_i, D) sequences to (N, L, D) with zeros, plus the (N, L) bool mask of real tokens."""
    out = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)  # (N, L, D), zeros after each sequence
    if out.shape[1] == 0:  # only empty sequences: one padding token, masked
        out = out.new_zeros(len(seqs), 1, out.shape[-1])
    lengths = torch.tensor([s.shape[0] for s in seqs], device=out.device)
    mask = torch.arange(out.shape[1], device=out.device)[None] < lengths[:, None]  # (N, L)
    return out, mask


def drop_captions(
    text: torch.Tensor, mask: torch.Tensor, empty: torch.Tensor, drop: torch.Tensor, inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace the captions of rows where `drop` is True by the empty-caption embedding (L0, D).

    text (B, L, D), mask (B, L), drop (B,) bool -> (B, max(L, L0), D), (B, max(L, L0)). The inputs are not
    modified, except `text` with inplace=True (a copy the caller owns, such as the training step's float32 one): then
    only the dropped rows are written, not a whole new batch of embeddings. The flags come from StepDraws.noise
    (framework/training/draws.py; classifier-free guidance), on the host, so that finding whether any row drops
    reads no device memory.
    """
    if not bool(drop.any()):
        return text, mask
    n_tok = max(text.shape[1], empty.shape[0])
    if n_tok > text.shape[1]:  # the empty caption is longer than every caption in this batch: new, padded tensors
        text = F.pad(text, (0, 0, 0, n_tok - text.shape[1]))
        mask = F.pad(mask, (0, n_tok - mask.shape[1]))
    else:
        text, mask = (text if inplace else text.clone()), mask.clone()
    rows = drop.nonzero().flatten().to(text.device, non_blocking=True)  # (K,) the dropped rows
    text[rows] = 0.0
    text[rows, : empty.shape[0]] = empty
    mask[rows] = False
    mask[rows, : empty.shape[0]] = True
    return text, mask


def guidance_batch(model: Any, text: torch.Tensor | None, mask: torch.Tensor | None, labels: torch.Tensor | None,
                   empty: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The conditioning of a batch of B doubled for classifier-free guidance in one forward: rows 0..B-1 as given, rows
    B..2B-1 unconditional (the empty caption `empty` (L0, D), the model's null label). None stays None."""
    B = (text if text is not None else labels).shape[0]
    if text is not None:
        drop = torch.cat([torch.zeros(B, dtype=torch.bool), torch.ones(B, dtype=torch.bool)])  # on the host
        # repeat makes a copy of its own: the unconditional half is written into it
        text, mask = drop_captions(text.repeat(2, 1, 1), mask.repeat(2, 1), empty.to(text), drop, inplace=True)
    if labels is not None:
        labels = torch.cat([labels, model.null_labels(B).to(labels)])
    return text, mask, labels


def guide(pred: torch.Tensor, guidance: float) -> torch.Tensor:
    """uncond + guidance * (cond - uncond) of a prediction (2B, ...) on a `guidance_batch`, in float32."""
    cond, uncond = pred.float().chunk(2)
    return uncond + guidance * (cond - uncond)
