"""strategy=fsdp builds on the meta device and materialises only local shards (framework/distributed/fsdp.py).

The reference everywhere is the ordinary build: `DiffusionModule` without fsdp (build_denoiser, then
load_weights for init_from) under the same seed. In-process tests check the pieces for every family
and uneven splits (3 ranks); one 2-rank gloo launch (tests/workers/fsdp_init.py) checks the real
Lightning set-up: gathered parameters and every buffer, right after set-up, equal the reference
bit for bit, for fresh inits and for init_from a checkpoint, a .safetensors file and a diffusers folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from safetensors.torch import save_file

from framework.distributed.fsdp import build_meta, file_shards, fresh_shards, local_rows
from framework.models.backbones import build_denoiser, load_preset
from framework.models.init import init_weights
from framework.training.module import DiffusionModule
from framework.models.objectives import ObjectiveConfig
from framework.training.optim import OptimizerConfig
from tests.zygote import lightning_ranks

EXACT = dict(rtol=0, atol=0)


def ordinary(model: str, seed: int, init_from: str | None = None) -> torch.nn.Module:
    """The ordinary (single/ddp) build, seeded as framework.train seeds, with a few numbers drawn first
    so that a build which ignored the RNG state at construction time would differ."""
    pl.seed_everything(seed, workers=True, verbose=False)
    torch.rand(3)
    return DiffusionModule(load_preset(model), ObjectiveConfig(), OptimizerConfig(), max_steps=0, seed=seed,
                           init_from=init_from).model


def write_sources(model: str, folder: Path) -> dict[str, str]:
    """Weights of another seed as a Lightning-layout checkpoint, a bare .safetensors file and a diffusers folder."""
    torch.manual_seed(1234)
    src = build_denoiser(load_preset(model))
    folder.mkdir(parents=True, exist_ok=True)
    # The layout Lightning writes (framework.train's checkpoints): the module's weights under state_dict.
    torch.save({"state_dict": {f"model.{k}": v for k, v in src.state_dict().items()}, "global_step": 3},
               folder / "run.ckpt")
    save_file({k: v.contiguous() for k, v in src.net.state_dict().items()}, str(folder / "net.safetensors"))
    src.net.save_pretrained(folder / "diffusers", safe_serialization=True)
    return {"ckpt": str(folder / "run.ckpt"), "safetensors": str(folder / "net.safetensors"),
            "diffusers": str(folder / "diffusers")}


# --------------------------------------------------------------------------------------------
# The pieces, in process
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("init", ["diffusers", "reference"])
@pytest.mark.parametrize("name", ["pixart_debug", "sana_debug", "dit_debug", "sd2_unet_debug"])
def test_fresh_shards_are_rows_of_the_ordinary_build(name, init):
    """The ordinary from-scratch build (build_denoiser, then init_weights: model.init=reference re-initialises as the
    family's reference code does) against each rank's rows from fresh_shards."""
    cfg = load_preset(name, init=init)
    torch.manual_seed(7)
    ref = build_denoiser(cfg)
    init_weights(ref)
    after = torch.rand(4)  # where the ordinary build leaves the RNG
    for world in (2, 3):  # 3: uneven splits, some ranks with fewer rows
        for rank in range(world):
            torch.manual_seed(7)
            params, buffers = fresh_shards(cfg, rank, world)
            torch.testing.assert_close(torch.rand(4), after, **EXACT)
            assert params.keys() == dict(ref.named_parameters()).keys()
            for k, p in ref.named_parameters():
                torch.testing.assert_close(params[k], local_rows(p.detach(), rank, world), **EXACT)
            assert buffers.keys() == dict(ref.named_buffers()).keys()
            for k, b in ref.named_buffers():
                torch.testing.assert_close(buffers[k], b, **EXACT)


@pytest.mark.parametrize("source", ["ckpt", "safetensors", "diffusers"])
def test_file_shards_are_rows_of_the_file(source, tmp_path):
    path = write_sources("pixart_debug", tmp_path)[source]
    torch.manual_seed(1234)
    src = build_denoiser(load_preset("pixart_debug"))
    meta = build_meta(load_preset("pixart_debug"))
    persistent = {k for k in src.state_dict() if k not in dict(src.named_parameters())}
    for rank in range(3):
        params, buffers = file_shards(path, meta, rank, 3)
        for k, p in src.named_parameters():
            torch.testing.assert_close(params[k], local_rows(p.detach(), rank, 3), **EXACT)
        assert buffers.keys() == persistent


def test_file_shards_from_another_model_names_the_file(tmp_path):
    path = write_sources("pixart_debug", tmp_path)["safetensors"]
    with pytest.raises(ValueError, match=r"net\.safetensors.*another model"):
        file_shards(path, build_meta(load_preset("sana_debug")), 0, 2)


# --------------------------------------------------------------------------------------------
# Two ranks through Lightning
# --------------------------------------------------------------------------------------------

FRESH = [("pixart_debug", 11), ("sana_debug", 12), ("dit_debug", 13)]
LOADED = [("pixart_debug", "ckpt"), ("pixart_debug", "safetensors"), ("pixart_debug", "diffusers"),
          ("sana_debug", "ckpt"), ("sana_debug", "safetensors")]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[list[dict], Path]:
    root = tmp_path_factory.mktemp("fsdp_init")
    sources = {m: write_sources(m, root / m) for m in {m for m, _ in LOADED}}
    cases = [{"model": m, "seed": s, "init_from": None} for m, s in FRESH]
    cases += [{"model": m, "seed": 21, "init_from": sources[m][kind]} for m, kind in LOADED]
    (root / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "TMPDIR": str(root)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        env.pop(k, None)
    args = [str(root / "cases.json"), str(root)]
    results = lightning_ranks("tests.workers.fsdp_init", args, 2, env, root, timeout=600)  # tests/zygote.py
    assert all(r.returncode == 0 for r in results), "".join(r.stdout[-2000:] + r.stderr[-3000:] for r in results)
    return cases, root


@pytest.mark.parametrize("index", range(len(FRESH) + len(LOADED)))
def test_two_rank_fsdp_setup_equals_the_ordinary_build(two_ranks, index):
    cases, root = two_ranks
    case = cases[index]
    ref = ordinary(case["model"], case["seed"], case["init_from"])
    if case["init_from"]:  # the file's weights, not a fresh init that happens to match
        fresh = ordinary(case["model"], case["seed"])
        assert not all(torch.equal(a, b) for a, b in zip(ref.parameters(), fresh.parameters()))
    total = sum(p.numel() for p in ref.parameters())
    local = []
    for rank in (0, 1):
        got = torch.load(root / f"case{index}_rank{rank}.pt", weights_only=True)
        assert got["dtensor"]
        local.append(got["local_numel"])
        assert got["params"].keys() == dict(ref.named_parameters()).keys()
        for k, p in ref.named_parameters():
            torch.testing.assert_close(got["params"][k], p.detach(), **EXACT)
        # Buffers, non-persistent ones included (PixArt's and DiT's sin-cos positional table).
        assert got["buffers"].keys() == dict(ref.named_buffers()).keys()
        for k, b in ref.named_buffers():
            torch.testing.assert_close(got["buffers"][k], b, **EXACT)
    assert sum(local) == total and max(local) < total  # each rank holds only its shards
