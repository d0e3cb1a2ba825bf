"""logger=wandb with the real wandb package, offline (no API key), read back from what it wrote."""

from __future__ import annotations

from pathlib import Path

import pytest

from framework.train import train
from tests.test_train import cheap, compose_cfg
from tests.wandb_records import history, run_ids, wait_for_exit

pytest.importorskip("wandb")


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """No API key anywhere: a fresh HOME (no ~/.netrc) and no WANDB_* variables from the caller."""
    import os

    for k in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_SILENT", "true")


def _log_file(run_dir: Path, run_no: int) -> Path:
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) > run_no, f"no offline run #{run_no} under {run_dir / 'wandb'}: {runs}"
    (log,) = runs[run_no].glob("run-*.wandb")
    wait_for_exit(log)
    return log


def test_wandb_offline_logs_loss_lr_throughput_and_grids_and_resumes_the_same_run(tmp_path, digits_shards, offline_wandb):
    args = ["logger=wandb", "sample.every_n_steps=3", "trainer.checkpoint_every_n_steps=3"]
    first = train(compose_cfg(cheap(tmp_path, digits_shards, *args, steps=24)))
    run_dir = Path(first["run_dir"])
    run_id = (run_dir / "wandb_id.txt").read_text().strip()
    log = _log_file(run_dir, 0)
    assert run_ids(log) == [run_id]
    rows = history(log)
    keys = set().union(*rows)
    assert {"train/loss", "lr-AdamW", "train/device/samples_per_sec"} <= keys, sorted(keys)
    loss_steps = sorted(r["trainer/global_step"] for r in rows if "train/loss" in r)
    assert loss_steps == list(range(24))
    grids = [r for r in rows if r.get("samples/_type") == "images/separated"]
    assert len(grids) == 8  # steps 3, 6, ..., 24
    media = list(log.parent.glob("files/media/images/samples_*.png"))
    assert len(media) == 8

    # A resumed run (resume=auto, same run.dir) continues the same W&B run and its step count.
    train(compose_cfg(cheap(tmp_path, digits_shards, *args, "resume=auto", steps=30)))
    log2 = _log_file(run_dir, 1)
    assert run_ids(log2) == [run_id]
    steps2 = sorted(r["trainer/global_step"] for r in history(log2) if "train/loss" in r)
    assert steps2 == list(range(24, 30))
