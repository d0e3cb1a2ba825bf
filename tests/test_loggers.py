"""logger=wandb with the real wandb package, offline (no API key), read back from what it wrote."""

from __future__ import annotations

from pathlib import Path

import pytest

from framework.train import train
from tests.helpers import cheap, compose_cfg, history, run_ids, run_record, wait_for_exit, wandb_config

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


def test_wandb_offline_logs_loss_lr_throughput_and_grids_and_resumes_the_same_run(tmp_path, digits_shards, offline_wandb,
                                                                                    digits_val):
    args = ["logger=wandb", "sample.every_n_steps=3", "sample.prompts=[a handwritten 3,a handwritten 7]",
            "sample.per_prompt=2", "trainer.checkpoint_every_n_steps=3", "logger.name=fox-256",
            "logger.group=ablation", "logger.tags=[baseline,cpu]", "optimizer.lr=3e-4", f"data.val_path={digits_val}",
            "eval.val_every_n_steps=12"]
    first = train(compose_cfg(cheap(tmp_path, digits_shards, *args, steps=24)))
    run_dir = Path(first["run_dir"])
    run_id = (run_dir / "wandb_id.txt").read_text().strip()
    log = _log_file(run_dir, 0)
    assert run_ids(log) == [run_id]
    run = run_record(log)
    assert (run.display_name, run.run_group, list(run.tags)) == ("fox-256", "ablation", ["baseline", "cpu"])
    assert wandb_config(log)["optimizer"]["lr"] == 3e-4 and wandb_config(log)["model"]["in_channels"] == 1  # the resolved config
    rows = history(log)
    keys = set().union(*rows)
    per_step = {"train/loss", "lr-AdamW", "train/device/samples_per_sec", "train/grad_norm", "train/data_wait_ms",
                "trainer/images_seen"}
    assert per_step <= keys, sorted(keys)
    loss_steps = sorted(r["trainer/global_step"] for r in rows if "train/loss" in r)
    assert loss_steps == list(range(24))
    val = [r for r in rows if "val/loss" in r]  # the validation loss and its quarters at steps 0, 12 and 24
    assert [r["trainer/global_step"] for r in val] == [0, 12, 24] and all(f"val/loss_t{i}" in val[0] for i in range(4))
    # Every step logged its gradient norm (> 0: the optimizer had gradients), its data wait from step 1 on, and
    # the loss of each noise-level quarter its samples fell in; the step's loss, their count-weighted mean, lies
    # between the lowest and the highest of them.
    norms = [r["train/grad_norm"] for r in rows if "train/grad_norm" in r]
    assert len(norms) == 24 and min(norms) > 0
    assert len([r for r in rows if "train/data_wait_ms" in r]) == 23
    levels = [r for r in rows if any(k.startswith("train/loss_t") for k in r)]
    assert len(levels) == 24 and {k for r in levels for k in r if k.startswith("train/loss_t")} == {
        f"train/loss_t{i}" for i in range(4)}
    for r in levels:
        quarters = [v for k, v in r.items() if k.startswith("train/loss_t")]
        assert min(quarters) - 1e-5 <= r["train/loss"] <= max(quarters) + 1e-5, r
    grids = [r for r in rows if r.get("samples/_type") == "images/separated"]
    assert len(grids) == 8  # steps 3, 6, ..., 24
    # Each grid as one image per prompt and seed, captioned with its prompt (the grid itself is in run.dir/samples/).
    for g in grids:
        assert g["samples/count"] == 4 and g.get("samples/captions") == [
            "a handwritten 3 (seed 0)", "a handwritten 7 (seed 0)", "a handwritten 3 (seed 1)", "a handwritten 7 (seed 1)"]
    media = list(log.parent.glob("files/media/images/samples_*.png"))
    assert len(media) == 8 * 4

    # A resumed run (resume=auto, same run.dir) continues the same W&B run and its step count.
    train(compose_cfg(cheap(tmp_path, digits_shards, *args, "resume=auto", steps=30)))
    log2 = _log_file(run_dir, 1)
    assert run_ids(log2) == [run_id]
    steps2 = sorted(r["trainer/global_step"] for r in history(log2) if "train/loss" in r)
    assert steps2 == list(range(24, 30))
    # trainer/images_seen: the job's samples so far (16 a step), continued by the resumed run from its checkpoint.
    batch = wandb_config(log)["data"]["batch_size"]
    for rows_of_run, want_steps in ((rows, range(24)), (history(log2), range(24, 30))):
        seen = {r["trainer/global_step"]: r["trainer/images_seen"] for r in rows_of_run if "trainer/images_seen" in r}
        assert seen == {s: (s + 1) * batch for s in want_steps}, seen



@pytest.mark.parametrize("kind", ["csv", "wandb"])
def test_a_watching_evaluation_logs_into_the_runs_logger(tmp_path, offline_wandb, kind):
    """framework.eval watch='s metrics of each checkpoint, at its step: csv to its own metrics.csv (the training owns
    run.dir's), W&B to an offline run of the training run's group named <name>-eval, over trainer/global_step."""
    import csv

    from framework.evaluation.watch import RunLogger

    run_dir, out = tmp_path / "run", tmp_path / "run" / "eval"
    out.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(f"name: digits\nlogger:\n  kind: {kind}\n  mode: offline\n  group: null\n")
    (run_dir / "wandb_id.txt").write_text("train123")
    logger = RunLogger(run_dir, out)
    logger.log({"eval/prompt_accuracy": 0.25, "eval/fd": 3.0}, 2)
    logger.log({"eval/prompt_accuracy": 0.5, "eval/fd": 2.0}, 4)
    logger.close()
    if kind == "csv":
        rows = list(csv.DictReader((out / "metrics.csv").open(newline="")))
        assert [(r["step"], r["eval/prompt_accuracy"], r["eval/fd"]) for r in rows] == [("2", "0.25", "3.0"),
                                                                                        ("4", "0.5", "2.0")]
        return
    files = list(out.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1
    record = run_record(files[0])
    assert (record.display_name, record.run_group, record.job_type) == ("digits-eval", "train123", "eval")
    rows = [r for r in history(files[0]) if "eval/prompt_accuracy" in r]
    assert [(r["trainer/global_step"], r["eval/prompt_accuracy"]) for r in rows] == [(2, 0.25), (4, 0.5)]
