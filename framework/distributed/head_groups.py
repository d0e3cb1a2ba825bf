"""`sequence_parallel_head_groups=auto`: how many head groups G Ulysses attention should exchange in, for one size.

With G > 1 (framework/distributed/sequence.py ulysses_attention) every group's input all-to-all is issued first, group
g attends once its own inputs are in and its output all-to-all travels while group g+1 attends: each exchange is
hidden behind attention, at the cost of G messages' latency instead of one. Whether that pays depends on the token
count (attention grows with its square, the exchanges with it), the link and the device's attention speed. `predict`
replays that schedule for one attention layer (one link carrying the exchanges in issue order beside one stream of
attention), with exchange time = latency + bytes / bandwidth and each group's attention time measured on this device
at the generation's size and that group's head count (`measure_attention`); `choose` takes the G with the shortest
layer, the smallest on a tie. It models the attention alone: the rest of a block (its projections, MLP) is the same
for every G, and the per-group projections and bookkeeping ulysses_attention adds are not counted;
`python -m framework.bench overlap` replays whole recorded steps instead.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch

# Per-message latency (s) and bytes/s one rank sends at, by link. NVLink: an H100 SXM's 450 GB/s each way, of which
# NCCL's all-to-all reaches about 80%; InfiniBand: NDR 400 Gb/s per GPU (50 GB/s), about 90% reached; gloo: its
# all-to-all between two CPU processes on the 2-core machine this project is tested on (89 us, 1.51 GB/s, measured
# by `python -m framework.bench overlap link=gloo`, docs/sequence-parallelism.md).
LINKS = {"nvlink": (15e-6, 360e9), "infiniband": (20e-6, 45e9), "gloo": (89e-6, 1.51e9)}

CANDIDATES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Layer:
    """One Ulysses attention layer on one rank of a P-rank group: with G groups each group carries
    hg = ceil(H / (G P)) heads a rank (the last padded with zero heads, as ulysses_attention pads them)."""

    ranks: int
    """P."""
    heads: int
    """H, the layer's heads."""
    send_in_bytes: float
    """What the rank sends for one head in the input all-to-all (q, k and v of its tokens, for the other ranks)."""
    send_out_bytes: float
    """What it sends for one head in the output all-to-all."""
    attention_s: dict[int, float]
    """Seconds of one group's attention over all tokens, by its heads a rank (hg), measured: a smaller call is not
    proportionally faster (fixed costs, a kernel less busy)."""

    def heads_per_group(self, groups: int) -> int:
        return math.ceil(self.heads / (groups * self.ranks))


def layer_of(batch: int, tokens: int, heads: int, head_dim: int, ranks: int, element_bytes: int,
             attention_s: dict[int, float]) -> Layer:
    """The layer of a rank holding tokens / P tokens of every head, keeping (P - 1) / P of each head's for the others;
    q, k, v in (three tensors), the output back (one)."""
    share = batch * (tokens / ranks) * head_dim * element_bytes * (ranks - 1) / ranks
    return Layer(ranks, heads, 3 * share, share, attention_s)


def groups_to_try(heads: int, ranks: int, candidates: tuple[int, ...] = CANDIDATES) -> list[int]:
    """The candidates that leave each group at least one real head a rank (more would exchange and attend padding)."""
    return [g for g in candidates if g <= math.ceil(heads / ranks)]


def predict(layer: Layer, groups: int, latency: float, bandwidth: float) -> float:
    """Seconds of the layer with G = `groups` head groups: the link sends every group's inputs, then each group's
    output once that group has attended (in that order); group g attends when its inputs are in and group g - 1 is
    done; the layer ends when the last output has arrived."""
    hg = layer.heads_per_group(groups)
    send = lambda per_head: latency + hg * layer.ranks * per_head / bandwidth  # noqa: E731  (one group's message)
    link = 0.0
    arrived = []
    for _ in range(groups):
        link += send(layer.send_in_bytes)
        arrived.append(link)
    compute = 0.0
    for g in range(groups):
        compute = max(compute, arrived[g]) + layer.attention_s[hg]
        link = max(link, compute) + send(layer.send_out_bytes)
    return link


def choose(layer: Layer, latency: float, bandwidth: float,
           candidates: tuple[int, ...] = CANDIDATES) -> tuple[int, dict[int, float]]:
    """The G of the shortest predicted layer (the smallest on a tie) and every tried candidate's prediction."""
    times = {g: predict(layer, g, latency, bandwidth) for g in groups_to_try(layer.heads, layer.ranks, candidates)}
    return min(times, key=lambda g: (round(times[g], 12), g)), times


def measure_attention(batch: int, heads: int, tokens: int, head_dim: int, device: torch.device, dtype: torch.dtype,
                      repeats: int = 3) -> float:
    """Median seconds of torch's scaled_dot_product_attention over (batch, heads, tokens, head_dim) here (one call to
    warm up first)."""
    q, k, v = (torch.randn(batch, heads, tokens, head_dim, device=device, dtype=dtype) for _ in range(3))
    times = []
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def link_of(device: torch.device, ranks: int, ranks_per_node: int) -> str:
    """The link a group's exchanges take: gloo between CPU processes; NVLink for a group within a node, InfiniBand
    for one across nodes."""
    if device.type != "cuda":
        return "gloo"
    return "nvlink" if ranks <= ranks_per_node else "infiniband"
