"""Scoring clips of moving digits (data_prep/sources/moving_digits.py): what digit each frame shows, where the digit
goes, whether it stays the same digit, and how real its frames look.

Each frame (1, 16, 16) is read where its digit is: the brightest 8x8 window (`digit_crops`) is cropped and classified
by the digit scorer (framework/evaluation/metrics.py), and the intensity-weighted centroid of the frame gives the
digit's position. The clip's motion is the least-squares slope of the centroid track over the frames; its direction
is the axis and sign of the larger component (`track_direction`), "still" when it moves less than MIN_SPEED pixels a
frame. Real clips from the held-out digits score 1.0 direction accuracy (tests/test_video.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

MIN_SPEED = 0.25  # pixels a frame: slower counts as no motion ("still"), never a direction
STILL = "still"


def digit_crops(frames: torch.Tensor, size: int = 8) -> torch.Tensor:
    """Frames (N, C, H, W) in [-1, 1] -> (N, 1, size, size) crops at each frame's brightest size x size window."""
    x = (frames.float().mean(1, keepdim=True).clamp(-1, 1) + 1) / 2  # (N, 1, H, W) in [0, 1]
    mass = F.avg_pool2d(x, size, stride=1)  # (N, 1, H - size + 1, W - size + 1)
    best = mass.flatten(1).argmax(1)  # (N,)
    cols = mass.shape[-1]
    rows, lefts = (best // cols).tolist(), (best % cols).tolist()
    crops = torch.stack([x[i, :, r : r + size, c : c + size] for i, (r, c) in enumerate(zip(rows, lefts))])
    return crops * 2 - 1


def centroids(frames: torch.Tensor) -> torch.Tensor:
    """(N, C, H, W) in [-1, 1] -> (N, 2): the intensity-weighted (row, column) centre of each frame."""
    x = (frames.float().mean(1).clamp(-1, 1) + 1) / 2  # (N, H, W)
    h, w = x.shape[-2:]
    total = x.sum((1, 2)).clamp_min(1e-6)
    rows = (x.sum(2) * torch.arange(h, dtype=x.dtype)).sum(1) / total
    cols = (x.sum(1) * torch.arange(w, dtype=x.dtype)).sum(1) / total
    return torch.stack([rows, cols], 1)


def track_direction(track: torch.Tensor) -> str:
    """The direction of a centroid track (F, 2): left / right / up / down by its least-squares velocity, or "still"."""
    f = torch.arange(len(track), dtype=track.dtype)
    f = f - f.mean()
    velocity = (f[:, None] * (track - track.mean(0))).sum(0) / f.square().sum().clamp_min(1e-6)  # (2,) pixels a frame
    dr, dc = velocity.tolist()
    if max(abs(dr), abs(dc)) < MIN_SPEED:
        return STILL
    if abs(dc) >= abs(dr):
        return "left" if dc < 0 else "right"
    return "up" if dr < 0 else "down"


def read_clips(clips: torch.Tensor) -> dict[str, Any]:
    """What the scorer reads in clips (N, F, C, H, W): per-frame digits (N, F), each clip's direction (N,) and the
    crops (N * F, 1, 8, 8) the digits were read from."""
    from framework.evaluation.metrics import digit_scorer

    n, frames = clips.shape[:2]
    flat = clips.flatten(0, 1)
    crops = digit_crops(flat)
    digits = digit_scorer().predict(crops).reshape(n, frames)
    tracks = centroids(flat).view(n, frames, 2)
    return {"digits": digits, "directions": np.array([track_direction(t) for t in tracks]), "crops": crops}


def score_clips(targets: list[tuple[int, str]], heldout: np.ndarray, clips: torch.Tensor, per_prompt: int = 1,
                real: torch.Tensor | None = None) -> dict[str, Any]:
    """Metrics of clips (P * per_prompt, F, C, H, W) for prompts asking (digit, direction): per-frame digit accuracy,
    direction accuracy, identity consistency (the share of a clip's frames showing its most common digit) and, given
    real digits (M, 1, 8, 8), the fd of the frames' crops to them; each for the training phrasings, and the
    accuracies for the held-out ones."""
    from framework.evaluation.metrics import digit_scorer, frechet_distance

    read = read_clips(clips)
    want_digit = np.repeat(np.array([d for d, _ in targets]), per_prompt)
    want_way = np.repeat(np.array([w for _, w in targets]), per_prompt)
    held = np.repeat(heldout, per_prompt)
    frame_ok = read["digits"] == want_digit[:, None]  # (N, F)
    way_ok = read["directions"] == want_way  # (N,)
    both = frame_ok.all(1) & way_ok
    consistency = np.array([np.bincount(row, minlength=10).max() / len(row) for row in read["digits"]])
    mean = lambda a: float(a.mean()) if a.size else float("nan")
    out: dict[str, Any] = {}
    for prefix, mask in (("", ~held), ("heldout_", held)):
        out[f"{prefix}digit_accuracy"] = mean(frame_ok[mask])
        out[f"{prefix}direction_accuracy"] = mean(way_ok[mask])
        out[f"{prefix}clip_accuracy"] = mean(both[mask])
    out["identity_consistency"] = mean(consistency)
    out["still_fraction"] = mean(read["directions"] == "still")
    if real is not None:
        out["fd"] = frechet_distance(real, read["crops"], digit_scorer().featurizer(1))
    out["num_clips"] = len(clips)
    return out


def motion_summary(metrics: dict[str, Any]) -> str:
    """One line for people."""
    return (f"digit_accuracy {metrics['digit_accuracy']:.3f}  direction_accuracy {metrics['direction_accuracy']:.3f}  "
            f"heldout_phrasing digit/direction {metrics['heldout_digit_accuracy']:.3f}/"
            f"{metrics['heldout_direction_accuracy']:.3f}  identity_consistency {metrics['identity_consistency']:.3f}  "
            f"fd {metrics['fd']:.2f}  ({metrics['num_clips']} clips)")
