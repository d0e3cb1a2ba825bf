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


def _splitmix64(state: int, n: int) -> list[int]:
    """SplitMix64 by hand on Python integers (Steele, Lea and Flood 2014): the first n outputs from `state`."""
    out = []
    for _ in range(n):
        state = (state + 0x9E3779B97F4A7C15) % 2**64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
        out.append(z ^ (z >> 31))
    return out


def test_the_step_draws_from_each_samples_splitmix64_sequence():
    """keyed.bits is SplitMix64 from each key: seed 0's first output is the published 0xE220A8397B1DCDAF, and keys
    whose arithmetic overflows int64 (negative, near 2**63) agree with the hand-written generator bit for bit."""
    from framework.training import keyed

    assert _splitmix64(0, 1) == [0xE220A8397B1DCDAF]
    states = [0, 1, 12345678901234, 2**63 - 1, -1, -(2**63), hash((0, 7, 3, 1))]
    got = keyed.bits(torch.tensor(states, dtype=torch.int64), 5)
    for row, state in zip(got.tolist(), states):
        assert [v % 2**64 for v in row] == _splitmix64(state % 2**64, 5)
    # a key's first numbers do not depend on how many are drawn
    k = keyed.keys(0, 3, range(6), 0)
    torch.testing.assert_close(keyed.normals(k, 7), keyed.normals(k, 12)[:, :7], rtol=0, atol=0)


def test_keyed_draws_are_finite_and_symmetric_for_every_bit_pattern_they_read():
    """Every pattern of the 24 top bits (the rest zero; their complements, all ones): the uniform equals (top 23 bits
    + 1/2) / 2**23 computed in float64 by hand, lies strictly inside (0, 1), mirrors the complementary bits' about 1/2
    exactly, and its normal is finite. All-ones bits once gave 1.0 and an infinite noise draw (the video quickstart
    at step 213)."""
    from framework.training import keyed

    top = torch.arange(1 << 24, dtype=torch.int64)
    u = keyed.unit(top << 40)
    assert torch.equal(u.double(), ((top >> 1).double() + 0.5) / 2**23)
    assert 0 < u.min() and u.max() < 1
    assert torch.equal(u + keyed.unit(~(top << 40)), torch.ones_like(u))  # the complements: all ones below
    assert torch.isfinite(torch.special.ndtri(u)).all()


def test_keyed_normals_and_uniforms_have_their_distributions_and_no_correlation():
    """4096 samples x 64 draws: normals with mean 0, variance 1, kurtosis 3 and the normal CDF at 5 points; uniforms
    in (0, 1) with mean 1/2, variance 1/12; neighbouring draws of a sample and neighbouring samples uncorrelated (each
    bound about 5 standard errors)."""
    from framework.training import keyed

    k = keyed.keys(0, 11, range(4096), 0)
    z = keyed.normals(k, 64).double()
    n = z.numel()
    assert abs(z.mean()) < 5 / n**0.5 and abs(z.var() - 1) < 5 * (2 / n) ** 0.5
    assert abs((z**4).mean() - 3) < 5 * (96 / n) ** 0.5
    for x in (-2.0, -1.0, 0.0, 0.5, 1.5):
        p = torch.special.ndtr(torch.tensor(x, dtype=torch.float64))
        assert abs((z < x).double().mean() - p) < 5 * (p * (1 - p) / n) ** 0.5, x
    for a, b in ((z[:, :-1], z[:, 1:]), (z[:-1], z[1:])):  # within a sample; across samples
        assert abs((a * b).mean()) < 5 / a.numel() ** 0.5
    u = keyed.uniforms(k, 64).double()
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean() - 0.5) < 5 * (1 / 12 / n) ** 0.5 and abs(u.var() - 1 / 12) < 5 * (1 / 180 / n) ** 0.5
    assert abs(((u[:, :-1] - 0.5) * (u[:, 1:] - 0.5)).mean()) < 5 / 12 / n**0.5
    # another tag or micro-batch: other numbers
    assert not torch.equal(keyed.normals(keyed.keys(0, 11, range(8), 1), 4), z[:8, :4].float())
    assert not torch.equal(keyed.normals(keyed.keys(0, 12, range(8), 0), 4), z[:8, :4].float())
