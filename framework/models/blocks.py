"""A uniform view of any backbone: its blocks and, per block, its residual branches.

diffusers gives each family its own block class; this module names the same parts in all of them,
so code that works block by block never branches on the family. framework/distributed/fsdp.py takes its
FSDP2 and torch.compile units from here.

A branch's `out_proj` is the last op on that residual branch: zero it and the branch adds nothing
(tests/test_blocks.py checks that zeroing every branch makes each block the identity).

Families: pixart and dit use diffusers' BasicTransformerBlock in `net.transformer_blocks`; sana its
SanaTransformerBlock (linear self-attention, softmax cross-attention, GLUMBConv MLP whose last op is a
1x1 conv). Those three are one stack of blocks that `blocks()` returns and `replace_blocks()` swaps.
The unet's BasicTransformerBlocks live inside its down / mid / up stages, between resnets: it has
views of its blocks (`block_views`) but no stack (`has_stack` is False).

Video families: latte's spatial blocks (`net.transformer_blocks`, each frame's tokens, with cross-attention) and
temporal blocks (`net.temporal_transformer_blocks`, each position's frames, no cross-attention) are BasicTransformerBlocks
that alternate, spatial first: views of both in that order. wan's WanTransformerBlocks (`net.blocks`) keep their MLP in
`ffn`, and only their self-attention and MLP are gated (cross-attention is added as it is).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.transformers.transformer_wan import WanTransformerBlock
from torch import nn

from framework.models.backbones import Denoiser
from framework.models.families import plan_of

BranchKind = Literal["self_attn", "cross_attn", "mlp"]
# Where diffusers' blocks keep each branch's module (BasicTransformerBlock and SanaTransformerBlock alike; wan's MLP
# is `ffn`). They call it and only then apply the adaLN gate, so the module's output is the branch's ungated output.
BRANCH_ATTRS: dict[str, str] = {"self_attn": "attn1", "cross_attn": "attn2", "mlp": "ff"}


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
    attr: str = ""
    # the block's attribute holding `module` (attn1, attn2, ff; wan's MLP: ffn): swap it to wrap the branch

    def __post_init__(self) -> None:
        self.attr = self.attr or BRANCH_ATTRS[self.kind]


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
    if isinstance(block, WanTransformerBlock):
        out.append(Branch("mlp", block.ffn, _last_linear(block.ffn), attr="ffn"))
    elif isinstance(block, BasicTransformerBlock):
        # FeedForward.net = [activation(proj_in), Dropout, Linear(out), (Dropout)]
        out.append(Branch("mlp", block.ff, _last_linear(block.ff)))
    else:  # SanaTransformerBlock: GLUMBConv ends with the 1x1 conv_point
        out.append(Branch("mlp", block.ff, block.ff.conv_point))
    return out


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------

def has_stack(denoiser: Denoiser) -> bool:
    """Whether the backbone is one replaceable stack of blocks (`blocks`, `replace_blocks`): its family's plan."""
    return plan_of(denoiser.cfg.family).stack


def blocks(denoiser: Denoiser) -> nn.ModuleList:
    """The container of the residual stack of a family with one list of blocks (swap it with `replace_blocks`)."""
    family = denoiser.cfg.family
    if not has_stack(denoiser):
        raise NotImplementedError(f"model.family={family} has no uniform block stack "
                                  f"({plan_of(family).why_not}); use block_views() for per-block access.")
    attrs = plan_of(family).stack_attrs
    if len(attrs) > 1:
        raise NotImplementedError(f"model.family={family}'s stack is {len(attrs)} lists of blocks side by side "
                                  f"({', '.join(attrs)}); use layer_views() for its layers.")
    return getattr(denoiser.net, attrs[0])


def layer_views(denoiser: Denoiser) -> list[list[BlockView]]:
    """The stack's layers in forward order, each the views of its blocks: one block a layer, or Latte's spatial and
    temporal block i in layer i. Growth copies and pruning drops whole layers."""
    if not has_stack(denoiser):
        raise NotImplementedError(f"model.family={denoiser.cfg.family} has no uniform block stack "
                                  f"({plan_of(denoiser.cfg.family).why_not})")
    layers: list[list[BlockView]] = [[] for _ in getattr(denoiser.net, plan_of(denoiser.cfg.family).stack_attrs[0])]
    for view in block_views(denoiser):
        layers[int(view.name.rsplit(".", 1)[1])].append(view)
    return layers


def block_views(denoiser: Denoiser) -> list[BlockView]:
    """Every block of the backbone with its branches, in forward order."""
    named = denoiser.family.named_blocks(denoiser.net)  # (name in the net, block) in forward order
    return [BlockView(i, name, block, _branches(block)) for i, (name, block) in enumerate(named)]


def replace_blocks(denoiser: Denoiser, new_blocks: nn.ModuleList) -> None:
    """Swap in another stack (deeper or shallower), keeping the config (and so checkpoints / save_pretrained) in step.

    Note for dit: diffusers' DiT conditions its final layer on block 0's embedder
    (`transformer_blocks[0].norm1.emb`), so a stack without the old block 0 changes that conditioning too.
    """
    blocks(denoiser)  # raises for families without a stack
    setattr(denoiser.net, plan_of(denoiser.cfg.family).stack_attrs[0], new_blocks)
    denoiser.net.register_to_config(num_layers=len(new_blocks))
    denoiser.cfg.num_layers = len(new_blocks)


# --------------------------------------------------------------------------------------------------
# The stack in a state dict (growth and pruning work on weights, then build the model they fit)
# --------------------------------------------------------------------------------------------------

def stack_prefixes(family: str) -> list[str]:
    """The Denoiser keys of a family's stack: net.transformer_blocks.<i>.<rest> (Wan: net.blocks.<i>.<rest>; Latte
    net.transformer_blocks.<i>. and net.temporal_transformer_blocks.<i>., layer i being both)."""
    return [f"net.{attr}." for attr in plan_of(family).stack_attrs]


def stack_depth(state: dict[str, Any], family: str) -> int:
    """Number of layers in the stack of a Denoiser-keyed state dict of `family`."""
    prefix = stack_prefixes(family)[0]
    return 1 + max((int(k[len(prefix):].split(".", 1)[0]) for k in state if k.startswith(prefix)), default=-1)


def restack_state(state: dict[str, Any], order: list[int | None], family: str) -> dict[str, Any]:
    """`state` (of `family`) with its stack rebuilt: new layer j holds old layer order[j] (renumbered, in every list
    of the stack); None leaves layer j out (the caller fills it). Every tensor outside the stack is kept as it is."""
    prefixes = stack_prefixes(family)
    out = {k: v for k, v in state.items() if not k.startswith(tuple(prefixes))}
    by_layer: dict[int, dict[tuple[str, str], Any]] = {}  # layer -> {(list prefix, key in the block): tensor}
    for k, v in state.items():
        for prefix in prefixes:
            if k.startswith(prefix):
                index, rest = k[len(prefix):].split(".", 1)
                by_layer.setdefault(int(index), {})[(prefix, rest)] = v
    for j, i in enumerate(order):
        if i is None:
            continue
        if i not in by_layer:
            raise IndexError(f"block {i} is not in the state dict (its stack has {len(by_layer)} blocks)")
        out.update({f"{prefix}{j}.{rest}": v for (prefix, rest), v in by_layer[i].items()})
    return out


def silence_block(view: BlockView) -> None:
    """Zero the output projection of every residual branch: the block becomes the identity."""
    for branch in view.branches:
        nn.init.zeros_(branch.out_proj.weight)
        if branch.out_proj.bias is not None:
            nn.init.zeros_(branch.out_proj.bias)
