"""Model growth (plugins/growth) and depth pruning (plugins/prune) against hand-built references."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from framework.inference.sampling import SamplingPlan
from framework.models.blocks import block_views, layer_views, silence_block
from framework.models.backbones import build_denoiser, load_preset
from plugins.growth import GrowthConfig, grow, grow_checkpoint, layer_plan
from plugins.prune import PruneCommand, choose_kept, prune
from tests.helpers import (
    FAMILIES, LEAST_GRID, cheap, compose_cfg, crash_and_resume, forked_children, losses,
)


def _source(name: str, layers: int = 2):
    """A debug model with every weight perturbed (no zero-initialised projection left: each block matters)."""
    cfg = load_preset(name, num_layers=layers)
    torch.manual_seed(1)
    net = build_denoiser(cfg)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return cfg, net


def _outputs(net, cfg) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, cfg.in_channels, *cfg.latent_shape, generator=g)  # clips (2, C, F, h, w)
    text = torch.randn(2, 5, cfg.text_dim or 8, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    labels = torch.tensor([3, 7]) if cfg.family == "dit" else None
    with torch.no_grad():
        return net(x, torch.tensor([20.0, 700.0]), text, mask, labels)


def _grown_net(cfg, state, layers):
    net = build_denoiser(dataclasses.replace(cfg, num_layers=layers))
    net.load_state_dict(state)
    return net


# The stack families: the image ones, Wan (its 3D blocks are one stack, net.blocks) and Latte (layer i: its spatial and
# temporal block i)
STACKS = [*FAMILIES, "wan_debug", "latte_debug"]


@pytest.mark.parametrize("init", ["constant", "cyclic", "block_expand"])
@pytest.mark.parametrize("name", STACKS)
def test_grown_model_computes_the_source_function(name, init):
    cfg, src = _source(name)
    state, plan = grow(src.state_dict(), cfg, 5, init, seed=3)
    grown = _grown_net(cfg, state, 5)
    ref = _outputs(src, cfg)
    torch.testing.assert_close(_outputs(grown, cfg), ref, rtol=0, atol=1e-6)
    assert ref.abs().max() > 0.1
    # The copied blocks are the source's, except what makes a new block the identity: the output projections and
    # the block's own adaLN table (pixart, sana), or the adaLN-Zero modulation (dit, whose projections keep their
    # weights so that its gates get gradients). Every new block still carries non-zero weights to train.
    zeroed = ("norm1.linear",) if cfg.family == "dit" else (
        "attn1.to_out", "attn2.to_out", "ff.net.2", "ffn.net.2", "ff.conv_point", "scale_shift_table")
    layers, source_layers = layer_views(grown), layer_views(src)
    for j, (s, silenced) in enumerate(plan):
        for n, view in enumerate(layers[j]):  # a layer's blocks: one, or Latte's spatial and temporal block
            block = view.module.state_dict()
            if s is not None:
                for k, v in source_layers[s][n].module.state_dict().items():
                    if not (silenced and k.startswith(zeroed)):
                        assert torch.equal(block[k], v), (j, k)
            if silenced:
                assert all(not v.any() for k, v in block.items() if k.startswith(zeroed)), j
            assert view.branches[0].module.to_q.weight.abs().sum() > 0
            if cfg.family == "dit":
                assert all(b.out_proj.weight.abs().sum() > 0 for b in view.branches)


@pytest.mark.parametrize("name", STACKS)
def test_fresh_blocks_are_initialised_as_documented(name):
    """init=constant's fresh blocks: linear weights N(0, 0.02) (checked on their statistics), biases 0, norm weights 1;
    the same seed gives the same blocks."""
    cfg, src = _source(name)
    state, plan = grow(src.state_dict(), cfg, 4, "constant", zero_gate=False, seed=3)
    again, _ = grow(src.state_dict(), cfg, 4, "constant", zero_gate=False, seed=3)
    assert all(torch.equal(state[k], again[k]) for k in state)
    fresh = [j for j, (s, _) in enumerate(plan) if s is None]
    assert fresh == [2, 3]
    block = layer_views(_grown_net(cfg, state, 4))[2][-1].module  # Latte: layer 2's temporal block
    weights = torch.cat([m.weight.flatten() for m in block.modules() if isinstance(m, torch.nn.Linear)])
    assert abs(weights.std().item() - 0.02) < 0.002 and abs(weights.mean().item()) < 0.002
    for m in block.modules():
        if isinstance(m, torch.nn.Linear) and m.bias is not None:
            assert not m.bias.any()
        if isinstance(m, torch.nn.LayerNorm) and m.weight is not None:
            assert torch.equal(m.weight, torch.ones_like(m.weight))


@pytest.mark.parametrize("name", STACKS)
def test_without_zero_gate_or_with_drop_last_the_function_changes(name):
    cfg, src = _source(name)
    ref = _outputs(src, cfg)
    for kwargs in (dict(init="cyclic", zero_gate=False), dict(init="constant", zero_gate=False),
                   dict(init="constant", drop_last=1)):
        state, _ = grow(src.state_dict(), cfg, 4, seed=3, **kwargs)
        assert (_outputs(_grown_net(cfg, state, 4), cfg) - ref).abs().max() > 1e-3, kwargs


def test_growing_a_model_without_qk_norm_warns_and_names_the_key_that_adds_it():
    """SANA-1.5 calls QK-norm crucial for every growth initialisation: growing a model without it warns, naming
    model.kwargs.qk_norm where the family's diffusers class takes it; a SANA with it grows silently."""
    import warnings

    for name, key in (("sana_debug", True), ("pixart_debug", False)):
        cfg, src = _source(name)
        with pytest.warns(UserWarning, match="no QK normalisation") as caught:
            grow(src.state_dict(), cfg, 3, seed=0)
        assert ("model.kwargs.qk_norm=rms_norm_across_heads" in str(caught[0].message)) is key, caught[0].message
    cfg = load_preset("sana_debug", num_layers=2, kwargs={**load_preset("sana_debug").kwargs,
                                                          "qk_norm": "rms_norm_across_heads"})
    src = build_denoiser(cfg)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*QK normalisation")
        grow(src.state_dict(), cfg, 3, seed=0)


def test_growth_config_seed_weights_and_zero_gate_reach_the_grown_weights(monkeypatch):
    """plugins.growth.seed (null: the run's), .weights and .zero_gate reach grow(): the checkpoint reader is a stub
    here, the grown weights are compared with grow() called by hand."""
    from types import SimpleNamespace

    import framework.inference.checkpoint as checkpoint
    from plugins.growth import build

    run = SimpleNamespace(init_from=None, seed=1)
    assert (build(GrowthConfig(ckpt="x", seed=5), run).seed, build(GrowthConfig(ckpt="x"), run).seed) == (5, 1)
    cfg, src = _source(FAMILIES[0])
    asked = []
    monkeypatch.setattr(checkpoint, "read_checkpoint",
                        lambda path: {checkpoint.CKPT_KEY: {"config": {"model": dataclasses.asdict(cfg)}}})
    monkeypatch.setattr(checkpoint, "weights_used", lambda ckpt, which: asked.append(which) or which)
    monkeypatch.setattr(checkpoint, "model_weights", lambda ckpt, used: src.state_dict())
    state, _, record = grow_checkpoint("x", 4, GrowthConfig(ckpt="x", weights="train", zero_gate=False), seed=3)
    ref, _ = grow(src.state_dict(), cfg, 4, "constant", 0, False, 3)
    assert asked == ["train"] and record["zero_gate"] is False and state.keys() == ref.keys()
    assert all(torch.equal(state[k], ref[k]) for k in ref)


def test_layer_plans_by_hand():
    assert layer_plan(3, 5, "constant") == [(0, False), (1, False), (2, False), (None, True), (None, True)]
    assert layer_plan(3, 5, "constant", drop_last=1) == [(0, False), (1, False), (None, True), (None, True), (None, True)]
    assert layer_plan(2, 5, "cyclic") == [(0, False), (1, False), (0, True), (1, True), (0, True)]
    assert layer_plan(2, 4, "block_expand") == [(0, False), (0, True), (1, False), (1, True)]
    assert layer_plan(3, 5, "block_expand") == [(0, False), (0, True), (1, False), (1, True), (2, False)]


def test_growth_refuses_the_unet_and_mismatched_sources():
    cfg = load_preset("sd2_unet_debug")
    with pytest.raises(ValueError, match="unet has no stack"):
        grow(build_denoiser(cfg).state_dict(), cfg, cfg.num_layers + 1)
    cfg, src = _source("pixart_debug")
    with pytest.raises(ValueError, match="not more than the source"):
        grow(src.state_dict(), cfg, 2)
    with pytest.raises(ValueError, match="drop_last=1 applies to init=constant only"):
        GrowthConfig(ckpt="x", init="cyclic", drop_last=1)


# --------------------------------------------------------------------------------------------
# Through training, sampling, evaluation and export
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory, digits_shards) -> Path:
    """A 4-block quickstart model trained for 3 steps: the growth source."""
    from framework.train import train

    tmp = tmp_path_factory.mktemp("small")
    return Path(train(compose_cfg(cheap(tmp, digits_shards, steps=3)))["checkpoint"])


def test_grown_run_starts_at_the_source_models_loss_and_its_ema_at_the_grown_weights(tmp_path, digits_shards, small_ckpt):
    from framework.inference.checkpoint import model_weights, read_checkpoint
    from framework.train import train

    source = train(compose_cfg(cheap(tmp_path, digits_shards, f"init_from={small_ckpt}", steps=1, run="source")))
    grown = train(compose_cfg(cheap(tmp_path, digits_shards, "plugins=[growth,ema]", f"plugins.growth.ckpt={small_ckpt}",
                                    "model.num_layers=6", "plugins.ema.decay=0.999999", steps=1, run="grown")))
    # Step 0: the same batch and noise through the same function.
    assert abs(losses(Path(grown["run_dir"]))[0] - losses(Path(source["run_dir"]))[0]) < 1e-6
    expected, _, record = grow_checkpoint(str(small_ckpt), 6, GrowthConfig(ckpt=str(small_ckpt)), seed=0)
    assert record["weights"] == "train" and record["from_layers"] == 4
    ema = model_weights(read_checkpoint(grown["checkpoint"]), "ema")
    for k, v in expected.items():
        torch.testing.assert_close(ema[k], v, rtol=0, atol=1e-6)


def test_a_grown_run_continues_the_schedule_and_warms_up_only_its_new_blocks(tmp_path, digits_shards, small_ckpt):
    """optimizer.schedule_start / schedule_steps continue the small run's cosine schedule (its peak scaled by
    lr_scaling=sqrt from the reference batch to this run's); the new blocks' group runs
    at new_lr_scale times it, ramped over new_warmup_steps (hand-computed lr per group and step); each new block's
    output-projection norm and block importance are logged at every logging step."""
    import csv
    import math

    from framework.train import train

    grown = train(compose_cfg(cheap(
        tmp_path, digits_shards, "plugins=[growth]", f"plugins.growth.ckpt={small_ckpt}", "plugins.growth.init=cyclic",
        "plugins.growth.new_lr_scale=2.0", "plugins.growth.new_warmup_steps=4", "model.num_layers=6",
        "optimizer.lr=1e-3", "optimizer.warmup_steps=2", "optimizer.schedule=cosine", "optimizer.min_lr_ratio=0.1",
        "optimizer.schedule_steps=10", "optimizer.schedule_start=3", "optimizer.lr_scaling=sqrt",
        "optimizer.lr_reference_batch=64", steps=3)))
    with open(Path(grown["run_dir"]) / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))

    def schedule(step: int) -> float:  # the 10-step plan entered at its step 3: warm-up (2 steps) long over
        progress = (step + 3 - 2) / (10 - 2)
        peak = 1e-3 * math.sqrt(16 / 64)  # lr_scaling=sqrt: this run's 16 samples per step, lr given for 64
        return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    kept = {int(r["step"]): float(r["lr-AdamW/pg1"]) for r in rows if r.get("lr-AdamW/pg1")}
    new = {int(r["step"]): float(r["lr-AdamW/pg2"]) for r in rows if r.get("lr-AdamW/pg2")}
    assert sorted(kept) == sorted(new) == [0, 1, 2]
    for step in range(3):
        assert kept[step] == pytest.approx(schedule(step), rel=1e-6)
        assert new[step] == pytest.approx(2.0 * schedule(step) * (step + 1) / 4, rel=1e-6)
    # cyclic 4 -> 6: blocks 4 and 5 are the new ones (repeats of 0 and 1)
    logged = {k for r in rows for k, v in r.items() if v and k.startswith("growth/")}
    assert logged == {"growth/out_norm_4", "growth/out_norm_5", "growth/bi_4", "growth/bi_5"}
    norms = [float(r["growth/out_norm_4"]) for r in rows if r.get("growth/out_norm_4")]
    assert len(norms) == 3 and norms[0] > 0  # trained away from zero from the first step
    assert all(0.0 <= float(r["growth/bi_5"]) <= 2.0 for r in rows if r.get("growth/bi_5"))


def test_growth_run_resumes_after_a_crash_like_an_uninterrupted_run(tmp_path, digits_shards, small_ckpt, monkeypatch):
    crash_and_resume(tmp_path, digits_shards, ["plugins=[growth]", f"plugins.growth.ckpt={small_ckpt}",
                                               "plugins.growth.init=cyclic", "model.num_layers=6"], monkeypatch)


def test_grown_and_pruned_checkpoints_work_in_every_command(tmp_path, digits_shards, small_ckpt):
    """An identity block (zeroed output projections) gets BI ~0 and goes first; the grown and pruned
    checkpoints sample, evaluate, export to diffusers (loaded back with the reduced depth) and train."""
    from diffusers import PixArtTransformer2DModel

    from framework.training.checkpointing import save_derived
    from framework.eval import EvalCommand, evaluate
    from framework.export import ExportCommand, export
    from framework.inference.checkpoint import read_checkpoint
    from framework.inference.pipeline import Pipeline
    from framework.train import train

    state, source, record = grow_checkpoint(str(small_ckpt), 5, GrowthConfig(ckpt=str(small_ckpt)), seed=0)
    grown = save_derived(tmp_path / "grown.ckpt", state, source, {"num_layers": 5}, record)
    # Block 4 is the fresh, silenced block of init=constant; make block 1 the identity too.
    pipe = Pipeline.from_checkpoint(grown)
    assert pipe.model.cfg.num_layers == 5
    silence_block(block_views(pipe.model)[1])
    marked = save_derived(tmp_path / "marked.ckpt", pipe.model.state_dict(), read_checkpoint(grown), {}, {"test": 1})
    report = prune(PruneCommand(ckpt=str(marked), keep=3, out=str(tmp_path / "pruned" / "p.ckpt"),
                                prompts=["a handwritten 3", "the digit 5"], steps=3))
    bi = report["importance"]
    assert bi[1] < 1e-6 and bi[4] < 1e-6 and min(bi[i] for i in (0, 2, 3)) > 1e-3, bi
    assert report["dropped"] == [1, 4] and report["kept"] == [0, 2, 3]
    assert (tmp_path / "pruned" / "importance.json").exists() and (tmp_path / "pruned" / "importance.png").exists()
    pruned = tmp_path / "pruned" / "p.ckpt"
    # Dropping identity blocks keeps the function: the pruned model samples what the marked one does.
    plan = SamplingPlan(steps=3, seed=1)
    a = Pipeline.from_checkpoint(marked).generate(["a handwritten 3"], plan)
    b = Pipeline.from_checkpoint(pruned).generate(["a handwritten 3"], plan)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    metrics = evaluate(Pipeline.from_checkpoint(pruned), EvalCommand(ckpt=str(pruned), seeds=1, phrasings=1, steps=2))
    assert 0 <= metrics["prompt_accuracy"] <= 1 and metrics["fd"] > 0
    folder = export(ExportCommand(ckpt=str(pruned), out=str(tmp_path / "diffusers"), format="diffusers"))
    net = PixArtTransformer2DModel.from_pretrained(folder, subfolder="transformer")  # a whole pipeline folder
    assert net.config.num_layers == 3 and len(net.transformer_blocks) == 3
    out = train(compose_cfg(cheap(tmp_path, digits_shards, f"init_from={pruned}", "model.num_layers=3", steps=1,
                                  run="recover")))
    assert len(losses(Path(out["run_dir"]))) == 1
    with pytest.raises(ValueError, match="another model"):
        train(compose_cfg(cheap(tmp_path, digits_shards, f"init_from={grown}", steps=1, run="wrong_depth")))


def test_pruning_calibrates_on_100_trajectories_over_every_training_phrasing():
    """prompts=null: SANA-1.5's 100 calibration samples, the digits' 50 training prompts (10 digits x 5 phrasings,
    none of the held-out phrasings) each twice, every digit in one phrasing before the next; given prompts are
    used as given; the moving digits' 160 are cut at 100, every digit and direction in their first phrasing first."""
    from types import SimpleNamespace

    from data_prep.sources.digits import digit_captions, heldout_digit_captions
    from data_prep.sources.moving_digits import DIRECTIONS, motion_captions
    from plugins.prune import calibration_prompts

    assert PruneCommand(ckpt="c", keep=1, out="o").samples == 100
    digits = SimpleNamespace(info={"source": {"name": "digits"}, "num_classes": 10})
    got = calibration_prompts(digits, None, 100)
    by_hand = [digit_captions(d)[k] for k in range(5) for d in range(10)]
    assert got == by_hand + by_hand
    assert not set(got) & {c for d in range(10) for c in heldout_digit_captions(d)}
    assert calibration_prompts(digits, ["a 3", "a 4"], 100) == ["a 3", "a 4"]
    motion = calibration_prompts(SimpleNamespace(info={"source": {"name": "moving_digits"}}), None, 100)
    assert len(motion) == len(set(motion)) == 100
    assert motion[:40] == [motion_captions(d, way)[0] for d in range(10) for way in DIRECTIONS]
    with pytest.raises(ValueError, match="samples=0"):
        PruneCommand(ckpt="c", keep=1, out="o", samples=0)


def test_prune_samples_reaches_the_calibration(tmp_path, small_ckpt):
    """plugins.prune samples= sets how many trajectories the importance is measured on (the report records it)."""
    report = prune(PruneCommand(ckpt=str(small_ckpt), keep=3, out=str(tmp_path / "p.ckpt"), samples=3, steps=2))
    assert report["calibration"]["prompts"] == 3


def test_choose_kept_by_hand():
    bi = [0.5, 0.1, 0.3, 0.05, 0.4]
    assert choose_kept(bi, 3, "importance", [], 0, "pixart") == [0, 2, 4]
    assert choose_kept(bi, 3, "importance", [3], 0, "pixart") == [0, 3, 4]
    assert choose_kept(bi, 3, "last", [], 0, "pixart") == [0, 1, 2]
    assert choose_kept(bi, 3, "last", [-1], 0, "pixart") == [0, 1, 4]
    assert choose_kept([0.0] + bi[1:], 4, "importance", [], 0, "dit") == [0, 1, 2, 4]  # dit keeps block 0 (BI 0)
    r = choose_kept(bi, 2, "random", [], 7, "pixart")
    assert r == choose_kept(bi, 2, "random", [], 7, "pixart") and len(r) == 2
    with pytest.raises(ValueError, match="keep=5"):
        choose_kept(bi, 5, "importance", [], 0, "pixart")


def test_eval_every_n_steps_logs_fd_and_accuracy_curves(tmp_path, digits_shards):
    from framework.train import train

    out = train(compose_cfg(cheap(tmp_path, digits_shards, "eval.every_n_steps=2", "eval.seeds=1", "eval.phrasings=1",
                                  "eval.steps=2", steps=4)))
    run = Path(out["run_dir"])
    from framework.studies.growth_report import read_series

    assert [s for s, _ in read_series(run, "eval/fd")] == [0, 2, 4]
    assert len(read_series(run, "eval/prompt_accuracy")) == 3
    assert (run / "eval" / "step0000002" / "metrics.json").exists()


def test_growth_report_by_hand(tmp_path):
    from framework.studies.growth_report import compare

    def write(name, rows):
        d = tmp_path / name
        d.mkdir()
        lines = ["step,train/loss,eval/fd"] + [f"{s},{loss},{fd}" for s, loss, fd in rows]
        (d / "metrics.csv").write_text("\n".join(lines) + "\n")
        return d

    small = write("small", [(0, 1.0, 50), (10, 0.5, 20), (20, 0.4, 10)])
    grown = write("grown", [(0, 0.4, 10), (10, 0.3, 6), (20, 0.25, 4)])
    scratch = write("scratch", [(0, 1.0, 60), (20, 0.5, 15), (30, 0.4, 9), (40, 0.3, 5)])
    r = compare(small, grown, scratch)
    assert r["growth_step"] == 20 and r["small_final_fd"] == 10
    assert r["steps_to_small_final_fd"] == {"grown_total": 20, "grown_after_growth": 0, "scratch": 30}
    assert r["final_fd"] == {"small": 10, "grown": 4, "scratch": 5}
    assert r["steps_to_scratch_final_fd"] == {"grown_total": 40, "scratch": 40}
    assert r["loss_around_growth"] == {"small_last": pytest.approx(1.9 / 3), "grown_first": pytest.approx(0.95 / 3)}

    # The same through the public command, which writes growth.json and growth.png into out
    import json
    import sys

    from tests import zygote

    out = tmp_path / "report"
    cmd = [sys.executable, "-m", "framework.studies", "growth_report", f"small={small}", f"grown={grown}",
           f"scratch={scratch}", f"out={out}"]
    proc = zygote.run(cmd, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "growth.json").read_text()) == json.loads(json.dumps(r)) and (out / "growth.png").is_file()
    # A study asked of the benchmarks' command is pointed to where it lives
    proc = zygote.run([sys.executable, "-m", "framework.bench", "buckets"], timeout=120)
    assert proc.returncode != 0 and "python -m framework.studies buckets" in proc.stderr


@pytest.mark.slow
def test_growth_study_runs_every_arm_and_compares_at_equal_flops(tmp_path, digits_shards, monkeypatch):
    """framework.studies growth on a 4-step plan (2 + 2), 2 seeds: the arms run once (a second pass keeps them); the
    grown and control runs start from the small model's function (their first fd is the small run's last) at the
    small run's FLOPs; the large model's step costs more; the comparison gives seed means inside their intervals."""
    import json

    from framework.studies import growth as study

    launched = forked_children(monkeypatch)
    cmd = study.GrowthStudy(
        base="quickstart", seeds=[0, 1], inits=["cyclic"], small_layers=2, large_layers=3, small_steps=2,
        total_steps=4, eval_every=2, new_warmup_steps=2, out=str(tmp_path / "study"),
        overrides=[f"data.path={digits_shards}", f"data.local={tmp_path / 'cache'}", "data.batch_size=16",
                   "eval.seeds=1", "eval.phrasings=1", "eval.steps=2", "trainer.enable_progress_bar=false", *LEAST_GRID])
    for _ in range(2):  # the second pass finds every run complete
        for seed in cmd.seeds:
            for arm in study.arms(cmd):
                study.train_arm(cmd, arm, seed)
    assert len(launched) == 2 * 4
    fd = study.compare(cmd, "fd")
    small_ckpt_flops = study.flops_per_step(study.run_dir(cmd, "small", 0)) * 2
    assert study.flops_per_step(study.run_dir(cmd, "scratch", 0)) > small_ckpt_flops / 2  # 3 blocks cost more than 2
    for seed in ("0", "1"):
        small_last = fd["curves"]["small"][seed][-1]
        for arm in ("control", "grown_cyclic"):
            first = fd["curves"][arm][seed][0]
            assert first[0] == pytest.approx(small_ckpt_flops) and first[1] == pytest.approx(small_last[1], rel=1e-6)
        assert [x for x, _ in fd["curves"]["scratch"][seed]] == pytest.approx([0, fd["scratch_total_flops"] / 2,
                                                                               fd["scratch_total_flops"]])
    for arm, final in fd["final"].items():
        assert final["low"] <= final["mean"] <= final["high"], arm
    # paired by seed, checked by hand: the mean of the per-seed differences of the last evaluations
    last = {arm: [fd["curves"][arm][seed][-1][1] for seed in ("0", "1")] for arm in fd["curves"]}
    for ref in ("scratch", "control"):
        for arm, d in fd[f"paired_to_{ref}"].items():
            assert d["mean"] == pytest.approx((last[arm][0] - last[ref][0] + last[arm][1] - last[ref][1]) / 2), (ref, arm)
            assert d["low"] <= d["mean"] <= d["high"]
        assert ref not in fd[f"paired_to_{ref}"]
    assert len(fd["flops_fraction_to_reach_scratch_final"]["grown_cyclic"]) == 2
    path = study.plot(cmd, {"fd": fd}, tmp_path / "growth.png")
    assert path.stat().st_size > 10_000
    json.dumps(fd)  # what growth.json holds


def test_the_sana15_recipes_are_the_papers_keys():
    """experiment=sana15_4800m[_grow|_finetune] as their tables cite them: the grown run keeps 18 of the 1.6B's 20
    blocks and appends 42 fresh identity blocks (60); CAME-8bit at 1e-4 for pre-training, 2e-5 for fine-tuning."""
    from framework.bench.suite_cost import compose_phase

    base, grow, tune = (compose_phase(f"sana15_4800m{x}", []) for x in ("", "_grow", "_finetune"))
    for cfg in (base, grow, tune):
        assert (cfg.model.name, cfg.model.num_layers, cfg.model.kwargs["qk_norm"]) == (
            "sana15_4800m_1024", 60, "rms_norm_across_heads")
        assert (cfg.optimizer.name, cfg.optimizer.settings.block_size, cfg.optimizer.settings.min_8bit_size) == (
            "came8bit", 2048, 16384)
        assert (cfg.optimizer.warmup_steps, cfg.optimizer.schedule, cfg.trainer.gradient_clip_val) == (
            2000, "constant", 0.1)
        assert (cfg.objective.name, cfg.objective.flow_shift, cfg.objective.timestep_sampling) == (
            "flow", 3.0, "logit_normal")
        assert (cfg.strategy.name, cfg.trainer.precision, cfg.data.global_batch_size) == ("ddp", "bf16-mixed", 1024)
        assert "ema" not in cfg.plugins
    assert (base.optimizer.lr, grow.optimizer.lr, tune.optimizer.lr) == (1e-4, 1e-4, 2e-5)
    assert (grow.trainer.max_steps, tune.trainer.max_steps) == (100_000, 10_000)
    assert "growth" not in base.plugins and "growth" not in tune.plugins
    g = grow.plugins["growth"]
    assert (g["init"], g["drop_last"], g["zero_gate"]) == ("constant", 2, True)
    plan = layer_plan(20, 60, g["init"], g["drop_last"])
    assert plan == [(i, False) for i in range(18)] + [(None, True)] * 42


def test_optimizers_study_runs_each_optimizer_and_seed_and_pairs_them_by_seed(tmp_path, digits_shards, monkeypatch):
    """framework.studies optimizers on a 4-step quickstart, AdamW against CAME-8bit, 2 seeds: each run once (a second
    pass keeps them) with the optimizer asked for and the base's lr; the report's final losses and paired differences
    are the logged losses' means computed by hand; CAME-8bit's state is its registered bytes per parameter."""
    import json

    from framework.studies import optimizers as study
    from framework.training.optim import OptimizerConfig, state_bytes

    launched = forked_children(monkeypatch)
    cmd = study.OptimizersStudy(
        optimizers=["adamw", "came8bit"], seeds=[0, 1], smooth=2, tail=2, out=str(tmp_path / "study"),
        overrides=[f"data.path={digits_shards}", f"data.local={tmp_path / 'cache'}", "data.batch_size=16",
                   "trainer.max_steps=4", "trainer.log_every_n_steps=1", "eval.seeds=1", "eval.phrasings=1",
                   "eval.steps=2", "trainer.enable_progress_bar=false", *LEAST_GRID])
    for _ in range(2):
        for seed in cmd.seeds:
            for name in cmd.optimizers:
                study.train_run(cmd, name, seed)
    assert len(launched) == 4 and all("optimizer=came8bit" in " ".join(a) for a in launched[1::2])
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(study.run_dir(cmd, "came8bit", 0) / "config.yaml")
    assert (cfg.optimizer.name, cfg.optimizer.lr, cfg.optimizer.schedule) == ("came8bit", 5e-4, "cosine")
    result = study.compare(cmd)
    losses = {(n, s): study.logged(study.run_dir(cmd, n, s))[0] for n in cmd.optimizers for s in cmd.seeds}
    final = {k: (v[max(v)] + v[sorted(v)[-2]]) / 2 for k, v in losses.items()}
    got = result["optimizers"]["came8bit"]
    assert got["final_loss"]["mean"] == pytest.approx((final["came8bit", 0] + final["came8bit", 1]) / 2)
    assert got["final_loss_minus_adamw"]["mean"] == pytest.approx(
        (final["came8bit", 0] - final["adamw", 0] + final["came8bit", 1] - final["adamw", 1]) / 2)
    assert got["final_loss"]["low"] <= got["final_loss"]["mean"] <= got["final_loss"]["high"]
    assert "prompt_accuracy" in got and "fd" in got and got["nonfinite_runs"] == 0
    first = losses["adamw", 0]
    steps = sorted(first)
    assert result["curves"]["adamw"]["0"][1] == [steps[1], (first[steps[0]] + first[steps[1]]) / 2]
    shapes = [tuple(p.shape) for p in build_meta_model(cfg).parameters()]
    came8 = OptimizerConfig(**OmegaConf.to_container(cfg.optimizer, resolve=True))
    count = sum(int(torch.tensor(s).prod()) for s in shapes)
    assert got["state_bytes_per_param"] == pytest.approx(state_bytes(came8, shapes) / count)
    assert result["optimizers"]["adamw"]["state_bytes_per_param"] == pytest.approx(8.0)  # two fp32 moments
    path = study.plot(cmd, result, tmp_path / "optimizers.png")
    assert path.stat().st_size > 10_000
    json.dumps(result)


def build_meta_model(cfg):
    import torch

    from framework.models.backbones import build_denoiser, to_model_config

    with torch.device("meta"):
        return build_denoiser(to_model_config(cfg.model))


def test_growth_study_gives_grown_only_overrides_to_tagged_grown_arms(tmp_path):
    """grown_overrides go to the grown arms alone, which grown_tag names (beside the untagged ones, sharing small,
    control and scratch); overrides without a tag are refused."""
    from framework.studies import growth as study

    cmd = study.GrowthStudy(inits=["cyclic"], grown_overrides=["plugins.growth.new_lr_scale=4"], grown_tag="_lr4",
                             out=str(tmp_path))
    assert study.arms(cmd) == ["small", "control", "grown_cyclic_lr4", "scratch"]
    small = tmp_path / "small.ckpt"
    for arm in study.arms(cmd):
        args = study.arm_args(cmd, arm, small)
        assert ("plugins.growth.new_lr_scale=4" in args) == (arm == "grown_cyclic_lr4"), arm
    assert "plugins.growth.init=cyclic" in study.arm_args(cmd, "grown_cyclic_lr4", small)
    assert study.run_dir(cmd, "grown_cyclic_lr4", 0) == tmp_path / "grown_cyclic_lr4" / "seed0"
    assert study.report_path(cmd) == tmp_path / "growth_lr4"  # the untagged study's growth.json is not overwritten
    assert study.report_path(study.GrowthStudy(out=str(tmp_path))) == tmp_path / "growth"
    with pytest.raises(ValueError, match="need a grown_tag"):
        study.GrowthStudy(grown_overrides=["plugins.growth.new_lr_scale=4"])


def test_a_studys_flops_per_step_count_the_global_batch_of_the_job(tmp_path):
    """The FLOPs of a step are the job's: a run of 4 ranks x 16 per device x 2 micro-batches took 128 samples a step,
    whatever data.batch_size says."""
    import torch
    from omegaconf import OmegaConf

    from framework.inference.checkpoint import CKPT_KEY
    from framework.studies import growth as study
    from tests.helpers import compose_cfg

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    cfg = compose_cfg(["model.in_channels=1", "model.sample_size=8", "model.text_dim=384", "data.batch_size=16"])
    (run / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    torch.save({"global_step": 4, CKPT_KEY: {"global_batch": 16}}, run / "checkpoints" / "last.ckpt")
    one = study.flops_per_step(run)
    torch.save({"global_step": 4, CKPT_KEY: {"global_batch": 128}}, run / "checkpoints" / "last.ckpt")
    assert study.flops_per_step(run) == pytest.approx(8 * one) and one > 0
