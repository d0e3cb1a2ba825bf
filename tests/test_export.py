"""framework.export: exported weights reproduce the trained model's output exactly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from framework.models.backbones import FAMILIES, ModelConfig, build_denoiser, load_weights
from framework.inference.checkpoint import CKPT_KEY, model_weights, read_checkpoint
from tests.helpers import cheap, compose_cfg
from tests import zygote

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, digits_shards) -> Path:
    from framework.train import train

    tmp = tmp_path_factory.mktemp("export")
    fit = ["model.in_channels=1", "model.sample_size=8", "model.text_dim=384", "logger=none"]
    return Path(train(compose_cfg(cheap(tmp, digits_shards, *fit, steps=2)))["checkpoint"])


def _inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 1, 8, 8, generator=g)  # (B, C, h, w)
    t = torch.tensor([10.0, 700.0])
    text = torch.randn(2, 5, 384, generator=g)  # (B, L, D)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    return x, t, text, mask


@pytest.mark.parametrize("fmt", ["safetensors", "diffusers"])
def test_export_round_trip_is_exact(tmp_path, checkpoint, fmt):
    out = tmp_path / ("m.safetensors" if fmt == "safetensors" else "m")
    proc = zygote.run([sys.executable, "-m", "framework.export", f"ckpt={checkpoint}", f"out={out}", f"format={fmt}",
                           f"hydra.run.dir={tmp_path / 'hydra'}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ckpt = read_checkpoint(checkpoint)
    cfg = ModelConfig(**ckpt[CKPT_KEY]["config"]["model"])
    ref = build_denoiser(cfg).eval()
    ref.load_state_dict(model_weights(ckpt))
    got = build_denoiser(cfg).eval()
    if fmt == "diffusers":
        got.net = FAMILIES[cfg.family].from_pretrained(out / "transformer").eval()  # the family's own loader
    else:
        load_weights(got, out)  # what init_from=FILE does
    with torch.no_grad():
        torch.testing.assert_close(got(*_inputs()), ref(*_inputs()), rtol=0, atol=0)

