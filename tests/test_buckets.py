"""Aspect-ratio buckets in training: every batch from one bucket, the same global batches on 1 and 2 ranks, an exact
resume, a bucket too small for a global batch reported, and non-square latents through each family that takes them.
(Precompute's side, bucket by bucket: tests/test_data_prep.py.)"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import (
    LEAST_GRID, folder_config, forked_children, losses, make_mixed_folder, probe, run_train, same_updates,
)

BUCKETS = [[4, 32], [8, 16], [12, 12], [16, 8]]
# (h, w): 20 landscape (-> 8x16), 20 square (-> 12x12), 12 portrait (-> 16x8), 3 very wide (-> 4x32: fewer than a
# global batch of 8, so left out)
SIZES = [(40, 80 + i) for i in range(20)] + [(60 + i, 60 + i) for i in range(20)] + [(90, 44 + i) for i in range(12)] + \
    [(10, 90 + i) for i in range(3)]
MODEL = ["model.in_channels=3", "model.sample_size=12", "model.text_dim=384", "data.num_workers=0"]
STEPS = 4


@pytest.fixture(scope="module")
def bucketed(tmp_path_factory) -> Path:
    from data_prep.precompute import precompute

    root = tmp_path_factory.mktemp("buckets")
    src = make_mixed_folder(root / "imgs", SIZES)
    return precompute(folder_config(src, root / "data", "minilm", buckets=BUCKETS), rank=0, world_size=1)


def bucket_of(key: str) -> int:
    """The bucket an image of the fixture went to, from its key (img<i>.png#<caption>)."""
    h, w = SIZES[int(key.split("#")[0][3:6])]
    return 0 if w / h > 4 else 1 if w > h else 2 if w == h else 3


def test_the_data_module_reads_each_batch_from_one_bucket_and_reports_what_it_leaves_out(bucketed, tmp_path, caplog):
    from framework.data.datamodule import DataConfig, LatentDataModule

    info = json.loads((bucketed / "dataset.json").read_text())
    assert [b["num_samples"] for b in info["buckets"]] == [3, 20, 20, 12]
    dm = LatentDataModule(DataConfig(path=str(bucketed), local=str(tmp_path / "cache"), batch_size=8), seed=0)
    with pytest.warns(UserWarning, match=r"1 aspect-ratio buckets have fewer samples than a global batch \(8\) and are "
                                         r"left out \(3 of 55 samples\): 4x32: 3"):
        dm.setup("fit")
    assert [b["size"] for b in dm.buckets] == [[8, 16], [12, 12], [16, 8]]
    # The samples in the order the data set yields them, before any batch is stacked: each run of 8 from one bucket.
    order = [bucket_of(sample["key"]) for sample in dm.dataset]
    assert len(order) == 40 and all(len(set(order[i:i + 8])) == 1 for i in range(0, 40, 8)), order
    batches = list(dm.train_dataloader())
    shapes = {tuple(b["latents"].shape[2:]) for b in batches}
    assert shapes == {(8, 16), (12, 12), (16, 8)}
    for b in batches:
        assert len({bucket_of(k) for k in b["key"]}) == 1 and b["latents"].shape[0] == 8
    # 20 // 8 + 20 // 8 + 12 // 8 = 5 full batches; the rest of each bucket is left out this epoch
    assert len(batches) == 5 and len({k for b in batches for k in b["key"]}) == 40


@pytest.mark.slow
def test_bucketed_training_on_two_ranks_follows_one_process_and_resumes_exactly(bucketed, tmp_path):
    """1 process x 8 and 2 ranks x 4 (ddp, and fsdp) see the same global batches, each from one bucket, and take the
    same steps; 2 ranks stopped at step 2 and resumed finish like the uninterrupted run."""
    ref, two, split = tmp_path / "ref", tmp_path / "two", tmp_path / "split"
    common = [*MODEL, "trainer.checkpoint_every_n_steps=2"]
    run_train(ref, bucketed, *common, "data.batch_size=8", f"trainer.max_steps={STEPS}")
    ddp = [*common, "strategy=ddp", "trainer.devices=2", "data.batch_size=4"]
    run_train(two, bucketed, *ddp, f"trainer.max_steps={STEPS}")
    run_train(split, bucketed, *ddp, "trainer.max_steps=2")
    run_train(split, bucketed, *ddp, f"trainer.max_steps={STEPS}")
    sharded = tmp_path / "fsdp"  # FSDP2 over batches whose latent shape changes from step to step
    run_train(sharded, bucketed, *[o for o in ddp if o != "strategy=ddp"], "strategy=fsdp", f"trainer.max_steps={STEPS}")

    keys = probe(ref)["keys"]
    assert sorted(map(int, keys)) == list(range(STEPS))
    assert len({bucket_of(k) for step in keys.values() for k in step}) >= 2  # the run crossed buckets
    for step, batch in keys.items():
        assert len({bucket_of(k) for k in batch}) == 1, (step, batch)
        assert sorted(probe(two, 0)["keys"][step] + probe(two, 1)["keys"][step]) == sorted(batch)
    a, b, c = losses(ref), losses(two), losses(split)
    torch.testing.assert_close(torch.tensor([b[s] for s in range(STEPS)]), torch.tensor([a[s] for s in range(STEPS)]),
                               rtol=1e-4, atol=1e-5)
    assert [c[s] for s in range(STEPS)] == [b[s] for s in range(STEPS)]
    same_updates(two, ref)
    same_updates(split, two, init=two)
    d = losses(sharded)
    torch.testing.assert_close(torch.tensor([d[s] for s in range(STEPS)]), torch.tensor([a[s] for s in range(STEPS)]),
                               rtol=1e-4, atol=1e-5)
    same_updates(sharded, ref)


@pytest.mark.parametrize("name", ["pixart_debug", "sana_debug", "sd2_unet_debug"])
def test_non_square_latents_go_through_the_families_that_take_them(name):
    """A model built for 12x12 latents denoises 8x16 and 16x8 ones (positional embeddings at the latent's own
    height and width) into outputs of the input's shape."""
    from framework.models.backbones import build_denoiser, load_preset

    torch.manual_seed(0)
    model = build_denoiser(load_preset(name, in_channels=3, sample_size=12, text_dim=32)).eval()
    text, mask = torch.randn(1, 5, 32), torch.ones(1, 5, dtype=torch.bool)
    for hw in ((8, 16), (16, 8), (12, 12)):
        x = torch.randn(1, 3, *hw)
        with torch.no_grad():
            out = model(x, torch.full((1,), 500.0), text, mask, None)
        assert out.shape == x.shape and torch.isfinite(out).all()


def test_sample_draws_a_trained_bucket_by_size_or_aspect_and_refuses_others(bucketed, tmp_path, digits_shards):
    """framework.sample height= width= / aspect=W:H on a model trained on buckets: the image has that shape (the
    pixel codec: latents are pixels); a size it was not trained at, or an aspect for a square-only model, is refused."""
    from PIL import Image

    from framework.sample import SampleCommand
    from framework.sample import run as sample
    from framework.train import train
    from tests.helpers import cheap, compose_cfg

    ckpt = train(compose_cfg(cheap(tmp_path, bucketed, *MODEL, "data.batch_size=8", "model=pixart_debug",
                                   "sample.every_n_steps=0", steps=2, run="bucketed")))["checkpoint"]
    run = lambda **kw: sample(SampleCommand(ckpt=ckpt, out=str(tmp_path / "s"), steps=2, prompts=["a landscape picture"],
                                            device="cpu", **kw))
    for kw, (h, w) in (({"height": 8, "width": 16}, (8, 16)), ({"aspect": "1:2"}, (16, 8)), ({"aspect": "16:9"}, (8, 16)),
                       ({}, (12, 12)), ({"aspect": "8:1"}, (8, 16))):  # 4x32: left out of training, so the next

        paths = run(**kw)
        with Image.open(paths[0]) as im:
            assert im.size[0] * h == im.size[1] * w, (kw, im.size)
    with pytest.raises(ValueError, match=r"not trained at that size; its sizes nearest that aspect ratio are 12x12"):
        run(height=10, width=10)
    with pytest.raises(ValueError, match="not trained at that size"):
        run(height=4, width=32)  # in the dataset, but too few samples to train on
    with pytest.raises(ValueError, match="write it as width:height"):
        run(aspect="wide")
    square = train(compose_cfg(cheap(tmp_path, digits_shards, steps=1, run="digits")))["checkpoint"]
    with pytest.raises(ValueError, match="trained at 8x8 only"):
        sample(SampleCommand(ckpt=square, out=str(tmp_path / "d"), steps=2, aspect="16:9", device="cpu"))


def test_pixart_size_conditioning_feeds_each_batch_its_own_shape(bucketed, tmp_path):
    """model.size_conditioning=true: PixArt's resolution / aspect-ratio embedding gets the latents' own size (in an 8x
    VAE's pixels, as diffusers' PixArt pipeline passes them), so the same weights draw differently per shape; a run
    on the buckets trains the embedding and samples by aspect."""
    from framework.models.backbones import build_denoiser, load_preset
    from framework.sample import SampleCommand
    from framework.sample import run as sample
    from framework.train import train
    from tests.helpers import cheap, compose_cfg

    torch.manual_seed(0)
    model = build_denoiser(load_preset("pixart_debug", in_channels=3, sample_size=12, text_dim=32, head_dim=24, width=96,
                                       size_conditioning=True)).eval()  # 4 heads x 24: a width 3 divides
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # the embedding's output layer starts at zero in diffusers
    x, t = torch.randn(2, 3, 8, 16), torch.full((2,), 500.0)
    text, mask = torch.randn(2, 5, 32), torch.ones(2, 5)

    def direct(resolution, aspect):
        return model.net(x, encoder_hidden_states=text, timestep=t, encoder_attention_mask=mask, return_dict=False,
                         added_cond_kwargs={"resolution": torch.tensor([resolution] * 2),
                                            "aspect_ratio": torch.tensor([[aspect]] * 2)})[0][:, :3]  # learned sigma off

    with torch.no_grad():
        ours = model(x, t, text, mask.bool(), None)
        torch.testing.assert_close(ours, direct([64.0, 128.0], 0.5))
        assert not torch.allclose(ours, direct([96.0, 96.0], 1.0), atol=1e-4)
    with pytest.raises(ValueError, match="size_conditioning"):
        load_preset("sana_debug", size_conditioning=True)
    with pytest.raises(ValueError, match="width divisible by 3"):
        load_preset("pixart_debug", size_conditioning=True)  # 128 wide

    out = train(compose_cfg(cheap(tmp_path, bucketed, *MODEL, "data.batch_size=8", "model.size_conditioning=true",
                                  "model.head_dim=24", "model.width=96", "sample.every_n_steps=0", steps=2, run="sized")))
    state = torch.load(out["checkpoint"], weights_only=True)["state_dict"]
    assert any("resolution_embedder" in k for k in state)
    paths = sample(SampleCommand(ckpt=out["checkpoint"], out=str(tmp_path / "s"), steps=2, aspect="1:2", device="cpu",
                                 prompts=["a portrait picture"]))
    assert paths[-1].name == "grid.png"


class SizeIdsProbe:
    """Records, per training batch, its keys and the time ids the UNet's added embedding received."""

    def __init__(self) -> None:
        import lightning.pytorch as pl

        probe = self

        class _Callback(pl.Callback):
            def on_train_start(self, trainer, pl_module) -> None:
                def grab(module, args, kwargs):
                    added = kwargs.get("added_cond_kwargs")
                    if torch.is_grad_enabled() and added is not None:
                        probe.time_ids.append(added["time_ids"].detach().clone())
                pl_module.model.net.register_forward_pre_hook(grab, with_kwargs=True)

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
                probe.keys.append(list(batch["key"]))

        self.keys: list[list[str]] = []
        self.time_ids: list[torch.Tensor] = []
        self.callback = _Callback()


def test_unet_size_conditioning_feeds_each_sample_its_original_size_and_crop(bucketed, tmp_path, monkeypatch):
    """model.size_conditioning=true on the UNet: SDXL's micro-conditioning (diffusers' text_time embedding) gets each
    training sample's original size and crop corner as precompute recorded them, and its latents' size (latent units);
    the pooled text is the mean of the caption's own tokens; sampling uses the target size uncropped; a stock
    diffusers export, which would pass no size ids, is refused."""
    import framework.train as train_lib
    from framework.data.datamodule import LatentCollate
    from framework.export import ExportCommand, export
    from framework.models.backbones import build_denoiser, default_size_ids, load_preset
    from framework.sample import SampleCommand
    from framework.sample import run as sample
    from tests.helpers import read_rows
    from tests.helpers import with_callback, cheap, compose_cfg

    torch.manual_seed(0)
    model = build_denoiser(load_preset("sd2_unet_debug", in_channels=3, sample_size=12, text_dim=32,
                                       size_conditioning=True)).eval()
    x, t = torch.randn(2, 3, 8, 16), torch.full((2,), 500.0)
    text, mask = torch.randn(2, 5, 32), torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    ids = torch.tensor([[20.0, 41.0, 3.0, 0.0, 8.0, 16.0], [8.0, 16.0, 0.0, 0.0, 8.0, 16.0]])
    pooled = torch.stack([text[0, :3].mean(0), text[1].mean(0)])  # each caption's own tokens
    with torch.no_grad():
        ours = model(x, t, text, mask, None, size_ids=ids)
        direct = model.net(x, t, encoder_hidden_states=text, encoder_attention_mask=mask.float(), return_dict=False,
                           added_cond_kwargs={"text_embeds": pooled, "time_ids": ids})[0]
        torch.testing.assert_close(ours, direct)
        torch.testing.assert_close(model(x, t, text, mask, None), model(x, t, text, mask, None, size_ids=default_size_ids(x)))
        assert not torch.allclose(ours, model(x, t, text, mask, None), atol=1e-5)  # the sizes reach the output
    assert default_size_ids(x).tolist() == [[8.0, 16.0, 0.0, 0.0, 8.0, 16.0]] * 2

    # The collate turns the recorded pixels into latent units (a 4x codec here).
    sample_row = {"latents": np.zeros((3, 10, 20), np.float16), "text_embeds": np.zeros((2, 4), np.float16),
                  "caption": "c", "original_size": np.array([120, 250], np.int32),
                  "crop_top_left": np.array([0, 6], np.int32)}
    batch = LatentCollate(1.0, 0.0, downsample=4)([sample_row, sample_row])
    assert batch["size_ids"].tolist() == [[30.0, 62.5, 0.0, 1.5, 10.0, 20.0]] * 2

    probe = SizeIdsProbe()
    with_callback(monkeypatch, probe.callback)
    out = train_lib.train(compose_cfg(cheap(tmp_path, bucketed, "model=sd2_unet_debug", *MODEL, "data.batch_size=8",
                                            "model.size_conditioning=true", "sample.every_n_steps=0", steps=2,
                                            run="unet_sized")))
    info = json.loads((bucketed / "dataset.json").read_text())
    stored = {r["key"]: r for b in info["buckets"] for r in read_rows(bucketed / b["dir"])}
    assert len(probe.keys) == 2 and len(probe.time_ids) >= 2
    for keys, got in zip(probe.keys, probe.time_ids[-2:]):
        want = [[*stored[k]["original_size"], *stored[k]["crop_top_left"], *stored[k]["latents"].shape[1:]] for k in keys]
        assert got.tolist() == [[float(v) for v in row] for row in want]
        assert {tuple(SIZES[int(k.split("#")[0][3:6])]) for k in keys} == {tuple(r[:2]) for r in want}
    paths = sample(SampleCommand(ckpt=out["checkpoint"], out=str(tmp_path / "s"), steps=2, aspect="2:1", device="cpu",
                                 prompts=["a landscape picture"]))
    assert paths[-1].name == "grid.png"
    with pytest.raises(ValueError, match="size-conditioned"):
        export(ExportCommand(ckpt=out["checkpoint"], out=str(tmp_path / "pipe"), format="diffusers"))


# --------------------------------------------------------------------------------------------
# The demonstration's scenes and detector (python -m framework.studies buckets)
# --------------------------------------------------------------------------------------------


def test_the_shapes_detector_finds_the_named_blocks_and_a_square_crop_loses_them():
    """On real scenes of every layout the detector finds both blocks where the caption puts them, and not when the
    caption names other colours or the ends are swapped; a 24x24 centre crop of a wide or tall scene (the default
    precompute) cuts both away, while a square scene keeps them."""
    from data_prep.precompute import cover_crop, to_tensor
    from data_prep.sources.shapes import Scene, draw_scene
    from framework.evaluation.shapes import found_blocks, parse_scene
    from PIL import Image

    for i in range(30):
        scene, img = draw_scene(i)
        assert parse_scene(scene.caption) == scene
        assert found_blocks(to_tensor(Image.fromarray(img)), scene) == [True, True], scene.caption
        assert found_blocks(to_tensor(Image.fromarray(img)), Scene(scene.layout, scene.colours[::-1])) == [False, False]
        cropped = to_tensor(cover_crop(Image.fromarray(img), 24, 24)[0])
        assert found_blocks(cropped, scene) == ([True, True] if scene.layout == "square" else [False, False]), scene
    with pytest.raises(ValueError, match="not a shapes caption"):
        parse_scene("a handwritten 3")


@pytest.mark.slow
def test_the_bucket_demonstration_runs_end_to_end(tmp_path, monkeypatch):
    from framework.studies.buckets import BucketsStudy, run

    launched = forked_children(monkeypatch)
    rows = run(BucketsStudy(scenes=48, steps=1, batch_size=8, eval_scenes=3, sample_steps=2, bootstrap=10,
                            train_overrides=list(LEAST_GRID), out=str(tmp_path / "demo" / "buckets.json")))
    assert len(launched) == 2 and all(set(LEAST_GRID) <= set(argv) for argv in launched)
    sizes = {(r["model"], r["layout"]): r["image_size"] for r in rows}
    assert sizes[("buckets", "wide")] == "16x32" and sizes[("buckets", "tall")] == "32x16"
    assert sizes[("square", "wide")] == "24x24" and sizes[("buckets", "square")] == "24x24"
    assert all(0 <= r["both_found"] <= 1 and r["num_images"] == (3 if r["layout"] == "all" else 1) for r in rows)
    assert (tmp_path / "demo" / "buckets.png").is_file()
