"""The family registry (framework/models/families/) against a reference written out by hand: for each family, the
denoiser the registry builds is the diffusers class constructed directly with the documented arguments (same state
dict, key by key and value by value), and its forward is the diffusers call written out here. A new family adds a
row to ROWS (tests/test_families.py fails until it has one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from diffusers import (
    DiTTransformer2DModel,
    LatteTransformer3DModel,
    PixArtTransformer2DModel,
    SanaTransformer2DModel,
    UNet2DConditionModel,
    WanTransformer3DModel,
)

from framework.models.backbones import build_denoiser, load_preset
from framework.models.families import FAMILIES, family_of

TEXT = 32  # caption width of every text family's row (the presets' 4096 would only cost time)
Call = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _pixart(net, x, t, text, mask, labels):
    return net(x, encoder_hidden_states=text, timestep=t, encoder_attention_mask=mask.float(),
               added_cond_kwargs={"resolution": None, "aspect_ratio": None}, return_dict=False)[0][:, :4]  # learned sigma


def _sana(net, x, t, text, mask, labels):
    return net(x, encoder_hidden_states=text, timestep=t, encoder_attention_mask=mask.float(), return_dict=False)[0]


def _dit(net, x, t, text, mask, labels):
    return net(x, timestep=t, class_labels=labels, return_dict=False)[0][:, :4]  # learned sigma


def _unet(net, x, t, text, mask, labels):
    return net(x, t, encoder_hidden_states=text, encoder_attention_mask=mask.float(), return_dict=False)[0]


def _latte(net, x, t, text, mask, labels):
    bias = ((1 - mask.float()) * -10000.0).repeat_interleave(x.shape[2], 0).unsqueeze(1)  # each frame's caption bias
    return net(x, timestep=t, encoder_hidden_states=text, encoder_attention_mask=bias, return_dict=False)[0]


def _wan(net, x, t, text, mask, labels):
    padded = F.pad(text * mask.unsqueeze(-1).float(), (0, 0, 0, 32 - text.shape[1]))  # zeros to model.text_len
    return net(x, timestep=t, encoder_hidden_states=padded, return_dict=False)[0]


TRANSFORMER = dict(in_channels=4, sample_size=8, num_attention_heads=4, attention_head_dim=32)
# family: (preset, its diffusers class, the constructor arguments the preset documents, the forward written out)
ROWS: dict[str, tuple[str, type, dict[str, Any], Call]] = {
    "pixart": ("pixart_debug", PixArtTransformer2DModel,
               dict(TRANSFORMER, out_channels=8, num_layers=4, patch_size=2, caption_channels=TEXT, cross_attention_dim=128,
                    use_additional_conditions=False), _pixart),
    "sana": ("sana_debug", SanaTransformer2DModel,
             dict(TRANSFORMER, num_attention_heads=2, out_channels=4, num_layers=4, patch_size=1, caption_channels=TEXT,
                  cross_attention_dim=64, num_cross_attention_heads=2, cross_attention_head_dim=32), _sana),
    "dit": ("dit_debug", DiTTransformer2DModel,
            dict(TRANSFORMER, out_channels=8, num_layers=4, patch_size=2, num_embeds_ada_norm=10), _dit),
    "unet": ("sd2_unet_debug", UNet2DConditionModel,
             dict(in_channels=4, out_channels=4, sample_size=8, layers_per_block=1, cross_attention_dim=TEXT,
                  attention_head_dim=[2, 4], block_out_channels=[32, 64],
                  down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"], up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"],
                  norm_num_groups=8, use_linear_projection=True), _unet),
    "latte": ("latte_debug", LatteTransformer3DModel,
              dict(TRANSFORMER, out_channels=4, num_layers=2, patch_size=2, caption_channels=TEXT, cross_attention_dim=128,
                   video_length=4, norm_type="ada_norm_single", activation_fn="gelu-approximate", attention_bias=True,
                   norm_elementwise_affine=False, norm_eps=1e-6, num_embeds_ada_norm=1000), _latte),
    "wan": ("wan_debug", WanTransformer3DModel,
            dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=32, num_layers=2,
                 patch_size=(1, 2, 2), text_dim=TEXT, ffn_dim=256), _wan),
}


def test_every_family_has_a_row_and_every_preset_a_family():
    presets = {p.stem: p for p in (Path(__file__).resolve().parents[1] / "conf" / "model").glob("*.yaml")}
    assert set(ROWS) == set(FAMILIES)
    for name in presets:
        assert load_preset(name).family in FAMILIES, name


def test_an_unknown_family_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"model.family='flux' is unknown; choose one of \['dit', 'latte', 'pixart', "
                                         r"'sana', 'unet', 'wan'\]"):
        family_of("flux")
    with pytest.raises(ValueError, match="model.family='flux' is unknown"):
        load_preset("pixart_debug", family="flux")


@pytest.mark.parametrize("family", list(ROWS))
def test_the_registry_builds_and_feeds_the_documented_diffusers_model(family: str):
    preset, cls, kwargs, call = ROWS[family]
    cfg = load_preset(preset, **({} if family == "dit" else {"text_dim": TEXT}))
    assert family_of(cfg) is FAMILIES[family] and family_of(cfg).diffusers_class is cls
    torch.manual_seed(0)
    model = build_denoiser(cfg).eval()
    torch.manual_seed(0)  # the same draws: the constructor is the only thing that draws
    reference = cls(**kwargs).eval()
    assert type(model.net) is cls
    ours, theirs = model.net.state_dict(), reference.state_dict()
    assert list(ours) == list(theirs)
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key
    torch.manual_seed(1)
    x = torch.randn(2, 4, *cfg.latent_shape)
    t = torch.tensor([10.0, 700.0])
    text, mask = torch.randn(2, 5, TEXT), torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    labels = torch.tensor([3, 7])
    with torch.no_grad():
        got = model(x, t, text, mask, labels)
        want = call(reference, x, t, text, mask, labels)
    assert got.shape == x.shape
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same ops in the same order: bitwise
