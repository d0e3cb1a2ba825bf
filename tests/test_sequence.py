"""Ulysses sequence parallelism (framework/distributed/sequence.py): split models compute what whole-sequence models do.

Multi-process cases run under torchrun in subprocesses (gloo, CPU). The training runs (2 ranks, and 2 data x 2
sequence ranks under fsdp) are compared with the one-process reference in tests/test_distributed.py; the eval
command's in tests/test_decoupled.py.
"""

from __future__ import annotations

import json

import pytest

from framework.distributed.config import StrategyConfig
import torch

from framework.models.backbones import build_denoiser, load_preset
from framework.distributed.sequence import check
from tests.helpers import torchrun


def _check_splits(result: dict, ranks: int) -> None:
    """Every family's split forward and backward equal the whole model's (fp64), each rank's blocks saw and hold only
    its band, and the only all-gather is the output's (the halo moves by send / receive). Wan: 4 frames of 4x4 tokens,
    each rank's queries and keys rotated by its own tokens' 3D positions. Latte: its spatial blocks on the rank's frames
    and its temporal blocks on the rank's positions, switched by all-to-all (latte/2: each switch in 2 slices of the
    positions, the spatial block's tail and the temporal block run slice by slice; latte/2/intra: the switch to
    positions made by the temporal block instead)."""
    for family, tokens in (("pixart", 16), ("sana", 64), ("dit", 16), ("wan", 64), ("latte", 64)):
        keys = [k for k in result if k.startswith(f"{family}/")]
        assert f"{family}/1" in keys and f"{family}/ckpt" in keys
        for key in keys:
            r = result[key]
            wide = 2 if key.endswith("/wide") else 1  # 8x16 latents (an aspect-ratio bucket's): twice the tokens
            assert r["tokens"] == [tokens * wide // ranks], key  # each rank's blocks saw 1/P of the tokens
            # and hold only those: the whole embedding can be freed (with activation checkpointing each block starts
            # again in backward; its recomputation stops early, before the block's end)
            calls = 2 if key.endswith("/ckpt") else 1
            assert r["band_storage"] == [1.0] * calls, key
            assert r["all_gathers"] == 1, key
            # pixart's caption K/V were computed while the first exchange travelled: 2 projections x 2 blocks per
            # forward (with checkpointing, once more in backward); dit has no caption, sana no exchange to wait on
            want = 0 if family != "pixart" or key.endswith("/diffusers") else 4 * calls
            assert r["kv_in_gap"] == want, (key, r["kv_in_gap"])
            assert r["grads"] == r["params"] > 0, key
            # diffusers' own SANA linear attention (the reference) sums in fp32 even for fp64 inputs; Wan's forward
            # runs its output norm in fp32 too (`norm_out(hidden_states.float())`), so the gradients of what precedes it
            # are fp32 sums over the tokens, in another order on P bands
            tol = 1e-7 if family in ("sana", "wan") else 1e-12
            assert r["forward"] < tol and r["grad"] < tol, (key, r)


@pytest.mark.slow  # 2 ranks through every family: 12.5 s in a full run
def test_split_forward_backward_and_sampling_equal_the_whole_model(tmp_path, digits_shards):
    out = tmp_path / "result.json"
    proc = torchrun(2, "-m", "tests.workers.sequence", str(digits_shards), str(out), tmp=tmp_path, fork=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    _check_splits(result, 2)
    # 2: overlapped head groups; diffusers: its own Ulysses attention in our processors' place, the same numbers
    assert {"pixart/2", "dit/2", "sana/2", "pixart/wide", "sana/wide", "pixart/diffusers", "pixart/pad",
            "wan/pad", "latte/2", "latte/2/intra", "latte/2/ckpt"} <= set(result)
    for family in ("pixart", "sana"):
        r = result[f"sample/{family}"]
        assert r["shape"] == [3, 1, 8, 8] and r["max_abs"] > 0.1 and r["max_diff"] < 1e-5, (family, r)
        assert r["decoded"] == [True, False], "one rank of the group decodes, and the other gets its images"
        # cached sampling (uniform:2 reuses every other step's branches) under the split equals it unsplit, and the
        # cache changes the images (it is really on)
        assert r["cached_max_diff"] < 1e-5 and r["cached_vs_full"] > 1e-3, (family, r)
    # a schedule reusing only the cross-attention at steps 1 and 3 samples as unsplit; pixart's caption K/V are
    # computed in the self-attention's gap only at the steps that run the cross-attention (2 of 4 steps, 2 batches,
    # k and v per block) and every one is used
    r = result["sample/pixart"]
    assert r["no_attn2_max_diff"] < 1e-5 and r["kv_blocks"] > 0, r
    assert r["no_attn2_kv"] == [8 * r["kv_blocks"]] * 2, r


@pytest.mark.slow
def test_four_ranks_with_interior_bands_equal_the_whole_model(tmp_path, digits_shards):
    """P = 4: ranks 1 and 2 hold interior bands (SANA's halo comes from both neighbours), 4 tokens per rank; SANA's
    sums all-reduced in 2 head groups too."""
    out = tmp_path / "result.json"
    proc = torchrun(4, "-m", "tests.workers.sequence", str(digits_shards), str(out), tmp=tmp_path, fork=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    _check_splits(result, 4)
    assert {"sana/2", "latte/2", "latte/2/intra", "latte/2/ckpt"} <= set(result)  # latte: 2 slices of 4 positions


def test_a_sequence_group_across_two_nodes_equals_the_whole_model(tmp_path, digits_shards):
    """4 ranks as 2 nodes x 2: Ulysses within a node, ring attention across the two (pixart, dit, wan: each node's
    queries over both nodes' keys, passed round the ring; with 2 head groups, each its own ring; with activation
    checkpointing, run again in the recomputation; 3 heads padded to 4 per node's 2 ranks); SANA and Latte over the
    whole group. Exact against the whole model in fp64, forward and backward."""
    out = tmp_path / "result.json"
    proc = torchrun(4, "-m", "tests.workers.sequence", str(digits_shards), str(out), "2", tmp=tmp_path, fork=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert set(result) == {"pixart/1", "sana/1", "dit/1", "wan/1", "latte/1", "pixart/2", "pixart/ckpt", "wan/pad"}
    for key, r in result.items():
        tol = 1e-7 if key.startswith(("sana", "wan")) else 1e-12  # fp32 sums in diffusers' code: _check_splits
        assert r["forward"] < tol and r["grad"] < tol and r["grads"] == r["params"] > 0, (key, r)
        assert r["all_gathers"] == 1, key
    # the ring's passes, 2 layers: forward 1 (the other node's keys and values), backward 1 + 2 (the keys and values
    # again, and their gradients round to their node); per head group; the recomputation's forward again
    assert [result[k]["passes"] for k in ("pixart/1", "dit/1", "wan/1", "pixart/2", "pixart/ckpt")] == [8, 8, 8, 16, 10]
    assert result["latte/1"]["passes"] == 0  # its switches are all-to-alls over the whole group
    # the order, per layer (repeats merged): forward sends this node's chunk on and attends to it before waiting for the
    # other node's, then attends to that; backward likewise, each chunk's gradients passed on after it, waited for by
    # the next node only after it attended to the chunk (the last pass takes them home); both layers' forward, then
    # both backward
    forward = ["pass", "attend", "wait", "attend"]
    backward = ["pass", "attend", "pass", "wait", "attend", "wait", "pass", "wait"]
    assert result["pixart/1"]["ring_order"] == forward * 2 + backward * 2


def test_sizes_a_group_cannot_split_are_refused():
    pixart, sana = load_preset("pixart_debug"), load_preset("sana_debug")  # 4 heads, 16 tokens; 8x8 tokens
    check(pixart, 2)
    check(pixart, 2, head_groups=2)
    check(sana, 4)  # linear attention keeps every head: only rows must divide
    check(sana, 4, head_groups=2)  # its per-head sums are all-reduced in head groups
    with pytest.raises(ValueError, match="sequence_parallel_head_groups=3 does not divide model.num_heads"):
        check(sana, 2, head_groups=3)
    check(pixart, 2, head_groups=4)  # 8 heads' exchanges: 4 of them zero heads (padded)
    check(load_preset("pixart_debug", num_heads=3, width=96), 2)  # likewise one zero head
    with pytest.raises(ValueError, match="does not divide the 9 tokens"):
        check(load_preset("pixart_debug", sample_size=6), 2)
    with pytest.raises(ValueError, match="token rows of model.family=sana"):
        check(load_preset("sana_debug", sample_size=6), 4)
    with pytest.raises(ValueError, match="does not divide the 3 ranks"):
        check(pixart, 2, world=3)
    with pytest.raises(ValueError, match="model.family=unet is not supported"):
        check(load_preset("sd2_unet_debug"), 2)
    check(load_preset("wan_debug"), 4)  # 4 frames of 4x4 tokens, 4 heads
    with pytest.raises(ValueError, match=r"does not divide the 27 tokens \(3x3x3\) of model.wan_debug"):
        check(load_preset("wan_debug", num_frames=3, sample_size=6), 2)
    check(load_preset("latte_debug"), 4)  # 4 frames of 4x4 tokens: one frame, and 4 positions, a rank
    with pytest.raises(ValueError, match="must divide model.latte_debug's 4 latent frames .* 16 tokens a frame"):
        check(load_preset("latte_debug"), 8)
    with pytest.raises(ValueError, match="needs several devices"):
        StrategyConfig(name="single", sequence_parallel=2)
    with pytest.raises(ValueError, match="strategy.compile"):
        StrategyConfig(name="ddp", sequence_parallel=2, compile=True)


def test_head_groups_auto_replays_the_schedule_by_hand():
    """framework/distributed/head_groups.py: one Ulysses layer of 8 heads on 2 ranks (a rank's inputs 3,000 bytes,
    outputs 1,000, attention 1 s) on a link of 0.1 s and 1,000 B/s. G=1: inputs 3.1, attention to 4.1, output to
    5.2. G=2: inputs arrive at 1.6 and 3.2; group 0 attends to 2.1, its output waits for the link (3.2) and is in at
    3.8; group 1 attends 3.2 to 3.7; its output 3.8 to 4.4. G=4 by the same steps: 4.8. So G=2; with latency
    dominant, G=1."""
    from framework.cli import RankSharing, share_ranks
    from framework.distributed import head_groups as hg

    layer = hg.Layer(ranks=2, heads=8, send_in_bytes=375, send_out_bytes=125, attention_s={4: 1.0, 2: 0.5, 1: 0.25})
    times = {g: hg.predict(layer, g, 0.1, 1000.0) for g in (1, 2, 4)}
    assert times[1] == pytest.approx(5.2) and times[2] == pytest.approx(4.4) and times[4] == pytest.approx(4.8)
    assert hg.choose(layer, 0.1, 1000.0, (1, 2, 4))[0] == 2
    assert set(hg.choose(layer, 0.1, 1000.0)[1]) == {1, 2, 4}  # G=8 would leave groups of padding only
    assert hg.choose(hg.Layer(2, 8, 30, 10, {4: 0.1, 2: 0.05, 1: 0.03}), 1.0, 1e9)[0] == 1  # latency dominates
    # half the heads taking 1.5 s of the whole layer's 1 (fixed costs, a kernel less busy): the groups do not pay
    assert hg.choose(hg.Layer(2, 8, 375, 125, {4: 1.0, 2: 1.5, 1: 1.5}), 0.1, 1000.0)[0] == 1
    # 3 heads over 2 ranks in 2 groups: one head a rank a group, the fourth padding, costs as 4 heads would
    assert hg.predict(hg.Layer(2, 3, 750, 250, {1: 0.5}), 2, 0.1, 1000.0) == pytest.approx(
        hg.predict(hg.Layer(2, 4, 750, 250, {1: 0.5}), 2, 0.1, 1000.0))
    # q, k, v of 64 of 128 tokens in fp16 (heads of 8), half of it for the other rank; the output a third of that
    assert hg.layer_of(2, 128, 4, 8, 2, 2, {2: 0.5}) == hg.Layer(2, 4, 3 * 2 * 64 * 8 * 2 / 2, 2 * 64 * 8 * 2 / 2,
                                                                 {2: 0.5})
    assert hg.link_of(torch.device("cpu"), 2, 2) == "gloo"
    with pytest.raises(ValueError, match="auto needs sequence_parallel > 1"):
        share_ranks(None, RankSharing(sequence_parallel_head_groups="auto"))
    with pytest.raises(ValueError, match="a number of head groups"):
        share_ranks(None, RankSharing(sequence_parallel=2, sequence_parallel_head_groups=0))
    from types import SimpleNamespace

    from framework.cli import auto_head_groups

    sana = SimpleNamespace(model=SimpleNamespace(cfg=load_preset("sana_debug")))
    with pytest.raises(ValueError, match="family=sana's sequence parallelism is 'linear': give a number"):
        auto_head_groups(sana, RankSharing(sequence_parallel=2, sequence_parallel_head_groups="auto"))


def test_the_job_mesh_dims_follow_nodes_and_sequence_groups():
    """ParallelDims.of: replicate x shard x sequence = the world; hybrid replicates across nodes; a sequence group is
    part of a node, or whole nodes (its ring dim: one rank a node)."""
    from streaming.base.world import World

    from framework.distributed.mesh import ParallelDims

    assert ParallelDims.of(8, 8) == ParallelDims(1, 8, 1, nodes=1)
    assert ParallelDims.of(32, 8, sequence=4) == ParallelDims(1, 8, 4, nodes=4)
    assert ParallelDims.of(32, 8, sequence=4, hybrid=True) == ParallelDims(4, 2, 4, nodes=4)
    assert ParallelDims.of(32, 8, sequence=16) == ParallelDims(1, 2, 16, nodes=4, ring=2)
    assert ParallelDims.of(4, 1, sequence=4) == ParallelDims(1, 1, 4, nodes=4, ring=4)
    d = ParallelDims.of(16, 4, sequence=2, hybrid=True)
    assert (d.world, d.data_parallel) == (16, 8)
    # Streaming's deal of a global batch, nodes innermost: 2 nodes x 4 ranks (ranks 0-3 on node 0) hold positions
    # 0 2 4 6 | 1 3 5 7. With sequence groups Streaming deals to a world of W / P ranks it lays out itself: 4 groups of
    # 2 on 2 nodes of 4 are one node of 4 groups to it, 0 0 1 1 | 2 2 3 3.
    assert [ParallelDims.of(8, 4).stream_position(r) for r in range(8)] == [0, 2, 4, 6, 1, 3, 5, 7]
    assert [ParallelDims.of(8, 4, sequence=2).stream_position(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [ParallelDims.of(4, 4, sequence=2).stream_position(r) for r in range(4)] == [0, 0, 1, 1]
    # against Streaming's own world, on every layout of up to 4 nodes of up to 8 ranks
    for nodes in (1, 2, 3, 4):
        for per_node in (1, 2, 4, 8):
            world = nodes * per_node
            for sequence in (s for s in (1, 2, 4, 8, 16) if world % s == 0 and (per_node % s == 0 or s % per_node == 0)):
                dims = ParallelDims.of(world, per_node, sequence)
                for rank in range(world):
                    w = World(num_nodes=nodes, ranks_per_node=per_node, workers_per_rank=1, worker=rank)
                    w = w.replicate(sequence) if sequence > 1 else w
                    want = w.rank_of_node * w.num_nodes + w.node  # nodes innermost
                    assert dims.stream_position(rank) == want, (nodes, per_node, sequence, rank)
    with pytest.raises(ValueError, match="neither divides the 4 ranks of a node nor is a multiple"):
        ParallelDims.of(24, 4, sequence=6)
    with pytest.raises(ValueError, match="HYBRID_SHARD replicates .* spans 2 nodes"):
        ParallelDims.of(16, 2, sequence=4, hybrid=True)
    with pytest.raises(ValueError, match="does not divide the 6 ranks"):
        ParallelDims.of(6, 6, sequence=4)
    with pytest.raises(ValueError, match="do not split into nodes"):
        ParallelDims.of(6, 4)


def test_training_refuses_a_sequence_group_over_parts_of_nodes_at_start_up(tmp_path, digits_shards):
    from framework.train import train
    from tests.helpers import cheap, compose_cfg

    overrides = [*cheap(tmp_path, digits_shards, steps=1), "strategy=ddp", "trainer.devices=3", "trainer.num_nodes=2",
                 "strategy.sequence_parallel=2"]
    with pytest.raises(ValueError, match="sequence_parallel=2 neither divides the 3 ranks of a node"):
        train(compose_cfg(overrides))


def test_training_refuses_an_indivisible_split_at_start_up(tmp_path, digits_shards):
    from framework.train import train
    from tests.helpers import cheap, compose_cfg

    overrides = [*cheap(tmp_path, digits_shards, steps=1), "strategy=ddp", "trainer.devices=3",
                 "strategy.sequence_parallel=2"]
    with pytest.raises(ValueError, match="does not divide the 3 ranks"):
        train(compose_cfg(overrides))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["sana", "dit"])
def test_two_rank_sequence_parallel_training_follows_one_process(tmp_path, digits_shards, family):
    """sana (linear attention, halo exchange) and dit (class labels) on 2 sequence-parallel ranks against one
    process with the same batch; pixart, and 2 data x 2 sequence ranks, are in tests/test_distributed.py."""
    import torch

    from tests.helpers import STEPS, TOL, run_train
    from tests.helpers import losses

    model = [f"model={family}_debug", "model.in_channels=1", "model.sample_size=8", "data.batch_size=16",
             "data.num_workers=1", f"trainer.max_steps={STEPS}", "trainer.checkpoint_every_n_steps=2"]
    model += ["model.text_dim=384"] if family == "sana" else ["model.text_dim=null"]
    run_train(tmp_path / "ref", digits_shards, *model)
    run_train(tmp_path / "sp", digits_shards, *model, "strategy=ddp", "trainer.devices=2", "strategy.sequence_parallel=2")
    ref, got = losses(tmp_path / "ref"), losses(tmp_path / "sp")
    assert sorted(got) == list(range(STEPS))
    torch.testing.assert_close(torch.tensor([got[s] for s in range(STEPS)]), torch.tensor([ref[s] for s in range(STEPS)]),
                               **TOL)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["wan", "latte"])
def test_two_rank_sequence_parallel_video_training_and_grids_follow_one_process(tmp_path, moving_shards, family):
    """Wan and Latte on the moving digits' clips (8 frames of 8x8 tokens) on 2 sequence-parallel ranks against one
    process: the same losses, and the grid of step 2 sampled split is the one process's."""
    import numpy as np
    import torch
    from PIL import Image

    from tests.helpers import STEPS, TOL, losses, run_train

    keys = ["data.batch_size=4", "data.num_workers=1", f"trainer.max_steps={STEPS}", "sample.every_n_steps=2",
            "sample.prompts=[a 3 moving left]"]
    run_train(tmp_path / "ref", moving_shards, *keys, model=(f"model={family}_debug",))
    run_train(tmp_path / "sp", moving_shards, *keys, "strategy=ddp", "trainer.devices=2", "strategy.sequence_parallel=2",
              model=(f"model={family}_debug",))
    ref, got = losses(tmp_path / "ref"), losses(tmp_path / "sp")
    assert sorted(got) == list(range(STEPS))
    torch.testing.assert_close(torch.tensor([got[s] for s in range(STEPS)]), torch.tensor([ref[s] for s in range(STEPS)]),
                               **TOL)
    grids = [np.asarray(Image.open(d / "samples" / "step0000002.png"), dtype=float) for d in (tmp_path / "ref", tmp_path / "sp")]
    assert np.abs(grids[0] - grids[1]).max() <= 2  # 8-bit pixels of the same clip, up to rounding


def test_a_self_attention_mask_is_refused_instead_of_ignored():
    from framework.distributed.sequence import SequenceParallel, UlyssesAttnProcessor

    net = build_denoiser(load_preset("pixart_debug"))
    attn = net.net.transformer_blocks[0].attn1
    x = torch.randn(1, 8, net.cfg.hidden_size)
    for groups in (1, 2):
        sp = SequenceParallel(2, 0, None, 0, 1, head_groups=groups)
        with pytest.raises(ValueError, match="does not take a self-attention mask"):
            UlyssesAttnProcessor(sp)(attn, x, attention_mask=torch.ones(1, 8, dtype=torch.bool))


def test_the_split_linear_attention_clips_fp16_like_diffusers(monkeypatch):
    """SANA's processor clips an fp16 output to the finite range; the split one does too (one rank: the all-reduce of
    the per-head sums is the identity)."""
    from diffusers.models.attention_processor import SanaLinearAttnProcessor2_0

    import framework.distributed.sequence as seq
    from framework.distributed.sequence import SequenceParallel, UlyssesLinearAttnProcessor

    torch.manual_seed(0)
    net = build_denoiser(load_preset("sana_debug")).half()
    attn = net.net.transformer_blocks[0].attn1
    with torch.no_grad():
        attn.to_out[0].bias.fill_(6e4)
        attn.to_out[0].weight.fill_(1e4)  # outputs beyond fp16's 65504
    x = torch.randn(1, 16, net.cfg.hidden_size).half()
    monkeypatch.setattr(seq, "_all_reduce", lambda t, group: t)
    with torch.no_grad():
        ref = SanaLinearAttnProcessor2_0()(attn, x)
        got = UlyssesLinearAttnProcessor(SequenceParallel(1, 0, None, 0, 1))(attn, x)
    assert ref.abs().max() == 65504 and torch.isfinite(got).all()
    torch.testing.assert_close(got, ref)
