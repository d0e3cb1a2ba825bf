"""The trainer through its real config: compose conf/, shrink only the cost settings, run on CPU."""

from __future__ import annotations

import csv
import gc
import math
import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from framework import config as config_lib
from framework.train import train
from tests import zygote
from tests.helpers import CONF, LEAST_GRID, ROOT, cheap, compose_cfg, losses, make_tiny_vlm, with_callback

config_lib.register()

DEBUG_PRESETS = ["pixart_debug", "sana_debug", "dit_debug", "sd2_unet_debug"]


# --------------------------------------------------------------------------------------------
# Composition and validation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (CONF / "experiment").glob("*.yaml")))
def test_every_experiment_composes(experiment):
    # The real-size experiments read data=shards, whose path the user gives; an adapter recipe, its base (init_from).
    text = (CONF / "experiment" / f"{experiment}.yaml").read_text()
    given = ["data.path=DIR"] if "data.path=" in text else []  # the command each recipe's header gives
    given += ["init_from=DIR"] if "override /adapter: lora" in text else []
    given += ["plugins.growth.ckpt=DIR"] if "ckpt: ???" in text else []
    cfg = config_lib.to_object(compose_cfg([f"experiment={experiment}", *given]))  # the plugins' own fields too
    assert cfg.trainer.max_steps > 0


def test_a_misspelled_plugin_field_is_refused_before_any_data_is_built(tmp_path):
    """plugins.ema.decy: refused by the config check, naming the plugin, before train() would prepare data.path (a
    folder that does not exist yet, with data.prepare set, would be built first)."""
    where = tmp_path / "not_built"
    overrides = ["plugins=[ema]", "+plugins.ema.decy=0.9", f"data.path={where}", f"data.prepare.out={where}"]
    with pytest.raises(ValueError, match=r"plugins.ema: .*decy"):
        config_lib.to_object(compose_cfg(overrides))
    with pytest.raises(ValueError, match=r"plugins.ema: .*decy"):
        train(compose_cfg(overrides))
    assert not (tmp_path / "not_built").exists()


# Parameters of the published models (diffusers' DiT keeps a timestep/label embedder per block: ~750M stored).
REAL_SIZES = {"pixart_xl_2_256": (0.60e9, 0.62e9), "sana_1600m_1024": (1.55e9, 1.65e9), "dit_xl_2_256": (0.67e9, 0.76e9)}


@pytest.mark.parametrize("experiment", sorted(REAL_SIZES))
def test_real_size_experiments_build_their_published_model(experiment):
    from framework.distributed.fsdp import build_meta
    from framework.models.backbones import to_model_config

    cfg = config_lib.to_object(compose_cfg([f"experiment={experiment}", "data.path=DIR"]))
    assert cfg.model.name == experiment and cfg.data.path == "DIR"  # the rest: tests/test_recipes.py's key tables
    model = build_meta(to_model_config(cfg.model).filled())  # the data it was made for
    n = sum(p.numel() for p in model.parameters())
    low, high = REAL_SIZES[experiment]
    assert low <= n <= high, f"{experiment}: {n / 1e9:.3f}B parameters"


def test_a_preset_takes_its_input_and_caption_widths_from_the_dataset(digits_shards):
    """model=PRESET data.path=DIR under the default (quickstart) experiment: the architecture is the preset's,
    the channels / latent size / text width (null in the preset) are the dataset's, each named in the lines the run
    plan prints."""
    from framework.preflight import fit_model_to_data

    cfg = compose_cfg(["model=pixart_xl_2_256", f"data.path={digits_shards}", "data.prepare=null"])
    assert (cfg.model.in_channels, cfg.model.sample_size, cfg.model.text_dim) == (None, None, None)
    assert dict(cfg.model.made_for) == {"in_channels": 4, "sample_size": 32, "text_dim": 4096}
    _, fitted = fit_model_to_data(cfg)
    m = config_lib.to_object(cfg).model
    assert (m.in_channels, m.sample_size, m.sample_width, m.text_dim) == (1, 8, None, 384)
    assert (m.num_layers, m.width, m.learned_sigma) == (28, 1152, False)  # the preset's, the quickstart's sigma
    assert fitted == (f"model.in_channels=1, model.sample_size=8, model.text_dim=384 from {digits_shards}/dataset.json",)


@pytest.mark.parametrize("given", ["model.in_channels=4", "model.in_channels=1"])
def test_a_model_key_the_user_gives_is_checked_against_the_dataset(digits_shards, given):
    """model.in_channels=4 (what the preset was made for) on 1-channel latents is refused, naming both; the
    dataset's own value is accepted as given. No record of the command line is read: null means "the dataset's"."""
    from framework.preflight import fit_model_to_data

    cfg = compose_cfg(["model=pixart_xl_2_256", given, f"data.path={digits_shards}", "data.prepare=null"])
    if given.endswith("=4"):
        with pytest.raises(ValueError, match=r"model.in_channels=4 does not fit the dataset .* has in_channels=1"):
            fit_model_to_data(cfg)
        return
    _, fitted = fit_model_to_data(cfg)
    assert cfg.model.in_channels == 1 and "model.in_channels" not in fitted[0]


@pytest.mark.parametrize("model", sorted(p.stem for p in (CONF / "model").glob("*.yaml")))
def test_every_model_preset_composes(model):
    cfg = compose_cfg([f"model={model}", "data.prepare=null"])
    obj = config_lib.to_object(cfg)
    assert obj.model.name == model


@pytest.mark.parametrize(
    "override,message",
    [
        (["model.num_layrs=3"], "num_layrs"),
        (["trainer.max_steps=many"], "max_steps"),
        (["objective=flow", "sample.sampler=ddim"], "sampler='ddim' cannot sample a model trained with objective='flow'"),
        (["optimizer.lr=-1"], "optimizer.lr=-1"),
        (["strategy=single", "trainer.devices=2"], "use strategy=ddp or strategy=fsdp"),
        (["strategy=fsdp", "trainer.precision=transformer-engine"], "trainer.precision='transformer-engine'"),
        (["trainer.keep_checkpoints=-1"], "trainer.keep_checkpoints=-1"),
        (["trainer.val_check_interval=100"], "trainer.val_check_interval=100: training runs no validation loop"),
        (["optimizer.lr_scaling=log"], "optimizer.lr_scaling='log'"),
        (["strategy=ddp", "trainer.devices=4", "data.global_batch_size=10"],
         "data.global_batch_size=10 does not divide over 4 data-parallel ranks"),
        (["data.global_batch_size=16", "trainer.accumulate_grad_batches=2"],
         "drop trainer.accumulate_grad_batches"),
    ],
)
def test_bad_config_fails_at_start_with_the_key(override, message):
    with pytest.raises((ConfigCompositionException, ValueError)) as err:
        config_lib.to_object(compose_cfg(override))
    text = str(err.value) + str(getattr(err.value, "__cause__", ""))
    assert message in text


@pytest.mark.parametrize("override,key", [("model.in_channels=3", "model.in_channels"), ("model.text_dim=512", "model.text_dim"),
                                          ("model.sample_size=16", "model.sample_size")])
def test_model_that_does_not_fit_the_data_fails_naming_the_key(tmp_path, digits_shards, override, key):
    with pytest.raises(ValueError, match=key) as err:
        train(compose_cfg(cheap(tmp_path, digits_shards, override, "data.prepare=null")))
    assert "dataset.json" in str(err.value)


@pytest.mark.parametrize("job_name", ["train", "interactive"])
def test_a_slurm_job_without_a_gpu_trains_on_the_cpu_only_when_asked(tmp_path, monkeypatch, job_name):
    """trainer.accelerator=auto in a Slurm task (an sbatch job, or srun from an salloc shell named `interactive`) that
    sees no GPU is refused at start-up, naming the key; trainer.accelerator=cpu is accepted. Outside Slurm auto is
    the CPU here, as before."""
    from framework.preflight import check_accelerator

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for k in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(k)
    check_accelerator(config_lib.to_object(compose_cfg(cheap(tmp_path, tmp_path, "trainer.accelerator=auto"))))
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_JOB_NAME", job_name)
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    with pytest.raises(ValueError, match="trainer.accelerator=cpu"):
        check_accelerator(config_lib.to_object(compose_cfg(cheap(tmp_path, tmp_path, "trainer.accelerator=auto"))))
    check_accelerator(config_lib.to_object(compose_cfg(cheap(tmp_path, tmp_path, "trainer.accelerator=cpu"))))


@pytest.mark.parametrize("rank_env", [{}, {"RANK": "1"}, {"SLURM_PROCID": "1"}, {"LOCAL_RANK": "1"}],
                         ids=["rank0", "torchrun-rank1", "srun-rank1", "launcher-rank1"])
def test_only_global_rank_zero_writes_hydra_files_into_the_run_dir(tmp_path, rank_env):
    """Every rank of an srun or torchrun job runs the whole command: only global rank 0 writes run.dir/.hydra/ and
    train.log (the others log to stdout). The run stops at the missing data, after Hydra has set up its outputs."""
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "SLURM_PROCID", "LOCAL_RANK")}
    proc = zygote.run([sys.executable, "-m", "framework.train", f"run.dir={run_dir}", f"data.path={tmp_path / 'none'}",
                       "data.prepare=null"], env={**env, **rank_env, "TMPDIR": str(tmp_path)}, timeout=300)
    assert proc.returncode != 0 and "dataset.json" in proc.stdout + proc.stderr, proc.stderr[-2000:]
    written = sorted(p.name for p in run_dir.iterdir()) if run_dir.exists() else []
    assert written == ([".hydra", "train.log"] if not rank_env else []), written


# --------------------------------------------------------------------------------------------
# Training runs
# --------------------------------------------------------------------------------------------


def _fit_digits(preset: str) -> list[str]:
    """A debug preset on the 1-channel 8x8 MiniLM digits latents: the preset's own channels and text width
    (4 and 4096 / 2304 / 1024) are replaced by the dataset's, nothing else is needed."""
    return [f"model={preset}"]


def test_the_logged_loss_is_the_mean_over_the_logging_interval(tmp_path, digits_shards):
    """With trainer.log_every_n_steps=4 the loss logged at steps 3 and 7 is the mean of the 4 steps' losses since
    the last logged step (the same run logged at every step), not the loss of the one batch at the logged step."""
    every = losses(Path(train(compose_cfg(cheap(tmp_path / "every", digits_shards, "logger=csv", steps=8)))["run_dir"]))
    out = train(compose_cfg(cheap(tmp_path / "four", digits_shards, "logger=csv", "trainer.log_every_n_steps=4", steps=8)))
    logged = losses(Path(out["run_dir"]))
    assert sorted(every) == list(range(8)) and sorted(logged) == [3, 7]
    for step in (3, 7):
        assert logged[step] == pytest.approx(sum(every[s] for s in range(step - 3, step + 1)) / 4, rel=1e-5), step
        assert logged[step] != pytest.approx(every[step], rel=1e-5)


@pytest.mark.parametrize("preset", DEBUG_PRESETS)
@pytest.mark.parametrize("objective", ["eps", "v", "flow"])
def test_debug_presets_train_a_few_steps_with_each_objective(tmp_path, digits_shards, preset, objective):
    cfg = compose_cfg(cheap(tmp_path, digits_shards, *_fit_digits(preset), f"objective={objective}", "logger=none"))
    out = train(cfg)
    ckpt = torch.load(out["checkpoint"], map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 3
    assert (tmp_path / "run" / "config.yaml").exists()
    assert OmegaConf.load(tmp_path / "run" / "config.yaml").objective.name == objective


def test_same_seed_gives_identical_losses(tmp_path, digits_shards):
    a = train(compose_cfg(cheap(tmp_path, digits_shards, steps=6, run="a")))
    b = train(compose_cfg(cheap(tmp_path, digits_shards, steps=6, run="b")))
    la, lb = losses(Path(a["run_dir"])), losses(Path(b["run_dir"]))
    assert len(la) == 6 and la == lb  # bit-identical


def test_loss_goes_down_on_digits(tmp_path, digits_shards):
    # A short warm-up so that 60 steps learn (measured: the last 10 losses average 0.47x the first 10).
    out = train(compose_cfg(cheap(tmp_path, digits_shards, "data.batch_size=32", "optimizer.warmup_steps=10", steps=60)))
    ls = list(losses(Path(out["run_dir"])).values())
    first, last = sum(ls[:10]) / 10, sum(ls[-10:]) / 10
    assert last < 0.7 * first, (first, last)


def test_resume_auto_continues_like_an_uninterrupted_run(tmp_path, digits_shards):
    full = train(compose_cfg(cheap(tmp_path, digits_shards, steps=8, run="full")))
    common = ["trainer.checkpoint_every_n_steps=4", "resume=auto"]
    train(compose_cfg(cheap(tmp_path, digits_shards, *common, steps=4, run="split")))
    resumed = train(compose_cfg(cheap(tmp_path, digits_shards, *common, steps=8, run="split")))
    lf, lr = losses(Path(full["run_dir"])), losses(Path(resumed["run_dir"]))
    assert sorted(lr) == list(range(8)), "metrics.csv keeps the rows from before the restart"
    assert [lr[s] for s in range(4, 8)] == [lf[s] for s in range(4, 8)]
    wf = torch.load(full["checkpoint"], weights_only=True)["state_dict"]
    wr = torch.load(resumed["checkpoint"], weights_only=True)["state_dict"]
    for k in wf:
        torch.testing.assert_close(wr[k], wf[k], rtol=0, atol=0)


def test_a_resume_with_another_global_batch_is_refused_unless_asked_for(tmp_path, digits_shards):
    """Global batch 16 saved; resuming with 8 per step (the same ranks, half the batch) is refused with a message
    naming the key, and goes on with trainer.allow_global_batch_change=true; 2 x 8 by accumulation is accepted."""
    common = ["trainer.checkpoint_every_n_steps=2", "resume=auto"]
    train(compose_cfg(cheap(tmp_path, digits_shards, *common, steps=2)))
    with pytest.raises(ValueError, match="global batch was 16 samples per step with 8.*allow_global_batch_change") as info:
        train(compose_cfg(cheap(tmp_path, digits_shards, *common, "data.batch_size=8", steps=4)))
    del info  # its traceback holds the refused run's StreamingDataset, whose cache folder the next run reuses
    gc.collect()
    out = train(compose_cfg(cheap(tmp_path, digits_shards, *common, "data.batch_size=8",
                                  "trainer.accumulate_grad_batches=2", steps=3)))
    assert torch.load(out["checkpoint"], weights_only=True)["global_step"] == 3
    out = train(compose_cfg(cheap(tmp_path, digits_shards, *common, "data.batch_size=8",
                                  "trainer.allow_global_batch_change=true", steps=4)))
    assert torch.load(out["checkpoint"], weights_only=True)["global_step"] == 4


def test_nonfinite_loss_stops_with_a_message(tmp_path, digits_shards):
    with pytest.raises(Exception, match="loss is nan"):
        train(compose_cfg(cheap(tmp_path, digits_shards, "optimizer.lr=1e30", "trainer.gradient_clip_val=null", steps=30)))


class _PoisonBatch(pl.Callback):
    """Puts a NaN into the latents of one micro-batch."""

    def __init__(self, at: int) -> None:
        self.at, self.seen = at, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.seen == self.at:
            batch["latents"][0, 0, 0, 0] = float("nan")
        self.seen += 1


def test_skip_nonfinite_skips_the_bad_step_and_finishes(tmp_path, digits_shards, monkeypatch):
    import framework.train as train_lib

    base = train_lib.build_callbacks
    monkeypatch.setattr(train_lib, "build_callbacks", lambda cfg, run_dir: [*base(cfg, run_dir), _PoisonBatch(at=2)])
    out = train(compose_cfg(cheap(tmp_path, digits_shards, "trainer.skip_nonfinite=true", steps=5)))
    ckpt = torch.load(out["checkpoint"], weights_only=True)
    assert ckpt["global_step"] == 5  # the skipped step counts as a step (as on several ranks), its update is dropped
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values() if v.is_floating_point())
    assert len(losses(Path(out["run_dir"]))) == 5


class _PoisonGradient(pl.Callback):
    """Puts an inf into one gradient after the backward of one micro-batch (a finite loss, an overflowing backward)."""

    def __init__(self, at: int) -> None:
        self.at, self.seen = at, 0

    def on_after_backward(self, trainer, pl_module) -> None:
        if self.seen == self.at:
            next(p for p in pl_module.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
        self.seen += 1


def test_a_nonfinite_gradient_with_a_finite_loss_is_skipped(tmp_path, digits_shards, monkeypatch):
    """The gradient norm is checked with the loss: step 2's backward overflows while its loss is finite, and
    skip_nonfinite drops that update (the weights saved after step 3 equal those saved after step 2)."""
    with_callback(monkeypatch, _PoisonGradient(at=2))
    out = train(compose_cfg(cheap(tmp_path, digits_shards, "trainer.skip_nonfinite=true",
                                  "trainer.checkpoint_every_n_steps=1", "trainer.keep_checkpoints=10", steps=4)))
    ckpts = Path(out["run_dir"]) / "checkpoints"
    w2, w3, w4 = (torch.load(ckpts / f"step{s:07d}.ckpt", weights_only=True)["state_dict"] for s in (2, 3, 4))
    for k in w2:
        torch.testing.assert_close(w3[k], w2[k], rtol=0, atol=0)
    assert any(not torch.equal(w4[k], w3[k]) for k in w3)  # the next step trains again
    assert all(math.isfinite(v) for v in losses(Path(out["run_dir"])).values())


def test_a_nonfinite_step_found_late_leaves_no_checkpoint_of_its_weights(tmp_path, digits_shards, monkeypatch):
    """Without skip_nonfinite the flag is read on logging steps, before saves and at the end, not every step: with
    logging every 100 steps, the NaN of step 2 stops the run at the next save, and the newest checkpoint on disk
    is the one from before it."""
    with_callback(monkeypatch, _PoisonBatch(at=2))
    with pytest.raises(Exception, match="at step 2; stopping"):
        train(compose_cfg(cheap(tmp_path, digits_shards, "trainer.log_every_n_steps=100",
                                "trainer.checkpoint_every_n_steps=2", "trainer.keep_checkpoints=10", steps=6)))
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step*.ckpt")) == ["step0000002.ckpt"]
    saved = torch.load(ckpts / "step0000002.ckpt", weights_only=True)["state_dict"]
    assert all(torch.isfinite(v).all() for v in saved.values() if v.is_floating_point())


def test_skip_nonfinite_gives_up_on_a_run_of_bad_steps(tmp_path, digits_shards):
    with pytest.raises(Exception, match="consecutive non-finite losses"):
        train(compose_cfg(cheap(tmp_path, digits_shards, "optimizer.lr=1e30", "trainer.gradient_clip_val=null",
                                "trainer.skip_nonfinite=true", steps=60)))


@pytest.mark.slow
def test_quickstart_learns_the_prompts(tmp_path, digits_shards, digits_val):
    """The README's job cut to 500 steps (about a minute): the digits it draws are the ones the captions ask for, and
    the validation loss on the held-out digits (eval.val_every_n_steps=100) falls at every evaluation while the
    training loss (logged as the mean of every 5 steps) goes up and down (each batch its own noise and levels). The
    validation losses measured on 2026-11-27: 2.49, 0.81, 0.68, 0.62, 0.53, 0.50; the 5-step loss rose 34 times in
    80 after step 100.

    The digit judge reads every generated image: a model that ignores its captions scores about 0.1 (measured
    0.14 with caption dropout inverted), one that learned them near 1. The lr is held at its peak after the
    warm-up (the quickstart's cosine over 1,500 steps is still near its peak at step 500; squeezed into 500
    steps it decays early and reaches only 0.80). Measured on a 2-core CPU: 0.99 with seed 0 and with seed 1. Shorter
    runs leave too little margin: 350 steps at lr 7e-4 reached 0.89, 500 steps of batch 32 0.81. The final grid, which
    nothing here reads, is the least one.
    """
    out = train(compose_cfg([
        f"run.dir={tmp_path / 'run'}", f"data.path={digits_shards}", f"data.local={tmp_path / 'cache'}",
        "trainer.max_steps=500", "trainer.enable_progress_bar=false", "trainer.checkpoint_every_n_steps=0",
        "sample.every_n_steps=0", "eval.seeds=2", "logger=csv", "trainer.log_every_n_steps=5",
        "optimizer.schedule=constant", f"data.val_path={digits_val}", "eval.val_every_n_steps=100", *LEAST_GRID,
    ]))
    with open(Path(out["metrics"]), newline="") as f:
        rows = list(csv.DictReader(f))
    val = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    steps = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(val) == 6 and all(b < a for a, b in zip(val, val[1:])), val
    rises = sum(b > a for a, b in zip(steps[20:], steps[21:]))
    assert rises > len(steps[20:]) // 5, rises  # after the first 100 steps, the loss of 5 steps rises often
    metrics = out["eval"]
    assert metrics["num_images"] == 10 * (5 + 3) * 2, metrics  # 5 training and 3 held-out phrasings, 2 seeds
    assert metrics["prompt_accuracy"] >= 0.8, metrics
    assert metrics["heldout_phrasing_accuracy"] >= 0.8, metrics


# --------------------------------------------------------------------------------------------
# Sampling and evaluation from a checkpoint
# --------------------------------------------------------------------------------------------


def test_sample_and_eval_run_end_to_end(tmp_path, digits_shards):
    from framework.sample import SampleCommand, run

    out = train(compose_cfg(cheap(tmp_path, digits_shards, steps=2)))
    ckpt = out["checkpoint"]
    paths = run(SampleCommand(ckpt=ckpt, out=str(tmp_path / "s"), prompts=["a handwritten 3", "the digit seven"], steps=2,
                              best_of=2, judge="digits"))
    assert [p.name for p in paths][-1] == "grid.png" and all(p.exists() for p in paths)
    tournament = run(SampleCommand(ckpt=ckpt, out=str(tmp_path / "t"), prompts=["a handwritten 3"], steps=2, best_of=4,
                                   judge="digits", selection="tournament", pick=2))
    assert len(tournament) == 2 + 1
    vlm = make_tiny_vlm(tmp_path / "vlm", ["a handwritten 3"])  # SANA-1.5's judge: a local VLM's yes / no
    assert len(run(SampleCommand(ckpt=ckpt, out=str(tmp_path / "v"), prompts=["a handwritten 3"], steps=2, best_of=3,
                                 judge="vlm", judge_path=str(vlm), selection="tournament"))) == 1 + 1
    proc = zygote.run(
        [sys.executable, "-m", "framework.eval", f"ckpt={ckpt}", f"out={tmp_path / 'e'}", "seeds=1", "phrasings=1", "steps=2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 0.0 <= metrics["prompt_accuracy"] <= 1.0 and 0.0 <= metrics["heldout_phrasing_accuracy"] <= 1.0
    assert metrics["num_images"] == 10 + 30  # one training phrasing and the three held-out ones, per digit
    assert metrics["fd"] > 0 and metrics["classifier_heldout_accuracy"] >= 0.95


def test_scaling_command_writes_json_and_png(tmp_path, digits_shards):
    out = train(compose_cfg(cheap(tmp_path, digits_shards, steps=2)))
    proc = zygote.run(
        [sys.executable, "-m", "framework.eval", f"ckpt={out['checkpoint']}", f"out={tmp_path / 'e'}", "seeds=1",
         "phrasings=1", "steps=2", "scaling=[1,2,4]"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "e" / "scaling.json").read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == result
    assert [(r["selection"], r["best_of"], r["steps"]) for r in result["rows"]] == [
        (s, n, 2) for s in ("score", "tournament") for n in (1, 2, 4)] + [("steps", 1, 2 * n) for n in (1, 2, 4)]
    assert [r["compute"] for r in result["rows"]] == [2, 4, 8] * 3  # best of N at 2 steps = 1 at 2N steps
    assert result["candidates_generated"] == 40 * 4 and result["images_per_s"] > 0
    by = {(r["selection"], r["best_of"], r["steps"]): r for r in result["rows"]}
    assert by[("score", 1, 2)] == {**by[("tournament", 1, 2)], "selection": "score"}  # N=1: nothing to pick
    assert by[("steps", 1, 2)] == {**by[("score", 1, 2)], "selection": "steps"}
    # The steps curve's point at 8 steps is what a plain evaluation at 8 steps scores.
    proc = zygote.run(
        [sys.executable, "-m", "framework.eval", f"ckpt={out['checkpoint']}", f"out={tmp_path / 'e8'}", "seeds=1",
         "phrasings=1", "steps=8"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    plain = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {k: by[("steps", 1, 8)][k] for k in ("prompt_accuracy", "heldout_phrasing_accuracy", "fd")} == {
        k: plain[k] for k in ("prompt_accuracy", "heldout_phrasing_accuracy", "fd")}
    from PIL import Image

    with Image.open(tmp_path / "e" / "scaling.png") as im:
        assert im.size[0] > 800 and im.size[1] > 300


@pytest.mark.parametrize("accumulate", [1, 2])
def test_throughput_counts_every_batch_and_reads_the_clock_on_logging_steps_only(tmp_path, digits_shards,
                                                                                  monkeypatch, accumulate):
    """train/samples and train/batches count every batch, while the monitor's update (where Lightning waits for the GPU
    to read the clock) runs on logging steps only: 3 of 10 steps at log_every_n_steps=3. With 2 micro-batches per
    step the clock is read once per logged step, after its second micro-batch, and both are counted. The FLOPs each
    reading gets are those of every batch since the previous one (a sample counted as 1000 FLOPs here), so that
    TFLOP/s and MFU are over the same batches as samples/s."""
    import framework.models.flops
    from lightning.fabric.utilities.throughput import Throughput
    from lightning.pytorch.callbacks import ThroughputMonitor

    updates, flops = [], []
    base, update = ThroughputMonitor._update, Throughput.update
    monkeypatch.setattr(ThroughputMonitor, "_update", lambda self, trainer, *a: updates.append(trainer.global_step)
                        or base(self, trainer, *a))
    monkeypatch.setattr(Throughput, "update", lambda self, **kw: flops.append(kw["flops"]) or update(self, **kw))
    monkeypatch.setattr(framework.models.flops, "count_train_flops_per_sample", lambda model, batch: 1000)
    out = train(compose_cfg(cheap(tmp_path, digits_shards, "trainer.log_every_n_steps=3",
                                  f"trainer.accumulate_grad_batches={accumulate}", steps=10)))
    with open(Path(out["run_dir"]) / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/batches")]
    assert updates == [3, 6, 9]  # the trainer's step count after each of those steps
    assert flops == [3 * accumulate * 16 * 1000] * 3  # 3 steps of `accumulate` batches of 16 since each reading
    assert [(int(r["step"]), float(r["train/batches"]), float(r["train/samples"])) for r in rows] == [
        (s, accumulate * (s + 1), 16 * accumulate * (s + 1)) for s in (2, 5, 8)]
    assert all(float(r["train/device/samples_per_sec"]) > 0 for r in rows[1:])


class LoggingSteps(pl.Callback):
    """At each hook of a training step: (hook, framework's logging_step, Lightning's own private flag)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bool, bool]] = []

    def _record(self, trainer: pl.Trainer, hook: str, **kw) -> None:
        from framework.training.registry import logging_step

        self.seen.append((hook, logging_step(trainer, **kw), trainer._logger_connector.should_update_logs))

    def on_train_batch_start(self, trainer, *args) -> None:
        self._start = trainer.global_step
        self._record(trainer, "start")

    def on_before_optimizer_step(self, trainer, *args) -> None:
        self._record(trainer, "before_step")

    def on_train_batch_end(self, trainer, *args) -> None:
        self._record(trainer, "end", stepped=trainer.global_step != self._start)


def test_logging_step_is_lightnings_rule_at_every_hook(tmp_path, digits_shards, monkeypatch):
    """framework.training.registry.logging_step, read from public trainer state, says what Lightning's private
    flag says before, during and after each optimizer step, with 2 micro-batches per step and a log every 3 steps
    (steps 3 and 6 of 7 logged: 2 micro-batches at their start and end, 1 optimizer step each), a skipped non-finite
    step among them (step 3, a logged one: micro-batch 4 holds a NaN)."""
    seen = LoggingSteps()
    with_callback(monkeypatch, seen)
    with_callback(monkeypatch, _PoisonBatch(at=4))
    out = train(compose_cfg(cheap(tmp_path, digits_shards, "trainer.log_every_n_steps=3",
                                  "trainer.accumulate_grad_batches=2", "trainer.skip_nonfinite=true", steps=7)))
    assert torch.load(out["checkpoint"], weights_only=True)["global_step"] == 7
    assert [ours for _, ours, _ in seen.seen] == [lightning for _, _, lightning in seen.seen], seen.seen
    assert sum(ours for _, ours, _ in seen.seen) == 2 * (2 + 2 + 1)
    assert len(seen.seen) == 7 * (2 + 2 + 1)


# --------------------------------------------------------------------------------------------
# Speed switches keep the numerics
# --------------------------------------------------------------------------------------------


class BlockCalls(pl.Callback):
    """Counts the forward calls of the first transformer block during each training step (grids excluded)."""

    def __init__(self) -> None:
        self.per_step: list[int] = []
        self._calls, self._in_step = 0, False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.model = pl_module.model
        self.block = pl_module.model.net.transformer_blocks[0]
        self.block.register_forward_pre_hook(self._count)

    def _count(self, *args) -> None:
        self._calls += self._in_step

    def on_train_batch_start(self, *args) -> None:
        self._calls, self._in_step = 0, True

    def on_train_batch_end(self, *args) -> None:
        self.per_step.append(self._calls)
        self._in_step = False


def test_activation_checkpointing_recomputes_the_blocks_and_keeps_the_losses(tmp_path, digits_shards, extra_callback):
    """strategy.activation_checkpointing=true: each block's forward runs again in backward (twice per forward and
    backward, once without), and the losses are bit-identical to the run that keeps its activations."""
    plain_calls = extra_callback(BlockCalls())
    plain = train(compose_cfg(cheap(tmp_path, digits_shards, steps=4, run="plain")))
    ac_calls = extra_callback(BlockCalls())
    ckpt = train(compose_cfg(cheap(tmp_path, digits_shards, "strategy.activation_checkpointing=true", steps=4, run="ac")))
    # (Step 0 also counts the FLOP-counting pass of the first batch: a forward and backward of its own.)
    assert plain_calls.per_step[1:] == [1] * 3, plain_calls.per_step
    assert ac_calls.per_step == [2 * n for n in plain_calls.per_step], (plain_calls.per_step, ac_calls.per_step)
    assert losses(Path(plain["run_dir"])) == losses(Path(ckpt["run_dir"]))


@pytest.mark.slow
def test_compiled_blocks_run_compiled_and_follow_the_eager_losses(tmp_path, digits_shards, extra_callback):
    """strategy.compile=true: every block runs inside a torch.compile trace in training (none does without it), the
    losses follow the eager run's, and the final grid draws through the eager blocks (compiling their no-grad graphs
    cost more than the grid)."""
    from tests.helpers import CompiledBlocks

    torch.compiler.reset()  # no compiled frames of an earlier test in this worker count towards the recompile limit
    eager_probe = extra_callback(CompiledBlocks())
    eager = train(compose_cfg(cheap(tmp_path, digits_shards, steps=3, run="eager")))
    probe = extra_callback(CompiledBlocks())
    compiled = train(compose_cfg(cheap(tmp_path, digits_shards, "strategy.compile=true", steps=3, run="compiled")))
    assert not any(eager_probe.compiled) and all(probe.compiled), (eager_probe.compiled, probe.compiled)
    assert all(probe.eager), probe.counts  # the grid's calls
    le, lc = losses(Path(eager["run_dir"])), losses(Path(compiled["run_dir"]))
    # Inductor fuses and reorders fp32 arithmetic: equal up to float round-off.
    torch.testing.assert_close(torch.tensor(list(lc.values())), torch.tensor(list(le.values())), rtol=1e-4, atol=1e-5)


def test_optimizer_eps_reaches_adamw_and_its_step():
    """optimizer.eps is AdamW's denominator epsilon: at 1.0 the first step is lr * g / (|g| + 1), not lr * sign(g)."""
    from framework.training.optim import OptimizerConfig, build_optimizer

    p = torch.nn.Parameter(torch.zeros(3))
    opt = build_optimizer([p], OptimizerConfig(lr=0.1, eps=1.0, weight_decay=0.0))
    assert opt.param_groups[0]["eps"] == 1.0
    g = torch.tensor([1.0, -2.0, 0.5])
    p.grad = g.clone()
    opt.step()
    torch.testing.assert_close(p.detach(), -0.1 * g / (g.abs() + 1.0), rtol=1e-6, atol=1e-7)  # bias-corrected step 1


def test_sample_grid_draws_with_the_configured_seed_and_guidance(tmp_path):
    """sample.seed and sample.guidance reach the plan the grid is drawn with (the pipeline is a recorder here)."""
    from types import SimpleNamespace

    from framework.config import SampleConfig
    from framework.training.callbacks import SampleGrid

    class Recorder:
        model = SimpleNamespace(cfg=SimpleNamespace(num_classes=None))
        def __init__(self) -> None:
            self.plans = []

        def generate(self, prompts, plan, labels, ranks=None):
            self.plans.append(plan)
            return torch.zeros(len(prompts), 3, 4, 4)

        def free_text_encoder(self):
            pass

    module = pl.LightningModule()
    module.model = torch.nn.Linear(1, 1)
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    grid = SampleGrid(SampleConfig(prompts=["a", "b"], per_prompt=1, seed=7, guidance=2.5), tmp_path)
    grid._pipe = Recorder()
    assert grid.draw(trainer, module).is_file()
    assert [(p.seed, p.guidance) for p in grid._pipe.plans] == [(7, 2.5)]
