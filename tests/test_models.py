"""Backbones: presets load and validate, debug nets run, real nets have the published sizes, weights load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from framework.models import backbones
from framework.models.flops import count_train_flops_per_sample
from framework.models.backbones import (
    PRESET_DIR,
    Denoiser,
    ModelConfig,
    apply_attention_backend,
    build_denoiser,
    load_preset,
    load_weights,
    preset_names,
    xformers_targets,
)

DEBUG = [n for n in preset_names() if n.endswith("_debug")]
REAL = [n for n in preset_names() if not n.endswith("_debug")]


def _inputs(cfg: ModelConfig, batch: int = 2, length: int = 5, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, cfg.in_channels, *cfg.latent_shape, generator=g)  # (B, C, h, w); clips (B, C, F, h, w)
    out = {"x": x, "t": torch.rand(batch, generator=g) * 1000}
    if cfg.family == "dit":
        out["labels"] = torch.randint(0, cfg.num_classes, (batch,), generator=g)
    else:
        out["text"] = torch.randn(batch, length, cfg.text_dim, generator=g)
    return out


def _built(name: str, seed: int = 0, **overrides) -> Denoiser:
    torch.manual_seed(seed)
    return build_denoiser(load_preset(name, **overrides)).eval()


# --------------------------------------------------------------------------------------------------
# Presets and validation
# --------------------------------------------------------------------------------------------------

def test_every_preset_file_loads_into_model_config():
    files = sorted(PRESET_DIR.glob("*.yaml"))
    assert {f.stem for f in files} >= {
        "pixart_debug", "pixart_xl_2_256", "pixart_xl_2_512", "sana_debug", "sana_600m_512",
        "sana_1600m_1024", "dit_debug", "dit_xl_2_256", "sd2_unet_debug", "sd2_base"}
    for file in files:
        merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(file))
        cfg = OmegaConf.to_object(merged)  # runs __post_init__
        assert isinstance(cfg, ModelConfig) and cfg.name == file.stem


@pytest.mark.parametrize("overrides, key", [
    ({"family": "mamba"}, "model.family"),
    ({"attention": "flash"}, "model.attention"),
    ({"width": 100}, "model.width"),
    ({"sample_size": 9}, "model.sample_size"),
    ({"text_dim": 0}, "model.text_dim"),
    ({"num_heads": None}, "model.num_heads"),
    ({"kwargs": {"num_layers": 3}}, "model.kwargs.num_layers"),
    ({"kwargs": {"not_an_arg": 1}}, "model.kwargs.not_an_arg"),
    ({"kwargs": {"use_additional_conditions": True}}, "model.kwargs.use_additional_conditions"),
])
def test_bad_pixart_config_names_the_key(overrides, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_preset("pixart_debug", **overrides)


@pytest.mark.parametrize("name, overrides, key", [
    ("dit_debug", {"num_classes": None}, "model.num_classes"),
    ("sana_debug", {"kwargs": {"num_cross_attention_heads": 3, "cross_attention_head_dim": 32}},
     "model.kwargs.num_cross_attention_heads"),
    ("sd2_unet_debug", {"num_heads": 4}, "model.num_heads"),
    ("sd2_unet_debug", {"head_dim": 24}, "model.head_dim"),
    ("sd2_unet_debug", {"patch_size": 2}, "model.patch_size"),
])
def test_bad_family_config_names_the_key(name, overrides, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_preset(name, **overrides)


# --------------------------------------------------------------------------------------------------
# Debug nets run
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", DEBUG)
def test_debug_forward_keeps_input_shape(name):
    net = _built(name)
    inp = _inputs(net.cfg)
    with torch.no_grad():
        out = net(**inp)
        assert out.shape == inp["x"].shape
        if net.cfg.family != "dit":
            mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
            assert net(**inp, text_mask=mask).shape == inp["x"].shape
        else:
            assert net(inp["x"], inp["t"]).shape == inp["x"].shape  # no labels: unconditional
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", ["pixart_debug", "sana_debug", "sd2_unet_debug"])
def test_text_mask_hides_padding(name):
    """Masked padding tokens must not change the output: same as passing the caption unpadded."""
    net = _built(name)
    inp = _inputs(net.cfg, batch=1, length=3)
    padded = torch.cat([inp["text"], 100 * torch.randn(1, 4, net.cfg.text_dim)], dim=1)  # (1, 7, D)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    with torch.no_grad():
        ref = net(inp["x"], inp["t"], inp["text"])
        got = net(inp["x"], inp["t"], padded, mask)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)  # exp(-10000) is exactly 0 in fp32


def test_dit_null_labels_are_the_extra_class_and_dropout_is_ours():
    net = _built("dit_debug")
    labels = net.null_labels(3)
    assert labels.tolist() == [net.cfg.num_classes] * 3
    inp = _inputs(net.cfg, batch=64)
    with torch.no_grad():
        evaluated = net(**inp)
        net.train()  # diffusers would now replace ~10% of the 64 labels (all kept: 0.9**64 ~ 0.1%); the Denoiser does not
        torch.manual_seed(0)
        trained = net(**inp)
        assert not torch.allclose(trained, net(inp["x"], inp["t"], labels=net.null_labels(64)))
    torch.testing.assert_close(trained, evaluated, atol=0, rtol=0)
    assert _built("pixart_debug").null_labels(2) is None


# --------------------------------------------------------------------------------------------------
# Real presets: sizes on the meta device (nothing is allocated)
# --------------------------------------------------------------------------------------------------

# Published sizes: PixArt-alpha XL/2 0.611B (arXiv 2310.00426), SANA 0.59B / 1.6B (arXiv 2410.10629),
# DiT-XL/2 675M (arXiv 2212.09748), SD2 base UNet 865M (stabilityai/stable-diffusion-2-base).
PUBLISHED = {
    "pixart_xl_2_256": 611e6, "pixart_xl_2_512": 611e6, "sana_600m_512": 590e6,
    "sana_1600m_1024": 1.6e9, "dit_xl_2_256": 675e6, "sd2_base": 865e6,
    # PixArt-Sigma keeps PixArt-alpha's XL/2 (arXiv 2403.04692); SANA-1.5 1.6B and 4.8B (arXiv 2501.18427)
    "pixart_sigma_xl_2_512": 611e6, "pixart_sigma_xl_2_1024": 611e6, "sana15_1600m_1024": 1.6e9, "sana15_4800m_1024": 4.8e9,
}


@pytest.mark.parametrize("name", [n for n in REAL if n in PUBLISHED])  # the video presets: tests/test_video.py
def test_real_preset_parameter_count_matches_paper(name):
    with torch.device("meta"):
        net = build_denoiser(load_preset(name))
    count = sum(p.numel() for p in net.parameters())
    if net.cfg.family == "dit":
        # diffusers stores the timestep+label embedder once per block; the paper counts one shared copy.
        emb = net.net.transformer_blocks[0].norm1.emb
        count -= (net.cfg.num_layers - 1) * sum(p.numel() for p in emb.parameters())
    assert abs(count - PUBLISHED[name]) / PUBLISHED[name] < 0.02, f"{name}: {count:,} parameters"


# --------------------------------------------------------------------------------------------------
# Attention backend
# --------------------------------------------------------------------------------------------------

def test_xformers_without_gpu_or_package_raises_naming_the_key():
    from diffusers.utils import is_xformers_available

    if is_xformers_available() and torch.cuda.is_available():
        pytest.skip("xformers and a GPU are present")
    with pytest.raises(RuntimeError, match=r"model\.attention"):
        build_denoiser(load_preset("pixart_debug", attention="xformers"))


def test_xformers_selection_never_touches_sana_linear_attention(monkeypatch):
    net = _built("sana_debug")
    targets = xformers_targets(net.net)
    assert sorted(targets) == [f"transformer_blocks.{i}.attn2" for i in range(net.cfg.num_layers)]
    # Run the real switch with xformers faked present: only attn2 modules may be asked to switch.
    import diffusers.utils
    from diffusers.models.attention_processor import Attention

    switched = []
    monkeypatch.setattr(diffusers.utils, "is_xformers_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backbones, "xformers_problem", lambda: None)
    monkeypatch.setattr(Attention, "set_use_memory_efficient_attention_xformers",
                        lambda self, flag: switched.append(self))
    before = {n: type(b.attn1.processor) for n, b in enumerate(net.net.transformer_blocks)}
    apply_attention_backend(net.net, "xformers")
    assert switched == list(targets.values())
    after = {n: type(b.attn1.processor) for n, b in enumerate(net.net.transformer_blocks)}
    assert after == before and all(t.__name__ == "SanaLinearAttnProcessor2_0" for t in after.values())


def test_an_xformers_build_without_kernels_is_refused_naming_the_key(monkeypatch):
    """An xformers wheel built for another torch imports but cannot run (seen on an H200 with torch 2.11): refused
    before any module is switched, with the reason."""
    import diffusers.utils

    net = _built("pixart_debug")
    monkeypatch.setattr(diffusers.utils, "is_xformers_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backbones, "xformers_problem", lambda: "xformers 0.0.35 has no kernel for this GPU and torch")
    with pytest.raises(RuntimeError, match="model.attention=xformers: xformers 0.0.35 has no kernel.*model.attention=sdpa"):
        apply_attention_backend(net.net, "xformers")


def test_xformers_selection_takes_every_softmax_attention():
    net = _built("pixart_debug")
    assert len(xformers_targets(net.net)) == 2 * net.cfg.num_layers  # attn1 + attn2 per block


# --------------------------------------------------------------------------------------------------
# Weight loading (init_from)
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["pixart_debug", "dit_debug"])
def test_load_weights_round_trips(name, tmp_path: Path):
    src, dst = _built(name, seed=0), _built(name, seed=1)
    inp = _inputs(src.cfg)
    with torch.no_grad():
        ref = src(**inp)
        assert not torch.equal(dst(**inp), ref)
    save_file(src.state_dict(), str(tmp_path / "denoiser.safetensors"))
    save_file(src.net.state_dict(), str(tmp_path / "net.safetensors"))
    src.net.save_pretrained(tmp_path / "diffusers")
    torch.save({"state_dict": {f"model.{k}": v for k, v in src.state_dict().items()}}, tmp_path / "run.ckpt")
    for file in ["denoiser.safetensors", "net.safetensors", "diffusers", "run.ckpt"]:
        fresh = _built(name, seed=2)
        load_weights(fresh, tmp_path / file)
        with torch.no_grad():
            assert torch.equal(fresh(**inp), ref), file


def test_load_weights_from_another_model_names_the_file(tmp_path: Path):
    file = tmp_path / "pixart.safetensors"
    save_file(_built("pixart_debug").state_dict(), str(file))
    with pytest.raises(ValueError, match=r"pixart\.safetensors.*another model"):
        load_weights(_built("dit_debug"), file)
    wider = _built("pixart_debug", num_heads=2, width=64)
    with pytest.raises(ValueError, match="shape mismatches"):
        load_weights(wider, file)


# --------------------------------------------------------------------------------------------------
# FLOPs for MFU
# --------------------------------------------------------------------------------------------------

def test_train_flops_count_attention_and_leave_grads_alone():
    net = _built("pixart_debug")
    inp = _inputs(net.cfg)
    batch = {"latents": inp["x"], "text_embeds": inp["text"], "text_mask": torch.ones(2, 5, dtype=torch.bool)}
    marker = torch.ones_like(net.net.proj_out.weight)
    net.net.proj_out.weight.grad = marker
    flops = count_train_flops_per_sample(net, batch)
    assert net.net.proj_out.weight.grad is marker
    assert flops == count_train_flops_per_sample(net, {**batch, "latents": batch["latents"][:1]})
    # Self-attention over N tokens alone costs 3 * 4 * N^2 * width per layer (fwd + bwd); it must be in.
    tokens = (net.cfg.sample_size // net.cfg.patch_size) ** 2
    linear_only = 6 * tokens * sum(p.numel() for b in net.net.transformer_blocks for p in b.parameters())
    assert flops > linear_only


@pytest.mark.parametrize("name", ["pixart_debug", "sana_debug", "dit_debug", "sd2_unet_debug", "latte_debug",
                                  "wan_debug"])
def test_train_flops_are_counted_on_a_meta_replica_as_on_the_model_itself(name, monkeypatch):
    """The count runs on a meta-device build of the model's config: the live model never runs (a real-size model
    sharded over ranks would gather its blocks and keep a forward's activations for it), and the count is what the
    live model gives on real tensors, its fused attention with a padded caption's mask included. A model that is not
    its config's build (a module added) is counted on itself."""
    from framework.models import flops

    net = build_denoiser(load_preset(name))
    cfg = net.cfg
    g = torch.Generator().manual_seed(0)
    batch = {"latents": torch.randn(2, cfg.in_channels, *cfg.latent_shape, generator=g),
             "text_embeds": torch.randn(2, 7, cfg.text_dim or 1, generator=g), "text_mask": torch.ones(2, 7, dtype=torch.bool)}
    batch["text_mask"][1, 5:] = False
    if cfg.num_classes:
        batch["label"] = torch.tensor([1, 2])
    with monkeypatch.context() as m:
        m.setattr(flops, "meta_replica", lambda denoiser: None)
        on_the_model = count_train_flops_per_sample(net, batch)

    def refuse(*args, **kwargs):
        raise AssertionError("the live model ran")

    net.forward = refuse
    assert count_train_flops_per_sample(net, batch) == on_the_model
    del net.forward
    net.extra = torch.nn.Linear(2, 2)
    assert flops.meta_replica(net) is None


def test_a_replicas_count_is_reused_for_the_same_model_and_inputs_only(monkeypatch):
    """A process counts a meta replica's FLOPs once per config, trainable set, adapters and input shapes (a study's
    arms, a sweep): the same model again is not counted again; a frozen block, a longer caption or another width is,
    each to what a process that never counted before gets."""
    from framework.models import flops

    net = _built("pixart_debug")
    inp = _inputs(net.cfg)
    batch = {"latents": inp["x"], "text_embeds": inp["text"], "text_mask": torch.ones(2, 5, dtype=torch.bool)}
    first = count_train_flops_per_sample(net, batch)

    class Refuse:
        def __init__(self, *args, **kwargs):
            raise AssertionError("counted again")

    with monkeypatch.context() as m:
        m.setattr(flops.flop_counter, "FlopCounterMode", Refuse)
        assert count_train_flops_per_sample(_built("pixart_debug", seed=1), batch) == first  # other weights, same count

    def fresh(model, b):
        saved = dict(flops._ON_REPLICAS)
        flops._ON_REPLICAS.clear()
        try:
            return count_train_flops_per_sample(model, b)
        finally:
            flops._ON_REPLICAS.update(saved)

    frozen = _built("pixart_debug")
    frozen.net.transformer_blocks[0].requires_grad_(False)
    longer = {**batch, "text_embeds": torch.randn(2, 9, net.cfg.text_dim), "text_mask": torch.ones(2, 9, dtype=torch.bool)}
    wider = _built("pixart_debug", num_heads=2, width=64)
    for model, b in ((frozen, batch), (net, longer), (wider, batch)):
        expected = fresh(model, b)
        assert expected != first and count_train_flops_per_sample(model, b) == expected


@pytest.mark.parametrize("groups", [1, 4, 16])
def test_a_grouped_convolutions_backward_counts_twice_its_forward(groups):
    """Input gradient and weight gradient each cost what the forward does, grouped or not (torch's own formula
    counts a grouped weight gradient as dense: SANA's depthwise convolution made its MFU read 179% on an H200)."""
    from torch.utils import flop_counter

    from framework.models.flops import _CUSTOM

    conv = torch.nn.Conv2d(16, 32, 3, padding=1, groups=groups)
    x = torch.randn(2, 16, 8, 8, requires_grad=True)
    with flop_counter.FlopCounterMode(display=False, custom_mapping=_CUSTOM) as counter:
        conv(x).sum().backward()
    counts = counter.get_flop_counts()["Global"]
    forward = 2 * 2 * 8 * 8 * 32 * (16 // groups) * 9  # 2 FLOPs per multiply-add: batch, pixels, c_out, c_in/groups, 3x3
    assert counts[torch.ops.aten.convolution] == forward
    assert counts[torch.ops.aten.convolution_backward] == 2 * forward
