"""The validation loss (eval.val_every_n_steps) and its held-out split (precompute val_fraction=).

References: the records' keys (the split must follow them alone), a run whose weights cannot move (lr 1e-30: every
evaluation must give the same numbers, whatever the batch size that reads them), and the split's own counts.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from framework.training.validation import HeldOut
from tests.helpers import cheap, compose_cfg, digits_config

FIT = ["model.in_channels=1", "model.sample_size=8", "model.text_dim=384"]


def _keys(path: Path) -> list[str]:
    """The record keys of a dataset's rows (a row's key is its record's, then '#' and the caption's index)."""
    held = HeldOut(str(path))
    return [row["key"].split("#")[0] for group in held.groups for row in (group[i] for i in range(len(group)))]


def test_val_fraction_holds_out_the_records_whose_keys_hash_low(tmp_path):
    """precompute val_fraction=0.25 writes two datasets: out (the training records) and out/val (the held-out ones),
    disjoint, together every record; the held-out ones are those whose key's CRC-32 is in the lowest quarter (of the
    digits 3 and 7: a small dataset)."""
    import zlib

    from data_prep.precompute import precompute

    from data_prep.sources.digits import load_digits

    source = {"name": "digits", "rows_per_image": 1, "labels": [3, 7]}  # 290 records: a small dataset
    out = Path(precompute(digits_config(tmp_path / "d", val_fraction=0.25, source=source), rank=0, world_size=1))
    records = int(sum(load_digits("train")[1] == d for d in (3, 7)).sum())
    train, val = _keys(out), _keys(out / "val")
    assert len(set(train)) == len(train) and len(set(val)) == len(val) and not set(train) & set(val)
    assert len(train) + len(val) == records
    assert all(zlib.crc32(k.encode()) < 0.25 * 2**32 for k in val)
    assert all(zlib.crc32(k.encode()) >= 0.25 * 2**32 for k in train)
    assert 0.15 < len(val) / records < 0.35
    info = json.loads((out / "dataset.json").read_text())
    assert info["num_samples"] == len(train) and info["skipped"]["filtered"]["other_split"] == len(val)


def _val_rows(run_dir: Path) -> dict[int, dict[str, float]]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return {int(r["step"]): {k: float(v) for k, v in r.items() if k.startswith("val/") and v}
                for r in csv.DictReader(f) if r.get("val/loss")}


def test_the_validation_loss_of_unchanged_weights_is_the_same_at_every_evaluation(tmp_path, digits_shards, digits_val):
    """lr 1e-30: the weights do not move (an Adam step of 1e-30 is lost in every weight's float32 rounding, save a few
    zero biases'), so each evaluation (steps 0, 2, 4) gives the same val/loss and val/loss_t0..3, which equal the loss
    computed again from the final checkpoint in batches of 5 (the last one padded otherwise than in batches of 16),
    while train/loss, drawn anew each step, moves."""
    from types import SimpleNamespace

    from framework.inference.checkpoint import build_model, read_checkpoint
    from framework.models.objectives import Objective, ObjectiveConfig
    from framework.train import train
    from framework.training.validation import validation_loss

    run = train(compose_cfg(cheap(tmp_path, digits_shards, *FIT, "logger=csv", "optimizer.lr=1e-30",
                                  "optimizer.warmup_steps=0", f"data.val_path={digits_val}", "eval.val_every_n_steps=2",
                                  "sample.every_n_steps=0", steps=4)))
    rows = _val_rows(Path(run["run_dir"]))
    assert sorted(rows) == [0, 2, 4]
    assert set(rows[0]) == {"val/loss", *(f"val/loss_t{k}" for k in range(4))}
    for step in (2, 4):
        assert rows[step] == pytest.approx(rows[0], rel=1e-9)
    ckpt = read_checkpoint(run["checkpoint"])
    config = ckpt["latentforge"]["config"]
    model = build_model(ckpt, "train").eval()
    module = SimpleNamespace(model=model, model_cfg=model.cfg, objective=Objective(ObjectiveConfig(**config["objective"])),
                             device=torch.device("cpu"), trainer=SimpleNamespace(world_size=1))
    again = validation_loss(module, HeldOut(str(digits_val)), 0, 1, 5, config["seed"])
    assert again == pytest.approx(rows[4], rel=1e-6)
    with open(Path(run["run_dir"]) / "metrics.csv", newline="") as f:
        train_losses = [float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")]
    assert len(set(train_losses)) == len(train_losses) == 4


def test_the_validation_loss_measures_the_weights_being_trained(tmp_path, digits_shards, digits_val):
    """At the ordinary lr the weights move, and with an EMA beside them (decay 0.5, far from the weights after 4
    steps) val/loss at step 4 is the loss of the final training weights computed again from the checkpoint, not the
    EMA's and not step 0's."""
    from types import SimpleNamespace

    from framework.inference.checkpoint import build_model, read_checkpoint
    from framework.models.objectives import Objective, ObjectiveConfig
    from framework.train import train
    from framework.training.validation import validation_loss

    run = train(compose_cfg(cheap(tmp_path, digits_shards, *FIT, "logger=csv", "optimizer.lr=1e-3",
                                  "optimizer.warmup_steps=0", f"data.val_path={digits_val}", "eval.val_every_n_steps=4",
                                  "sample.every_n_steps=0", "plugins=[ema]", "plugins.ema.decay=0.5", steps=4)))
    rows = _val_rows(Path(run["run_dir"]))
    assert sorted(rows) == [0, 4]
    ckpt = read_checkpoint(run["checkpoint"])
    config = ckpt["latentforge"]["config"]

    def again(kind: str) -> dict[str, float]:
        model = build_model(ckpt, kind).eval()
        module = SimpleNamespace(model=model, model_cfg=model.cfg, device=torch.device("cpu"),
                                 objective=Objective(ObjectiveConfig(**config["objective"])),
                                 trainer=SimpleNamespace(world_size=1))
        return validation_loss(module, HeldOut(str(digits_val)), 0, 1, 16, config["seed"])

    trained, ema = again("train"), again("ema")
    assert rows[4] == pytest.approx(trained, rel=1e-6)
    assert abs(ema["val/loss"] - trained["val/loss"]) > 1e-4 and abs(rows[4]["val/loss"] - rows[0]["val/loss"]) > 1e-4


def test_a_validation_loss_without_held_out_latents_is_refused(tmp_path, digits_shards):
    from framework.train import train

    with pytest.raises(ValueError, match="needs held-out latents: give data.val_path=DIR"):
        train(compose_cfg(cheap(tmp_path, digits_shards, *FIT, "logger=none", "eval.val_every_n_steps=2", steps=2)))
