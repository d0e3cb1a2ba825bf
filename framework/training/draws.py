"""What a training step draws per sample: noise, noise level, caption drop, caption choice, posterior sample, flip.

Each is a function of (seed, micro-batch counter, the sample's row in the *global* batch, the kind of draw), drawn for
the whole batch at once (framework/training/keyed.py), and each rank draws its own rows only. So a run is
reproducible, resumes exactly from any checkpoint, and a 2-rank run draws the same numbers for the same samples as a
1-rank run with the same global batch (Streaming gives the rank at position r the global rows r, r+W, r+2W, ...).
The data module (captions, posterior, flip: on the host, before the copy to the device) and the LightningModule
(noise, level, drop) both take a StepDraws.of(trainer, seed): the counter and the rows come from the trainer alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import lightning.pytorch as pl
import torch

from framework.distributed.mesh import ParallelDims
from framework.training import keyed

# The kinds of a step's keyed draws (the tag in keyed.keys), so that no two kinds share numbers:
NOISE_DRAW, DROP_DRAW, CAPTION_DRAW, LATENT_DRAW, FLIP_DRAW = range(5)


def micro_batch(trainer: pl.Trainer) -> int:
    """The index of this micro-batch in the run, the same on every rank and after a resume. (Read before the loop
    counts the batch as ready, in the data module, it numbers the micro-batches of a step otherwise, as uniquely.)"""
    accumulate = trainer.accumulate_grad_batches
    return trainer.global_step * accumulate + trainer.fit_loop.epoch_loop.batch_progress.current.ready % accumulate


def stream_slots(trainer: pl.Trainer) -> tuple[int, int]:
    """(r, W): this rank holds rows r, r + W, r + 2W, ... of the global batch.

    Streaming deals a global batch out round-robin over W data-parallel ranks, nodes innermost: the rank at position
    r = local_rank * nodes + node_rank (tests/test_distributed.py checks this against a 1-process run with the same
    global batch, on 1 node and on 2); a sequence-parallel group of P ranks draws as one rank (Streaming's replication).
    """
    dims = getattr(trainer.strategy, "mesh", None)  # the job's mesh (ddp, fsdp); a single process has none
    if dims is None:
        dims = ParallelDims.of(trainer.world_size, trainer.num_devices, 1)
        return dims.stream_position(trainer.global_rank), dims.data_parallel
    return dims.stream_position, dims.dims.data_parallel


def _to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; to a GPU from pinned memory, so that the copy does not wait for the GPU's queue."""
    return (x.pin_memory() if device.type == "cuda" else x).to(device, non_blocking=True)


@dataclass(frozen=True)
class StepDraws:
    """The keyed draws of one rank in one micro-batch: `micro`, and this rank's rows `position` + k * `width`."""

    seed: int
    micro: int
    position: int
    width: int

    @classmethod
    def of(cls, trainer: pl.Trainer, seed: int) -> StepDraws:
        """The draws of the trainer's current micro-batch on this rank."""
        r, w = stream_slots(trainer)
        return cls(seed, micro_batch(trainer), r, w)

    def row_keys(self, n: int, tag: int) -> torch.Tensor:
        """(n,) int64 host keys of this rank's n samples for one kind of draw (keyed.keys): (seed, micro-batch, the
        sample's row in the global batch, tag), so a sample draws the same on any world size and after a resume."""
        r, W, micro = self.position, self.width, self.micro
        return keyed.keys(self.seed, micro, range(r, r + n * W, W), tag)

    def generator(self) -> torch.Generator:
        """CPU generator for this micro-batch, independent of rank count and of restarts."""
        return torch.Generator().manual_seed(hash((self.seed, self.micro)) & 0x7FFF_FFFF_FFFF)

    def noise(self, x0: torch.Tensor, caption_dropout: float, levels: Callable[[torch.Tensor], torch.Tensor]
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Noise (like x0), noise level (`levels` of a normal, (B,)) and caption-drop flag (B,) of each sample.

        A rank draws only its own rows (host time O(local batch) whatever the world size). The noise and the normal
        behind the noise level are drawn on the batch's device, the drop flags on the host: whether any row drops
        needs no device read.
        """
        B, n = x0.shape[0], x0[0].numel()
        drop = keyed.uniforms(self.row_keys(B, DROP_DRAW), 1)[:, 0] < caption_dropout
        z = keyed.normals(_to_device(self.row_keys(B, NOISE_DRAW), x0.device), n + 1)  # the noise, then the level's
        return z[:, :n].reshape(x0.shape), levels(z[:, n]), drop

    def latents(self, latents: torch.Tensor, std: torch.Tensor | None, hflip: bool) -> torch.Tensor:
        """The latents (B, C, h, w) each sample trains on: a draw latents + std * N(0, 1) of its VAE posterior when
        the dataset stores the std (posterior=distribution), mirrored left-right with probability 1/2 when hflip."""
        B, out = latents.shape[0], latents
        if std is not None:
            out = latents + std * keyed.normals(self.row_keys(B, LATENT_DRAW), latents[0].numel()).view(latents.shape)
        if hflip:
            flip = keyed.uniforms(self.row_keys(B, FLIP_DRAW), 1).view(B, *[1] * (latents.ndim - 1)) < 0.5
            out = torch.where(flip, out.flip(-1), out)
        return out

    def captions(self, counts: torch.Tensor) -> torch.Tensor:
        """For a batch of a caption_layout per_image dataset, whose samples have counts (B,) captions: which one each
        trains on, (B,) int64, uniform over its captions."""
        u = keyed.uniforms(self.row_keys(len(counts), CAPTION_DRAW), 1)[:, 0]
        return (u.double() * counts).long()  # in float64 u * count stays below count
