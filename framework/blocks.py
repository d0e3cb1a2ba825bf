"""A uniform view of any backbone: its blocks and, per block, its residual branches.

Model growth, depth pruning and the cache router work on "a stack of residual blocks, each adding
self-attention, cross-attention and MLP branches to its input". diffusers gives each family its own
block class; this module names the same parts in all of them, so plugins never branch on the family.

A branch's `out_proj` is the last op on that residual branch: zero it and the branch adds nothing
(tests/test_blocks.py checks that zeroing every branch makes each block the identity). That is what
zero-initialised growth needs, and what a cache that skips a branch relies on.

Families: pixart and dit use diffusers' BasicTransformerBlock in `net.transformer_blocks`; sana its
SanaTransformerBlock (linear self-attention, softmax cross-attention, GLUMBConv MLP whose last op is a
1x1 conv); the unet's BasicTransformerBlocks live inside its down / mid / up blocks, between resnets,
so it exposes them as views but is no uniform stack: growth and pruning are declared unsupported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from diffusers.models.attention import BasicTransformerBlock
from torch import nn

from framework.models import Denoiser

BranchKind = Literal["self_attn", "cross_attn", "mlp"]


# --------------------------------------------------------------------------------------------------
# Views
# --------------------------------------------------------------------------------------------------

@dataclass
class Branch:
    """One residual branch of a block: block(x) = x + ... + gate * out_proj(...)."""

    kind: BranchKind
    # "self_attn" | "cross_attn" | "mlp"
    module: nn.Module
    # the branch's module (diffusers Attention, FeedForward or GLUMBConv)
    out_proj: nn.Linear | nn.Conv2d
    # last op of the branch; an nn.Linear, except SANA's MLP whose last op is a 1x1 nn.Conv2d


@dataclass
class BlockView:
    """One block of the backbone with its residual branches, in forward order."""

    index: int
    # position in forward order (0 = nearest the input)
    name: str
    # qualified name inside the diffusers net, e.g. "transformer_blocks.3"
    module: nn.Module
    # the block itself; hooks on it see (hidden_states, ...) -> hidden_states of the same shape
    branches: list[Branch]
    # its residual branches in forward order


# --------------------------------------------------------------------------------------------------
# Branches of one block
# --------------------------------------------------------------------------------------------------

def _last_linear(module: nn.Module) -> nn.Linear:
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    return linears[-1]


def _branches(block: nn.Module) -> list[Branch]:
    """Branches of a BasicTransformerBlock or SanaTransformerBlock (attn1, attn2, ff)."""
    out = [Branch("self_attn", block.attn1, block.attn1.to_out[0])]
    if getattr(block, "attn2", None) is not None:
        out.append(Branch("cross_attn", block.attn2, block.attn2.to_out[0]))
    if isinstance(block, BasicTransformerBlock):
        # FeedForward.net = [activation(proj_in), Dropout, Linear(out), (Dropout)]
        out.append(Branch("mlp", block.ff, _last_linear(block.ff)))
    else:  # SanaTransformerBlock: GLUMBConv ends with the 1x1 conv_point
        out.append(Branch("mlp", block.ff, block.ff.conv_point))
    return out


def _unet_blocks(net: nn.Module) -> list[tuple[str, nn.Module]]:
    """The unet's BasicTransformerBlocks in forward order: down blocks, mid block, up blocks."""
    found = []
    for prefix, parent in [("down_blocks", net.down_blocks), ("mid_block", net.mid_block), ("up_blocks", net.up_blocks)]:
        if parent is None:
            continue
        for name, module in parent.named_modules():
            if isinstance(module, BasicTransformerBlock):
                found.append((f"{prefix}.{name}", module))
    return found


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------

def supports(denoiser: Denoiser) -> dict[str, bool]:
    """Which block-level surgeries this backbone allows: {"growth", "pruning", "cache"}.

    The cache needs only per-block residuals (hooks on `block_views`), so the unet supports it;
    growth and pruning replace the `blocks()` container, which the unet does not have.
    """
    stack = denoiser.cfg.family != "unet"
    return {"growth": stack, "pruning": stack, "cache": True}


def blocks(denoiser: Denoiser) -> nn.ModuleList:
    """The container of the residual stack (replace it with `replace_blocks` to grow or prune)."""
    if not supports(denoiser)["growth"]:
        raise NotImplementedError(
            f"model.family={denoiser.cfg.family} has no uniform block stack (its transformer blocks sit "
            "between resnets in down/mid/up blocks); use block_views() for per-block access.")
    return denoiser.net.transformer_blocks


def block_views(denoiser: Denoiser) -> list[BlockView]:
    """Every block of the backbone with its branches, in forward order."""
    if denoiser.cfg.family == "unet":
        named = _unet_blocks(denoiser.net)
    else:
        named = [(f"transformer_blocks.{i}", b) for i, b in enumerate(denoiser.net.transformer_blocks)]
    return [BlockView(i, name, block, _branches(block)) for i, (name, block) in enumerate(named)]


def replace_blocks(denoiser: Denoiser, new_blocks: nn.ModuleList) -> None:
    """Swap in a grown or pruned stack, keeping the config (and so checkpoints / save_pretrained) in step.

    Note for pruning dit: diffusers' DiT conditions its final layer on block 0's embedder
    (`transformer_blocks[0].norm1.emb`), so dropping block 0 changes that conditioning too.
    """
    blocks(denoiser)  # raises for families without a stack
    denoiser.net.transformer_blocks = new_blocks
    denoiser.net.register_to_config(num_layers=len(new_blocks))
    denoiser.cfg.num_layers = len(new_blocks)
