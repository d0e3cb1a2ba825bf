"""Decoupled generation (framework/inference/decoupled.py): denoising and decoding ranks give plain sampling's images.

Multi-process cases run under torchrun in subprocesses (gloo, CPU); the reference is each rank's own
plain generation of the same prompts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from framework.inference.decoupled import roles
from tests.helpers import torchrun

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("nproc,decode_ranks", [(2, 1), (3, 1), (3, 2)])
def test_decoupled_generation_draws_the_plain_images(tmp_path, digits_shards, tiny_vae_dir, nproc, decode_ranks):
    out = tmp_path / "result.json"
    proc = torchrun(nproc, "-m", "tests.workers.decoupled", str(digits_shards), str(tiny_vae_dir), str(decode_ranks),
                    str(out), tmp=tmp_path, fork=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    for schedule in ("None", "uniform:2"):
        r = result[schedule]
        assert r["equal"] and r["shape"] == [5, 3, 16, 16] and r["max_abs"] > 0.01, r
        assert r["returned"] == [[5, 3, 16, 16]] + [None] * (nproc - 1)  # rank 0 gets the images, the others None


def test_decoupled_video_generation_decodes_clips_with_the_tiled_video_vae(tmp_path, digits_shards):
    """decode_ranks=1 on 2 ranks for a Wan model of a video VAE (PipeDiT's decoupling where it matters: decoding long
    clips): rank 1 decodes every clip whole with the VAE in 8-pixel tiles (3 latent frames -> 9 frames), and the clips
    are plain generation's, bit for bit."""
    from tests.helpers import make_tiny_video_vae

    out = tmp_path / "result.json"
    vae = make_tiny_video_vae(tmp_path / "vae")
    proc = torchrun(2, "-m", "tests.workers.decoupled", "video", str(digits_shards), str(vae), "1", str(out), "8",
                    tmp=tmp_path, fork=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["equal"] and r["shape"] == [5, 9, 3, 16, 16] and r["max_abs"] > 0.01, r
    assert r["returned"] == [[5, 9, 3, 16, 16], None] and r["tiles"] == [8, 8], r  # both decoded plainly; rank 1 split


def test_grids_decode_on_rank_zero_only(tmp_path, digits_shards, tiny_vae_dir):
    """SplitRanks(decode_on_rank0=True) (a training job's sample grids) on 2 ranks: each denoises half the prompts,
    rank 0 alone loads the VAE and decodes them all, and the images are plain sampling's (the halves are denoised
    in other batches: float round-off only)."""
    out = tmp_path / "result.json"
    proc = torchrun(2, "-m", "tests.workers.decoupled", str(digits_shards), str(tiny_vae_dir), "0", str(out),
                    tmp=tmp_path, fork=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    r = json.loads(out.read_text())["rank0"]
    assert r["codec_loaded"] == [True, False] and r["shape"] == [5, 3, 16, 16] and r["max_abs"] > 0.01, r
    assert r["max_diff"] <= 1e-5, r


def test_decode_ranks_needs_more_processes_than_decoders():
    assert roles(3, 1) == ([0, 1], [2])
    assert roles(3, 2) == ([0], [1, 2])
    for world, k in ((1, 1), (2, 2), (2, 0)):
        with pytest.raises(ValueError, match="needs at least"):
            roles(world, k)


@pytest.fixture(scope="module")
def quick_ckpt(tmp_path_factory, digits_shards) -> str:
    from framework.train import train
    from tests.helpers import cheap, compose_cfg

    return train(compose_cfg(cheap(tmp_path_factory.mktemp("ckpt"), digits_shards, steps=2)))["checkpoint"]


def test_under_plain_torchrun_the_ranks_share_the_images(monkeypatch):
    """framework.eval / framework.sample with no sharing option, once share_ranks has joined torchrun's group:
    SplitRanks (each rank its share); one process alone (no group): OneProcess; decode_ranks: DecodeRanks."""
    import torch.distributed as dist

    from framework.cli import RankSharing
    from framework.inference.sharing import DecodeRanks, OneProcess, SplitRanks

    assert not dist.is_initialized()
    assert isinstance(RankSharing().sharing(), OneProcess)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    assert isinstance(RankSharing().sharing(), SplitRanks)
    assert isinstance(RankSharing(sequence_parallel=2).sharing(), SplitRanks)
    assert isinstance(RankSharing(decode_ranks=1).sharing(), DecodeRanks)


@pytest.mark.slow
@pytest.mark.parametrize("split", [pytest.param("", id="plain"), "decode_ranks=1 aco=0.5", "sequence_parallel=2",
                                   "sequence_parallel=2 sequence_parallel_head_groups=auto"])
def test_eval_command_on_two_processes_scores_what_one_process_scores(tmp_path, quick_ckpt, split):
    """`torchrun ... -m framework.eval` on 2 processes, plain (each rank draws half the 40 images), with
    decode_ranks=1 aco=0.5 (the decoding rank computing half the heads while it has nothing to decode;
    test_each_role_loads_only_its_own_model runs decode_ranks without Aco) or with sequence_parallel=2: the same
    metrics as one process (only the speed differs), printed once, by rank 0. Plain, both draw in batches of one
    rank's half: the same batches, the same rounding."""
    from framework.eval import EvalCommand, evaluate
    from framework.inference.pipeline import Pipeline

    ckpt = quick_ckpt
    args = dict(seeds=1, phrasings=1, steps=3, batch_size=8 if split else 20)
    # The ranks forked (tests/zygote.py); .ci/run runs the decode_ranks case again through the real torchrun
    proc = torchrun(2, "-m", "framework.eval", f"ckpt={ckpt}", f"out={tmp_path / 'eval'}", *split.split(), "device=cpu",
                    *(f"{k}={v}" for k, v in args.items()), tmp=tmp_path, fork=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert sum(line.startswith("prompt_accuracy ") for line in lines) == 1
    assert sum(line.startswith("aco: decoding ranks computed ") for line in lines) == ("aco" in split)
    assert sum(line.startswith("sequence_parallel_head_groups=auto: ") for line in lines) == ("auto" in split)
    got = json.loads(lines[-1])
    want = evaluate(Pipeline.from_checkpoint(ckpt), EvalCommand(ckpt=ckpt, **args))
    for key in ("prompt_accuracy", "heldout_phrasing_accuracy", "num_images"):
        assert got[key] == want[key], key
    # decoupled and split images are bit-identical; split attention may round differently in float32
    assert got["fd"] == (pytest.approx(want["fd"], rel=1e-4) if split.startswith("sequence") else want["fd"])


@pytest.mark.parametrize("decode_ranks,aco", [("1", 0), ("auto", 0), ("auto", 0.5)])
def test_each_role_loads_only_its_own_model(tmp_path, quick_ckpt, decode_ranks, aco):
    """3 ranks of a checkpoint's lazy pipeline (as framework.sample / eval load it with decode_ranks, through the
    commands' RankSharing): the denoising ranks build the denoiser and never load the image codec, the decoding ranks
    load the codec and never build the denoiser (it stays a meta-device placeholder), and the images are one
    process's. auto: the first batch's stage times choose K (the pixel codec decodes in no time: one decoder); with
    aco=0.5 rank 0 also times the batch with the last rank computing half the heads, which the worker makes the faster
    (a batch alone is timed 0.5 s longer, so that Aco stays on on a shared CPU), and the decoders then help each
    decoder's first batch at least (rank 0 prints the counts)."""
    import re

    out = tmp_path / "result.json"
    proc = torchrun(3, "-m", "tests.workers.decoupled", "roles", quick_ckpt, decode_ranks, str(out), tmp=tmp_path,
                    fork=True, env={"ACO": str(aco), **({"SLOW_ALONE": "0.5"} if aco else {})})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["equal"] and r["again_equal"]
    ks = [1, 1]  # each generate call's K
    if decode_ranks == "auto":
        assert "decode_ranks=auto: a batch of 2 takes" in proc.stdout, proc.stdout[-2000:]
        ks = [int(k) for k in re.findall(r"(\d) of 3 ranks decode", proc.stdout)]
        # the pixel codec decodes in no time: one decoder, unless Aco's help measured more than 3x faster
        assert len(ks) == 2 and (ks == [1, 1] or aco), proc.stdout[-2000:]
    built = [any(rank < 3 - k for k in ks) for rank in range(3)]
    codec = [any(rank >= 3 - k for k in ks) for rank in range(3)]
    assert [(x["built"], x["meta"], x["codec"]) for x in r["ranks"]] == list(zip(built, [not b for b in built], codec))
    assert ("s with a decoding rank's help) and" in proc.stdout) == bool(aco)
    told = [tuple(map(int, m)) for m in re.findall(r"aco: decoding ranks computed (\d+) heads in (\d+) of the (\d+) ",
                                                     proc.stdout)]
    # with Aco on, each generate call's line of counts: its first batch (of 3, then of 1) helped at least
    assert "; aco off: the help did not pay" not in proc.stdout, proc.stdout[-2000:]
    assert len(told) == (2 if aco else 0), proc.stdout[-2000:]
    assert all(heads > 0 and heads % helped == 0 and calls >= helped >= calls // 3 for heads, helped, calls in told)


def test_sequence_parallel_denoising_groups_with_decode_ranks(tmp_path, quick_ckpt):
    """3 ranks, sequence_parallel=2 with decode_ranks=1: ranks 0 and 1 denoise every batch together, their model split
    over the two of them (built on first use, then split), and rank 2 decodes; the images are one process's up to the
    split attention's float round-off. 4 ranks with decode_ranks=1 leave 3 denoisers, not whole groups: refused."""
    out = tmp_path / "result.json"
    proc = torchrun(3, "-m", "tests.workers.decoupled", "roles", quick_ckpt, "1", str(out), tmp=tmp_path, fork=True,
                    env={"SEQUENCE_PARALLEL": "2"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["max_diff"] < 1e-5 and r["again_equal"], r
    assert [(x["built"], x["codec"], x["split"]) for x in r["ranks"]] == [(True, False, [0, 2]), (True, False, [1, 2]),
                                                                         (False, True, None)]
    proc = torchrun(4, "-m", "tests.workers.decoupled", "roles", quick_ckpt, "1", str(tmp_path / "r4.json"),
                    tmp=tmp_path, fork=True, env={"SEQUENCE_PARALLEL": "2"})
    assert proc.returncode != 0 and "not whole groups of 2" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_bench_decode_reports_each_way_and_each_ranks_role(tmp_path):
    """`framework.bench decode` on 2 ranks with the small decoder, against its one-rank way: each way's images are one
    rank's (bit for bit, Aco's to float round-off: the helper computes half the heads), images/s is the images over
    the best time, and each rank's peak memory comes with its role (the decoding rank never built the denoiser, with
    or without Aco; in the split way both ranks denoise and decode)."""
    out = tmp_path / "bench.json"
    proc = torchrun(2, "-m", "framework.bench", "decode", "images=2", "batch_size=1", "steps=2", "latent_size=8",
                    "repeats=1", "ways=[one_rank,decoupled,decoupled_aco,split]", "vae=small", f"out={out}",
                    tmp=tmp_path, fork=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    one, decoupled, aco, split = json.loads(out.read_text())
    assert (one["way"], decoupled["way"], aco["way"], split["way"]) == ("one_rank", "decoupled", "decoupled_aco", "split")
    assert (decoupled["aco"], aco["aco"], aco["vae"]) == (0.0, 0.5, "small")
    assert one["same_images_as_one_rank"] and decoupled["same_images_as_one_rank"] and split["same_images_as_one_rank"]
    assert aco["max_diff_vs_one_rank"] <= 1e-5
    for r in (one, decoupled, aco, split):
        assert r["images_per_s"] == 2 / r["seconds"] and r["latency_s"] > 0
        assert all(m["peak_MiB"] > 0 for m in r["per_rank"])
    # recorded after each way: the decoupled ways came first, so the decoding rank had not built the denoiser yet
    for r in (decoupled, aco):
        assert [(m["denoiser"], m["decoder"]) for m in r["per_rank"]] == [(True, False), (False, True)]
    assert [(m["denoiser"], m["decoder"]) for m in split["per_rank"]] == [(True, True), (True, True)]


def test_bench_roles_measures_each_role_alone_and_adds_the_blocks_it_did_not_build(tmp_path):
    """`framework.bench roles` on wan_debug (1 of its 2 blocks built) and the tiny video VAE, 9 frames of 32x32 in
    16-pixel tiles, fp32: the denoise row (through the command, in its own process) adds the unbuilt block's weights
    (counted by hand here); the decode row (one role run here, in this process) decodes the whole clip (3 latent
    frames of 8x8 -> 9 frames)."""
    from framework.bench.suite_roles import RolesBench, _role
    from framework.models.backbones import build_denoiser, load_preset
    from framework.training.memory import GIB
    from tests import zygote
    from tests.helpers import make_tiny_video_vae

    out = tmp_path / "roles.json"
    vae = make_tiny_video_vae(tmp_path / "vae")
    args = dict(preset="wan_debug", num_frames=9, height=32, width=32, vae=str(vae), vae_tile=16, downsample=4,
                denoise_layers=1, dtype="fp32", device="cpu")
    proc = zygote.run([sys.executable, "-m", "framework.bench", "roles", "roles=[denoise]", f"out={out}",
                       *(f"{k}={v}" for k, v in args.items())])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (denoise,) = json.loads(out.read_text())
    _role(RolesBench(**args), "decode", str(tmp_path / "decode.json"))
    decode = json.loads((tmp_path / "decode.json").read_text())
    whole = build_denoiser(load_preset("wan_debug", num_frames=3, sample_size=8))
    block = sum(p.numel() for p in whole.net.blocks[1].parameters()) * 4
    assert (denoise["role"], denoise["layers"], denoise["of_layers"], denoise["tokens"]) == ("denoise", 1, 2, 48)
    assert denoise["blocks_added_bytes"] == block and denoise["block_bytes"] == block
    assert denoise["full_peak_gib"] == pytest.approx(denoise["peak_gib"] + block / GIB) and denoise["peak_gib"] > 0.1
    assert (decode["role"], decode["clip"], decode["tile"], decode["blocks_added_bytes"]) == \
        ("decode", [1, 3, 9, 32, 32], 16, 0)
    assert decode["full_peak_gib"] == decode["peak_gib"] > 0.1


def test_decode_ranks_is_a_count_or_auto():
    from framework.cli import RankSharing, share_ranks

    for bad in (-1, "two"):
        with pytest.raises(ValueError, match="a number of ranks"):
            share_ranks(None, RankSharing(decode_ranks=bad))
    with pytest.raises(ValueError, match="give the number of decoding ranks"):
        share_ranks(None, RankSharing(decode_ranks="auto", sequence_parallel=2))


def test_a_slow_decoder_does_not_hold_up_denoising(tmp_path, digits_shards, tiny_vae_dir):
    """2 ranks, decode_ranks=1, each decode 1.5 s slower: rank 0 denoises all 3 batches while the decoder is still on
    its first (latents are sent without waiting; the images come back on their own process group, so a decoder
    behind cannot block rank 0's sends, as it would under NCCL's in-order pairing on one group), and the images are
    plain sampling's."""
    out = tmp_path / "result.json"
    env_proc = torchrun(2, "-m", "tests.workers.decoupled", str(digits_shards), str(tiny_vae_dir), "1", str(out),
                        tmp=tmp_path, fork=True, env={"SLOW_DECODE": "1.5"})
    assert env_proc.returncode == 0, env_proc.stdout[-2000:] + env_proc.stderr[-4000:]
    r = json.loads(out.read_text())["slow"]
    assert r["equal"]
    denoised = [t for name, t in r["events"][0] if name == "denoised"]
    decoded = [t for name, t in r["events"][1] if name == "decoded"]
    assert len(denoised) == 3 and len(decoded) == 3
    assert denoised[-1] < decoded[0], "rank 0 waited for the decoder before denoising its last batch"


@pytest.mark.parametrize("family,nproc,decode_ranks,hold,share", [
    ("pixart", 2, 1, True, "0.5"), ("pixart", 3, 1, True, "0.5"), ("pixart", 3, 2, False, "0.5"),
    ("wan", 2, 1, False, "0.5"), ("latte", 2, 1, False, "0.5"), ("pixart", 3, 1, True, "auto")])
def test_idle_decoders_compute_attention_heads_and_the_images_are_unchanged(tmp_path, digits_shards, tiny_vae_dir,
                                                                            family, nproc, decode_ranks, hold, share):
    """decode_ranks=K with aco=0.5 (PipeDiT's attention co-processing): each decoder, free before its first batch,
    computes half the heads (2 of 4) of every self-attention of that batch's denoising, and the images (wan, latte:
    clips through the tiled video VAE; latte's spatial and temporal blocks both) are plain generation's, bit for bit.
    Whatever a decoder serves, its denoiser sent: the counts agree. hold: each decode waits until every denoiser has
    sent its last "done", so every later batch's decoder is still busy and reads "done" before it could say "free":
    exactly the decoders' first batches are helped (1+1: batches 1, 2 not; 2+1, two denoisers on one decoder: batch
    0 only), and the images are the same. aco=auto on 2+1 ranks: PipeDiT's N_decode / N = 1/3, one head of 4."""
    from tests.helpers import make_tiny_video_vae

    out = tmp_path / "result.json"
    vae = tiny_vae_dir if family == "pixart" else make_tiny_video_vae(tmp_path / "vae")
    proc = torchrun(nproc, "-m", "tests.workers.decoupled", "aco", family, str(digits_shards), str(vae),
                    str(decode_ranks), str(out), tmp=tmp_path, fork=True,
                    env={"HOLD_DECODE": str(int(hold)), "ACO_SHARE": share})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["equal"] and r["max_abs"] > 0.01 and r["heads"] == 4, r
    denoisers, decoders = r["ranks"][:nproc - decode_ranks], r["ranks"][nproc - decode_ranks:]
    assert all(x["served"] == 0 for x in denoisers) and all(x["calls"] == 0 for x in decoders), r
    calls, helped = sum(x["calls"] for x in denoisers), sum(x["helped"] for x in denoisers)
    per_batch = calls // 3  # 3 batches, each the same number of self-attentions (2 steps x 2 blocks; latte: x 2)
    assert calls == 3 * per_batch and per_batch == (8 if family == "latte" else 4), r
    assert decode_ranks * per_batch <= helped <= calls, r  # every decoder's first batch at least
    if hold:
        assert helped == decode_ranks * per_batch, r
    per_help = 2 if share == "0.5" else round(4 * decode_ranks / nproc)  # of the 4 heads
    assert sum(x["heads_sent"] for x in denoisers) == per_help * helped == sum(x["heads_served"] for x in decoders), r
    assert helped == sum(x["served"] for x in decoders), r


def test_auto_decode_ranks_count_what_idle_decoders_give_back_with_aco():
    """The throughput decode_ranks=auto maximises, by hand. Without Aco (t_helped = t_denoise) it is the slower
    stage's rate: 3 ranks, denoise 2 s, decode 1.5 s: K=1 gives min(2/2, 1/1.5) = 0.667 batches/s, K=2 min(1/2, 2/1.5)
    = 0.5. With Aco halving a helped batch (1 s): K=2's one denoiser is helped a share h = min(1, 2 (1 - 1.5 r / 2))
    of its time and draws (1 - h) / 2 + h / 1 = 0.5 + h / 2 batches/s, so r = 1.5 - 0.75 r, r = 6/7 = 0.857, above
    K=1's 0.667 (its decoder is busy all the time at that rate: no help). 2 ranks, denoise 2, decode 0.5, helped 1:
    h = 1 - r / 2, r = 1 - r / 4, r = 0.8 (a batch every 1.25 s: 0.5 s alone while the decoder decodes, then 0.75 s of
    the rest helped at twice the speed). A helped batch slower than one alone counts as no help."""
    from framework.inference.decoupled import throughput

    assert throughput(3, 1, 2.0, 1.5, 2.0) == pytest.approx(2 / 3)
    assert throughput(3, 2, 2.0, 1.5, 2.0) == pytest.approx(0.5)
    assert throughput(3, 1, 2.0, 1.5, 1.0) == pytest.approx(2 / 3)
    assert throughput(3, 2, 2.0, 1.5, 1.0) == pytest.approx(6 / 7)
    assert throughput(2, 1, 2.0, 0.5, 1.0) == pytest.approx(0.8)
    assert throughput(3, 2, 2.0, 1.5, 3.0) == pytest.approx(0.5)
    assert throughput(2, 1, 2.0, 0.0, 2.0) == pytest.approx(0.5)  # a decoder that takes no time


def test_a_family_aco_cannot_share_is_refused_on_every_rank(tmp_path, digits_shards, tiny_vae_dir):
    """aco=0.5 with a SANA model (linear attention) on 1+1 ranks: both ranks refuse before any Aco message (a refusal
    on the denoiser alone would leave the decoder waiting for it until the process group's timeout)."""
    out = tmp_path / "result.json"
    proc = torchrun(2, "-m", "tests.workers.decoupled", "aco", "sana", str(digits_shards), str(tiny_vae_dir), "1",
                    str(out), tmp=tmp_path, fork=True, env={"HOLD_DECODE": "0"})
    assert proc.returncode != 0 and not out.exists()
    refusal = "ValueError: aco: model.family=sana has no softmax self-attention stack"  # the exception's own line
    assert (proc.stdout + proc.stderr).count(refusal) == 2, proc.stderr[-3000:]


def test_aco_needs_decode_ranks_a_share_and_a_softmax_stack():
    from framework.cli import RankSharing, share_ranks
    from framework.inference.decoupled import co_processing

    for cfg in (RankSharing(aco=0.5), RankSharing(decode_ranks=1, aco=1.5),
                RankSharing(decode_ranks=1, aco=0.5, sequence_parallel=2)):
        with pytest.raises(ValueError, match="aco="):
            share_ranks(None, cfg)

    class Stub:  # a SANA model (linear attention) and a UNet
        pass

    for family in ("sana", "unet"):
        model = Stub()
        model.cfg = Stub()
        model.cfg.family = family
        with pytest.raises(ValueError, match="no softmax self-attention stack"):
            with co_processing(model, object()):
                pass


def test_each_rank_of_a_sampling_job_picks_its_own_gpu(monkeypatch):
    """Under torchrun (LOCAL_RANK) `device=auto` or `cuda` is the rank's own GPU, modulo the visible count; without
    a launcher it stays `cuda`; explicit devices and the CPU are kept. (GPUs faked: only the choice is checked.)"""
    import torch

    from framework.cli import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("SLURM_LOCALID", raising=False)
    assert resolve_device("auto") == "cuda"
    picked = []
    for rank in range(6):
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        picked.append(resolve_device("auto"))
        assert resolve_device("cuda") == picked[-1]
        assert resolve_device("cuda:3") == "cuda:3" and resolve_device("cpu") == "cpu"
    assert picked == ["cuda:0", "cuda:1", "cuda:2", "cuda:3", "cuda:0", "cuda:1"]
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setenv("SLURM_LOCALID", "2")
    assert resolve_device("auto") == "cuda:2"
