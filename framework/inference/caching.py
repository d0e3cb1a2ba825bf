"""Cached sampling: reuse residual branches' outputs from the previous sampling step (Learning-to-Cache).

A `CacheSchedule` says, for each step of one sampler at one step count, which residual branch of which
block is recomputed; the others return the output that branch computed at an earlier step. The output
is taken before the block's adaLN gate (diffusers' blocks call the branch module, then gate its
output), so a reused branch is still scaled by the current timestep's gate. Skipped branches are not
run at all: `BranchRunner` swaps each branch module for a wrapper that either calls it or hands back
the cached tensor, so the time saved is real.

Where schedules come from:
  - learned: plugins/cache_router.py trains a router on a frozen backbone and writes cache_schedule.json
    (Learning-to-Cache, Ma et al., NeurIPS 2024, arXiv:2406.01733);
  - `uniform:K`: a full step every K steps and every branch reused in between, the fixed-interval
    heuristic of FORA / DeepCache-style caches (K may be fractional: ceil(steps / K) evenly spaced
    full steps, to match another schedule's count of computed branches).

The runner also serves the router's training: `record()` keeps every branch output of a full step, and
`mix(beta)` returns beta * fresh + (1 - beta) * cached for every branch.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from framework.models.blocks import block_views
from framework.models.backbones import Denoiser

SCHEDULE_FILE = "cache_schedule.json"
SCHEDULE_VERSION = 1


# --------------------------------------------------------------------------------------------------
# The schedule
# --------------------------------------------------------------------------------------------------

def model_signature(model: Denoiser, objective: str) -> dict[str, Any]:
    """What a schedule must match: the architecture (family, depth, width, each block's branches) and the
    objective (it decides the sampler's trajectory)."""
    cfg, views = model.cfg, block_views(model)
    return {"name": cfg.name, "family": cfg.family, "num_layers": len(views),
            "hidden_size": cfg.hidden_size, "latent_hw": list(cfg.latent_hw), "objective": objective,
            "branches": [[b.kind for b in v.branches] for v in views]}


@dataclass
class CacheSchedule:
    """Which branches each sampling step recomputes: compute[step][block][branch] (True = recompute)."""

    sampler: str
    # the sampler it was made for (ddim, flow_euler, dpm++)
    steps: int
    # the number of sampling steps it was made for
    model: dict[str, Any]
    # model_signature() of the model it was made for
    compute: list[list[list[bool]]]
    # [step][block][branch]; step 0 always computes everything (there is nothing to reuse yet)
    kind: str = "learned"
    # learned (a trained router) or uniform:K
    beta: list[list[list[float]]] | None = None
    # learned: the router's sigmoid outputs, same layout; the schedule is beta > threshold
    threshold: float | None = None
    # learned: the threshold that turned beta into compute
    source: dict[str, Any] = field(default_factory=dict)
    # where it came from (checkpoint, training step, ...), for people

    def __post_init__(self) -> None:
        shape = (self.steps, len(self.model["branches"]))
        if len(self.compute) != shape[0] or any(len(s) != shape[1] for s in self.compute):
            raise ValueError(f"cache schedule: compute has {len(self.compute)} steps x "
                             f"{[len(s) for s in self.compute][:1]} blocks, expected {shape[0]} x {shape[1]}")
        if not all(all(block) for block in self.compute[0]):
            raise ValueError("cache schedule: step 0 must compute every branch (no earlier step to reuse)")

    # ---- figures ------------------------------------------------------------------------

    @property
    def computed_fraction(self) -> float:
        """Share of all (step, block, branch) evaluations that run."""
        flat = [c for s in self.compute for b in s for c in b]
        return sum(flat) / len(flat)

    def describe(self) -> str:
        """One line: kind, steps, share of branch evaluations skipped."""
        return (f"cache schedule {self.kind} ({self.sampler}, {self.steps} steps): "
                f"{1 - self.computed_fraction:.1%} of branch evaluations reused")

    # ---- files --------------------------------------------------------------------------

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": SCHEDULE_VERSION, **asdict(self)}, indent=1))
        tmp.replace(path)  # never a half-written schedule
        return path

    @classmethod
    def load(cls, path: str | Path) -> "CacheSchedule":
        path = Path(path)
        if path.is_dir():
            path = path / SCHEDULE_FILE
        if not path.exists():
            raise FileNotFoundError(f"cache_schedule={path} does not exist; give a {SCHEDULE_FILE} written by "
                                    "experiment=cache_router, or uniform:K")
        data = json.loads(path.read_text())
        if data.pop("version", None) != SCHEDULE_VERSION:
            raise ValueError(f"cache_schedule={path} is not a version-{SCHEDULE_VERSION} LatentForge cache schedule")
        return cls(**data)

    # ---- checks -------------------------------------------------------------------------

    def check(self, model: Denoiser, objective: str, sampler: str, steps: int, where: str = "cache_schedule") -> None:
        """Refuse, with one message, a schedule made for another sampler, step count or model."""
        problems = []
        if sampler != self.sampler:
            problems.append(f"it was made for sampler={self.sampler}, this run samples with sampler={sampler}")
        if steps != self.steps:
            problems.append(f"it was made for steps={self.steps}, this run samples {steps} steps")
        mine = model_signature(model, objective)
        differ = [k for k in mine if k != "name" and mine[k] != self.model.get(k)]
        if differ:
            problems.append("it was made for another model (" + ", ".join(
                f"{k}: schedule {self.model.get(k)} vs model {mine[k]}" for k in differ) + ")")
        if problems:
            raise ValueError(f"{where}: {'; '.join(problems)}. Sample with the schedule's sampler and steps, or "
                             "train a schedule for this setting (experiment=cache_router), or use uniform:K.")


def uniform_schedule(model: Denoiser, objective: str, sampler: str, steps: int, every: float) -> CacheSchedule:
    """`uniform:K`: ceil(steps / K) evenly spaced full steps (step 0 first); every branch reused in between."""
    if every < 1:
        raise ValueError(f"cache_schedule=uniform:{every}: K must be >= 1 (a full step every K steps)")
    # Rounded first: uniform:1.53846 (20/13 to 6 digits) means 13 full steps of 20, not 14.
    count = math.ceil(round(steps / every, 3))
    full = {min(steps - 1, math.floor(round(i * every, 3))) for i in range(count)}
    shape = model_signature(model, objective)["branches"]
    compute = [[[s in full] * len(kinds) for kinds in shape] for s in range(steps)]
    return CacheSchedule(sampler, steps, model_signature(model, objective), compute, kind=f"uniform:{every:g}")


def resolve_schedule(spec: str | None, model: Denoiser, objective: str, sampler: str,
                     steps: int) -> CacheSchedule | None:
    """The schedule named by a `cache_schedule=` value (a file, a run dir holding one, or uniform:K), checked
    against the model, sampler and steps it will drive; None for no caching."""
    if spec in (None, "", "none", "null"):
        return None
    if spec.startswith("uniform:"):
        try:
            every = float(spec.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"cache_schedule={spec}: expected uniform:K with a number K >= 1, e.g. uniform:2") from None
        return uniform_schedule(model, objective, sampler, steps, every)
    schedule = CacheSchedule.load(spec)
    schedule.check(model, objective, sampler, steps, f"cache_schedule={spec}")
    return schedule


# --------------------------------------------------------------------------------------------------
# Running a backbone branch by branch
# --------------------------------------------------------------------------------------------------

class _Branch(nn.Module):
    """Stands in for one branch module while a BranchRunner is installed; the real module is its child."""

    def __init__(self, inner: nn.Module, key: tuple[int, int], runner: "BranchRunner") -> None:
        super().__init__()
        self.inner, self.key = inner, key
        object.__setattr__(self, "_runner", runner)  # not a submodule

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._runner.call(self.key, self.inner, args, kwargs)

    def runs(self) -> bool:
        """Whether the next call runs the branch (False: it returns the cached output)."""
        return self._runner.runs(self.key)


class BranchRunner:
    """Runs a denoiser's residual branches by a per-step plan, inside `with runner.installed():`.

    Modes, set between forwards: plain (compute everything, keep outputs as the cache), `compute`
    (a [block][branch] mask: False returns the cached output without running the branch), and `beta`
    (a (blocks, branches) tensor: beta * fresh + (1 - beta) * cached, for the router's training).
    """

    def __init__(self, model: Denoiser) -> None:
        self.model = model
        self.views = block_views(model)
        self.cache: dict[tuple[int, int], torch.Tensor] = {}
        self.compute: list[list[bool]] | None = None
        self.beta: torch.Tensor | None = None

    def runs(self, key: tuple[int, int]) -> bool:
        return self.compute is None or self.compute[key[0]][key[1]]

    def call(self, key: tuple[int, int], inner: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
        if not self.runs(key):
            return self.cache[key]  # (B, N, D), or (B, D, h, w) for SANA's conv MLP
        out = inner(*args, **kwargs)
        if self.beta is not None:
            b = self.beta[key].to(out.dtype)
            return b * out + (1 - b) * self.cache[key]
        self.cache[key] = out
        return out

    @contextmanager
    def installed(self) -> Iterator["BranchRunner"]:
        """Wrap every branch module for the `with` block; the model is exactly as before afterwards."""
        swapped = []
        try:
            for i, view in enumerate(self.views):
                for j, branch in enumerate(view.branches):
                    setattr(view.module, branch.attr, _Branch(branch.module, (i, j), self))
                    swapped.append((view.module, branch))
            yield self
        finally:
            for block, branch in swapped:
                setattr(block, branch.attr, branch.module)
            self.reset()

    def reset(self) -> None:
        """Forget the cache (a new image batch) and go back to computing everything."""
        self.cache.clear()
        self.compute, self.beta = None, None

    @contextmanager
    def mix(self, beta: torch.Tensor) -> Iterator[None]:
        """Forwards in the block blend fresh and cached outputs by `beta` (blocks, branches); the cache is kept."""
        self.beta = beta
        try:
            yield
        finally:
            self.beta = None


class ScheduledSampling:
    """Drives a BranchRunner through one sampling loop: `next_step()` before each denoiser call."""

    def __init__(self, runner: BranchRunner, schedule: CacheSchedule) -> None:
        self.runner, self.schedule, self.step = runner, schedule, -1

    def next_step(self) -> None:
        self.step += 1
        if self.step >= self.schedule.steps:
            raise RuntimeError(f"the sampler called the model {self.step + 1} times; the cache schedule has "
                               f"{self.schedule.steps} steps")
        self.runner.compute = self.schedule.compute[self.step]
