"""logger=tensorboard with the real tensorboard package, read back from its event files."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from framework.train import train
from tests.helpers import cheap, compose_cfg

pytest.importorskip("tensorboard")


def test_tensorboard_logs_what_wandb_gets_and_a_resumed_run_continues_in_its_folder(tmp_path, digits_shards, digits_val):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = ["logger=tensorboard", "sample.every_n_steps=3", "sample.prompts=[a handwritten 3,a handwritten 7]",
            "sample.per_prompt=2", "trainer.checkpoint_every_n_steps=3", "optimizer.lr=3e-4",
            f"data.val_path={digits_val}", "eval.val_every_n_steps=3"]
    run_dir = Path(train(compose_cfg(cheap(tmp_path, digits_shards, *args, steps=6)))["run_dir"])
    train(compose_cfg(cheap(tmp_path, digits_shards, *args, "resume=auto", steps=9)))
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    events.Reload()
    tags = events.Tags()
    # the scalars W&B gets (tests/test_loggers.py), every step of both runs once
    per_step = {"train/loss", "lr-AdamW", "train/device/samples_per_sec", "train/grad_norm", "train/data_wait_ms",
                "trainer/images_seen", *(f"train/loss_t{i}" for i in range(4))}
    assert per_step <= set(tags["scalars"]), sorted(tags["scalars"])
    assert [e.step for e in events.Scalars("train/loss")] == list(range(9))
    # the validation loss at the first step of each run (0, and 6 again on resuming) and every 3 steps
    assert [e.step for e in events.Scalars("val/loss")] == [0, 3, 6, 6, 9]
    assert {f"val/loss_t{i}" for i in range(4)} <= set(tags["scalars"])
    # each grid (steps 3, 6, 9) as one picture of its 4 images (prompt x seed, 96 px each, in a row) with their captions
    assert "samples" in tags["images"] and "samples/captions/text_summary" in tags["tensors"], tags
    grids = events.Images("samples")
    assert [g.step for g in grids] == [3, 6, 9], [(g.step, g.width, g.height) for g in grids]
    assert all((g.width, g.height) == (4 * 96, 96) for g in grids), [(g.width, g.height) for g in grids]
    (captions, *_) = events.Tensors("samples/captions/text_summary")
    text = captions.tensor_proto.string_val[0].decode()
    for i, c in enumerate(["a handwritten 3 (seed 0)", "a handwritten 7 (seed 0)", "a handwritten 3 (seed 1)",
                           "a handwritten 7 (seed 1)"]):
        assert f"{i}: {c}" in text, text
    # the resolved config, in hparams.yaml and in the Text tab
    assert "config/text_summary" in tags["tensors"]
    config = yaml.safe_load((run_dir / "tensorboard" / "hparams.yaml").read_text())
    assert {"optimizer", "model"} <= set(config), config
    assert config["optimizer"]["lr"] == 3e-4 and config["model"]["in_channels"] == 1
