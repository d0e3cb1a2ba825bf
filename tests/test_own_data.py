"""A user's own images, end to end: precompute with a local VAE and text encoder, then train a model preset
on the latents (its channels, latent size and caption width read from dataset.json) on a machine where the
encoder folders dataset.json recorded are gone, so sample.vae / sample.text_encoder point at copies."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from framework.inference.sampling import SamplingPlan
from framework.train import train
from tests.helpers import compose_cfg, make_image_folder


def _run(own: dict[str, Path], name: str, *extra: str, every: int = 3) -> list[str]:
    return ["model=pixart_debug", f"data.path={own['data']}", "data.batch_size=4", f"run.dir={own['tmp'] / name}",
            "trainer.max_steps=3", f"trainer.checkpoint_every_n_steps={every}", "trainer.enable_progress_bar=false",
            "logger=none", "eval.at_end=false", "sample.per_prompt=1", "sample.steps=2",
            "sample.prompts=[a random picture number 1]", *extra]


@pytest.fixture(scope="module")
def trained(own_data) -> dict:
    return train(compose_cfg(_run(own_data, "ok", f"sample.vae={own_data['vae']}",
                                  f"sample.text_encoder={own_data['text']}")))


def test_a_preset_trains_on_own_latents_and_grids_decode_with_local_encoders(trained):
    out = trained
    ckpt = torch.load(out["checkpoint"], map_location="cpu", weights_only=True)
    model = ckpt["latentforge"]["config"]["model"]
    # The preset's 4096-wide T5 captions and 8x8 size became the dataset's 32-wide captions and 8x8 latents
    # (16 px through the 2x VAE), 4 channels.
    assert (model["in_channels"], model["sample_size"], model["text_dim"]) == (4, 8, 32)
    assert ckpt["global_step"] == 3
    grid = Image.open(out["samples"][-1])
    assert grid.mode == "RGB" and "grid failed" not in out


def test_encoders_missing_on_this_machine_fail_before_training(own_data):
    with pytest.raises(FileNotFoundError, match=r"sample\.vae=PATH") as err:
        train(compose_cfg(_run(own_data, "missing")))
    assert "dataset.json" in str(err.value)
    assert not (own_data["tmp"] / "missing" / "checkpoints").exists()  # refused before any step


def test_a_failing_final_grid_keeps_the_final_checkpoint(own_data, tmp_path, monkeypatch):
    from framework.training.callbacks import SampleGrid

    seen = []  # the checkpoint on disk when the final grid starts: it must already hold the last step
    draw = SampleGrid.draw

    def spy(self, trainer, pl_module):
        last = Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"
        seen.append(torch.load(last, map_location="cpu", weights_only=True)["global_step"] if last.exists() else None)
        return draw(self, trainer, pl_module)

    monkeypatch.setattr(SampleGrid, "draw", spy)
    broken = tmp_path / "not_a_text_encoder"
    broken.mkdir()  # a folder, so the start-up check passes; loading it at the final grid fails
    # No periodic checkpoint at step 3: only the final one can be there when the final grid starts.
    out = train(compose_cfg(_run(own_data, "grid_fails", f"sample.vae={own_data['vae']}",
                                 f"sample.text_encoder={broken}", every=100)))
    assert seen == [3] and "grid failed" in out
    ckpt = torch.load(out["checkpoint"], map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 3


def test_a_dataset_smaller_than_one_batch_is_refused(own_data):
    with pytest.raises(ValueError, match=r"fewer than one global batch.*lower data\.batch_size"):
        train(compose_cfg(_run(own_data, "big_batch", "data.batch_size=64", f"sample.vae={own_data['vae']}",
                               f"sample.text_encoder={own_data['text']}")))


def test_sample_command_takes_the_encoders_of_this_machine(own_data, trained, tmp_path):
    from framework.sample import SampleCommand, run

    common = dict(ckpt=trained["checkpoint"], prompts=["a random picture number 2"], steps=2, device="cpu")
    with pytest.raises(FileNotFoundError, match=r"set vae=PATH"):
        run(SampleCommand(out=str(tmp_path / "refused"), **common))
    paths = run(SampleCommand(out=str(tmp_path / "ok"), vae=str(own_data["vae"]), text_encoder=str(own_data["text"]),
                              **common))
    image = Image.open(paths[0])
    assert image.mode == "RGB" and image.size == (256, 256)  # 16 px decoded (8x8 latents, 2x VAE), shown at 256


def test_grids_of_the_prompts_encoded_with_the_data_load_no_text_encoder(own_data, monkeypatch):
    """sample.prompts=null: the grid shows the first captions, which precompute encoded (prompts.safetensors),
    equal to what the text encoder gives them; training never loads the (moved) text encoder."""
    import json

    from safetensors.torch import load_file

    from data_prep import encoders

    spec = json.loads((own_data["data"] / "dataset.json").read_text())["prompts"]
    assert len(spec["texts"]) == 8 and spec["texts"][0].startswith("a random picture number")
    reference = encoders.load_text_encoder(str(own_data["text"])).encode(spec["texts"])
    stored = load_file(str(own_data["data"] / spec["file"]))
    for i, emb in enumerate(reference):
        torch.testing.assert_close(stored[str(i)].float(), emb.to(torch.float16).float(), rtol=0, atol=0)

    def refuse(*args, **kwargs):
        raise AssertionError("the text encoder was loaded")

    monkeypatch.setattr(encoders, "load_text_encoder", refuse)
    out = train(compose_cfg([a for a in _run(own_data, "dataset_prompts", f"sample.vae={own_data['vae']}")
                             if not a.startswith("sample.prompts=")]))
    assert "grid failed" not in out
    grid = Image.open(out["samples"][-1])
    assert grid.width >= 8 * 96  # eight columns of 96 px cells


def test_diffusers_export_is_a_pipeline_that_samples_like_framework_sample(own_data, trained, tmp_path):
    """format=diffusers writes a whole pipeline (backbone, the objective's scheduler, VAE, text encoder) that stock
    diffusers loads; from the same initial noise it draws the image framework.sample draws."""
    from diffusers import DiffusionPipeline

    from framework.export import ExportCommand, export
    from framework.inference.pipeline import Pipeline
    from framework.inference.sampling import noise_seeds

    encoders = dict(vae=str(own_data["vae"]), text_encoder=str(own_data["text"]))
    folder = export(ExportCommand(ckpt=trained["checkpoint"], out=str(tmp_path / "pipe"), format="diffusers", **encoders))
    pipe = DiffusionPipeline.from_pretrained(folder)
    assert type(pipe).__name__ == "PixArtAlphaPipeline" and type(pipe.scheduler).__name__ == "DPMSolverMultistepScheduler"
    assert pipe.scheduler.config.prediction_type == "flow_prediction"  # the quickstart objective: rectified flow

    prompt, seed, steps, guidance = "a random picture number 2", 7, 4, 3.0
    ours = Pipeline.from_checkpoint(trained["checkpoint"], **encoders)
    expected = ours.generate([prompt], SamplingPlan(steps, guidance, "dpm++", seed))  # (1, 3, 16, 16) in [-1, 1]
    (s,) = noise_seeds(seed, 1)
    latents = torch.randn(4, 8, 8, generator=torch.Generator().manual_seed(s))[None]  # framework.sample's noise
    got = pipe(prompt, num_inference_steps=steps, guidance_scale=guidance, latents=latents, height=16, width=16,
               use_resolution_binning=False, output_type="pt").images  # (1, 3, 16, 16) in [0, 1]
    torch.testing.assert_close(got * 2 - 1, expected, rtol=0, atol=2e-4)


def test_diffusers_export_of_a_class_conditional_dit_samples_like_framework_sample(own_data, tmp_path, capsys):
    """dit on labelled latents (a manifest with 3 classes): the exported DiTPipeline draws framework.sample's image for a
    class from the same noise. Stock DiTPipeline guides with ImageNet's null class 1000, which this model lacks: the
    export says so, and the comparison runs unguided (guidance 1)."""
    import pandas as pd
    from diffusers import DiffusionPipeline

    from data_prep.precompute import precompute
    from framework.export import ExportCommand, export
    from framework.inference.pipeline import Pipeline
    from framework.inference.sampling import noise_seeds

    src = make_image_folder(tmp_path / "images", n=12, size=20, seed=3)
    rows = [{"image": str(p), "caption": p.with_suffix(".txt").read_text(), "label": i % 3}
            for i, p in enumerate(sorted(src.rglob("*.png")))]
    pd.DataFrame(rows).to_json(tmp_path / "m.jsonl", orient="records", lines=True)
    data = precompute({"source": {"name": "manifest", "path": str(tmp_path / "m.jsonl")}, "vae": str(own_data["vae"]),
                       "text_encoder": str(own_data["text"]), "resolution": 16, "out": str(tmp_path / "latents"),
                       "progress": False})
    out = train(compose_cfg(["model=dit_debug", "objective=eps", f"data.path={data}", "data.batch_size=4",
                             f"run.dir={tmp_path / 'run'}", "trainer.max_steps=2", "trainer.enable_progress_bar=false",
                             "logger=none", "eval.at_end=false", "sample.every_n_steps=0", "sample.per_prompt=1",
                             "sample.steps=2"]))
    folder = export(ExportCommand(ckpt=out["checkpoint"], out=str(tmp_path / "pipe"), format="diffusers"))
    assert "guides with class 1000 as the null class" in capsys.readouterr().out
    pipe = DiffusionPipeline.from_pretrained(folder)
    assert type(pipe).__name__ == "DiTPipeline" and pipe.scheduler.config.prediction_type == "epsilon"
    seed, steps, label = 7, 4, 2
    expected = Pipeline.from_checkpoint(out["checkpoint"]).generate(["class 2"], SamplingPlan(steps, 1.0, "dpm++", seed), [label])
    (s,) = noise_seeds(seed, 1)  # framework.sample's noise for this image: DiTPipeline draws it from this generator
    got = pipe(class_labels=[label], num_inference_steps=steps, guidance_scale=1.0,
               generator=torch.Generator().manual_seed(s), output_type="pt").images  # (1, 16, 16, 3) in [0, 1]
    got = torch.as_tensor(got).permute(0, 3, 1, 2)
    torch.testing.assert_close(got * 2 - 1, expected, rtol=0, atol=2e-4)


def test_diffusers_export_of_sana_needs_a_dc_ae(own_data, tmp_path):
    """diffusers' SanaPipeline is built around a DC-AE: latents from an AutoencoderKL are refused with the way out,
    before anything is written (not an AttributeError from inside diffusers)."""
    from framework.export import ExportCommand, export

    out = train(compose_cfg(_run(own_data, "sana", "model=sana_debug", "trainer.max_steps=1",
                                 "trainer.checkpoint_every_n_steps=1", "sample.every_n_steps=0",
                                 f"sample.vae={own_data['vae']}", f"sample.text_encoder={own_data['text']}")))
    with pytest.raises(ValueError, match="SanaPipeline takes an AutoencoderDC.*AutoencoderKL.*format=safetensors"):
        export(ExportCommand(ckpt=out["checkpoint"], out=str(tmp_path / "pipe"), format="diffusers",
                             vae=str(own_data["vae"]), text_encoder=str(own_data["text"])))
    assert not (tmp_path / "pipe").exists()


def test_diffusers_export_of_sana_with_a_dc_ae_samples_like_framework_sample(own_data, tmp_path, capsys):
    """sana on the latents of a DC-AE (32 px images, 16x16 latents): the exported SanaPipeline, asked to encode the
    prompt as it is (without the Gemma instruction prefix stock SANA adds), draws framework.sample's image from the
    same noise, guided by the empty caption. A LoRA trained on that run, exported `format=lora`, goes onto the stock
    pipeline through SanaPipeline.load_lora_weights(), which then draws framework.sample's image of the LoRA run (and
    without it, another one)."""
    from diffusers import DiffusionPipeline

    from data_prep.precompute import precompute
    from framework.export import ExportCommand, export
    from framework.inference.pipeline import Pipeline
    from framework.inference.sampling import noise_seeds
    from tests.helpers import make_tiny_dc_ae

    dcae = make_tiny_dc_ae(tmp_path / "dcae")
    data = precompute({"source": {"name": "folder", "path": str(make_image_folder(tmp_path / "images", n=12, size=40))},
                       "vae": str(dcae), "text_encoder": str(own_data["text"]), "resolution": 32,
                       "out": str(tmp_path / "latents"), "progress": False})
    encoders = dict(vae=str(dcae), text_encoder=str(own_data["text"]))
    out = train(compose_cfg(["model=sana_debug", f"data.path={data}", "data.batch_size=4", f"run.dir={tmp_path / 'run'}",
                             "trainer.max_steps=2", "trainer.enable_progress_bar=false", "logger=none", "eval.at_end=false",
                             "sample.every_n_steps=0", "sample.per_prompt=1", "sample.steps=2",
                             f"sample.vae={dcae}", f"sample.text_encoder={own_data['text']}"]))
    folder = export(ExportCommand(ckpt=out["checkpoint"], out=str(tmp_path / "pipe"), format="diffusers", **encoders))
    assert "complex_human_instruction=None" in capsys.readouterr().out  # how to prompt the stock pipeline
    pipe = DiffusionPipeline.from_pretrained(folder)
    assert type(pipe).__name__ == "SanaPipeline" and type(pipe.vae).__name__ == "AutoencoderDC"
    assert pipe.scheduler.config.prediction_type == "flow_prediction"

    prompt, seed, steps, guidance = "a random picture number 2", 7, 4, 3.0
    ours = Pipeline.from_checkpoint(out["checkpoint"], **encoders)
    expected = ours.generate([prompt], SamplingPlan(steps, guidance, "dpm++", seed))
    (s,) = noise_seeds(seed, 1)
    latents = torch.randn(4, 16, 16, generator=torch.Generator().manual_seed(s))[None]  # framework.sample's noise
    got = pipe(prompt, num_inference_steps=steps, guidance_scale=guidance, latents=latents.clone(), height=32, width=32,
               use_resolution_binning=False, complex_human_instruction=None, max_sequence_length=64,  # the tiny BERT: 128
               output_type="pt").images
    assert got.shape == expected.shape == (1, 3, 32, 32)
    torch.testing.assert_close(got * 2 - 1, expected, rtol=0, atol=2e-4)

    tuned = train(compose_cfg(["model=sana_debug", f"data.path={data}", "data.batch_size=4", f"run.dir={tmp_path / 'lora'}",
                               "trainer.max_steps=2", "trainer.enable_progress_bar=false", "logger=none", "eval.at_end=false",
                               "sample.every_n_steps=0", "sample.per_prompt=1", "sample.steps=2", f"sample.vae={dcae}",
                               f"sample.text_encoder={own_data['text']}", f"init_from={out['checkpoint']}", "adapter=lora",
                               "adapter.rank=4", "optimizer.lr=1e-2", "optimizer.warmup_steps=0"]))["checkpoint"]
    lora = export(ExportCommand(ckpt=tuned, out=str(tmp_path / "sana_lora"), format="lora"))
    assert "stock SanaPipeline of the base with pipe.load_lora_weights" in capsys.readouterr().out
    expected = Pipeline.from_checkpoint(tuned, **encoders).generate([prompt], SamplingPlan(steps, guidance, "dpm++", seed))
    pipe.load_lora_weights(str(lora.parent), weight_name=lora.name)  # (weight_name: needed offline, HF_HUB_OFFLINE)
    with_lora = pipe(prompt, num_inference_steps=steps, guidance_scale=guidance, latents=latents.clone(), height=32, width=32,
                     use_resolution_binning=False, complex_human_instruction=None, max_sequence_length=64,
                     output_type="pt").images
    torch.testing.assert_close(with_lora * 2 - 1, expected, rtol=0, atol=2e-4)
    assert (got - with_lora).abs().max() > 1e-2  # the LoRA changed the image: the comparison above could fail


def test_diffusers_export_of_an_sd2_unet_samples_like_framework_sample_unguided(own_data, tmp_path, capsys):
    """unet (SD2's v objective): the exported StableDiffusionPipeline, given the caption's own token embeddings, draws
    framework.sample's image from the same noise. Unguided: with guidance, stock SD pads the caption and the empty one
    to one length and attends to the padding (it passes no mask); the export says so."""
    from diffusers import DiffusionPipeline

    from framework.export import ExportCommand, export
    from framework.inference.pipeline import Pipeline
    from framework.inference.sampling import noise_seeds

    encoders = dict(vae=str(own_data["vae"]), text_encoder=str(own_data["text"]))
    out = train(compose_cfg(_run(own_data, "sd2", "model=sd2_unet_debug", "objective=v", "trainer.max_steps=2",
                                 "trainer.checkpoint_every_n_steps=2", "sample.every_n_steps=0",
                                 f"sample.vae={own_data['vae']}", f"sample.text_encoder={own_data['text']}")))
    folder = export(ExportCommand(ckpt=out["checkpoint"], out=str(tmp_path / "pipe"), format="diffusers", **encoders))
    assert "attends to the padding" in capsys.readouterr().out
    pipe = DiffusionPipeline.from_pretrained(folder)
    assert type(pipe).__name__ == "StableDiffusionPipeline" and hasattr(pipe, "unet")
    assert pipe.scheduler.config.prediction_type == "v_prediction"

    prompt, seed, steps = "a random picture number 2", 7, 4
    ours = Pipeline.from_checkpoint(out["checkpoint"], **encoders)
    expected = ours.generate([prompt], SamplingPlan(steps, 1.0, "dpm++", seed))  # (1, 3, 16, 16) in [-1, 1]
    (embeds,) = ours.encode([prompt])  # (L, D): the caption's own tokens, as training saw them
    (s,) = noise_seeds(seed, 1)
    latents = torch.randn(4, 8, 8, generator=torch.Generator().manual_seed(s))[None]
    got = pipe(prompt_embeds=embeds[None], num_inference_steps=steps, guidance_scale=1.0, latents=latents, height=16,
               width=16, output_type="pt").images
    torch.testing.assert_close(got * 2 - 1, expected, rtol=0, atol=2e-4)


def test_a_lora_file_loads_into_the_stock_sd2_pipeline_and_samples_like_framework_sample(own_data, tmp_path, capsys):
    """adapter=lora on an SD2 UNet: `framework.export format=lora` writes the file that stock
    StableDiffusionPipeline.load_lora_weights() puts on the exported base pipeline; from the same noise the pipeline
    then draws framework.sample's image of the LoRA run (and without the LoRA, another one)."""
    from diffusers import DiffusionPipeline

    from framework.export import ExportCommand, export
    from framework.inference.pipeline import Pipeline
    from framework.inference.sampling import noise_seeds

    encoders = dict(vae=str(own_data["vae"]), text_encoder=str(own_data["text"]))
    sd2 = ["model=sd2_unet_debug", "objective=v", "sample.every_n_steps=0", f"sample.vae={own_data['vae']}",
           f"sample.text_encoder={own_data['text']}"]
    base = train(compose_cfg(_run(own_data, "sd2_base", *sd2, "trainer.max_steps=2", "trainer.checkpoint_every_n_steps=2")))
    tuned = train(compose_cfg(_run(own_data, "sd2_lora", *sd2, "adapter=lora", "adapter.rank=4", "adapter.alpha=8",
                                   f"init_from={base['checkpoint']}", "optimizer.lr=1e-2", "optimizer.warmup_steps=0")))
    folder = export(ExportCommand(ckpt=base["checkpoint"], out=str(tmp_path / "pipe"), format="diffusers", **encoders))
    lora = export(ExportCommand(ckpt=tuned["checkpoint"], out=str(tmp_path / "lora"), format="lora"))
    assert lora.name == "pytorch_lora_weights.safetensors"
    assert "pipe.load_lora_weights" in capsys.readouterr().out

    prompt, seed, steps = "a random picture number 2", 7, 4
    ours = Pipeline.from_checkpoint(tuned["checkpoint"], **encoders)
    expected = ours.generate([prompt], SamplingPlan(steps, 1.0, "dpm++", seed))  # (1, 3, 16, 16) in [-1, 1]
    (embeds,) = ours.encode([prompt])
    (s,) = noise_seeds(seed, 1)
    latents = torch.randn(4, 8, 8, generator=torch.Generator().manual_seed(s))[None]
    pipe = DiffusionPipeline.from_pretrained(folder)

    def draw() -> torch.Tensor:
        return pipe(prompt_embeds=embeds[None], num_inference_steps=steps, guidance_scale=1.0, latents=latents.clone(),
                    height=16, width=16, output_type="pt").images * 2 - 1

    without = draw()
    pipe.load_lora_weights(str(lora.parent), weight_name=lora.name)  # (weight_name: needed offline, HF_HUB_OFFLINE)
    torch.testing.assert_close(draw(), expected, rtol=0, atol=2e-4)
    assert (without - expected).abs().max() > 1e-2  # the LoRA changed the image: the comparison above could fail


# --------------------------------------------------------------------------------------------
# Evaluation on one's own data: fid and clip_score against held-out real images
# --------------------------------------------------------------------------------------------


def test_fid_is_the_frechet_formula_and_its_interval_holds_it():
    from framework.evaluation.realdata import fid_from_features, fid_with_interval
    from tests.helpers import reference_frechet

    g = torch.Generator().manual_seed(0)
    real, fake = torch.randn(300, 6, generator=g).double(), (torch.randn(200, 6, generator=g) * 1.3 + 0.4).double()
    assert fid_from_features(real, fake) == pytest.approx(reference_frechet(real.numpy(), fake.numpy()), rel=1e-6)
    assert fid_from_features(real, real) == pytest.approx(0.0, abs=1e-6)
    fid, (lo, hi) = fid_with_interval(real, fake, resamples=50)
    assert lo < fid < hi and hi - lo < fid


def test_eval_command_scores_own_data_against_held_out_images(own_data, trained, metric_nets, tmp_path):
    """framework.eval real=DIR inception=FILE clip=DIR: fid equals the formula on the features of the images the
    pipeline draws for the held-out captions; clip_score is torchmetrics' CLIPScore of those images."""
    import json
    import sys

    from framework.evaluation.realdata import clip_scores, features, fid_from_features, real_images, ScriptedFeatures
    from framework.inference.pipeline import Pipeline
    from tests import zygote

    encoders = [f"vae={own_data['vae']}", f"text_encoder={own_data['text']}"]
    nets = [f"real={metric_nets['real']}", f"inception={metric_nets['inception']}", f"clip={metric_nets['clip']}"]
    cmd = [sys.executable, "-m", "framework.eval", f"ckpt={trained['checkpoint']}", f"out={tmp_path / 'eval'}",
           "seeds=2", "steps=2", "bootstrap=30", "device=cpu", *encoders, *nets]
    proc = zygote.run(cmd, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (metrics["num_images"], metrics["num_real"], metrics["num_prompts"]) == (20, 10, 10)
    for key in ("fid", "clip_score"):
        lo, hi = metrics[f"{key}_interval"]
        assert lo <= metrics[key] <= hi, (key, metrics)

    pipe = Pipeline.from_checkpoint(trained["checkpoint"], vae=str(own_data["vae"]), text_encoder=str(own_data["text"]))
    real, captions = real_images(metric_nets["real"], 16, 16)
    drawn = [c for c in captions for _ in range(2)]
    images = pipe.generate(drawn, SamplingPlan(2, 4.0, None, seed=0))
    net = ScriptedFeatures(metric_nets["inception"])
    assert metrics["fid"] == pytest.approx(fid_from_features(features(net, real), features(net, images)), rel=1e-6)
    assert metrics["clip_score"] == pytest.approx(float(clip_scores(images, drawn, metric_nets["clip"]).mean()), rel=1e-5)
    assert (tmp_path / "eval" / "samples.png").is_file()


def test_training_ends_with_the_own_data_evaluation(own_data, metric_nets, tmp_path):
    """The final evaluation against held-out images, drawing the prompts of eval.prompts (a file, one per line, blank
    lines skipped) instead of the images' captions; a missing feature network is refused before training."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square\n\nthree blue dots\n a green stripe \n")
    out = train(compose_cfg([a for a in _run(own_data, "own_eval", f"sample.vae={own_data['vae']}",
                                             f"sample.text_encoder={own_data['text']}")
                             if a != "eval.at_end=false"]
                            + ["eval.at_end=true", "eval.seeds=2", "eval.steps=2", "eval.bootstrap=10",
                               f"eval.real={metric_nets['real']}", f"eval.inception={metric_nets['inception']}",
                               f"eval.prompts={prompts}"]))
    assert out["eval"]["num_real"] == 10 and out["eval"]["fid"] >= 0 and "clip_score" not in out["eval"]
    assert (out["eval"]["num_prompts"], out["eval"]["num_images"]) == (3, 6)
    with pytest.raises(FileNotFoundError, match=r"eval\.inception="):  # checked before training, not at its end
        train(compose_cfg(_run(own_data, "own_eval_missing", f"sample.vae={own_data['vae']}",
                               f"sample.text_encoder={own_data['text']}", "eval.every_n_steps=2",
                               f"eval.real={metric_nets['real']}", "eval.inception=/nonexistent/features.pt")))
