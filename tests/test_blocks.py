"""The block view is true for every family: branch out-projections really end the residual branches."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from framework.models.blocks import (
    block_views, blocks, has_stack, layer_views, replace_blocks, restack_state, silence_block, stack_depth,
)
from framework.models.backbones import Denoiser, ModelConfig, build_denoiser, load_preset

DEBUG = ["pixart_debug", "sana_debug", "dit_debug", "sd2_unet_debug", "latte_debug", "wan_debug"]


def _net(name: str) -> Denoiser:
    torch.manual_seed(0)
    return build_denoiser(load_preset(name)).eval()


def _inputs(cfg: ModelConfig) -> tuple:
    x = torch.randn(2, cfg.in_channels, *cfg.latent_shape)  # (2, C, h, w), clips (2, C, F, h, w)
    t = torch.tensor([10.0, 700.0])
    if cfg.family == "dit":
        return x, t, None, None, torch.tensor([1, 2])
    return x, t, torch.randn(2, 5, cfg.text_dim), torch.ones(2, 5, dtype=torch.bool), None


def _expected_blocks(cfg: ModelConfig) -> int:
    if cfg.family == "latte":  # a spatial and a temporal block per layer
        return 2 * cfg.num_layers
    if cfg.family != "unet":
        return cfg.num_layers
    down = sum(t.startswith("CrossAttn") for t in cfg.kwargs["down_block_types"]) * cfg.num_layers
    up = sum(t.startswith("CrossAttn") for t in cfg.kwargs["up_block_types"]) * (cfg.num_layers + 1)
    return down + 1 + up  # the mid block holds one transformer block


def _block_residuals(net: Denoiser) -> list[float]:
    """Max |block output - block input| for each block, via forward hooks."""
    diffs: list[float] = []

    def hook(module, args, kwargs, output):
        hidden = args[0] if args else kwargs["hidden_states"]
        diffs.append((output - hidden).abs().max().item())

    handles = [v.module.register_forward_hook(hook, with_kwargs=True) for v in block_views(net)]
    with torch.no_grad():
        net(*_inputs(net.cfg))
    for h in handles:
        h.remove()
    return diffs


@pytest.mark.parametrize("name", DEBUG)
def test_views_list_every_block_with_its_branches(name):
    net = _net(name)
    views = block_views(net)
    assert len(views) == _expected_blocks(net.cfg)
    assert [v.index for v in views] == list(range(len(views)))
    kinds = ["self_attn", "mlp"] if net.cfg.family == "dit" else ["self_attn", "cross_attn", "mlp"]
    for v in views:
        temporal = v.name.startswith("temporal_")  # latte's temporal blocks attend across frames, to no caption
        assert [b.kind for b in v.branches] == (["self_attn", "mlp"] if temporal else kinds)
        assert all(isinstance(b.out_proj, (nn.Linear, nn.Conv2d)) for b in v.branches)
        assert v.module is net.net.get_submodule(v.name)


@pytest.mark.parametrize("name", DEBUG)
def test_zeroed_out_projections_make_every_block_the_identity(name):
    net = _net(name)
    assert max(_block_residuals(net)) > 1e-3  # random blocks do change their input
    for view in block_views(net):
        silence_block(view)
    residuals = _block_residuals(net)
    assert len(residuals) == _expected_blocks(net.cfg)
    assert max(residuals) == 0.0


def test_sana_self_attention_is_the_linear_one():
    view = block_views(_net("sana_debug"))[0]
    assert type(view.branches[0].module.processor).__name__ == "SanaLinearAttnProcessor2_0"
    assert isinstance(view.branches[2].out_proj, nn.Conv2d)  # GLUMBConv's conv_point


def test_the_unet_declares_it_has_no_stack_and_says_why():
    net = _net("sd2_unet_debug")
    assert not has_stack(net)
    with pytest.raises(NotImplementedError, match="model.family=unet has no uniform block stack"):
        blocks(net)


def test_a_latte_layer_is_its_spatial_and_temporal_block_and_restacks_whole():
    net = _net("latte_debug")
    assert has_stack(net)
    assert [[v.name for v in layer] for layer in layer_views(net)] == [
        ["transformer_blocks.0", "temporal_transformer_blocks.0"], ["transformer_blocks.1", "temporal_transformer_blocks.1"]]
    with pytest.raises(NotImplementedError, match="2 lists of blocks side by side"):
        blocks(net)
    state = net.state_dict()
    swapped = restack_state(state, [1, 0], "latte")
    for stack in ("transformer_blocks", "temporal_transformer_blocks"):
        for j, i in ((0, 1), (1, 0)):
            key = f"net.{stack}.{{}}.attn1.to_q.weight"
            assert key.format(j) in swapped and torch.equal(swapped[key.format(j)], state[key.format(i)])
    assert stack_depth(restack_state(state, [0], "latte"), "latte") == 1
    assert not any(k.startswith("net.temporal_transformer_blocks.1.") for k in restack_state(state, [0], "latte"))


def test_latte_views_alternate_spatial_and_temporal_blocks_and_wan_wraps_its_ffn():
    names = [v.name for v in block_views(_net("latte_debug"))]
    assert names == ["transformer_blocks.0", "temporal_transformer_blocks.0", "transformer_blocks.1",
                     "temporal_transformer_blocks.1"]
    wan = block_views(_net("wan_debug"))[0]
    assert [b.attr for b in wan.branches] == ["attn1", "attn2", "ffn"]
    assert wan.branches[2].module is wan.module.ffn


@pytest.mark.parametrize("name", ["pixart_debug", "sana_debug", "dit_debug", "wan_debug"])
def test_replace_blocks_prunes_and_keeps_config_in_step(name, tmp_path):
    net = _net(name)
    assert has_stack(net)
    stack = blocks(net)
    attr = "blocks" if name == "wan_debug" else "transformer_blocks"  # Wan's stack is net.blocks
    assert stack is getattr(net.net, attr)
    replace_blocks(net, nn.ModuleList(list(stack)[:2]))
    assert len(block_views(net)) == 2 == net.cfg.num_layers == net.net.config.num_layers
    inp = _inputs(net.cfg)
    with torch.no_grad():
        assert net(*inp).shape == inp[0].shape
    net.net.save_pretrained(tmp_path)  # the pruned net reloads at its new depth
    reloaded = type(net.net).from_pretrained(tmp_path)
    assert len(getattr(reloaded, attr)) == 2
