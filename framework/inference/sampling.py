"""One process's sampling: a plan, the images it draws, and the sampler that draws them.

`SamplingPlan` says what to draw (steps, guidance, sampler, seed, cache schedule, latent size, candidates)
and is the one object every caller passes: the sample and eval commands, training grids, studies.
`Draws` lists the images one call draws, each with its prompt, label and noise seed. `Sampler` turns
draws into latents and images on one process, batch by batch; it is indifferent to the latent's
dimensions after the channels, so frames can be added. How ranks share the draws is
framework/inference/sharing.py, around it.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any, Iterator, Sequence

import torch

from framework.inference.caching import BranchRunner, CacheSchedule, ScheduledSampling
from framework.models.objectives import sample_latents


@dataclass(frozen=True)
class SamplingPlan:
    """What one generate call draws."""

    steps: int = 20
    # sampling steps
    guidance: float = 4.0
    # classifier-free guidance scale (1.0: the conditional prediction alone)
    sampler: str | None = None
    # ddim, flow_euler, dpm++; None: the objective's default
    seed: int = 0
    # the noise of prompt i depends only on (seed, i, candidate)
    cache_schedule: str | CacheSchedule | None = None
    # reuse skipped branches from the previous step (framework/inference/caching.py): a CacheSchedule or a
    # `cache_schedule=` value (a file, uniform:K)
    size: tuple[int, ...] | None = None
    # the latent's size after the channels, e.g. (h, w), one the model was trained at; None: the model's own
    candidates: int = 1
    # images per prompt (best-of-N); candidate 0 is what candidates=1 draws

    def __post_init__(self) -> None:
        if self.candidates < 1:
            raise ValueError(f"candidates={self.candidates} must be >= 1")
        if self.steps < 1:
            raise ValueError(f"steps={self.steps} must be >= 1")
        if self.size is not None:
            object.__setattr__(self, "size", tuple(self.size))

    @classmethod
    def of(cls, settings: Any, **given: Any) -> "SamplingPlan":
        """The plan of a settings object (a command's or eval's config) that holds some of these fields by the same
        names (steps, guidance, sampler, seed, cache_schedule); `given` sets or overrides the others."""
        own = {f.name: getattr(settings, f.name) for f in fields(cls) if hasattr(settings, f.name)}
        return cls(**{**own, **given})


@dataclass(frozen=True)
class Draws:
    """The images one call draws, in order (each prompt's candidates together): prompt, class label, noise seed."""

    prompts: list[str]
    labels: list[int | None]
    seeds: list[int]

    @classmethod
    def of(cls, prompts: Sequence[str], labels: Sequence[int | None] | None, seed: int, candidates: int) -> "Draws":
        """Candidate j of prompt i gets noise that depends only on (seed, i, j), so the first candidates are the same
        whatever `candidates` is, and candidate 0 is what plain sampling draws."""
        labels = list(labels) if labels is not None else [None] * len(prompts)
        per_candidate = [noise_seeds(seed, len(prompts), j) for j in range(candidates)]
        return cls([p for p in prompts for _ in range(candidates)],
                   [lbl for lbl in labels for _ in range(candidates)],
                   [per_candidate[j][i] for i in range(len(prompts)) for j in range(candidates)])

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, which: slice | list[int]) -> "Draws":
        if isinstance(which, slice):
            return Draws(self.prompts[which], self.labels[which], self.seeds[which])
        return Draws([self.prompts[i] for i in which], [self.labels[i] for i in which], [self.seeds[i] for i in which])

    def batches(self, batch_size: int) -> list["Draws"]:
        return [self[i : i + batch_size] for i in range(0, len(self), batch_size)]


def noise_seeds(seed: int, n: int, candidate: int = 0) -> list[int]:
    """The initial-noise seed of each of n prompts for one candidate stream (0: plain sampling)."""
    stream = seed if candidate == 0 else (seed * 0x9E3779B97F4A7C15 + candidate) % 2**63
    return torch.randint(0, 2**62, (n,), generator=torch.Generator().manual_seed(stream)).tolist()


class Sampler:
    """Draws -> scaled latents -> images on one process, `batch_size` images at a time.

    `pipe` (framework/inference/pipeline.py) holds the denoiser, objective and encoders; the plan is checked
    against it here (the size against the sizes the model was trained at, the cache schedule against the model,
    sampler and step count)."""

    def __init__(self, pipe: Any, plan: SamplingPlan, batch_size: int = 64, progress: bool = False) -> None:
        if plan.size is not None and plan.size not in pipe.sizes():
            raise ValueError(f"size={plan.size}: the model was trained at latent sizes {pipe.sizes()}")
        self.pipe, self.plan, self.batch_size, self.progress = pipe, plan, batch_size, progress
        cfg = pipe.model.cfg
        self.shape = (cfg.in_channels, *(plan.size or cfg.latent_shape))  # one image's (clip's) latents
        self.schedule = pipe.schedule(plan.cache_schedule, plan.sampler, plan.steps)

    def images(self, draws: Draws, decode: bool = True, progress: bool | None = None) -> torch.Tensor:
        """The draws' images (n, C, H, W) (clips: (n, F, C, H, W)) in [-1, 1], in order; decode=False: their scaled
        latents."""
        from tqdm import tqdm

        show = self.progress if progress is None else progress
        out = []
        bar = tqdm(total=len(draws), desc="generate", unit="img", disable=not show, leave=False)
        with self.caching() as runner:
            for batch in draws.batches(self.batch_size):
                z = self.latents(batch, runner)
                out.append(self.pipe.decode(z) if decode else z)
                bar.update(len(out[-1]))
        bar.close()
        return torch.cat(out)

    @contextmanager
    def caching(self, on: bool = True) -> Iterator[BranchRunner | None]:
        """The model's branches wrapped for the plan's cache schedule while inside (None, nothing done, without one)."""
        if self.schedule is None or not on:
            yield None
            return
        runner = BranchRunner(self.pipe.model)
        with runner.installed():
            yield runner

    def latents(self, draws: Draws, runner: BranchRunner | None = None) -> torch.Tensor:
        """Scaled latents (b, *shape) of one batch; both guidance halves in one forward, so they share one branch
        cache (`runner`: from caching())."""
        from framework.models.conditioning import guidance_batch, guide, pad_and_stack

        pipe, plan, device = self.pipe, self.plan, self.pipe.device
        text, mask = pad_and_stack([e.to(device) for e in pipe.encode(draws.prompts)])  # (b, L, D)
        lab = torch.tensor(draws.labels, device=device) if pipe.model.cfg.num_classes is not None else None
        text2, mask2, lab = guidance_batch(pipe.model, text, mask, lab, pipe.empty_text)
        steps_run = ScheduledSampling(runner, self.schedule) if runner is not None else None
        if runner is not None:
            runner.reset()

        def denoise(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            if steps_run is not None:
                steps_run.next_step()
            return guide(pipe.model(torch.cat([x, x]), t.repeat(2), text2, mask2, lab), plan.guidance)

        # One generator per image keeps image i independent of the batch it lands in.
        x = torch.stack([torch.randn(self.shape, generator=torch.Generator().manual_seed(s)) for s in draws.seeds])
        return sample_latents(denoise, pipe.objective.sampler(plan.sampler), x, plan.steps, device)
