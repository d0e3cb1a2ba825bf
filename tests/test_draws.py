"""framework.training.draws.StepDraws, the step's per-sample draws that the data module and the LightningModule share,
against draws made by hand from framework.training.keyed for the whole global batch on one rank."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from framework.models.objectives import Objective, ObjectiveConfig
from framework.training import keyed
from framework.training.draws import CAPTION_DRAW, DROP_DRAW, FLIP_DRAW, LATENT_DRAW, NOISE_DRAW, StepDraws

SEED, B, W = 11, 6, 2  # a global batch of 6 rows over 2 data-parallel ranks: rank r holds rows r, r + 2, r + 4


def by_hand(micro: int, tag: int, n: int, normal: bool = True) -> torch.Tensor:
    """(B, n): the global batch's keyed numbers of one kind at micro-batch `micro`, drawn for all rows at once."""
    keys = torch.tensor([hash((SEED, micro, row, tag)) for row in range(B)], dtype=torch.int64)
    return keyed.normals(keys, n) if normal else keyed.uniforms(keys, n)


def gathered(parts: list[torch.Tensor]) -> torch.Tensor:
    """The ranks' rows (rank r's k-th row is global row r + k W) put back in global order."""
    return torch.stack([parts[i % W][i // W] for i in range(B)])


@pytest.mark.parametrize("micro", [0, 5])
def test_two_ranks_draw_the_rows_of_one_process_drawing_the_global_batch(micro):
    """Noise, level, drop flag, caption choice, posterior sample and flip of each rank of 2 are the global batch's
    rows drawn by hand (keyed by seed, micro-batch, global row and kind), bit for bit; the kinds differ."""
    assert len({NOISE_DRAW, DROP_DRAW, CAPTION_DRAW, LATENT_DRAW, FLIP_DRAW}) == 5
    g = torch.Generator().manual_seed(0)
    x0, std = torch.randn(B, 2, 3, 4, generator=g), torch.rand(B, 2, 3, 4, generator=g) + 0.5
    counts = torch.tensor([1, 2, 3, 4, 5, 7])
    levels = Objective(ObjectiveConfig()).levels
    ranks = [StepDraws(SEED, micro, r, W) for r in range(W)]

    n = x0[0].numel()
    z = by_hand(micro, NOISE_DRAW, n + 1)
    noise, level, drop = zip(*(d.noise(x0[r::W], 0.5, levels) for r, d in enumerate(ranks)))
    torch.testing.assert_close(gathered(list(noise)), z[:, :n].reshape(x0.shape), rtol=0, atol=0)
    torch.testing.assert_close(gathered(list(level)), levels(z[:, n]), rtol=0, atol=0)
    assert gathered(list(drop)).tolist() == (by_hand(micro, DROP_DRAW, 1, normal=False)[:, 0] < 0.5).tolist()

    u = by_hand(micro, CAPTION_DRAW, 1, normal=False)[:, 0]
    chosen = gathered([d.captions(counts[r::W]) for r, d in enumerate(ranks)])
    assert chosen.tolist() == [int(float(a) * int(c)) for a, c in zip(u.double(), counts)]

    posterior = x0 + std * by_hand(micro, LATENT_DRAW, n).view(x0.shape)
    flip = by_hand(micro, FLIP_DRAW, 1, normal=False)[:, 0] < 0.5
    expected = torch.stack([p.flip(-1) if f else p for p, f in zip(posterior, flip)])
    drawn = gathered([d.latents(x0[r::W], std[r::W], True) for r, d in enumerate(ranks)])
    torch.testing.assert_close(drawn, expected, rtol=0, atol=0)


def trainer(global_step: int, accumulate: int, ready: int, mesh=None, world: int = 1, rank: int = 0):
    """What StepDraws.of reads of a Lightning trainer."""
    progress = SimpleNamespace(current=SimpleNamespace(ready=ready))
    return SimpleNamespace(global_step=global_step, accumulate_grad_batches=accumulate, world_size=world,
                           num_devices=world, global_rank=rank, strategy=SimpleNamespace(mesh=mesh),
                           fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)))


def test_the_draws_of_a_trainer_follow_its_micro_batch_and_stream_position():
    """StepDraws.of: micro-batch = optimizer steps x accumulation + the batch's place in its step (each micro-batch
    of a run its own number, the same after a resume); the stream position is the job mesh's when there is one, the
    rank's on a single node otherwise."""
    assert StepDraws.of(trainer(4, 3, 8), SEED) == StepDraws(SEED, 14, 0, 1)
    assert StepDraws.of(trainer(4, 3, 9), SEED) == StepDraws(SEED, 12, 0, 1)
    assert StepDraws.of(trainer(2, 1, 3, world=2, rank=1), SEED) == StepDraws(SEED, 2, 1, 2)
    mesh = SimpleNamespace(stream_position=3, dims=SimpleNamespace(data_parallel=4))
    assert StepDraws.of(trainer(0, 2, 1, mesh=mesh, world=8, rank=5), SEED) == StepDraws(SEED, 1, 3, 4)
    a, b = StepDraws(SEED, 14, 0, 1).generator(), StepDraws(SEED, 15, 0, 1).generator()
    assert torch.rand(3, generator=a).tolist() != torch.rand(3, generator=b).tolist()
