"""Video: the Latte and Wan families on clips (B, C, F, h, w), the moving digits and their scoring, training on clips,
and sampling MP4s, GIFs and frame grids through the commands.

References: a clip's own frames (a model's output for one sample whatever the batch and the caption padding), the
source's known motion (real clips score direction accuracy 1, reversed ones 0), and the generated clips themselves
(the files written hold exactly their frames).
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch

from framework.models.backbones import build_denoiser, load_preset
from tests.helpers import (
    TOL, CompiledBlocks, TinyI3D, cheap, compose_cfg, losses, make_tiny_vae, make_tiny_video_vae, read_rows, run_train,
    same_updates, weights, write_video,
)

VIDEO_PRESETS = ["latte_debug", "wan_debug"]
STRIP_WIDTH = round(96 * (8 * 17 - 1) / 16)  # a grid cell 96 high: 8 frames of 16 side by side, a column between two


def _clip_inputs(cfg, batch: int = 2, tokens: int = 7) -> tuple:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, cfg.in_channels, *cfg.latent_shape, generator=g)  # (B, C, F, h, w)
    text = torch.randn(batch, tokens, cfg.text_dim, generator=g)
    mask = torch.ones(batch, tokens, dtype=torch.bool)
    mask[batch - 1, tokens - 2 :] = False
    return x, torch.tensor([10.0, 600.0][:batch]), text, mask


# --------------------------------------------------------------------------------------------------
# The families
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", VIDEO_PRESETS)
def test_a_clip_is_denoised_alone_whatever_its_batch_and_padding(name):
    torch.manual_seed(0)
    net = build_denoiser(load_preset(name)).eval()
    x, t, text, mask = _clip_inputs(net.cfg)
    with torch.no_grad():
        out = net(x, t, text, mask)
        assert out.shape == x.shape and out[0].sub(out[1]).abs().max() > 1e-3
        # sample 1 alone, its caption without its padding: the same output
        alone = net(x[1:], t[1:], text[1:, :5], mask[1:, :5])
        torch.testing.assert_close(alone, out[1:], atol=2e-5, rtol=1e-5)
        # the padded tokens' values are never read
        noisy = text.clone()
        noisy[1, 5:] = 100.0
        torch.testing.assert_close(net(x, t, noisy, mask), out, atol=2e-5, rtol=1e-5)
        # frames are not independent samples: changing frame 0 changes the prediction of the last one
        moved = x.clone()
        moved[:, :, 0] += 1.0
        assert net(moved, t, text, mask)[:, :, -1].sub(out[:, :, -1]).abs().max() > 1e-4


def test_wan_pads_every_caption_to_text_len_and_refuses_a_longer_one():
    net = build_denoiser(load_preset("wan_debug", text_len=6)).eval()
    x, t, text, mask = _clip_inputs(net.cfg)
    padded = net.padded_text(text[:, :6], mask[:, :6])
    assert padded.shape == (2, 6, net.cfg.text_dim) and not padded[1, 5:].any()
    with pytest.raises(ValueError, match="a caption of 7 tokens is longer than model.text_len=6"):
        net(x, t, text, mask)
    # the padding is part of Wan's model: a caption padded to 16 tokens is another input than one padded to 6
    longer = build_denoiser(load_preset("wan_debug", text_len=16)).eval()
    longer.load_state_dict(net.state_dict())
    with torch.no_grad():
        assert net(x, t, text[:, :5], mask[:, :5]).sub(longer(x, t, text[:, :5], mask[:, :5])).abs().max() > 1e-5


def test_latte_denoises_a_shorter_clip_as_a_latte_built_for_its_frames_and_refuses_a_longer_one():
    """A frame-count bucket's clip has fewer frames than model.num_frames (the longest): it takes the first rows of the
    temporal positions, which is what a Latte built for that many frames has."""
    net = build_denoiser(load_preset("latte_debug", num_frames=4)).eval()
    short = build_denoiser(load_preset("latte_debug", num_frames=3)).eval()
    short.load_state_dict(net.state_dict())
    x, t, text, mask = _clip_inputs(net.cfg)
    with torch.no_grad():
        torch.testing.assert_close(net(x[:, :, :3], t, text, mask), short(x[:, :, :3], t, text, mask))
        assert net.net.temp_pos_embed.shape[1] == 4  # put back
        with pytest.raises(ValueError, match="a clip of 5 latent frames: this Latte's temporal positions go up to "
                                             "model.num_frames=4"):
            net(torch.cat([x, x[:, :, :1]], 2), t, text, mask)


@pytest.mark.parametrize("preset,override,message", [
    ("latte_debug", {"num_frames": 0}, "model.num_frames=0 must be positive"),
    ("pixart_debug", {"num_frames": 8}, "model.num_frames=8: model.family=pixart denoises images"),
    ("wan_debug", {"text_len": None}, "model.text_len=None: it is set for model.family=wan only"),
    ("latte_debug", {"text_len": 16}, "model.text_len=16: it is set for model.family=wan only"),
    ("latte_debug", {"kwargs": {"video_length": 8}}, "model.kwargs.video_length is set from ModelConfig's own fields"),
])
def test_video_keys_are_checked_naming_the_key(preset, override, message):
    with pytest.raises(ValueError, match=message):
        load_preset(preset, **override)


# The released models' configurations: Wan-Video/Wan2.1 wan/configs/wan_t2v_1_3B.py and wan_t2v_14B.py (dim, ffn_dim,
# heads, layers; text_len 512, 16 latent channels, patch (1, 2, 2)); the Latte-1 transformer's config.json (28 layers,
# 16 heads x 72, patch 2, 4 channels with learned sigma, 4096-wide T5 captions, 64x64 latents, 16 frames).
RELEASED = {
    "wan21_t2v_1_3b": {"inner_dim": 1536, "ffn_dim": 8960, "num_attention_heads": 12, "num_layers": 30,
                       "patch_size": (1, 2, 2), "in_channels": 16, "out_channels": 16, "text_dim": 4096},
    "wan21_t2v_14b": {"inner_dim": 5120, "ffn_dim": 13824, "num_attention_heads": 40, "num_layers": 40,
                      "patch_size": (1, 2, 2), "in_channels": 16, "out_channels": 16, "text_dim": 4096},
    "latte_1_512": {"inner_dim": 1152, "num_attention_heads": 16, "attention_head_dim": 72, "num_layers": 28,
                    "patch_size": 2, "in_channels": 4, "out_channels": 8, "caption_channels": 4096, "sample_size": 64,
                    "video_length": 16, "norm_type": "ada_norm_single", "activation_fn": "gelu-approximate"},
}


@pytest.mark.parametrize("name", list(RELEASED))
def test_the_real_presets_build_the_released_configurations(name):
    with torch.device("meta"):
        net = build_denoiser(load_preset(name)).net
    config = {k: tuple(v) if isinstance(v, list) else v for k, v in net.config.items()}
    config["inner_dim"] = net.config.num_attention_heads * net.config.attention_head_dim
    assert {k: config[k] for k in RELEASED[name]} == RELEASED[name]
    if name.startswith("wan"):
        assert load_preset(name).text_len == 512 and len(net.blocks) == RELEASED[name]["num_layers"]
    else:
        assert len(net.temporal_transformer_blocks) == len(net.transformer_blocks) == 28


# --------------------------------------------------------------------------------------------------
# Moving digits and their scoring
# --------------------------------------------------------------------------------------------------

def _source(split: str = "heldout"):
    from data_prep.sources.moving_digits import MovingDigitsSource

    return MovingDigitsSource(type("Settings", (), {"split": split, "rows_per_image": 2})())


def _as_clips(arrays: list[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.stack(arrays)).float().div(127.5).sub(1).unsqueeze(2)  # (N, F, 1, H, W)


def test_a_moving_digit_travels_one_pixel_a_frame_towards_its_direction_and_stays_whole():
    from data_prep.sources.digits import to_pixels
    from data_prep.sources.moving_digits import DIRECTIONS, FRAMES

    source = _source()
    step = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}
    for i in range(8):
        r = source.record(i)
        direction = DIRECTIONS[i % 4]
        assert r.meta["direction"] == direction and all(direction in c for c in r.captions)  # "upwards" too
        digit = to_pixels(source.images[i // 4])
        assert r.image.shape == (FRAMES, 16, 16) and r.label == int(source.labels[i // 4])
        (r0, c0), = {(a, b) for a in range(9) for b in range(9) if np.array_equal(r.image[0, a : a + 8, b : b + 8], digit)}
        for f in range(FRAMES):
            rr, cc = r0 + step[direction][0] * f, c0 + step[direction][1] * f
            assert np.array_equal(r.image[f, rr : rr + 8, cc : cc + 8], digit)
            assert r.image[f].sum() == digit.sum()  # nothing cut off at the canvas' edge


def test_real_clips_score_their_digit_and_direction_and_reversed_ones_the_opposite():
    from framework.evaluation.motion import score_clips

    source = _source()
    recs = [source.record(i) for i in range(200)]
    clips = _as_clips([r.image for r in recs])
    targets = [(r.label, r.meta["direction"]) for r in recs]
    real = score_clips(targets, np.zeros(len(recs), bool), clips)
    assert real["direction_accuracy"] == 1.0 and real["still_fraction"] == 0.0
    assert real["digit_accuracy"] >= 0.9 and real["identity_consistency"] >= 0.95  # the scorer reads real digits
    reversed_ = score_clips(targets, np.zeros(len(recs), bool), clips.flip(1))
    assert reversed_["direction_accuracy"] == 0.0 and reversed_["digit_accuracy"] == real["digit_accuracy"]
    still = score_clips(targets, np.zeros(len(recs), bool), clips[:, :1].expand_as(clips))
    assert still["still_fraction"] == 1.0 and still["direction_accuracy"] == 0.0


def test_the_motion_prompt_set_holds_out_phrasings_and_the_real_reference_scores_near_zero_fd():
    from framework.evaluation.metrics import digit_scorer, frechet_distance
    from framework.evaluation.motion import digit_crops
    from framework.evaluation.prompts import dataset_kind, prompt_set
    from framework.evaluation.scoring import real_reference

    assert dataset_kind({"source": {"name": "moving_digits"}, "num_classes": 10}) == "motion"
    ps = prompt_set("motion", seeds=2, phrasings=1)
    assert len(ps.prompts) == 10 * 4 * (1 + 2) * 2 and ps.heldout.sum() == 10 * 4 * 2 * 2
    assert ps.prompts[0] == ps.prompts[1] == "a 0 drifting to the left" and ps.targets[0] == (0, "left")
    assert ps.labels[:2] == [0, 0]
    train_clips = _as_clips([_source("train").record(i).image for i in range(300)]).flatten(0, 1)
    reference = real_reference("motion")
    assert reference.shape[1:] == (1, 8, 8)
    fd_real = frechet_distance(reference, digit_crops(train_clips), digit_scorer().featurizer(1))
    fd_noise = frechet_distance(reference, digit_crops(torch.rand_like(train_clips) * 2 - 1), digit_scorer().featurizer(1))
    assert fd_real < 0.1 * fd_noise


def test_read_clip_takes_a_decoded_clips_first_frames_and_says_when_it_is_short():
    from data_prep.video import ShortVideo, read_clip

    clip = _source().record(0).image
    frames = read_clip(clip, 5, mode="L")
    assert len(frames) == 5 and all(np.array_equal(np.array(f), a) for f, a in zip(frames, clip))
    with pytest.raises(ShortVideo, match="8 frames, fewer than num_frames=9"):
        read_clip(clip, 9)


# --------------------------------------------------------------------------------------------------
# Training on clips and sampling them
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory, moving_shards):
    """family -> (the run's folder, its checkpoint): a debug model of the family after 2 steps on the moving digits,
    with a grid at step 2; trained when first asked for."""
    from framework.train import train

    runs: dict[str, tuple] = {}

    def get(family: str) -> tuple:
        if family not in runs:
            tmp = tmp_path_factory.mktemp(family)
            result = train(compose_cfg(cheap(tmp, moving_shards, f"model={family}_debug", "sample.every_n_steps=2",
                                             "sample.prompts=[a 3 moving left]", steps=2)))
            runs[family] = (tmp / "run", result["checkpoint"])
        return runs[family]

    return get


def test_latte_trains_on_clips_and_samples_mp4_gif_and_a_frame_grid(tmp_path, trained):
    import av
    from PIL import Image

    from framework.inference.pipeline import Pipeline, video_frames
    from framework.inference.sampling import SamplingPlan
    from framework.sample import SampleCommand, run as sample

    run_dir, ckpt = trained("latte")
    with Image.open(run_dir / "samples" / "step0000002.png") as grid:  # the training grid: a clip's frames a row
        assert grid.size == (STRIP_WIDTH, 96 + 28)
    prompts = ["a 3 drifting to the left", "the digit seven moving up"]
    paths = sample(SampleCommand(ckpt=ckpt, out=str(tmp_path / "out"), prompts=prompts, steps=2, fps=4.0,
                                 device="cpu"))
    assert [p.name for p in paths] == ["000_a_3_drifting_to_the_left.mp4", "000_a_3_drifting_to_the_left.gif",
                                       "001_the_digit_seven_moving_up.mp4", "001_the_digit_seven_moving_up.gif",
                                       "grid.png", "grid.gif"]
    pipe = Pipeline.from_checkpoint(ckpt)
    z = torch.rand(2, 1, 8, 16, 16) * 2 - 1  # the pixel codec's latents are the frames themselves
    torch.testing.assert_close(pipe.decode(z), z.transpose(1, 2))  # (B, F, C, H, W), frames in order
    clips = pipe.generate(prompts, SamplingPlan(steps=2))
    assert clips.shape == (2, 8, 1, 16, 16)
    for clip, mp4, gif in zip(clips, paths[0:4:2], paths[1:4:2]):
        want = [np.array(f) for f in video_frames(clip, 256)]  # (256, 256, 3) each
        with Image.open(gif) as im:
            got = []
            for k in range(im.n_frames):
                im.seek(k)
                got.append(np.array(im.convert("RGB")))
            assert im.info["duration"] == 250  # 4 frames a second
        assert len(got) == 8 and all(np.array_equal(a, b) for a, b in zip(got, want))
        with av.open(str(mp4)) as container:
            stream = container.streams.video[0]
            assert float(stream.average_rate) == 4.0 and (stream.width, stream.height) == (256, 256)
            decoded = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        assert len(decoded) == 8
        error = np.mean([np.abs(a.astype(float) - b).mean() for a, b in zip(decoded, want)])
        assert error < 4.0, error  # H.264 at crf 12: a few levels of 255
    with Image.open(paths[-2]) as grid:  # one row a clip
        assert grid.size == (STRIP_WIDTH, 2 * (96 + 28))
    # without fps=, the clips play at the rate the dataset recorded its frames at (12 here)
    from framework.inference.checkpoint import CKPT_KEY, read_checkpoint

    recorded = read_checkpoint(ckpt)
    recorded[CKPT_KEY]["dataset"]["fps"] = 12.0
    torch.save(recorded, tmp_path / "at12.ckpt")
    at12 = sample(SampleCommand(ckpt=str(tmp_path / "at12.ckpt"), out=str(tmp_path / "at12"), prompts=prompts[:1],
                                steps=1, device="cpu"))
    with av.open(str(at12[0])) as container:
        assert float(container.streams.video[0].average_rate) == 12.0
    with Image.open(at12[1]) as im:
        assert im.info["duration"] == 80  # 1000 / 12 ms, in the GIF format's hundredths of a second
    with Image.open(paths[-1]) as both:  # both clips side by side, frame by frame, 8 times their 16 pixels
        assert (both.n_frames, both.size) == (8, (8 * (2 * 17 - 1), 8 * 16))
        both.seek(3)
        frame = np.array(both.convert("L"))[::8, ::8]  # (16, 33): clip 0's frame 3, a white column, clip 1's
        want = ((clips[:, 3, 0] + 1) * 127.5).round()
        assert np.array_equal(frame[:, :16], want[0].numpy()) and np.array_equal(frame[:, 17:], want[1].numpy())
        assert (frame[:, 16] == 255).all()


@pytest.mark.slow
def test_clips_train_alike_on_two_ddp_ranks_and_resume_exactly(tmp_path, moving_shards):
    """The training step on clips under the strategies and objectives images have. Latte under the v objective: two
    DDP ranks of 8 clips follow one process of 16 (losses within round-off, the same updates). Wan under the eps
    objective: a run stopped after step 2 and resumed gives the uninterrupted run's losses and weights bit for bit."""
    latte = ("model=latte_debug", "objective=v")
    every2 = "trainer.checkpoint_every_n_steps=2"
    run_train(tmp_path / "ref", moving_shards, "data.batch_size=16", every2, "trainer.max_steps=4", model=latte)
    run_train(tmp_path / "ddp", moving_shards, "strategy=ddp", "trainer.devices=2", "data.batch_size=8",
              "data.num_workers=1", every2, "trainer.max_steps=4", model=latte)
    ref, ddp = losses(tmp_path / "ref"), losses(tmp_path / "ddp")
    assert sorted(ddp) == list(range(4))
    torch.testing.assert_close(torch.tensor([ddp[s] for s in range(4)]), torch.tensor([ref[s] for s in range(4)]), **TOL)
    same_updates(tmp_path / "ddp", tmp_path / "ref")

    wan = ("model=wan_debug", "objective=eps")
    run_train(tmp_path / "full", moving_shards, every2, "trainer.max_steps=4", model=wan)
    run_train(tmp_path / "split", moving_shards, every2, "trainer.max_steps=2", model=wan)
    run_train(tmp_path / "split", moving_shards, every2, "trainer.max_steps=4", model=wan)
    full, split = losses(tmp_path / "full"), losses(tmp_path / "split")
    assert sorted(split) == list(range(4)) and [split[s] for s in range(4)] == [full[s] for s in range(4)]
    wf, ws = weights(tmp_path / "full" / "checkpoints" / "last.ckpt"), weights(tmp_path / "split" / "checkpoints" / "last.ckpt")
    for k in wf:
        torch.testing.assert_close(ws[k], wf[k], rtol=0, atol=0)


@pytest.mark.slow
def test_compiled_video_blocks_run_compiled_and_follow_the_eager_losses(tmp_path, moving_shards, extra_callback):
    """strategy.compile=true on Latte: each spatial and temporal block runs inside a torch.compile trace, and the
    losses follow the eager run's."""
    from framework.train import train

    # Dynamo's cache of compiled frames outlives a test: another module's compiled blocks in this worker (diffusers'
    # BasicTransformerBlock is PixArt's too) would count towards the recompile limit, past which a block runs eager.
    torch.compiler.reset()
    runs = {}
    for name, extra in (("eager", ()), ("compiled", ("strategy.compile=true",))):
        probe = extra_callback(CompiledBlocks())
        runs[name] = (probe, train(compose_cfg(cheap(tmp_path, moving_shards, "model=latte_debug", *extra, steps=3,
                                                     run=name))))
    assert not any(runs["eager"][0].compiled) and all(runs["compiled"][0].compiled)
    assert all(runs["compiled"][0].eager)  # the final grid's calls
    assert len(runs["compiled"][0].compiled) == 2 * load_preset("latte_debug").num_layers
    le, lc = (losses(Path(r[1]["run_dir"])) for r in runs.values())
    torch.testing.assert_close(torch.tensor(list(lc.values())), torch.tensor(list(le.values())), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model,data,message", [
    ("pixart_debug", "moving", "holds video clips \\(8 latent frames\\).*model.family=pixart denoises images"),
    ("wan_debug", "digits", "holds images .*model.family=wan denoises video"),
])
def test_a_model_of_the_other_kind_than_the_data_is_refused(tmp_path, request, model, data, message):
    from framework.train import train

    shards = request.getfixturevalue("moving_shards" if data == "moving" else "digits_shards")
    with pytest.raises(ValueError, match=message):
        train(compose_cfg(cheap(tmp_path, shards, f"model={model}", steps=1)))


@pytest.mark.parametrize("family", ["latte", "wan"])
def test_the_cache_router_learns_a_schedule_of_video_blocks_that_sampling_follows(tmp_path, trained, moving_shards,
                                                                                  family):
    """experiment=cache_router on a video checkpoint: a logit per (cache step, block, branch) of every block view
    (Latte's spatial blocks with cross-attention and its temporal blocks without, one after the other; Wan's 3D
    blocks), the backbone left bit for bit, and sampling with the learned schedule, or a uniform one, calls exactly
    the branches the schedule computes."""
    from framework.inference.caching import CacheSchedule, resolve_schedule
    from framework.inference.pipeline import Pipeline
    from framework.inference.sampling import SamplingPlan
    from framework.models.blocks import block_views
    from framework.train import train

    _, ckpt = trained(family)
    out = train(compose_cfg(cheap(tmp_path, moving_shards, "experiment=cache_router", f"init_from={ckpt}",
                                  f"model={family}_debug", "plugins.cache_router.steps=4", "eval.at_end=false", steps=2,
                                  run="stage")))
    schedule = CacheSchedule.load(Path(out["run_dir"]) / "cache_schedule.json")
    pipe = Pipeline.from_checkpoint(out["checkpoint"], weights="train")
    full, spatial_only = ["self_attn", "cross_attn", "mlp"], ["self_attn", "mlp"]
    layer = [full, spatial_only] if family == "latte" else [full]
    assert schedule.model["branches"] == layer * pipe.model.cfg.num_layers and schedule.steps == 4
    before, after = (torch.load(c, weights_only=True)["state_dict"] for c in (ckpt, out["checkpoint"]))
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("model."))
    plain = pipe.generate(["a 3 moving left"], SamplingPlan(steps=4, seed=1))
    for chosen in (schedule, resolve_schedule("uniform:2", pipe.model, "flow", "flow_euler", 4)):
        calls: dict[tuple[int, int], int] = {}
        hooks = []
        for i, view in enumerate(block_views(pipe.model)):
            for j, branch in enumerate(view.branches):
                calls[(i, j)] = 0
                hooks.append(branch.module.register_forward_hook(
                    lambda *_, key=(i, j), calls=calls: calls.__setitem__(key, calls[key] + 1)))
        try:
            clips = pipe.generate(["a 3 moving left"], SamplingPlan(steps=4, seed=1, cache_schedule=chosen))
        finally:
            for h in hooks:
                h.remove()
        assert calls == {(i, j): sum(step[i][j] for step in chosen.compute) for (i, j) in calls}
        assert clips.shape == plain.shape and (chosen.computed_fraction < 1) == bool((clips - plain).abs().max() > 0)


@pytest.mark.parametrize("family", ["latte", "wan"])
def test_video_models_grow_and_prune_by_whole_layers_through_the_commands(tmp_path, trained, moving_shards, family):
    """Wan's 3D blocks are one stack (net.blocks), Latte's layer i its spatial and temporal block i: growth adds a
    layer that starts as the identity (the source's clips come out), depth pruning's block importance finds it and
    drops it (the same clips again), and a run trains from the grown checkpoint at its depth."""
    from framework.inference.pipeline import Pipeline
    from framework.inference.sampling import SamplingPlan
    from framework.models.blocks import layer_views
    from framework.train import train
    from framework.training.checkpointing import save_derived
    from plugins.growth import GrowthConfig, grow_checkpoint
    from plugins.prune import PruneCommand, prune

    _, ckpt = trained(family)
    state, source, record = grow_checkpoint(str(ckpt), 3, GrowthConfig(ckpt=str(ckpt)), seed=0)
    grown = save_derived(tmp_path / "grown.ckpt", state, source, {"num_layers": 3}, record)
    plan = SamplingPlan(steps=3, seed=1)
    clips = lambda path: Pipeline.from_checkpoint(path).generate(["a 3 moving left"], plan)  # noqa: E731
    want = clips(ckpt)
    assert [len(layer) for layer in layer_views(Pipeline.from_checkpoint(grown).model)] == [1 + (family == "latte")] * 3
    torch.testing.assert_close(clips(grown), want, rtol=0, atol=1e-5)
    report = prune(PruneCommand(ckpt=str(grown), keep=2, out=str(tmp_path / "pruned" / "p.ckpt"),
                                prompts=["a 3 moving left", "the digit seven moving up"], steps=3))
    bi = report["importance"]
    assert report["dropped"] == [2] and bi[2] < 1e-6 < min(bi[:2]), bi
    torch.testing.assert_close(clips(tmp_path / "pruned" / "p.ckpt"), want, rtol=0, atol=1e-5)
    # Growth in a run (plugins=[growth]): the new layer's parameter group, its BI and output norm logged
    out = train(compose_cfg(cheap(tmp_path, moving_shards, f"model={family}_debug", "plugins=[growth]",
                                  f"plugins.growth.ckpt={ckpt}", "model.num_layers=3", steps=2, run="grown_run")))
    assert len(losses(Path(out["run_dir"]))) == 2
    with open(Path(out["run_dir"]) / "metrics.csv", newline="") as f:
        logged = [r for r in csv.DictReader(f) if r.get("growth/bi_2")]
    assert len(logged) == 2 and all(0 <= float(r["growth/bi_2"]) < 1e-3 for r in logged[:1])  # starts as the identity
    assert float(logged[-1]["growth/out_norm_2"]) > 0  # the zeroed projections have moved after a step


def test_check_compatible_names_the_frames(moving_shards):
    from framework.data.datamodule import check_compatible, read_dataset_info

    info = read_dataset_info(str(moving_shards))
    assert (info.num_frames, info.latent_size) == (8, (16, 16))
    check_compatible(info, 1, (16, 16), 384, num_frames=8)
    with pytest.raises(ValueError, match="model.num_frames=4 but the clips have 8 latent frames"):
        check_compatible(info, 1, (16, 16), 384, num_frames=4)
    with pytest.raises(ValueError, match="it holds video clips of 8 latent frames"):
        check_compatible(info, 1, (16, 16), 384)


def test_a_clip_dataset_records_its_frames_for_sampling(moving_shards):
    from framework.data.datamodule import read_dataset_info

    summary = read_dataset_info(str(moving_shards)).summary()
    assert (summary["num_frames"], summary["fps"]) == (8, None)


@pytest.mark.parametrize("family,guidance", [("latte", 1.0), ("wan", 3.0)])
def test_diffusers_export_is_a_stock_video_pipeline_that_samples_like_framework_sample(tmp_path, trained, capsys,
                                                                                      family, guidance):
    """format=diffusers writes a LattePipeline / WanPipeline folder that stock diffusers loads; from the same noise it
    draws framework.sample's latents (the pixel codec is no diffusers VAE: output_type="latent"). Wan's pipeline pads
    the empty prompt as training padded captions, so it matches guided too; Latte's attends to padding of the empty
    prompt (the export says so): compared unguided."""
    from diffusers import DiffusionPipeline

    from framework.export import ExportCommand, export
    from framework.inference.pipeline import Pipeline
    from framework.inference.sampling import Draws, Sampler, SamplingPlan, noise_seeds

    _, ckpt = trained(family)
    folder = export(ExportCommand(ckpt=ckpt, out=str(tmp_path / "pipe"), format="diffusers"))
    printed = capsys.readouterr().out
    assert ("max_sequence_length=32" in printed) == (family == "wan")
    assert ("unguided ones (guidance_scale=1) are the same" in printed) == (family == "latte")
    assert "load it with from_pretrained(folder, vae=None)" in printed
    pipe = DiffusionPipeline.from_pretrained(folder, vae=None)
    assert type(pipe).__name__ == {"latte": "LattePipeline", "wan": "WanPipeline"}[family]

    prompt, seed, steps = "a 3 drifting to the left", 5, 3
    ours = Pipeline.from_checkpoint(ckpt)
    plan = SamplingPlan(steps, guidance, "dpm++", seed)
    expected = Sampler(ours, plan).latents(Draws.of([prompt], None, seed, 1))  # (1, 1, 8, 16, 16)
    (s,) = noise_seeds(seed, 1)
    latents = torch.randn(1, 8, 16, 16, generator=torch.Generator().manual_seed(s))[None]  # framework.sample's noise
    kwargs = dict(max_sequence_length=32, num_frames=29) if family == "wan" else dict(video_length=8)
    got = pipe(prompt, num_inference_steps=steps, guidance_scale=guidance, latents=latents, height=128, width=128,
               output_type="latent", **kwargs).frames
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-4)


def test_a_wan_lora_file_loads_into_the_stock_wan_pipeline_and_samples_like_framework_sample(tmp_path, trained,
                                                                                             moving_shards, capsys):
    """A LoRA on the Wan run (the family of experiment=wan21_t2v_1_3b_lora): `framework.export format=lora` writes the
    file that stock WanPipeline.load_lora_weights() puts on the base's exported pipeline, which then draws
    framework.sample's latents of the LoRA run from the same noise, guided (and without the LoRA, others)."""
    from diffusers import DiffusionPipeline

    from framework.export import ExportCommand, export
    from framework.inference.pipeline import Pipeline
    from framework.inference.sampling import Draws, Sampler, SamplingPlan, noise_seeds
    from framework.train import train

    _, base = trained("wan")
    tuned = train(compose_cfg(cheap(tmp_path, moving_shards, "model=wan_debug", f"init_from={base}", "adapter=lora",
                                    "adapter.rank=4", "optimizer.lr=1e-2", "optimizer.warmup_steps=0",
                                    "sample.every_n_steps=0", steps=2)))["checkpoint"]
    folder = export(ExportCommand(ckpt=base, out=str(tmp_path / "pipe"), format="diffusers"))
    lora = export(ExportCommand(ckpt=tuned, out=str(tmp_path / "lora"), format="lora"))
    assert "stock WanPipeline of the base with pipe.load_lora_weights" in capsys.readouterr().out

    prompt, seed, steps, guidance = "a 3 drifting to the left", 5, 3, 3.0
    expected = Sampler(Pipeline.from_checkpoint(tuned), SamplingPlan(steps, guidance, "dpm++", seed)).latents(
        Draws.of([prompt], None, seed, 1))  # (1, 1, 8, 16, 16)
    (s,) = noise_seeds(seed, 1)
    latents = torch.randn(1, 8, 16, 16, generator=torch.Generator().manual_seed(s))[None]
    pipe = DiffusionPipeline.from_pretrained(folder, vae=None)

    def draw() -> torch.Tensor:
        return pipe(prompt, num_inference_steps=steps, guidance_scale=guidance, latents=latents.clone(), height=128,
                    width=128, output_type="latent", max_sequence_length=32, num_frames=29).frames

    without = draw()
    pipe.load_lora_weights(str(lora.parent), weight_name=lora.name)  # (weight_name: needed offline, HF_HUB_OFFLINE)
    torch.testing.assert_close(draw(), expected, rtol=0, atol=2e-4)
    assert (without - expected).abs().max() > 1e-2  # the LoRA changed the latents: the comparison above could fail


def test_a_latte_export_that_stock_diffusers_would_sample_wrongly_is_refused():
    from framework.export import check_video_pipeline

    check_video_pipeline(load_preset("latte_debug", in_channels=1), None)  # one channel: its half is itself
    check_video_pipeline(load_preset("latte_debug", learned_sigma=True), None)
    with pytest.raises(ValueError, match="stock LattePipeline keeps the first half of the transformer's output"):
        check_video_pipeline(load_preset("latte_debug"), None)


@pytest.mark.parametrize("name", VIDEO_PRESETS)
def test_train_flops_count_the_temporal_and_3d_attention(name):
    """The attention FLOPs of one training step read off the counter for the clips' own shapes, against the count by
    hand: an attention of Q queries over K keys, width D, costs 2 matrix products forward and 5 backward (the scores
    recomputed, then the gradients of V, the probabilities, Q and K), 2 * Q * K * D each: 14 * Q * K * D. Latte's spatial
    attention runs over each frame's N tokens (F sequences), its temporal attention over each position's F frames (N
    sequences), its cross-attention from each frame to the caption's 7 tokens; Wan's self-attention over all F * N
    tokens at once, its cross-attention to the caption zero-padded to text_len. Counted on the CPU, where torch's counter
    has no formula for the fused kernel (framework/models/flops.py maps it)."""
    from torch.utils import flop_counter

    from framework.models.flops import _CUSTOM

    def attention_flops(frames: int) -> int:
        net = build_denoiser(load_preset(name, num_frames=frames))
        x, t, text, mask = _clip_inputs(net.cfg, batch=1)
        with flop_counter.FlopCounterMode(display=False, custom_mapping=_CUSTOM) as counter:
            net(x, t, text, mask).square().mean().backward()
        ops = counter.get_flop_counts()["Global"]
        return sum(v for op, v in ops.items() if "scaled_dot_product" in str(op))

    cfg = load_preset(name)
    n, width = (cfg.sample_size // cfg.patch_size) ** 2, cfg.hidden_size  # tokens a frame; heads * head_dim
    cost = lambda sequences, queries, keys: 14 * sequences * queries * keys * width
    for frames in (2, 4):
        if name == "latte_debug":
            per_layer = cost(frames, n, n) + cost(n, frames, frames) + cost(frames, n, 7)
        else:
            per_layer = cost(1, frames * n, frames * n) + cost(1, frames * n, cfg.text_len)
        assert attention_flops(frames) == per_layer * cfg.num_layers, frames


# --------------------------------------------------------------------------------------------------
# Video VAEs: clips encoded whole, time compressed
# --------------------------------------------------------------------------------------------------

VIDEO_VAE_SCALING = {"wan": ([1 / 1.5, 1 / 0.5, 1 / 2.0, 1.0], [0.1, -0.2, 0.3, 0.0]), "cogvideox": (0.7, 0.0),
                     "hunyuan": (0.6, 0.0)}  # (scaling, shift) of make_tiny_video_vae's VAEs


def _video_folder(root, count: int = 4) -> str:
    """`count` lossless 16x16 videos of 9 frames at 24 fps, each a gradient sliding one pixel a frame, captioned."""
    if not root.exists():
        root.mkdir()
        ramp = np.add.outer(np.arange(16), np.arange(48)) * 4  # (16, 48)
        for k in range(count):
            frames = [np.stack([np.roll(ramp, 3 * k + i, 1)[:, :16], ramp[:, k:k + 16], np.full((16, 16), 40 * k)],
                               -1).clip(0, 255).astype(np.uint8) for i in range(9)]
            write_video(root / f"v{k}.mp4", frames)
            (root / f"v{k}.txt").write_text(f"clip number {k}")
    return str(root)


def _clip_config(tmp_path, text_dir, vae, out: str, **keys) -> dict:
    return {"source": {"name": "video_folder", "path": _video_folder(tmp_path / "videos")}, "vae": str(vae),
            "text_encoder": str(text_dir), "resolution": 16, "num_frames": 9, "out": str(tmp_path / out),
            "progress": False, **keys}


def _encoded_by_hand(vae_dir, source: str, tile: int | None = None) -> list:
    """Each video's first 9 frames, through the VAE's own encode (the posterior mean): (4, 3, 4, 4) each."""
    import diffusers

    from data_prep.encoders import _read_config
    from data_prep.precompute import to_tensor
    from data_prep.video import read_clip

    vae = getattr(diffusers, _read_config(vae_dir)["_class_name"]).from_pretrained(vae_dir).eval()
    if tile is not None:
        vae.enable_tiling(tile_sample_min_height=tile, tile_sample_min_width=tile, tile_sample_stride_height=4,
                          tile_sample_stride_width=4)  # 8-pixel tiles: 3/4 of 8 rounded down to whole 4-pixel cells
    out = []
    for k in range(4):
        clip = torch.stack([to_tensor(f) for f in read_clip(f"{source}/v{k}.mp4", 9)])  # (F, C, H, W)
        with torch.no_grad():
            out.append(vae.encode(clip.transpose(0, 1)[None]).latent_dist.mean[0])
    return out


@pytest.mark.parametrize("kind", list(VIDEO_VAE_SCALING))
def test_a_video_vae_encodes_each_clip_whole_into_fewer_latent_frames(tmp_path, tiny_text_encoder_dir, kind):
    """precompute vae=<a Wan / CogVideoX / HunyuanVideo VAE folder> num_frames=9: each clip goes through the VAE whole,
    9 frames making 3 latent frames (the first alone, then one per 4), the rows holding the VAE's own posterior mean of
    the clip; dataset.json records the compression and the VAE's scaling (Wan's per channel), which the trainer's
    batches apply channel by channel."""
    from data_prep.precompute import precompute
    from data_prep.record import DatasetRecord
    from framework.data.datamodule import LatentCollate, read_dataset_info

    vae = make_tiny_video_vae(tmp_path / "vae", kind)
    out = precompute(_clip_config(tmp_path, tiny_text_encoder_dir, vae, "clips"), rank=0, world_size=1)
    rec = DatasetRecord.read(out)
    assert (rec.num_frames, rec.temporal_compression, rec.latent_frames, rec.format_version) == (9, 4, 3, 6)
    assert (rec.latent_channels, rec.latent_size, rec.downsample) == (4, [4, 4], 4)
    scaling, shift = VIDEO_VAE_SCALING[kind]
    assert (rec.scaling_factor, rec.shift_factor) == (pytest.approx(scaling), pytest.approx(shift))
    rows = sorted(read_rows(out), key=lambda r: r["key"])
    for row, want in zip(rows, _encoded_by_hand(vae, tmp_path / "videos")):
        assert row["latents"].shape == (4, 3, 4, 4)
        np.testing.assert_allclose(row["latents"].astype(np.float32), want.numpy(), rtol=2e-3, atol=2e-3)
    info = read_dataset_info(str(out))
    assert info.num_frames == 3  # the model's model.num_frames: latent frames
    batch = LatentCollate(info.scaling_factor, info.shift_factor)(rows[:2])
    raw = torch.from_numpy(np.stack([r["latents"] for r in rows[:2]])).float()
    scale = torch.tensor(scaling).view(-1, 1, 1, 1) if kind == "wan" else scaling
    torch.testing.assert_close(batch["latents"], (raw - torch.tensor(shift).view(-1, 1, 1, 1)) * scale
                               if kind == "wan" else raw * scale)


def test_a_video_vae_is_refused_frames_it_cannot_compress_images_and_tiles_it_cannot_take(tmp_path,
                                                                                       tiny_text_encoder_dir):
    from data_prep.precompute import precompute

    vae = make_tiny_video_vae(tmp_path / "vae")
    cfg = _clip_config(tmp_path, tiny_text_encoder_dir, vae, "clips")
    for keys, message in [({"num_frames": 8}, r"num_frames=8: .* use 1 \+ 4k frames \(5 or 9"),
                          ({"num_frames": [5, 8]}, r"num_frames=8: .* use 1 \+ 4k frames \(5 or 9"),
                          ({"vae_tile": 6}, "vae_tile=6: a tile side in pixels, a multiple of the VAE's downsample factor 4"),
                          ({"vae": str(make_tiny_vae(tmp_path / "image_vae")), "vae_tile": 8},
                           "vae_tile=8: tiling is for a video VAE"),
                          ({"source": {"name": "digits"}, "num_frames": None, "resolution": 8},
                           "is a video VAE .AutoencoderKLWan.: it encodes clips")]:
        with pytest.raises(ValueError, match=message):
            precompute({**cfg, **keys, "out": str(tmp_path / "refused")}, rank=0, world_size=1)
        assert not (tmp_path / "refused").exists()  # refused before anything is written


def test_a_tiled_video_vae_encodes_in_tiles_and_sampling_decodes_with_the_same_tiles(tmp_path, tiny_text_encoder_dir):
    """vae_tile=8 on 16-pixel frames: the VAE works on overlapping 8-pixel tiles (diffusers' tiling, blended), which
    gives other latents than whole frames; dataset.json records the tile, and sampling's codec tiles likewise."""
    from data_prep.precompute import precompute
    from data_prep.record import DatasetRecord
    from framework.data.datamodule import read_dataset_info
    from framework.inference.pipeline import Pipeline
    from framework.models.objectives import Objective, ObjectiveConfig

    vae = make_tiny_video_vae(tmp_path / "vae")
    out = precompute(_clip_config(tmp_path, tiny_text_encoder_dir, vae, "tiled", vae_tile=8), rank=0, world_size=1)
    assert DatasetRecord.read(out).image_codec["tile"] == 8
    rows = sorted(read_rows(out), key=lambda r: r["key"])
    tiled, whole = _encoded_by_hand(vae, tmp_path / "videos", 8), _encoded_by_hand(vae, tmp_path / "videos")
    for row, want, other in zip(rows, tiled, whole):
        assert row["latents"].shape == (4, 3, 4, 4)
        np.testing.assert_allclose(row["latents"].astype(np.float32), want.numpy(), rtol=2e-3, atol=2e-3)
        assert np.abs(row["latents"].astype(np.float32) - other.numpy()).max() > 1e-2
    summary = read_dataset_info(str(out)).summary()
    assert summary["vae_tile"] == 8
    pipe = Pipeline(build_denoiser(load_preset("wan_debug", in_channels=4, sample_size=4, num_frames=3, text_dim=32)),
                    Objective(ObjectiveConfig()), torch.zeros(1, 32), summary)
    assert pipe.codec.tile == 8 and pipe.codec.vae.use_tiling


# --------------------------------------------------------------------------------------------------
# Frame-count and aspect-ratio buckets
# --------------------------------------------------------------------------------------------------

# name -> (frames, height, width) of uniformly gray videos, frame i of the k-th at level 10 i + 3 k; with num_frames=[4, 8]
# and buckets 16x16, 16x24, 24x16 each goes to the longest count it has at its own shape (d: too short for either)
BUCKETED_VIDEOS = {"a": (12, 16, 16), "b": (6, 16, 24), "c": (9, 24, 16), "d": (3, 16, 16), "e": (5, 16, 16),
                   "f": (8, 16, 16), "g": (7, 16, 24), "h": (10, 24, 16), "i": (6, 16, 16)}
EXPECTED_BUCKETS = {"bucket_4f_16x16": "ei", "bucket_4f_16x24": "bg", "bucket_8f_16x16": "af", "bucket_8f_24x16": "ch"}


def test_clips_go_to_the_longest_frame_count_they_have_at_their_aspect_and_train_and_sample_by_bucket(
        tmp_path, tiny_text_encoder_dir, extra_callback):
    """precompute num_frames=[8, 4] buckets=[...]: each clip takes the first 4 or 8 frames (the most it has) at the
    bucket of its aspect ratio, one MDS folder per (frames, size) bucket, recorded in dataset.json (format 7); Latte
    trains on them a bucket a global batch, its clips of 4 frames through the first rows of its temporal positions;
    sampling makes a trained frame count and size (num_frames=, height=, width=) and refuses an untrained one."""
    import av
    import lightning.pytorch as pl

    from data_prep.precompute import precompute
    from data_prep.record import DatasetRecord
    from framework.sample import SampleCommand, run as sample
    from framework.train import train

    src = tmp_path / "videos"
    src.mkdir()
    for k, (name, (n, h, w)) in enumerate(BUCKETED_VIDEOS.items()):
        write_video(src / f"{name}.mp4", [np.full((h, w, 3), 10 * i + 3 * k, np.uint8) for i in range(n)])
        (src / f"{name}.txt").write_text(f"clip {name}")
    out = Path(precompute({"source": {"name": "video_folder", "path": str(src)}, "vae": "pixel", "image_mode": "L",
                           "text_encoder": str(tiny_text_encoder_dir), "resolution": 16, "num_frames": [8, 4],
                           "buckets": [[16, 16], [16, 24], [24, 16]], "max_bad_fraction": 1.0, "out": str(tmp_path / "data"),
                           "progress": False}, rank=0, world_size=1))
    rec = DatasetRecord.read(out)
    assert (rec.format_version, rec.num_frames, rec.num_samples, rec.skipped["bad_images"]) == (7, 8, 8, 1)
    assert {b["dir"]: (b["frames"], b["latent_frames"], b["num_samples"]) for b in rec.buckets} == {
        "bucket_4f_16x16": (4, 4, 2), "bucket_4f_16x24": (4, 4, 2), "bucket_4f_24x16": (4, 4, 0),
        "bucket_8f_16x16": (8, 8, 2), "bucket_8f_16x24": (8, 8, 0), "bucket_8f_24x16": (8, 8, 2)}
    for folder, names in EXPECTED_BUCKETS.items():
        frames, (h, w) = int(folder[7]), map(int, folder[10:].split("x"))
        rows = sorted(read_rows(out / folder), key=lambda r: r["key"])
        assert [r["key"] for r in rows] == [f"{name}.mp4#0" for name in names]
        for r in rows:
            k = list(BUCKETED_VIDEOS).index(r["key"][0])
            assert r["latents"].shape == (1, frames, h, w)
            want = (10 * np.arange(frames) + 3 * k) / 127.5 - 1  # the clip's first frames, each uniform
            np.testing.assert_allclose(r["latents"].astype(np.float32).mean(axis=(0, 2, 3)), want, atol=2 / 127.5)

    class Shapes(pl.Callback):
        def __init__(self) -> None:
            self.seen: list[tuple] = []
            self.flops: dict[tuple, int] = {}

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.seen.append(tuple(batch["latents"].shape))
            self.flops[self.seen[-1]] = pl_module.batch_flops(batch)

    shapes = extra_callback(Shapes())
    result = train(compose_cfg(cheap(tmp_path, out, "model=latte_debug", "data.batch_size=2", steps=4)))
    # one epoch: each bucket's two clips make one global batch
    assert sorted(shapes.seen) == [(2, 1, 4, 16, 16), (2, 1, 4, 16, 24), (2, 1, 8, 16, 16), (2, 1, 8, 24, 16)]
    # TFLOP/s and MFU count each bucket's own FLOPs: twice the frames, at least twice the work
    assert shapes.flops[(2, 1, 8, 16, 16)] > 2 * shapes.flops[(2, 1, 4, 16, 16)]
    assert shapes.flops[(2, 1, 4, 16, 24)] > shapes.flops[(2, 1, 4, 16, 16)]
    assert all(np.isfinite(list(losses(tmp_path / "run").values())))
    wide = {"ckpt": result["checkpoint"], "prompts": ["clip a"], "steps": 2, "device": "cpu", "height": 16, "width": 24}
    paths = sample(SampleCommand(out=str(tmp_path / "wide"), num_frames=4, **wide))
    with av.open(str(paths[0])) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 4 and frames[0].shape == (172, 256, 3)  # 4 frames of 16x24, enlarged (even sides for H.264)
    with pytest.raises(ValueError, match="num_frames=8: the model was trained on clips of 4 frames at this size"):
        sample(SampleCommand(out=str(tmp_path / "refused"), num_frames=8, **wide))
    with pytest.raises(ValueError, match="num_frames=5: the model was trained on clips of 4, 8 frames at this size"):
        sample(SampleCommand(ckpt=result["checkpoint"], out=str(tmp_path / "refused"), num_frames=5, device="cpu"))


def test_wan_trains_on_video_vae_latents_samples_their_frames_and_exports_a_pipeline_with_the_vae(
        tmp_path, tiny_text_encoder_dir, capsys):
    """Wan on the Wan VAE's latents: training runs, framework.sample decodes each clip whole through the VAE (3 latent
    frames back to 9, undoing the per-channel scaling), and the exported WanPipeline, VAE included, draws the same
    pixels from the same noise."""
    from diffusers import AutoencoderKLWan, DiffusionPipeline

    from data_prep.precompute import precompute
    from framework.export import ExportCommand, export
    from framework.inference.pipeline import Pipeline
    from framework.inference.sampling import SamplingPlan, noise_seeds
    from framework.sample import SampleCommand, run as sample
    from framework.train import train

    vae = make_tiny_video_vae(tmp_path / "vae")
    data = precompute(_clip_config(tmp_path, tiny_text_encoder_dir, vae, "clips"), rank=0, world_size=1)
    result = train(compose_cfg(cheap(tmp_path, data, "model=wan_debug", "data.batch_size=2", "sample.prompts=[clip 1]",
                                     steps=2)))
    pipe = Pipeline.from_checkpoint(result["checkpoint"])
    z = torch.randn(2, 4, 3, 4, 4)
    mean, std = torch.tensor([0.1, -0.2, 0.3, 0.0]).view(-1, 1, 1, 1), torch.tensor([1.5, 0.5, 2.0, 1.0]).view(-1, 1, 1, 1)
    with torch.no_grad():
        want = AutoencoderKLWan.from_pretrained(vae).decode(z * std + mean).sample.clamp(-1, 1)  # (B, C, 9, H, W)
    torch.testing.assert_close(pipe.decode(z), want.transpose(1, 2), rtol=0, atol=1e-5)
    paths = sample(SampleCommand(ckpt=result["checkpoint"], out=str(tmp_path / "out"), prompts=["clip number 2"],
                                 steps=2, device="cpu"))
    import av

    with av.open(str(paths[0])) as container:
        assert sum(1 for _ in container.decode(video=0)) == 9

    folder = export(ExportCommand(ckpt=result["checkpoint"], out=str(tmp_path / "pipe"), format="diffusers"))
    assert "load it with from_pretrained(folder, vae=None)" not in capsys.readouterr().out
    stock = DiffusionPipeline.from_pretrained(folder)
    assert type(stock.vae).__name__ == "AutoencoderKLWan"
    prompt, seed = "clip number 2", 3
    ours = pipe.generate([prompt], SamplingPlan(2, 1.0, "dpm++", seed))  # (1, 9, 3, 16, 16) in [-1, 1]
    (s,) = noise_seeds(seed, 1)
    latents = torch.randn(1, 4, 3, 4, 4, generator=torch.Generator().manual_seed(s))
    got = stock(prompt, num_inference_steps=2, guidance_scale=1.0, latents=latents, height=16, width=16, num_frames=9,
                max_sequence_length=32, output_type="pt").frames  # (1, 9, 3, 16, 16) in [0, 1]
    torch.testing.assert_close(got, (ours + 1) / 2, rtol=0, atol=2e-3)


# --------------------------------------------------------------------------------------------------
# One's own clips: FVD and per-frame CLIP score
# --------------------------------------------------------------------------------------------------

def _heldout_videos(root, count: int = 8) -> str:
    """`count` lossless 16x16 videos of 10 frames, a bright square drifting, captioned like the moving digits."""
    root.mkdir()
    for k in range(count):
        frames = []
        for i in range(10):
            pixels = np.zeros((16, 16, 3), dtype=np.uint8)
            top, left = (3 * k) % 9, (k + i) % 9
            pixels[top:top + 7, left:left + 7] = 200 + 5 * k
            frames.append(pixels)
        write_video(root / f"held{k}.mp4", frames)
        (root / f"held{k}.txt").write_text(f"a {k} drifting to the right")
    return str(root)


def test_video_features_feed_i3d_224_pixel_frames_in_minus_one_to_one(tmp_path):
    """The I3D gets each frame resized to cover 224 x 224 and centre-cropped, gray as 3 channels, (N, 3, F, 224, 224):
    a uniform clip reaches it as that value everywhere; a 112 x 168 one as torch's bilinear 2x enlargement, its middle
    224 columns."""
    from framework.evaluation.realdata import VideoFeatures

    torch.manual_seed(0)
    net = TinyI3D()
    torch.jit.script(net).save(str(tmp_path / "i3d.pt"))
    features = VideoFeatures(tmp_path / "i3d.pt")
    assert features.kwargs == {"return_features": True, "rescale": False, "resize": False}
    clip = torch.full((2, 8, 1, 16, 24), 0.25)  # 2 clips of 8 wide gray frames
    with torch.no_grad():
        want = net(torch.full((2, 3, 8, 224, 224), 0.25), return_features=True)
    torch.testing.assert_close(features(clip), want)
    clip = torch.randn(2, 4, 1, 112, 168, generator=torch.Generator().manual_seed(1)).clamp(-1, 1)
    frames = torch.nn.functional.interpolate(clip.flatten(0, 1), scale_factor=2, mode="bilinear", align_corners=False)
    seen = frames[..., 56:280].clamp(-1, 1).expand(-1, 3, -1, -1).unflatten(0, (2, 4)).transpose(1, 2)
    with torch.no_grad():
        torch.testing.assert_close(features(clip), net(seen, return_features=True))


def test_eval_scores_own_clips_with_fvd_and_per_frame_clip_score(tmp_path, trained, metric_nets, moving_shards,
                                                                capsys):
    """framework.eval real=<videos> i3d=FILE clip=DIR on a video model: fvd is the Fréchet distance of the I3D features
    of the clips it draws for the held-out captions to those of the held-out videos (taken as precompute takes clips),
    clip_score the CLIP score of every frame against its prompt, averaged over each clip, then over clips; both with
    bootstrap intervals. A network for the other kind of model is refused, naming the key."""
    import json

    from framework.eval import EvalCommand, run
    from framework.evaluation.realdata import (
        VideoFeatures, clip_scores, fid_from_features, real_clips, video_features,
    )
    from framework.inference.pipeline import Pipeline
    from framework.inference.sampling import SamplingPlan

    _, ckpt = trained("latte")
    torch.manual_seed(0)
    torch.jit.script(TinyI3D()).save(str(tmp_path / "i3d.pt"))
    real_dir = _heldout_videos(tmp_path / "heldout")
    nets = dict(real=real_dir, i3d=str(tmp_path / "i3d.pt"), clip=str(metric_nets["clip"]))
    run(EvalCommand(ckpt=ckpt, out=str(tmp_path / "eval"), seeds=2, steps=2, bootstrap=30, device="cpu", **nets))
    lines = capsys.readouterr().out.strip().splitlines()
    metrics = json.loads(lines[-1])
    assert "fvd" in lines[-2] and "clips of 8 frames" in lines[-2]
    assert (metrics["num_images"], metrics["num_real"], metrics["num_frames"]) == (16, 8, 8)
    assert {"fvd", "clip_score"} <= set(metrics) and "fid" not in metrics
    for key in ("fvd", "clip_score"):
        lo, hi = metrics[f"{key}_interval"]
        assert lo <= metrics[key] <= hi, (key, metrics)

    pipe = Pipeline.from_checkpoint(ckpt)
    real, captions = real_clips(real_dir, 8, None, 16, 16)
    assert real.shape == (8, 8, 3, 16, 16) and captions[3] == "a 3 drifting to the right"
    # the reference clips are the videos' first 8 frames as written (lossless), by _heldout_videos' own formula
    expected = torch.full((8, 8, 3, 16, 16), -1.0)
    for k in range(8):
        for i in range(8):
            top, left = (3 * k) % 9, (k + i) % 9
            expected[k, i, :, top:top + 7, left:left + 7] = (200 + 5 * k) / 127.5 - 1
    torch.testing.assert_close(real, expected, rtol=0, atol=2 / 127.5)
    drawn = [c for c in captions for _ in range(2)]
    clips = pipe.generate(drawn, SamplingPlan(2, 4.0, None, seed=0))  # (16, 8, 1, 16, 16)
    i3d = VideoFeatures(tmp_path / "i3d.pt")
    want = fid_from_features(video_features(i3d, real), video_features(i3d, clips))
    assert metrics["fvd"] == pytest.approx(want, rel=1e-6) and want > 0
    per_frame = clip_scores(clips.flatten(0, 1), [p for p in drawn for _ in range(8)], metric_nets["clip"])
    assert metrics["clip_score"] == pytest.approx(float(per_frame.view(16, 8).mean()), rel=1e-5)
    assert (tmp_path / "eval" / "samples.png").is_file()

    with pytest.raises(ValueError, match="eval.inception scores images, and this model makes clips"):
        run(EvalCommand(ckpt=ckpt, out=str(tmp_path / "bad"), seeds=1, steps=1, device="cpu", real=real_dir,
                        inception=str(metric_nets["inception"])))
    with pytest.raises(ValueError, match="does not give a clip of 12 frames"):
        real_clips(real_dir, 12, None, 16, 16)
    from framework.train import train

    with pytest.raises(ValueError, match="eval.inception scores images, and this model makes clips"):  # before training
        train(compose_cfg(cheap(tmp_path, moving_shards, "model=latte_debug", "eval.every_n_steps=2",
                                f"eval.real={real_dir}", f"eval.inception={metric_nets['inception']}", run="refused")))
    assert not (tmp_path / "refused" / "checkpoints").exists()


@pytest.mark.parametrize("preset, right, wrong", [("latte_debug", "AutoencoderKL", "AutoencoderKLWan"),
                                                  ("wan_debug", "AutoencoderKLWan", "AutoencoderKL")])
def test_a_diffusers_export_refuses_a_vae_its_stock_pipeline_cannot_decode_with(preset, right, wrong):
    """Stock LattePipeline decodes frame by frame with an image VAE, stock WanPipeline with the Wan VAE's latent
    statistics: the other class is refused, naming both; the right one (or none given) passes."""
    from framework.models.families import family_of

    cfg = load_preset(preset, **({"learned_sigma": True} if preset == "latte_debug" else {}))
    fam, vae = family_of(cfg), lambda name: type(name, (), {})()
    fam.check_pipeline(cfg, vae(right))
    fam.check_pipeline(cfg, None)
    with pytest.raises(ValueError, match=rf"stock {fam.pipeline_class} .*{right}.*latents come from an {wrong}\. "
                                         r"Export format=safetensors for the transformer alone, or "):
        fam.check_pipeline(cfg, vae(wrong))
