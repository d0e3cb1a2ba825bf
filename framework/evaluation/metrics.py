"""The digit classifier that scores generated digits, and the Fréchet distance on its features.

Metrics and picking never share a model: the training digits are split once into two fixed halves;
the `scorer` half trains the small convolutional classifier below (prompt_accuracy, pair_accuracy and
the features of `fd`), the `judge` half trains the judges that pick among candidates
(framework/evaluation/judge.py). The classifier trains in seconds with a fixed seed and is cached on disk
(`LATENTFORGE_CACHE`, default ~/.cache/latentforge), so every evaluation uses the same weights.
"""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from data_prep.location import cache_dir
from data_prep.sources.digits import MAX_VALUE, load_digits

HALVES_SEED = 20241  # fixed forever: the two halves of the training digits
CLASSIFIER_VERSION = 2  # bump when the architecture or the recipe changes (invalidates the cache)


def training_half(half: str) -> tuple[np.ndarray, np.ndarray]:
    """One fixed half of the training digits: 'scorer' (metrics) or 'judge' (picking); images (N, 8, 8) 0..16."""
    if half not in ("scorer", "judge"):
        raise ValueError(f"half must be 'scorer' or 'judge', got {half!r}")
    images, labels = load_digits("train")
    order = np.random.default_rng(HALVES_SEED).permutation(len(images))
    idx = np.sort(order[: len(images) // 2] if half == "scorer" else order[len(images) // 2 :])
    return images[idx], labels[idx]


def to_unit_digits(images: torch.Tensor) -> torch.Tensor:
    """Generated images (N, C, H, W) in [-1, 1] -> (N, 1, 8, 8) grayscale in [0, 1], the real digits' format."""
    x = images.float().mean(dim=1, keepdim=True)
    if x.shape[-2:] != (8, 8):
        x = F.adaptive_avg_pool2d(x, 8)
    return (x.clamp(-1, 1) + 1) / 2


def as_images(digits: np.ndarray) -> torch.Tensor:
    """Real digit arrays (N, H, W) in 0..16 as generated images look: (N, 1, H, W) in [-1, 1]."""
    return torch.from_numpy(digits.astype(np.float32) / MAX_VALUE * 2 - 1).unsqueeze(1)


def real_digit_images(half_or_split: str) -> tuple[torch.Tensor, np.ndarray]:
    """Real digits as generated images look, (N, 1, 8, 8) in [-1, 1], and their labels."""
    x, y = training_half(half_or_split) if half_or_split in ("scorer", "judge") else load_digits(half_or_split)
    return as_images(x), y


class DigitNet(nn.Module):
    """Two 3x3 convolutions and a 32-wide feature layer; input (N, 1, 8, 8) in [0, 1]."""

    num_features = 32  # read by torchmetrics' FrechetInceptionDistance

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 4 * 4, self.num_features)
        self.head = nn.Linear(self.num_features, 10)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # (N, 32, 4, 4)
        return F.relu(self.fc(x.flatten(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def train_digit_net(images: np.ndarray, labels: np.ndarray, steps: int = 400, seed: int = 0) -> DigitNet:
    """Full-batch AdamW with small shifts as augmentation; the same weights for a seed on every machine (about 12 s on
    one CPU core). It computes on one thread: a convolution's weight gradient sums the batch in one part per thread,
    so on two threads the weights came out different in their last bits, and the fd of one set of images differed
    between a process that trained the cached scorer and one that loaded it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_digit_net(images, labels, steps, seed)
    finally:
        torch.set_num_threads(threads)


def _train_digit_net(images: np.ndarray, labels: np.ndarray, steps: int, seed: int) -> DigitNet:
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        net = DigitNet()
    x = torch.from_numpy(images.astype(np.float32) / MAX_VALUE).unsqueeze(1)
    y = torch.from_numpy(labels.astype(np.int64))
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps)
    padded = F.pad(x, (1, 1, 1, 1))
    for _ in range(steps):
        dy, dx = torch.randint(0, 3, (2,), generator=gen).tolist()  # shift the whole batch by up to 1 pixel
        loss = F.cross_entropy(net(padded[..., dy : dy + 8, dx : dx + 8]), y, label_smoothing=0.05)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return net.eval().requires_grad_(False)


class DigitScorer:
    """The metric side: classifies generated digits and gives the features `fd` compares."""

    def __init__(self) -> None:
        images, labels = training_half("scorer")
        key = hashlib.sha256(images.tobytes() + labels.tobytes()).hexdigest()[:12]
        path = cache_dir() / f"digit_scorer_v{CLASSIFIER_VERSION}_{key}.pt"
        self.net = DigitNet()
        if path.is_file():
            self.net.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
            self.net.eval().requires_grad_(False)
        else:
            self.net = train_digit_net(images, labels)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            torch.save(self.net.state_dict(), tmp)
            os.replace(tmp, path)  # atomic: concurrent processes never read half a file
        x_te, y_te = real_digit_images("heldout")
        self.heldout_accuracy = float((self.predict(x_te) == y_te).mean())

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> np.ndarray:
        """Digit classes of (N, C, H, W) images in [-1, 1]."""
        return self.net(to_unit_digits(images)).argmax(dim=1).numpy()

    def featurizer(self, cells: int = 1) -> nn.Module:
        """A module images -> features for torchmetrics; `cells` digits side by side are featurized each and concatenated."""
        return _Features(self.net, cells)


class _Features(nn.Module):
    def __init__(self, net: DigitNet, cells: int) -> None:
        super().__init__()
        self.net, self.cells = net, cells
        self.num_features = net.num_features * cells

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        parts = images.float().chunk(self.cells, dim=-1)  # split along the width
        return torch.cat([self.net.features(to_unit_digits(p)) for p in parts], dim=1)


@lru_cache(maxsize=1)
def digit_scorer() -> DigitScorer:
    return DigitScorer()


def frechet_distance(real: torch.Tensor, fake: torch.Tensor, featurizer: nn.Module, batch_size: int = 512) -> float:
    """Fréchet distance between two image sets (N, C, H, W) in [-1, 1] on `featurizer`'s features (torchmetrics)."""
    from torchmetrics.image.fid import FrechetInceptionDistance

    # sync_on_compute=False: a process that calls this holds the whole image set (in a multi-rank job every rank
    # scores all images, or rank 0 alone does); torchmetrics would otherwise sum the states of all processes,
    # counting every image once per rank (or wait for ranks that never call it).
    fid = FrechetInceptionDistance(feature=featurizer, reset_real_features=False, sync_on_compute=False)
    for images, real_side in ((real, True), (fake, False)):
        for i in range(0, len(images), batch_size):
            fid.update(images[i : i + batch_size].float(), real=real_side)
    return max(0.0, float(fid.compute()))
