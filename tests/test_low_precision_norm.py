"""plugins=[low_precision_norm]: close to the fp32 norms, in the autocast dtype, same parameters,
and no change at all in an fp32 run."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm
from torch import nn

from framework import train as train_lib
from plugins.low_precision_norm import LPLayerNorm, apply_low_precision_norms
from tests.helpers import cheap, compose_cfg, losses

# bf16 keeps 8 significant bits (relative step 2**-8 ~ 0.004); inputs and outputs are both rounded,
# so a normalized value of magnitude ~5 may be ~0.03 off. Tolerance: |lp - fp32| <= 2e-2 + 2e-2 * |fp32|.
BF16_TOL = dict(rtol=2e-2, atol=2e-2)


def _norms() -> list[tuple[nn.Module, tuple[int, ...]]]:
    """Each swapped norm kind with random affine weights, and an input shape for it."""
    torch.manual_seed(0)
    mods = [(nn.LayerNorm(64), (4, 8, 64)), (nn.GroupNorm(4, 16), (4, 16, 6, 6)),
            (DiffusersRMSNorm(64, eps=1e-6), (4, 8, 64)), (nn.RMSNorm(64), (4, 8, 64))]
    for m, _ in mods:
        for p in m.parameters():
            nn.init.normal_(p, 1.0, 0.3)
    return mods


def in_bf16(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The norm computed by hand on bf16 inputs and parameters (torch's kernels for that dtype)."""
    b = torch.bfloat16
    w = norm.weight.to(b)
    if isinstance(norm, nn.LayerNorm):
        return F.layer_norm(x.to(b), norm.normalized_shape, w, norm.bias.to(b), norm.eps)
    if isinstance(norm, nn.GroupNorm):
        return F.group_norm(x.to(b), norm.num_groups, w, norm.bias.to(b), norm.eps)
    return F.rms_norm(x.to(b), x.shape[-1:], w, norm.eps)


@pytest.mark.parametrize("index", range(4), ids=["layer_norm", "group_norm", "diffusers_rms_norm", "rms_norm"])
def test_norm_runs_in_the_autocast_dtype_close_to_fp32(index):
    norm, shape = _norms()[index]
    ref = copy.deepcopy(norm)
    params = list(norm.parameters())
    counts = apply_low_precision_norms(nn.Sequential(norm))
    assert sum(counts.values()) == 1
    x = torch.randn(shape) * 3 + 1
    expected = ref(x)  # fp32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = norm(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), expected, **BF16_TOL)
    # Computed in bf16, not computed in fp32 and cast at the end (which differs in many elements).
    assert torch.equal(y, in_bf16(ref, x))
    assert not torch.equal(y, expected.to(torch.bfloat16))
    # Same Parameter objects, same dtype; outside autocast the parent's forward, bit for bit.
    assert all(a is b for a, b in zip(norm.parameters(), params)) and all(p.dtype == torch.float32 for p in params)
    assert torch.equal(norm(x), expected)


class NormProbe(pl.Callback):
    """Runs before the plugins: records parameter identities, then what the optimizer and norms see."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.param_ids = {id(p) for p in pl_module.model.parameters() if p.requires_grad}
        self.dtypes: list[torch.dtype] = []
        for m in pl_module.model.modules():
            if isinstance(m, nn.LayerNorm):
                m.register_forward_hook(self._record)

    def _record(self, mod: nn.Module, inp: Any, out: torch.Tensor) -> None:
        if torch.is_autocast_enabled("cpu"):  # training steps (the end-of-run grid runs without autocast)
            self.dtypes.append(out.dtype)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.optimizer_ids = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
        self.classes = {type(m) for m in pl_module.model.modules()}


@pytest.fixture
def probe(monkeypatch) -> NormProbe:
    p = NormProbe()
    build = train_lib.build_callbacks
    monkeypatch.setattr(train_lib, "build_callbacks", lambda cfg, run_dir: [p, *build(cfg, run_dir)])
    return p


def test_bf16_run_swaps_norms_before_the_optimizer_is_built(tmp_path, digits_shards, probe):
    cfg = cheap(tmp_path, digits_shards, "plugins=[low_precision_norm]", "trainer.precision=bf16-mixed", steps=2)
    train_lib.train(compose_cfg(cfg))
    assert LPLayerNorm in probe.classes and nn.LayerNorm not in probe.classes
    assert probe.optimizer_ids == probe.param_ids  # the very tensors, swapped before configure_optimizers
    assert probe.dtypes and set(probe.dtypes) == {torch.bfloat16}


def test_fp32_run_warns_and_is_bit_identical(tmp_path, digits_shards):
    # The unet preset has GroupNorm too.
    fit: list[Any] = ["model=sd2_unet_debug", "trainer.precision=32-true"]
    plain = train_lib.train(compose_cfg(cheap(tmp_path, digits_shards, *fit, steps=3, run="plain")))
    with pytest.warns(UserWarning, match="does nothing with trainer.precision=32-true"):
        lp = train_lib.train(compose_cfg(cheap(tmp_path, digits_shards, *fit, "plugins=[low_precision_norm]", steps=3, run="lp")))
    la, lb = losses(Path(plain["run_dir"])), losses(Path(lp["run_dir"]))
    assert len(la) == 3 and la == lb


@pytest.mark.parametrize("off", ["group_norm", "rms_norm"])
def test_a_norm_kind_turned_off_is_left_as_it_is(off):
    """plugins.low_precision_norm.group_norm / rms_norm = false: that kind keeps its class, the others are swapped."""
    from types import SimpleNamespace

    from plugins.low_precision_norm import LowPrecisionNorm, LowPrecisionNormConfig

    model = nn.Sequential(nn.LayerNorm(4), nn.GroupNorm(2, 4), nn.RMSNorm(4))
    callback = LowPrecisionNorm(LowPrecisionNormConfig(**{off: False}))
    callback.setup(SimpleNamespace(precision="bf16-mixed"), SimpleNamespace(model=model), "fit")
    expected = {"layer_norm": 1, "group_norm": 1, "rms_norm": 1, off: 0}
    assert callback.swapped == expected
    kept = {"group_norm": nn.GroupNorm, "rms_norm": nn.RMSNorm}[off]
    assert [type(m) is kept for m in model] == [False, off == "group_norm", off == "rms_norm"]
