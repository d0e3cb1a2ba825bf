"""Video: the Latte and Wan families on clips (B, C, F, h, w), the moving digits and their scoring, training on clips,
and sampling MP4s, GIFs and frame grids through the commands.

References: a clip's own frames (a model's output for one sample whatever the batch and the caption padding), the
source's known motion (real clips score direction accuracy 1, reversed ones 0), and the generated clips themselves
(the files written hold exactly their frames).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from framework.models.backbones import build_denoiser, load_preset
from tests.helpers import cheap, compose_cfg

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


def test_latte_latents_must_have_the_frames_it_was_built_for():
    net = build_denoiser(load_preset("latte_debug", num_frames=4)).eval()
    x, t, text, mask = _clip_inputs(net.cfg)
    with torch.no_grad(), pytest.raises(RuntimeError):
        net(x[:, :, :3], t, text, mask)  # its temporal position embedding has num_frames rows


@pytest.mark.parametrize("preset,override,message", [
    ("latte_debug", {"num_frames": None}, "model.num_frames must be set"),
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
    with Image.open(paths[-1]) as both:  # both clips side by side, frame by frame, 8 times their 16 pixels
        assert (both.n_frames, both.size) == (8, (8 * (2 * 17 - 1), 8 * 16))
        both.seek(3)
        frame = np.array(both.convert("L"))[::8, ::8]  # (16, 33): clip 0's frame 3, a white column, clip 1's
        want = ((clips[:, 3, 0] + 1) * 127.5).round()
        assert np.array_equal(frame[:, :16], want[0].numpy()) and np.array_equal(frame[:, 17:], want[1].numpy())
        assert (frame[:, 16] == 255).all()


@pytest.mark.parametrize("model,data,message", [
    ("pixart_debug", "moving", "holds video clips \\(8 latent frames\\).*model.family=pixart denoises images"),
    ("wan_debug", "digits", "holds images .*model.family=wan denoises video"),
])
def test_a_model_of_the_other_kind_than_the_data_is_refused(tmp_path, request, model, data, message):
    from framework.train import train

    shards = request.getfixturevalue("moving_shards" if data == "moving" else "digits_shards")
    with pytest.raises(ValueError, match=message):
        train(compose_cfg(cheap(tmp_path, shards, f"model={model}", steps=1)))


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
