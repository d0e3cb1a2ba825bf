"""Decoupled generation (framework/inference/decoupled.py): denoising and decoding ranks give plain sampling's images.

Multi-process cases run under torchrun in subprocesses (gloo, CPU); the reference is each rank's own
plain generation of the same prompts.
"""

from __future__ import annotations

import json
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


@pytest.mark.slow
@pytest.mark.parametrize("split", ["decode_ranks=1", "sequence_parallel=2"])
def test_eval_command_on_two_processes_scores_what_one_process_scores(tmp_path, quick_ckpt, split):
    """`torchrun ... -m framework.eval decode_ranks=1` (or sequence_parallel=2) on 2 processes: the same
    metrics as one process (only the speed differs), printed once, by rank 0."""
    from framework.eval import EvalCommand, evaluate
    from framework.inference.pipeline import Pipeline

    ckpt = quick_ckpt
    args = dict(seeds=1, phrasings=1, steps=3, batch_size=8)
    # decode_ranks: through the real torchrun; sequence_parallel: the same ranks forked (tests/zygote.py)
    proc = torchrun(2, "-m", "framework.eval", f"ckpt={ckpt}", f"out={tmp_path / 'eval'}", split, "device=cpu",
                    *(f"{k}={v}" for k, v in args.items()), tmp=tmp_path, fork=split.startswith("sequence"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert sum(line.startswith("prompt_accuracy ") for line in lines) == 1
    got = json.loads(lines[-1])
    want = evaluate(Pipeline.from_checkpoint(ckpt), EvalCommand(ckpt=ckpt, **args))
    for key in ("prompt_accuracy", "heldout_phrasing_accuracy", "num_images"):
        assert got[key] == want[key], key
    # decoupled images are bit-identical; split attention may round differently in float32
    assert got["fd"] == (want["fd"] if split.startswith("decode") else pytest.approx(want["fd"], rel=1e-4))


@pytest.mark.parametrize("decode_ranks", ["1", "auto"])
def test_each_role_loads_only_its_own_model(tmp_path, quick_ckpt, decode_ranks):
    """3 ranks of a checkpoint's lazy pipeline (as framework.sample / eval load it with decode_ranks): the denoising
    ranks build the denoiser and never load the image codec, the decoding ranks load the codec and never build the
    denoiser (it stays a meta-device placeholder), and the images are one process's. auto: the first batch's stage
    times choose K (the pixel codec decodes in no time: one decoder)."""
    out = tmp_path / "result.json"
    proc = torchrun(3, "-m", "tests.workers.decoupled", "roles", quick_ckpt, decode_ranks, str(out), tmp=tmp_path,
                    fork=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["equal"] and r["again_equal"]
    assert [(x["built"], x["meta"], x["codec"]) for x in r["ranks"]] == [(True, False, False)] * 2 + [(False, True, True)]
    if decode_ranks == "auto":
        assert "decode_ranks=auto: a batch of 2 takes" in proc.stdout and "1 of 3 ranks decode" in proc.stdout


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
    """`framework.bench decode` on 2 ranks: images/s, one prompt's latency and each rank's peak memory with its role
    (the decoding rank never built the denoiser; in the split way both ranks denoise and decode)."""
    out = tmp_path / "bench.json"
    proc = torchrun(2, "-m", "framework.bench", "decode", "images=2", "batch_size=1", "steps=2", "latent_size=8",
                    "repeats=1", "ways=[decoupled,split]", f"out={out}", tmp=tmp_path, fork=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    decoupled, split = json.loads(out.read_text())
    assert decoupled["way"] == "decoupled" and split["way"] == "split"
    for r in (decoupled, split):
        assert r["images_per_s"] > 0 and r["latency_s"] > 0 and all(m["peak_MiB"] > 0 for m in r["per_rank"])
    # recorded after each way: the decoupled way came first, so the decoding rank had not built the denoiser yet
    assert [(m["denoiser"], m["decoder"]) for m in decoupled["per_rank"]] == [(True, False), (False, True)]
    assert [(m["denoiser"], m["decoder"]) for m in split["per_rank"]] == [(True, True), (True, True)]


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
