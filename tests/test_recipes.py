"""What real-size recipes need: a global batch kept on any device count, the lr scaled with it, and released
weights loaded with the configuration their config.json gives."""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from framework import config as config_lib
from framework.data.datamodule import split_global_batch
from framework.training.optim import OptimizerConfig, scaled_lr
from tests.helpers import CONF, compose_cfg

config_lib.register()


@pytest.mark.parametrize("global_batch, ranks, most, expected", [
    (256, 8, 32, (32, 1)),   # DiT-XL/2's 256 on 8 GPUs of 32
    (256, 4, 32, (32, 2)),   # the same recipe on 4 GPUs: two micro-batches of 32
    (256, 8, 20, (16, 2)),   # 32 per rank with at most 20: two of 16, not 20 + 12
    (12, 1, 5, (4, 3)),      # 12 with at most 5: 3 x 4 (2 x 6 would exceed 5)
    (7, 1, 3, (1, 7)),       # a prime share splits only into ones
    (16, 2, 64, (8, 1)),     # a micro-batch never exceeds the rank's share
])
def test_a_global_batch_splits_into_the_fewest_even_micro_batches(global_batch, ranks, most, expected):
    micro, accumulate = split_global_batch(global_batch, ranks, most)
    assert (micro, accumulate) == expected
    assert micro * accumulate * ranks == global_batch and micro <= most


def test_a_global_batch_the_ranks_do_not_divide_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"data.global_batch_size=10 does not divide over 4 data-parallel ranks"):
        split_global_batch(10, 4, 8)


@pytest.mark.parametrize("rule, batch, expected", [
    ("none", 1024, 2e-5),
    ("sqrt", 1024, 2e-5 * 2.0),       # PixArt's auto_lr: sqrt(1024 / 256)
    ("sqrt", 64, 2e-5 * 0.5),
    ("linear", 1024, 2e-5 * 4.0),
    ("linear", 128, 2e-5 * 0.5),
])
def test_the_lr_scales_with_the_global_batch_as_the_rule_says(rule, batch, expected):
    cfg = OptimizerConfig(lr=2e-5, lr_scaling=rule, lr_reference_batch=256)
    assert math.isclose(scaled_lr(cfg, batch), expected, rel_tol=1e-12)


# --------------------------------------------------------------------------------------------
# init_from= a diffusers folder: the model its config.json describes
# --------------------------------------------------------------------------------------------


def _save(folder: Path, family: str, pipeline: bool = False, **changes) -> Path:
    """A tiny diffusers backbone saved as a released model would be: the debug preset fitted to the digits (1 channel,
    384-wide captions, no learned variance), with `changes` to its config; under transformer/ of a pipeline folder
    when `pipeline`."""
    from framework.models.backbones import FAMILIES, diffusers_kwargs, load_preset

    args = diffusers_kwargs(load_preset(f"{family}_debug", in_channels=1, text_dim=384, learned_sigma=False))
    torch.manual_seed(0)
    net = FAMILIES[family](**{**args, **changes})
    if pipeline:
        folder.mkdir(parents=True)
        (folder / "model_index.json").write_text(json.dumps({"_class_name": "PixArtSigmaPipeline"}))
        net.save_pretrained(folder / "transformer")
    else:
        net.save_pretrained(folder)
    return folder


def _fit(overrides: list[str]):
    """The composed config after framework.train's preflight."""
    from framework.preflight import fit_model_to_data

    cfg = compose_cfg([*overrides, "data.prepare=null"])
    fit_model_to_data(cfg)
    return cfg


@pytest.mark.parametrize("family, changes, pipeline", [
    ("pixart", {"interpolation_scale": 2, "norm_eps": 1e-5}, True),
    ("sana", {"qk_norm": "rms_norm_across_heads", "interpolation_scale": 2, "mlp_ratio": 2.0}, False),
    # an architecture no shipped preset has: 3 layers of 3 heads, then heads of 16 in patches of 1 (PixArt attends to
    # the captions at its own width, which the model derives)
    ("pixart", {"num_layers": 3, "num_attention_heads": 3, "cross_attention_dim": 96}, False),
    ("pixart", {"attention_head_dim": 16, "patch_size": 1, "cross_attention_dim": 64}, False),
])
def test_a_diffusers_folder_builds_the_model_its_config_json_describes(tmp_path, digits_shards, family, changes,
                                                                       pipeline):
    """The preset leaves these constructor arguments unset or sets others (its size); init_from's config.json sets
    them, though the user named none, and the model built from the fitted config computes what diffusers' own
    from_pretrained of the folder computes."""
    from framework.models.backbones import FAMILIES, build_denoiser, load_weights, to_model_config

    folder = _save(tmp_path / "released", family, pipeline, **changes)
    cfg = _fit([f"model={family}_debug", f"init_from={folder}", f"data.path={digits_shards}"])
    named = {"num_attention_heads": "num_heads", "attention_head_dim": "head_dim"}  # ModelConfig's names
    set_here = {k: v for k, v in changes.items() if k != "cross_attention_dim"}
    assert {k: cfg.model.get(named.get(k, k), cfg.model.kwargs.get(k)) for k in set_here} == set_here
    model = load_weights(build_denoiser(to_model_config(cfg.model)), folder).eval()
    reference = FAMILIES[family].from_pretrained(folder, subfolder="transformer" if pipeline else None).eval()
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(2, 1, 8, 8, generator=g), torch.tensor([10, 700])
    text = torch.randn(2, 5, 384, generator=g)
    with torch.no_grad():
        got = model(x, t, text, None, None)
        extra = {"added_cond_kwargs": {"resolution": None, "aspect_ratio": None}} if family == "pixart" else {}
        want = reference(x, encoder_hidden_states=text, timestep=t, return_dict=False, **extra)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("changes, overrides, message", [
    ({"num_layers": 2}, ["model.num_layers=3"],
     r"config.json has num_layers=2, but your config \(command line or experiment file\) sets model.num_layers=3"),
    ({"attention_head_dim": 16}, ["model.head_dim=8"], r"has head_dim=16, but your config .* sets model.head_dim=8"),
    ({"interpolation_scale": 2}, ["+model.kwargs.interpolation_scale=1"],
     r"has kwargs.interpolation_scale=2, but your config \(command line or experiment file\) sets "
     r"model.kwargs.interpolation_scale=1"),
    ({}, ["model.num_layers=6"], r"has num_layers=4, but your config .* sets model.num_layers=6"),
    ({"in_channels": 4, "out_channels": 4}, [],
     r"does not fit the dataset .* gives model.in_channels=4, .* has in_channels=1"),
])
def test_a_key_the_user_set_that_contradicts_the_folder_is_refused_naming_both(tmp_path, digits_shards, changes,
                                                                            overrides, message):
    folder = _save(tmp_path / "released", "pixart", **changes)
    with pytest.raises(ValueError, match=message):
        _fit(["model=pixart_debug", f"init_from={folder}", f"data.path={digits_shards}", *overrides])


def test_a_folder_of_another_family_is_refused_naming_the_class(tmp_path, digits_shards):
    folder = _save(tmp_path / "released", "sana")
    with pytest.raises(ValueError, match=r"describes a SanaTransformer2DModel, but model.family=pixart"):
        _fit(["model=pixart_debug", f"init_from={folder}", f"data.path={digits_shards}"])


# --------------------------------------------------------------------------------------------
# The VAE posterior sampled each step, and the horizontal flip
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def posterior_data(tmp_path_factory, tiny_vae_dir) -> dict[str, Path]:
    """The digits through a tiny KL VAE (RGB, 4x4x4 latents), stored as the posterior's mean and as its distribution."""
    from data_prep.precompute import precompute
    from tests.helpers import digits_config

    root = tmp_path_factory.mktemp("posterior")
    out = {}
    for posterior in ("mean", "distribution"):
        out[posterior] = root / posterior
        precompute(digits_config(out[posterior], vae=str(tiny_vae_dir), image_mode="RGB", posterior=posterior),
                   rank=0, world_size=1)
    return out


def test_a_distribution_dataset_stores_the_posteriors_mean_and_std(posterior_data, tiny_vae_dir):
    """posterior=distribution: the rows' latents are the mean dataset's, bit for bit; latents_std is the std of the
    VAE's posterior for the same pixels (diffusers' own AutoencoderKL); dataset.json says format 4."""
    from diffusers import AutoencoderKL

    from data_prep.precompute import load_pixels
    from data_prep.record import DatasetRecord
    from data_prep.sources.digits import load_digits, to_pixels
    from tests.helpers import read_rows

    mean, dist = read_rows(posterior_data["mean"]), read_rows(posterior_data["distribution"])
    assert [r["key"] for r in mean] == [r["key"] for r in dist] and "latents_std" not in mean[0]
    assert all(np.array_equal(a["latents"], b["latents"]) for a, b in zip(mean, dist))
    record = DatasetRecord.read(posterior_data["distribution"] / "dataset.json")
    assert (record.posterior, record.format_version, "latents_std" in record.columns) == ("distribution", 4, True)
    vae = AutoencoderKL.from_pretrained(tiny_vae_dir).eval()
    images = load_digits("train")[0]
    for row in dist[:6]:  # keys digits-train-NNNN#j
        pixels = load_pixels(to_pixels(images[int(row["key"].split("#")[0].rsplit("-", 1)[1])]), "RGB", 8)
        with torch.no_grad():
            std = vae.encode(pixels[None]).latent_dist.std[0]
        torch.testing.assert_close(torch.from_numpy(row["latents_std"]).float(), std, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("vae", ["pixel", "dc_ae"])
def test_a_codec_without_a_posterior_refuses_to_store_one(tmp_path, vae):
    from data_prep.encoders import load_image_codec
    from tests.helpers import make_tiny_dc_ae

    spec = "pixel" if vae == "pixel" else str(make_tiny_dc_ae(tmp_path / "dc_ae"))
    with pytest.raises(ValueError, match="posterior=distribution: .*(no posterior|deterministic)"):
        load_image_codec(spec, posterior="distribution")


def _draws(latents, std, hflip, micro, r=0, W=1):
    from tests.helpers import rank_at

    return rank_at(0, micro, r, W).latents(latents, std, hflip)


def test_the_posterior_and_flip_draws_follow_the_step_and_the_global_row_not_the_rank_count():
    """8 samples over 300 micro-batches: two ranks (rows r, r + 2, ...) draw what one process draws for the same rows;
    (draw - mean) / std is standard normal, new each micro-batch; a flip mirrors the whole sample, about half the
    time; without std nor flip the latents are returned as they are."""
    g = torch.Generator().manual_seed(0)
    mean, std = torch.randn(8, 4, 4, 4, generator=g), torch.rand(8, 4, 4, 4, generator=g) + 0.5
    for micro in (0, 7):
        one = _draws(mean, std, True, micro)
        two = [_draws(mean[r::2], std[r::2], True, micro, r, 2) for r in range(2)]
        torch.testing.assert_close(torch.stack([two[i % 2][i // 2] for i in range(8)]), one, rtol=0, atol=0)
    eps = torch.stack([(_draws(mean, std, False, m) - mean) / std for m in range(300)])  # (300, 8, 4, 4, 4)
    assert abs(eps.mean().item()) < 0.02 and abs(eps.std().item() - 1) < 0.02  # 38,400 values
    assert not torch.equal(eps[0], eps[1])
    flips = []
    for m in range(300):
        drawn = _draws(mean, None, True, m)
        same = [torch.equal(drawn[i], mean[i]) for i in range(8)]
        mirrored = [torch.equal(drawn[i], mean[i].flip(-1)) for i in range(8)]
        assert all(a != b for a, b in zip(same, mirrored))
        flips += mirrored
    assert 0.45 < sum(flips) / len(flips) < 0.55  # 2,400 coin flips
    torch.testing.assert_close(_draws(mean, None, False, 3), mean, rtol=0, atol=0)


class SeenLatents(pl.Callback):
    """The latents each training step receives, by sample key."""

    def __init__(self) -> None:
        self.seen: list[dict[str, torch.Tensor]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen.append({k: x.float().cpu() for k, x in zip(batch["key"], batch["latents"])})


def test_training_mirrors_the_samples_it_draws(tmp_path, digits_shards, monkeypatch):
    """data.hflip=true on the pixel digits: every sample a step receives is its stored latents or their exact mirror,
    and both happen."""
    from framework.train import train
    from tests.helpers import cheap, compose_cfg, read_rows, with_callback

    seen = SeenLatents()
    with_callback(monkeypatch, seen)
    train(compose_cfg(cheap(tmp_path, digits_shards, "data.hflip=true", steps=3)))
    rows = {r["key"]: torch.from_numpy(r["latents"]).float() for r in read_rows(digits_shards)}
    mirrored = [torch.equal(x, rows[k].flip(-1)) for step in seen.seen for k, x in step.items()]
    same = [torch.equal(x, rows[k]) for step in seen.seen for k, x in step.items()]
    asymmetric = [not torch.equal(rows[k], rows[k].flip(-1)) for step in seen.seen for k in step]
    assert len(same) == 48 and all((a or b) for a, b in zip(same, mirrored))
    assert any(m and s for m, s in zip(mirrored, asymmetric)) and any(s and a for s, a in zip(same, asymmetric))


def test_training_draws_from_the_posterior_and_resumes_exactly(tmp_path, posterior_data, monkeypatch):
    """A posterior=distribution dataset: each step trains on mean + std * eps with eps standard
    normal, and a run crashed after step 3 and resumed ends as the uninterrupted run does."""
    from tests.helpers import crash_and_resume, read_rows, with_callback

    seen = SeenLatents()
    with_callback(monkeypatch, seen)
    crash_and_resume(tmp_path, posterior_data["distribution"], ["model=pixart_debug"], monkeypatch)
    rows = {r["key"]: r for r in read_rows(posterior_data["distribution"])}
    eps = []
    for step in seen.seen[:4]:  # the uninterrupted run's
        for k, x in step.items():
            mean = (torch.from_numpy(rows[k]["latents"]).float() - 0.1) * 0.5  # the tiny VAE's shift and scale
            std = torch.from_numpy(rows[k]["latents_std"]).float() * 0.5
            eps.append((x - mean) / std)
    eps = torch.stack(eps)  # (64, 4, 4, 4)
    assert abs(eps.mean().item()) < 0.05 and abs(eps.std().item() - 1) < 0.05


# --------------------------------------------------------------------------------------------
# SANA's text encoding: Gemma-2 as it is, an instruction before each caption, a token window
# --------------------------------------------------------------------------------------------

INSTRUCTION = "you are an assistant describe the image in detail with colors and shapes:"
WORDS = [*INSTRUCTION.split(), "a", "random", "picture", "number", "with", "stripes", *map(str, range(6))]


@pytest.mark.parametrize("prefix", [None, INSTRUCTION])
def test_gemma2_captions_are_encoded_as_sanas_training_code_selects_them(tmp_path, prefix):
    """A tiny Gemma-2 (its tokenizer pads on the left, as Gemma-2's does) is accepted. With text_prefix, each row
    is what SANA's training code keeps of prefix + caption tokenised to the prefix's length + max_tokens - 2 (padded to
    that length on the right): the first token and the last max_tokens - 1 positions, those the mask marks as real.
    Without, each row is the caption encoded alone. dataset.json records the prefix and the window, so prompts are
    encoded the same way at sampling (the data module's summary for the pipeline)."""
    from transformers import AutoModel, AutoTokenizer

    from data_prep.precompute import precompute
    from framework.data.datamodule import read_dataset_info
    from framework.data.text_storage import decode_text
    from tests.helpers import make_image_folder, make_tiny_gemma2, read_rows

    gemma = make_tiny_gemma2(tmp_path / "gemma", WORDS)
    src = make_image_folder(tmp_path / "imgs", n=6)
    window = 6  # shorter than the longer captions (up to 11 tokens): the window cuts them
    cfg = {"source": {"name": "folder", "path": str(src)}, "vae": "pixel", "text_encoder": str(gemma),
           "resolution": 8, "max_tokens": window, "out": str(tmp_path / "ds"), "progress": False}
    precompute({**cfg, "text_prefix": prefix} if prefix else cfg, rank=0, world_size=1)
    rows = read_rows(tmp_path / "ds")

    tok, model = AutoTokenizer.from_pretrained(gemma), AutoModel.from_pretrained(gemma).eval()
    assert tok.padding_side == "left"
    for row in rows:
        caption = row["caption"]
        with torch.no_grad():
            if prefix is None:
                ids = tok(caption, truncation=True, max_length=window, return_tensors="pt").input_ids
                want = model(input_ids=ids).last_hidden_state[0]
            else:
                tok.padding_side = "right"  # as SANA's code sets it
                n = len(tok(prefix).input_ids)
                t = tok(prefix + caption, max_length=n + window - 2, padding="max_length", truncation=True,
                        return_tensors="pt")
                hidden = model(input_ids=t.input_ids, attention_mask=t.attention_mask).last_hidden_state[0]
                select = [0, *range(-window + 1, 0)]
                want = hidden[select][t.attention_mask[0, select].bool()]
        got = decode_text(row, "fp16").float()
        assert got.shape == want.shape, (caption, got.shape, want.shape)
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    settings = read_dataset_info(str(tmp_path / "ds")).summary()["text_settings"]
    assert settings == ({"max_tokens": window} | ({"prefix": prefix} if prefix else {}))


# --------------------------------------------------------------------------------------------
# Each real-size experiment against the configuration it cites
# --------------------------------------------------------------------------------------------

def recipe_table(path: Path) -> list[tuple[str, str, str, str]]:
    """The key table in an experiment file's header: comment lines `# | key | source | ours | note |` (the header
    row and the separator skipped) as (key, source value, our value, note)."""
    rows = []
    for line in path.read_text().splitlines():
        if not line.startswith("# |"):
            continue
        cells = [c.strip() for c in line[2:].strip().strip("|").split("|")]
        if cells[0] in ("key", "---") or set(cells[0]) <= {"-"}:
            continue
        assert len(cells) == 4, f"{path.name}: a table row needs 4 cells: {line}"
        rows.append(tuple(cells))
    return rows


def _value(cell: str):
    """A table cell as the config holds it: YAML, with 1e-4 read as a number (YAML 1.1 wants 1.0e-4)."""
    import yaml

    def number(value):
        if isinstance(value, list):
            return [number(v) for v in value]
        try:
            return float(value) if isinstance(value, str) else value
        except ValueError:
            return value

    return number(yaml.safe_load(cell))


RECIPES = sorted(p for p in (CONF / "experiment").glob("*.yaml")
                 if "override /data: shards" in p.read_text() or "data.path=DIR" in p.read_text())


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_each_real_size_experiment_equals_the_table_of_the_config_it_cites(path):
    """The composed experiment has, key by key, the value its table says is ours; where ours differs from the source's,
    the note says why; and the table covers the keys a recipe must state."""
    table = recipe_table(path)
    assert table, f"{path.name} has no key table in its header"
    growth_source = ["plugins.growth.ckpt=DIR"] if "ckpt: ???" in path.read_text() else []
    cfg = compose_cfg([f"experiment={path.stem}", "data.path=DIR", *growth_source])
    for key, source, ours, note in table:
        from omegaconf import OmegaConf

        got = OmegaConf.to_container(cfg, resolve=True)
        for part in key.split("."):
            assert isinstance(got, dict) and part in got, f"{path.name}: {key} is not a config key"
            got = got[part]
        assert got == _value(ours), f"{path.name}: {key} is {got!r}, the table says {ours}"
        if _value(source) != _value(ours):
            assert note, f"{path.name}: {key} differs from the source ({source} vs {ours}) without a reason"
    keys = {row[0] for row in table}
    must = {"optimizer.name", "optimizer.lr", "optimizer.weight_decay", "optimizer.warmup_steps",
            "trainer.gradient_clip_val", "data.global_batch_size", "objective.name", "trainer.precision"}
    assert must <= keys, f"{path.name}: the table leaves out {sorted(must - keys)}"


# --------------------------------------------------------------------------------------------
# The fine-tuning recipe end to end (docs/finetune.md), on a debug-size released folder
# --------------------------------------------------------------------------------------------


def _released_pipeline(root: Path) -> Path:
    """A debug-size stand-in for a downloaded PixArt-Sigma pipeline folder: model_index.json, transformer/ (the
    pixart_debug sizes with a learned variance, 32-wide captions), vae/ (a tiny KL VAE), text_encoder/ (a tiny T5
    encoder) and tokenizer/, each where diffusers puts it."""
    from transformers import T5Config, T5EncoderModel

    from framework.models.backbones import FAMILIES, diffusers_kwargs, load_preset
    from tests.helpers import make_tiny_text_encoder, make_tiny_vae

    root.mkdir(parents=True)
    (root / "model_index.json").write_text(json.dumps({"_class_name": "PixArtSigmaPipeline"}))
    make_tiny_vae(root / "vae")
    words = "a random picture number with stripes 0 1 2 3 4 5".split()
    make_tiny_text_encoder(root / "tokenizer", vocab=words)  # its tokenizer files (and a BERT the recipe never reads)
    vocab = sum(1 for _ in open(root / "tokenizer" / "vocab.txt", encoding="utf-8"))
    torch.manual_seed(1)
    T5EncoderModel(T5Config(vocab_size=vocab, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2)).save_pretrained(
        root / "text_encoder")
    torch.manual_seed(2)
    FAMILIES["pixart"](**diffusers_kwargs(load_preset("pixart_debug", in_channels=4, text_dim=32))).save_pretrained(
        root / "transformer")
    return root


def test_the_finetune_recipe_runs_from_a_released_folder_to_a_sampled_export(tmp_path):
    """docs/finetune.md's commands on a debug-size released folder: precompute with the folder's own VAE and text
    encoder, train experiment=pixart_sigma_finetune from its weights (2 warm-up steps at lr 2e-5 x sqrt(2 / 256)
    x 1/1000 and 2/1000 leave them within 1e-6 of where they started), sample the checkpoint, export it as a diffusers
    pipeline."""
    import sys

    from diffusers import PixArtTransformer2DModel

    from data_prep.precompute import precompute
    from framework.inference.checkpoint import model_weights, read_checkpoint
    from framework.train import train
    from tests import zygote
    from tests.helpers import ROOT, make_image_folder

    released = _released_pipeline(tmp_path / "PixArt-Sigma-XL-2-512-MS")
    images = make_image_folder(tmp_path / "images", n=8, size=20)
    precompute({"source": {"name": "folder", "path": str(images)}, "vae": str(released), "text_encoder": str(released),
                "max_tokens": 300, "resolution": 16, "posterior": "distribution", "out": str(tmp_path / "data"),
                "progress": False}, rank=0, world_size=1)
    out = train(compose_cfg([
        "experiment=pixart_sigma_finetune", "model=pixart_debug", f"init_from={released}",
        f"data.path={tmp_path / 'data'}", f"data.local={tmp_path / 'cache'}", f"run.dir={tmp_path / 'run'}",
        "strategy=single", "trainer.accelerator=cpu", "trainer.precision=32-true", "data.num_workers=0",
        "trainer.max_steps=2", "sample.every_n_steps=0", "sample.steps=2", "trainer.enable_progress_bar=false"]))
    trained = model_weights(read_checkpoint(out["checkpoint"]), "train")
    start = PixArtTransformer2DModel.from_pretrained(released / "transformer").state_dict()
    for k, v in start.items():
        torch.testing.assert_close(trained[f"net.{k}"], v, atol=1e-6, rtol=0)
    sampled = zygote.run([sys.executable, "-m", "framework.sample", f"ckpt={out['checkpoint']}",
                          f"out={tmp_path / 'samples'}", "prompts=[a random picture number 3]", "steps=2",
                          f"hydra.run.dir={tmp_path / 'hydra'}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert sampled.returncode == 0, sampled.stderr[-2000:]
    assert (tmp_path / "samples" / "grid.png").is_file()
    exported = zygote.run([sys.executable, "-m", "framework.export", f"ckpt={out['checkpoint']}",
                           f"out={tmp_path / 'export'}", "format=diffusers", f"hydra.run.dir={tmp_path / 'hydra2'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert (tmp_path / "export" / "transformer" / "config.json").is_file()
    # the Sigma experiment's export: stock diffusers' Sigma pipeline (the Alpha one would cut prompts at 120 tokens)
    index = tmp_path / "export" / "model_index.json"
    assert json.loads(index.read_text()).get("_class_name") == "PixArtSigmaPipeline", index.read_text()
    from diffusers import DiffusionPipeline

    assert type(DiffusionPipeline.from_pretrained(tmp_path / "export")).__name__ == "PixArtSigmaPipeline"


def test_the_lora_recipe_runs_from_a_released_folder_to_a_lora_file(tmp_path):
    """docs/finetune.md's LoRA commands on a debug-size released folder: precompute with a held-out split
    (val_fraction), train experiment=pixart_sigma_lora from the folder's weights (its bf16 base under bf16-mixed, the
    validation loss at steps 0 and 2), export format=lora; the LoRA file, put on the folder's transformer by peft,
    computes what the checkpoint does."""
    import csv

    from diffusers import PixArtTransformer2DModel
    from peft import inject_adapter_in_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    from data_prep.precompute import precompute
    from framework.export import ExportCommand, export
    from framework.inference.checkpoint import build_model, read_checkpoint
    from framework.models.adapters import AdapterConfig
    from framework.train import train
    from tests.helpers import make_image_folder

    released = _released_pipeline(tmp_path / "PixArt-Sigma-XL-2-512-MS")
    images = make_image_folder(tmp_path / "images", n=16, size=20)
    data = precompute({"source": {"name": "folder", "path": str(images)}, "vae": str(released),
                       "text_encoder": str(released), "max_tokens": 300, "resolution": 16, "out": str(tmp_path / "data"),
                       "val_fraction": 0.25, "progress": False}, rank=0, world_size=1)
    assert (Path(data) / "val" / "dataset.json").is_file()
    out = train(compose_cfg([
        "experiment=pixart_sigma_lora", "model=pixart_debug", f"init_from={released}", f"data.path={data}",
        f"data.local={tmp_path / 'cache'}", f"run.dir={tmp_path / 'run'}", "strategy=single", "trainer.accelerator=cpu",
        "data.num_workers=0", "data.batch_size=4", "trainer.max_steps=2", "eval.val_every_n_steps=2", "logger=csv",
        "optimizer.lr=1e-2", "sample.every_n_steps=0", "sample.steps=2", "trainer.enable_progress_bar=false"]))
    with open(out["metrics"], newline="") as f:
        assert [int(r["step"]) for r in csv.DictReader(f) if r.get("val/loss")] == [0, 2]
    export(ExportCommand(ckpt=out["checkpoint"], out=str(tmp_path / "lora"), format="lora"))
    state = load_file(str(tmp_path / "lora" / "pytorch_lora_weights.safetensors"))
    net = PixArtTransformer2DModel.from_pretrained(released / "transformer")
    cfg = compose_cfg(["experiment=pixart_sigma_lora", "data.path=DIR"]).adapter
    adapter = AdapterConfig(kind="lora", rank=cfg.rank, alpha=cfg.alpha, targets=list(cfg.targets))
    inject_adapter_in_model(adapter.peft_config("pixart"), net)
    assert not set_peft_model_state_dict(net, {k[len("transformer."):]: v for k, v in state.items()}).unexpected_keys
    merged = build_model(read_checkpoint(out["checkpoint"]), "train").eval()
    g = torch.Generator().manual_seed(0)
    x, text = torch.randn(1, 4, 8, 8, generator=g), torch.randn(1, 5, 32, generator=g)
    with torch.no_grad():
        expected = merged(x, torch.tensor([500.0]), text, torch.ones(1, 5, dtype=torch.bool))
        mine = build_model(read_checkpoint(out["checkpoint"]), "train").eval()
        mine.net = net.eval()
        torch.testing.assert_close(mine(x, torch.tensor([500.0]), text, torch.ones(1, 5, dtype=torch.bool)), expected,
                                   rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------
# A class-conditional DiT on class labels alone: text_encoder=none
# --------------------------------------------------------------------------------------------


def test_a_class_conditional_dit_trains_samples_and_evaluates_without_a_text_encoder(tmp_path):
    """precompute text_encoder=none writes rows of latents and labels with no text columns (the row's key and caption
    kept for display); a dit trains on them, its grid and the digits evaluation draw by label; another family, and a
    source without labels, are refused naming why."""
    from data_prep.precompute import precompute
    from data_prep.record import DatasetRecord
    from framework.train import train
    from tests.helpers import cheap, digits_config, make_image_folder, read_rows

    data = tmp_path / "labels_only"
    precompute(digits_config(data, text_encoder="none"), rank=0, world_size=1)
    record = DatasetRecord.read(data / "dataset.json")
    assert (record.text_dim, record.text_encoder["name"]) == (0, "none")
    assert set(read_rows(data)[0]) == {"latents", "caption", "key", "label"}
    out = train(compose_cfg(cheap(tmp_path, data, "model=dit_debug", "eval.at_end=true", "eval.bootstrap=0",
                                  "sample.per_prompt=1", steps=3)))
    assert 0.0 <= out["eval"]["prompt_accuracy"] <= 1.0 and out["eval"]["num_images"] > 0
    assert out["samples"]
    with pytest.raises(ValueError, match="holds no captions .* model.family=pixart needs caption embeddings"):
        train(compose_cfg(cheap(tmp_path, data, "model=pixart_debug", run="pixart")))
    # ImageNet-style: a manifest of images and labels, no captions (caption_key=null): each row is "class N"
    images = sorted(make_image_folder(tmp_path / "labelled", n=4).rglob("*.png"))
    (tmp_path / "labels.jsonl").write_text("".join(json.dumps({"image": str(p), "label": i % 3}) + "\n"
                                                   for i, p in enumerate(images)))
    precompute({"source": {"name": "manifest", "path": str(tmp_path / "labels.jsonl"), "caption_key": None},
                "text_encoder": "none", "resolution": 8, "out": str(tmp_path / "manifest_ds"), "progress": False},
               rank=0, world_size=1)
    assert sorted(r["caption"] for r in read_rows(tmp_path / "manifest_ds")) == ["class 0", "class 0", "class 1",
                                                                                 "class 2"]
    with pytest.raises(ValueError, match="text_encoder=none encodes no captions, so the rows must carry class labels"):
        precompute({"source": {"name": "folder", "path": str(make_image_folder(tmp_path / "imgs", n=2))},
                    "text_encoder": "none", "resolution": 8, "out": str(tmp_path / "no_labels"), "progress": False},
                   rank=0, world_size=1)


# --------------------------------------------------------------------------------------------
# Memory known before it runs out
# --------------------------------------------------------------------------------------------


def test_the_memory_prediction_adds_up_the_training_state_as_documented():
    """1,000 parameters under AdamW with an EMA: 4 + 4 + 8 + 4 bytes each and AdamW's 4-byte step temporary; fsdp over
    4 ranks divides them; CAME-8bit's state is what it is given (plan_run counts it per shape: test_came.py) and it
    makes no temporary; activations 40 values a token and unit a block (bf16: 2 bytes), one block's and each block's
    input under checkpointing."""
    from framework.training.memory import PROCESS_BYTES, predict

    common = dict(batch=2, tokens=16, width=8, layers=3, precision="32-true")
    plan = predict(1000, 1000, optimizer="adamw", ema=True, shards=1, checkpointing=False, **common).parts
    assert plan == {"process": PROCESS_BYTES, "weights": 4000, "gradients": 4000, "optimizer": 8000, "ema": 4000,
                    "optimizer step": 4000, "activations": 4 * 2 * 16 * 8 * 40 * 3}
    plan = predict(1000, 1000, optimizer="came8bit", ema=False, shards=4, checkpointing=True, state_bytes=1020,
                   **{**common, "precision": "bf16-mixed"}).parts
    assert plan == {"process": PROCESS_BYTES, "weights": 1000, "gradients": 1000, "optimizer": 255,
                    "activations": 2 * 2 * 16 * 8 * (40 + 3)}


def test_a_run_predicted_to_exceed_its_memory_is_refused_before_it_trains(tmp_path, digits_shards):
    from framework.train import train
    from tests.helpers import cheap

    with pytest.raises(MemoryError, match=r"predicted to need [0-9.]+ GiB a rank, more than trainer.memory_limit_gb = "
                       r"0.5 GiB: process 1.0, weights .*Lower it with: strategy=fsdp .*optimizer=came8bit"):
        train(compose_cfg(cheap(tmp_path, digits_shards, "trainer.memory_limit_gb=0.5")))
    assert not (tmp_path / "run" / "checkpoints").exists()
