"""Diffusion objectives (epsilon, v, rectified flow) and the samplers that invert them.

Training draws a noise level per sample, corrupts the clean latents and asks the network for a
target; sampling walks a diffusers scheduler from noise back to latents. Both sides speak the same
time convention: the network always sees a timestep on the 0..1000 scale (the DDPM step index for
eps/v, `sigma * 1000` for flow), which is what diffusers' schedulers hand out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from diffusers import (
    DDIMScheduler,
    DDPMScheduler,
    DPMSolverMultistepScheduler,
    FlowMatchEulerDiscreteScheduler,
)
from diffusers.schedulers.scheduling_utils import SchedulerMixin

OBJECTIVES = ("eps", "v", "flow")
# Which sampler can invert which objective: DDIM has no flow parametrisation in diffusers, and
# flow-Euler only integrates a velocity field.
SAMPLERS = {"ddim": ("eps", "v"), "dpm++": ("eps", "v", "flow"), "flow_euler": ("flow",)}
DEFAULT_SAMPLER = {"eps": "dpm++", "v": "dpm++", "flow": "flow_euler"}


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


@dataclass
class ObjectiveConfig:
    """What the network predicts and how noise levels are drawn during training."""

    name: str = "flow"
    """eps (predict the noise), v (predict v = a*eps - s*x0) or flow (predict velocity noise - x0)."""
    num_train_timesteps: int = 1000
    """Length of the discrete DDPM chain (eps/v) and the scale of flow timesteps."""
    beta_schedule: str = "scaled_linear"
    """eps/v only: scaled_linear (SD/PixArt), linear (DiT) or squaredcos_cap_v2 (cosine)."""
    beta_start: float = 0.00085
    """eps/v only: first beta of the linear schedules."""
    beta_end: float = 0.012
    """eps/v only: last beta of the linear schedules."""
    flow_shift: float = 1.0
    """flow only: sigma -> shift*sigma / (1 + (shift-1)*sigma); >1 spends more steps at high noise (SD3, SANA use 3)."""
    timestep_sampling: str = "uniform"
    """uniform, or logit_normal (flow only; sigma = sigmoid(N(mean, std)), as in SD3)."""
    logit_mean: float = 0.0
    """Mean of the logit-normal timestep density."""
    logit_std: float = 1.0
    """Std of the logit-normal timestep density."""
    caption_dropout: float = 0.1
    """Share of training samples whose caption is replaced by the empty caption (for classifier-free guidance)."""

    def __post_init__(self) -> None:
        if self.name not in OBJECTIVES:
            raise ValueError(f"objective.name={self.name!r} is not one of {OBJECTIVES}; pick objective=eps|v|flow")
        if self.timestep_sampling not in ("uniform", "logit_normal"):
            raise ValueError(
                f"objective.timestep_sampling={self.timestep_sampling!r}: expected uniform or logit_normal"
            )
        if self.timestep_sampling == "logit_normal" and self.name != "flow":
            raise ValueError("objective.timestep_sampling=logit_normal is defined for objective=flow only")
        if not 0.0 <= self.caption_dropout < 1.0:
            raise ValueError(f"objective.caption_dropout={self.caption_dropout} must lie in [0, 1)")
        if self.flow_shift <= 0:
            raise ValueError(f"objective.flow_shift={self.flow_shift} must be > 0")


# --------------------------------------------------------------------------------------------
# The objective
# --------------------------------------------------------------------------------------------


class Objective:
    """Corrupts clean latents for training and builds matching samplers."""

    def __init__(self, cfg: ObjectiveConfig) -> None:
        self.cfg = cfg
        if cfg.name != "flow":
            # Only the beta schedule and add_noise/get_velocity of this scheduler are used.
            self.ddpm = DDPMScheduler(
                num_train_timesteps=cfg.num_train_timesteps,
                beta_schedule=cfg.beta_schedule,
                beta_start=cfg.beta_start,
                beta_end=cfg.beta_end,
            )

    # ---- training -----------------------------------------------------------------------

    def levels(self, z: torch.Tensor) -> torch.Tensor:
        """Noise levels u in [0, 1] from standard normals z (the training step draws one normal per sample):
        logit-normal, sigmoid(logit_mean + logit_std * z), or uniform, Phi(z) (the normal's CDF)."""
        if self.cfg.timestep_sampling == "logit_normal":
            return torch.sigmoid(z * self.cfg.logit_std + self.cfg.logit_mean)
        return torch.special.ndtr(z)

    def draw(self, x0: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw (noise, u) for a batch on the CPU generator: u in [0, 1] picks the noise level."""
        noise = torch.randn(x0.shape, generator=generator, dtype=torch.float32)
        return noise, self.levels(torch.randn(x0.shape[0], generator=generator))

    def corrupt(
        self, x0: torch.Tensor, noise: torch.Tensor, u: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return (x_t, timestep for the network on the 0..T scale, regression target)."""
        T = self.cfg.num_train_timesteps
        if self.cfg.name == "flow":
            sigma = self.shift(u).to(x0.dtype)  # (B,)
            s = sigma.view(-1, *([1] * (x0.ndim - 1)))
            xt = (1.0 - s) * x0 + s * noise  # straight path from data (sigma=0) to noise (sigma=1)
            return xt, sigma * T, noise - x0
        t = (u * T).long().clamp_(max=T - 1)  # (B,) integer DDPM steps
        xt = self.ddpm.add_noise(x0, noise, t)
        target = noise if self.cfg.name == "eps" else self.ddpm.get_velocity(x0, noise, t)
        return xt, t.to(x0.dtype), target

    def noise_to(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """x0 noised to a sampler's timestep t (a scalar on the 0..T scale, as schedulers hand out)."""
        if self.cfg.name == "flow":
            s = (t.float() / self.cfg.num_train_timesteps).to(x0.dtype)  # the (already shifted) sigma
            return (1.0 - s) * x0 + s * noise
        return self.ddpm.add_noise(x0, noise, t.long().expand(x0.shape[0]).to(x0.device))

    def shift(self, sigma: torch.Tensor) -> torch.Tensor:
        """Resolution-dependent timestep shift of SD3/SANA (identity at shift=1)."""
        k = self.cfg.flow_shift
        return k * sigma / (1.0 + (k - 1.0) * sigma)

    # ---- sampling -----------------------------------------------------------------------

    def sampler(self, name: str | None = None) -> SchedulerMixin:
        """A fresh diffusers scheduler that inverts this objective."""
        name = name or DEFAULT_SAMPLER[self.cfg.name]
        check_sampler(self.cfg.name, name)
        cfg = self.cfg
        if cfg.name == "flow":
            if name == "flow_euler":
                return FlowMatchEulerDiscreteScheduler(num_train_timesteps=cfg.num_train_timesteps, shift=cfg.flow_shift)
            return DPMSolverMultistepScheduler(
                num_train_timesteps=cfg.num_train_timesteps,
                use_flow_sigmas=True,
                prediction_type="flow_prediction",
                flow_shift=cfg.flow_shift,
            )
        common = dict(
            num_train_timesteps=cfg.num_train_timesteps,
            beta_schedule=cfg.beta_schedule,
            beta_start=cfg.beta_start,
            beta_end=cfg.beta_end,
            prediction_type="epsilon" if cfg.name == "eps" else "v_prediction",
            # Trailing spacing starts at the last training step, so few-step sampling starts from pure noise.
            timestep_spacing="trailing",
        )
        if name == "ddim":
            # The last step lands on alpha_bar=1 (a clean sample), not on the first training step.
            return DDIMScheduler(clip_sample=False, set_alpha_to_one=True, **common)
        return DPMSolverMultistepScheduler(algorithm_type="dpmsolver++", **common)


def check_sampler(objective: str, sampler: str) -> None:
    """Raise a message naming the key when a sampler cannot invert the objective."""
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler={sampler!r} is unknown; choose one of {sorted(SAMPLERS)}")
    if objective not in SAMPLERS[sampler]:
        ok = [s for s, objs in SAMPLERS.items() if objective in objs]
        raise ValueError(
            f"sampler={sampler!r} cannot sample a model trained with objective={objective!r}; use sampler={ok[0]}"
            f" (valid: {ok})"
        )


@torch.inference_mode()
def sample_latents(
    denoise: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    scheduler: SchedulerMixin,
    noise: torch.Tensor,
    steps: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Integrate from `noise` (B, C, h, w) to scaled latents; `denoise(x, t)` returns the guided prediction."""
    scheduler.set_timesteps(steps, device=device)
    x = noise.to(device) * getattr(scheduler, "init_noise_sigma", 1.0)
    for t in scheduler.timesteps:
        x_in = scheduler.scale_model_input(x, t) if hasattr(scheduler, "scale_model_input") else x
        pred = denoise(x_in, t.expand(x.shape[0]).to(device=device, dtype=torch.float32))
        x = scheduler.step(pred, t, x).prev_sample
    return x
