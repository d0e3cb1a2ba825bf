"""Objectives against hand-computed corruption and an oracle denoiser."""

import pytest
import torch

from framework.models.objectives import Objective, ObjectiveConfig, check_sampler, sample_latents


def _alphas_bar(cfg: ObjectiveConfig) -> torch.Tensor:
    # scaled_linear by hand: betas linear in sqrt space
    betas = torch.linspace(cfg.beta_start**0.5, cfg.beta_end**0.5, cfg.num_train_timesteps, dtype=torch.float64) ** 2
    return torch.cumprod(1 - betas, 0).float()


def test_flow_corruption_is_the_straight_path():
    obj = Objective(ObjectiveConfig(name="flow", flow_shift=3.0))
    x0, noise = torch.randn(4, 2, 3, 3), torch.randn(4, 2, 3, 3)
    u = torch.tensor([0.0, 0.25, 0.5, 0.9])
    xt, t, target = obj.corrupt(x0, noise, u)
    s = 3 * u / (1 + 2 * u)
    torch.testing.assert_close(t, s * 1000)
    torch.testing.assert_close(xt, (1 - s.view(-1, 1, 1, 1)) * x0 + s.view(-1, 1, 1, 1) * noise)
    torch.testing.assert_close(target, noise - x0)


@pytest.mark.parametrize("name", ["eps", "v"])
def test_eps_and_v_targets_match_the_ddpm_formulas(name):
    cfg = ObjectiveConfig(name=name, timestep_sampling="uniform")
    obj = Objective(cfg)
    x0, noise = torch.randn(3, 1, 4, 4), torch.randn(3, 1, 4, 4)
    u = torch.tensor([0.0, 0.5, 0.999])
    xt, t, target = obj.corrupt(x0, noise, u)
    ab = _alphas_bar(cfg)[t.long()].view(-1, 1, 1, 1)
    torch.testing.assert_close(t, torch.tensor([0.0, 500.0, 999.0]))
    torch.testing.assert_close(xt, ab.sqrt() * x0 + (1 - ab).sqrt() * noise, atol=1e-5, rtol=1e-5)
    want = noise if name == "eps" else ab.sqrt() * noise - (1 - ab).sqrt() * x0
    torch.testing.assert_close(target, want, atol=1e-5, rtol=1e-5)


def _oracle(obj: Objective, c: torch.Tensor):
    """Exact prediction for data that is the single point c."""
    T = obj.cfg.num_train_timesteps

    def denoise(x, t):
        if obj.cfg.name == "flow":
            s = (t / T).view(-1, 1, 1, 1)
            return (x - c) / s  # velocity noise - x0 with noise = (x - (1-s)c)/s
        ab = obj.ddpm.alphas_cumprod[t.long()].view(-1, 1, 1, 1).float()
        eps = (x - ab.sqrt() * c) / (1 - ab).sqrt()
        return eps if obj.cfg.name == "eps" else ab.sqrt() * eps - (1 - ab).sqrt() * c

    return denoise


@pytest.mark.parametrize(
    "name,sampler", [("eps", "ddim"), ("eps", "dpm++"), ("v", "ddim"), ("v", "dpm++"), ("flow", "flow_euler"), ("flow", "dpm++")]
)
def test_samplers_recover_the_data_point_with_an_oracle(name, sampler):
    obj = Objective(ObjectiveConfig(name=name, timestep_sampling="uniform"))
    c = torch.linspace(-0.8, 0.8, 16).view(1, 1, 4, 4)
    noise = torch.randn(2, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    x = sample_latents(_oracle(obj, c), obj.sampler(sampler), noise, steps=10)
    torch.testing.assert_close(x, c.expand(2, -1, -1, -1), atol=2e-3, rtol=0)


def test_flow_objective_refuses_ddim_with_a_message():
    with pytest.raises(ValueError, match="sampler='ddim' cannot sample a model trained with objective='flow'"):
        check_sampler("flow", "ddim")
    with pytest.raises(ValueError, match="objective.name='x0'"):
        ObjectiveConfig(name="x0")
    with pytest.raises(ValueError, match="logit_normal is defined for objective=flow only"):
        ObjectiveConfig(name="eps", timestep_sampling="logit_normal")


def test_logit_normal_draws_concentrate_mid_path():
    obj = Objective(ObjectiveConfig(name="flow", timestep_sampling="logit_normal"))
    _, u = obj.draw(torch.zeros(20000, 1), torch.Generator().manual_seed(0))
    assert 0.0 < u.min() and u.max() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.01
    assert ((u > 0.25) & (u < 0.75)).float().mean() > 0.6  # uniform would give 0.5
