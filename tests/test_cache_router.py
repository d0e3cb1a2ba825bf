"""Cached sampling (framework/inference/caching.py) and the cache router stage (plugins/cache_router.py).

References: plain sampling (a schedule that computes everything must reproduce it bit for bit), call
counts taken with forward hooks, the source checkpoint (the frozen backbone), an uninterrupted run (resume).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from framework.inference.sampling import SamplingPlan
from framework.models.blocks import block_views
from framework.inference.caching import CacheSchedule, model_signature, resolve_schedule, uniform_schedule
from tests.helpers import FAMILIES, cheap, compose_cfg, crash_and_resume, forked_children

PROMPTS = ["a handwritten 3", "the digit seven", "a handwritten 0"]


def family_pipeline(name: str, digits_shards: Path):
    """A debug preset of the family on the digits data (1 channel, MiniLM captions), every weight perturbed so
    that each branch matters (adaLN-zero and zero-initialised projections would hide a wrong cache)."""
    from framework.data.datamodule import read_dataset_info
    from framework.models.backbones import build_denoiser, load_preset
    from framework.models.objectives import Objective, ObjectiveConfig
    from framework.inference.pipeline import Pipeline

    info = read_dataset_info(str(digits_shards))
    overrides = {"in_channels": 1, "num_layers": 2} | ({} if name == "dit_debug" else {"text_dim": 384})
    torch.manual_seed(0)
    model = build_denoiser(load_preset(name, **overrides))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return Pipeline(model.eval(), Objective(ObjectiveConfig()), info.empty_text_embeds, info.summary())


def generate(pipe, steps: int = 4, **kw) -> torch.Tensor:
    labels = [3, 7, 0] if pipe.model.cfg.num_classes is not None else None
    return pipe.generate(PROMPTS, SamplingPlan(steps=steps, seed=5, **kw), labels, batch_size=2)  # two batches


def random_schedule(pipe, steps: int, seed: int = 0) -> CacheSchedule:
    g = torch.Generator().manual_seed(seed)
    sig = model_signature(pipe.model, "flow")
    compute = [[[s == 0 or bool(torch.rand(1, generator=g) < 0.5) for _ in kinds] for kinds in sig["branches"]]
               for s in range(steps)]
    return CacheSchedule("flow_euler", steps, sig, compute, kind="learned")


# --------------------------------------------------------------------------------------------
# Cached sampling
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_a_schedule_that_computes_everything_samples_bit_for_bit_like_plain_sampling(name, digits_shards):
    from plugins.cache_router import CacheRouterConfig, Router

    pipe = family_pipeline(name, digits_shards)
    plain = generate(pipe)
    sig = model_signature(pipe.model, "flow")
    # A router whose every beta is above the threshold: nothing is cached.
    everything = Router(4, sig["branches"], 3.0).schedule(CacheRouterConfig(steps=4), "flow_euler", sig, {})
    assert everything.computed_fraction == 1.0
    assert torch.equal(generate(pipe, cache_schedule=everything), plain)
    assert torch.equal(generate(pipe, cache_schedule="uniform:1"), plain)
    # Reusing branches changes the images, and the model is left as it was.
    reused = generate(pipe, cache_schedule="uniform:2")
    assert (reused - plain).abs().max() > 1e-3
    assert torch.equal(generate(pipe), plain)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_skipped_branch_is_not_called(name, digits_shards):
    """Forward hooks on every branch module count its calls: exactly the computed (step, block, branch) cells,
    per image batch (classifier-free guidance runs both halves in one call); SANA's linear attention included."""
    pipe = family_pipeline(name, digits_shards)
    schedule = random_schedule(pipe, 5)
    assert 0.3 < schedule.computed_fraction < 0.9
    calls: dict[tuple[int, int], int] = {}
    hooks = []
    for i, view in enumerate(block_views(pipe.model)):
        for j, branch in enumerate(view.branches):
            calls[(i, j)] = 0
            hooks.append(branch.module.register_forward_hook(lambda *_, key=(i, j): calls.__setitem__(key, calls[key] + 1)))
    try:
        generate(pipe, steps=5, cache_schedule=schedule)
    finally:
        for h in hooks:
            h.remove()
    batches = 2
    expected = {(i, j): batches * sum(step[i][j] for step in schedule.compute) for (i, j) in calls}
    assert calls == expected


def test_uniform_schedules_by_hand(digits_shards):
    pipe = family_pipeline("pixart_debug", digits_shards)
    full_steps = lambda k: [s for s, step in enumerate(uniform_schedule(pipe.model, "flow", "flow_euler", 10, k).compute)
                            if all(all(b) for b in step)]
    assert full_steps(2) == [0, 2, 4, 6, 8]
    assert full_steps(1) == list(range(10))
    assert full_steps(2.5) == [0, 2, 5, 7]  # ceil(10 / 2.5) = 4 evenly spaced full steps
    assert uniform_schedule(pipe.model, "flow", "flow_euler", 10, 2.5).computed_fraction == 0.4
    with pytest.raises(ValueError, match="K must be >= 1"):
        resolve_schedule("uniform:0.5", pipe.model, "flow", "flow_euler", 10)
    with pytest.raises(ValueError, match="uniform:K"):
        resolve_schedule("uniform:x", pipe.model, "flow", "flow_euler", 10)


def test_the_schedule_file_round_trips_and_a_mismatched_one_is_refused(tmp_path, digits_shards):
    pipe = family_pipeline("pixart_debug", digits_shards)
    schedule = random_schedule(pipe, 4)
    path = schedule.save(tmp_path / "cache_schedule.json")
    assert CacheSchedule.load(path) == schedule
    assert CacheSchedule.load(tmp_path) == schedule  # a run dir holding one
    assert torch.equal(generate(pipe, cache_schedule=str(path)), generate(pipe, cache_schedule=schedule))
    with pytest.raises(ValueError, match="made for steps=4"):
        generate(pipe, steps=5, cache_schedule=str(path))
    with pytest.raises(ValueError, match="sampler=flow_euler"):
        generate(pipe, sampler="dpm++", cache_schedule=str(path))
    other = family_pipeline("sana_debug", digits_shards)
    with pytest.raises(ValueError, match="another model"):
        generate(other, cache_schedule=str(path))
    deeper = dataclasses.replace(schedule, model={**schedule.model, "num_layers": 3})
    with pytest.raises(ValueError, match="num_layers: schedule 3 vs model 2"):
        generate(pipe, cache_schedule=deeper)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        generate(pipe, cache_schedule=str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text(json.dumps({"steps": 4}))
    with pytest.raises(ValueError, match="not a version-1"):
        CacheSchedule.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="step 0 must compute"):
        dataclasses.replace(schedule, compute=[[[False] * 3] * 2] + schedule.compute[1:])


# --------------------------------------------------------------------------------------------
# The router stage
# --------------------------------------------------------------------------------------------


# (objective, sampler) per family: dit covers DDIM on an eps model, the others flow-Euler.
SAMPLING = {"pixart_debug": ("flow", "flow_euler"), "sana_debug": ("flow", "flow_euler"), "dit_debug": ("eps", "ddim")}


def family_overrides(name: str) -> list[str]:
    return [f"model={name}", "model.in_channels=1", "model.num_layers=2", f"objective={SAMPLING[name][0]}"] + (
        [] if name == "dit_debug" else ["model.text_dim=384"])


@pytest.fixture(scope="module")
def sources(tmp_path_factory, digits_shards) -> dict[str, Path]:
    """A 2-step run of each family's debug preset on the digits: the stage's frozen backbones."""
    from framework.train import train

    tmp = tmp_path_factory.mktemp("sources")
    return {name: Path(train(compose_cfg(cheap(tmp, digits_shards, *family_overrides(name), steps=2, run=name)))["checkpoint"])
            for name in FAMILIES}


def stage_args(name: str, source: Path, *extra: str) -> list[str]:
    return ["experiment=cache_router", f"init_from={source}", *family_overrides(name), "plugins.cache_router.steps=4",
            f"plugins.cache_router.sampler={SAMPLING[name][1]}", "eval.at_end=false", *extra]


def backbone(ckpt: Path) -> dict[str, torch.Tensor]:
    state = torch.load(ckpt, weights_only=True)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("model.")}


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_router_training_lowers_the_distillation_loss_and_leaves_the_backbone_bit_identical(
        name, tmp_path, digits_shards, sources):
    """With no sparsity penalty and a router that starts mostly cached (beta ~0.12), training must raise the
    betas where caching hurts: the distillation MSE of every sampling step, on fixed batches, goes down."""
    from framework.inference.caching import BranchRunner
    from framework.eval import EvalCommand, evaluate
    from framework.inference.pipeline import Pipeline
    from framework.sample import SampleCommand
    from framework.sample import run as sample
    from framework.train import train
    from plugins.cache_router import CacheRouterConfig, CacheRouterStage, Router

    out = train(compose_cfg(cheap(tmp_path, digits_shards, *stage_args(
        name, sources[name], "plugins.cache_router.sparsity=0", "plugins.cache_router.init_logit=-2",
        "optimizer.lr=0.3"), steps=24, run="stage")))
    run_dir = Path(out["run_dir"])
    trained = torch.load(out["checkpoint"], weights_only=True)
    assert set(k for k in trained["state_dict"] if not k.startswith("model.")) == {"router.logits", "router.cost"}
    before, after = backbone(sources[name]), backbone(Path(out["checkpoint"]))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert not any(len(s["state"]) and s["state"].keys() - {0} for s in trained["optimizer_states"])
    assert all(len(g["params"]) == 1 for g in trained["optimizer_states"][0]["param_groups"])  # the router only

    schedule = CacheSchedule.load(run_dir / "cache_schedule.json")
    assert (run_dir / "cache_schedule.png").is_file() and schedule.steps == 4 and schedule.kind == "learned"

    # The distillation loss before (the starting router) and after (the trained one), same batches.
    pipe = Pipeline.from_checkpoint(out["checkpoint"], weights="train")
    objective, sampler = SAMPLING[name]
    assert pipe.objective.cfg.name == objective and schedule.sampler == sampler
    stage = CacheRouterStage(CacheRouterConfig(steps=4), sampler, objective, run_dir / "unused.json", "")
    stage.runner = BranchRunner(pipe.model)
    router = Router(4, model_signature(pipe.model, objective)["branches"], -2.0)
    module = SimpleNamespace(model=pipe.model, objective=pipe.objective, router=router)  # what distill() reads
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(8, 1, *pipe.model.cfg.latent_hw, generator=g)
    noise = torch.randn(x0.shape, generator=g)
    text = None if name == "dit_debug" else torch.randn(8, 6, 384, generator=g)
    mask = None if name == "dit_debug" else torch.ones(8, 6, dtype=torch.bool)
    labels = torch.arange(8) % 10 if name == "dit_debug" else None

    def total() -> float:
        with torch.no_grad():
            return sum(float(stage.distill(module, k, x0, noise, text, mask, labels)[0]) for k in router.cache_steps)

    start = total()
    router.logits.data.copy_(trained["state_dict"]["router.logits"])
    end = total()
    assert end < 0.5 * start, (start, end)

    if name == "pixart_debug":  # the public commands sample and evaluate with the run's schedule
        paths = sample(SampleCommand(ckpt=out["checkpoint"], out=str(tmp_path / "s"), steps=4, cache_schedule=str(run_dir),
                                     prompts=["a handwritten 3"], device="cpu"))
        assert paths[-1].name == "grid.png"
        with pytest.raises(ValueError, match="made for steps=4"):
            sample(SampleCommand(ckpt=out["checkpoint"], out=str(tmp_path / "s"), steps=5, cache_schedule=str(run_dir)))
        metrics = evaluate(pipe, EvalCommand(ckpt=out["checkpoint"], seeds=1, phrasings=1, steps=4,
                                             cache_schedule=str(run_dir / "cache_schedule.json")))
        assert metrics["cache_schedule"] == "learned" and metrics["branches_computed"] == schedule.computed_fraction


def test_the_sparsity_penalty_weighs_each_branch_by_its_cost():
    """cost=flops: a branch's weight is its share of the counted forward FLOPs (mean 1): PixArt's MLP (two 4x-wide
    linears) outweighs its cross-attention over 16 caption tokens; cost=time measures positive shares; the
    stage's loss is the MSE plus sparsity * sum(cost * beta)."""
    from framework.models.backbones import build_denoiser, load_preset
    from plugins.cache_router import Router, branch_costs

    model = build_denoiser(load_preset("pixart_debug", num_layers=2)).eval()
    flops = branch_costs(model, "flops")  # (blocks, branches: self_attn, cross_attn, mlp)
    assert flops.shape == (2, 3) and torch.equal(flops[0], flops[1])
    # A batch of 2; pixart_debug: 128 wide, 4x MLP, 4 x 4 = 16 latent tokens (8x8, patch 2), 16 caption tokens
    # (projected to the width before the blocks); 2 FLOPs per multiply-add
    B, W, T, L = 2, 128, 16, 16
    mlp = 2 * B * T * W * 4 * W * 2  # two linears
    cross = 2 * B * (T * W * W * 2 + L * W * W * 2 + T * L * W * 2)  # q, out; k, v; scores and their average
    assert flops[0, 2] == mlp and flops[0, 1] == cross
    timed = branch_costs(model, "time")
    assert (timed > 0).all()
    router = Router(4, [["self_attn", "cross_attn", "mlp"]] * 2, 0.0)
    assert torch.allclose(router.cost, torch.ones(2, 3))  # cost=none: all alike

    # The stage's loss: the distillation MSE (stubbed to 0.25 here) plus sparsity * sum(cost * beta_k)
    from plugins.cache_router import CacheRouterConfig, CacheRouterStage

    router.cost.copy_(flops / flops.mean())
    with torch.no_grad():
        router.logits.normal_(generator=torch.Generator().manual_seed(0))
    stage = CacheRouterStage(CacheRouterConfig(steps=4, sparsity=0.5), "flow_euler", "flow", Path("unused.json"), "")
    drawn = []
    stage.distill = lambda module, k, *rest: (drawn.append(k) or torch.tensor(0.25), router.beta(k))
    module = SimpleNamespace(router=router, step_generator=lambda: torch.Generator().manual_seed(3),
                             log_dict=lambda *a, **kw: None, trainer=SimpleNamespace(world_size=1))
    loss = stage.training_loss(module, torch.zeros(2, 1, 8, 8), None, None, None, None)
    beta = torch.sigmoid(router.logits[(drawn[0] - 1) // 2])
    assert torch.allclose(loss, 0.25 + 0.5 * (flops / flops.mean() * beta).sum().float())


@pytest.mark.slow
def test_the_stage_resumes_after_a_kill_like_an_uninterrupted_run(tmp_path, digits_shards, sources, monkeypatch):
    full, resumed = crash_and_resume(tmp_path, digits_shards, stage_args("pixart_debug", sources["pixart_debug"]),
                                     monkeypatch)
    assert json.loads((Path(full["run_dir"]) / "cache_schedule.json").read_text()) == \
        json.loads((Path(resumed["run_dir"]) / "cache_schedule.json").read_text())


def test_the_schedule_goes_where_out_says_and_the_penalty_weighs_branches_as_cost_says(tmp_path, digits_shards, sources):
    """plugins.cache_router.out: the schedule and its picture are written there, not in run.dir. cost=none: every
    branch weighs 1 in the sparsity penalty (the checkpoint's router.cost); the default, flops, weighs PixArt's MLP
    above its cross-attention."""
    from framework.train import train

    weights = {}
    for cost in ("none", "flops"):
        out = tmp_path / f"schedules_{cost}" / "mine.json"
        run = train(compose_cfg(cheap(tmp_path, digits_shards, *stage_args(
            "pixart_debug", sources["pixart_debug"], f"plugins.cache_router.out={out}",
            f"plugins.cache_router.cost={cost}"), steps=1, run=f"cost_{cost}")))
        assert out.is_file() and out.with_suffix(".png").is_file(), sorted(out.parent.parent.rglob("*.json"))
        assert CacheSchedule.load(out).steps == 4
        assert not (Path(run["run_dir"]) / "cache_schedule.json").exists()
        weights[cost] = torch.load(run["checkpoint"], weights_only=True)["state_dict"]["router.cost"]  # (blocks, 3)
    assert torch.equal(weights["none"], torch.ones_like(weights["none"]))
    assert (weights["flops"][:, 2] > weights["flops"][:, 1]).all()  # branches: self_attn, cross_attn, mlp


def test_the_stage_refuses_what_it_cannot_do(tmp_path, digits_shards, sources):
    from framework.train import train

    source = sources["pixart_debug"]
    cases = [
        (["experiment=cache_router"], "give its checkpoint with init_from"),
        (stage_args("pixart_debug", source, "strategy=fsdp"), "use strategy=ddp"),
        (stage_args("pixart_debug", source, "plugins.cache_router.sampler=dpm++"), "plugins.cache_router.sampler=flow_euler"),
        (stage_args("pixart_debug", source, "plugins.cache_router.steps=1"), "steps=1: need >= 2"),
        (stage_args("pixart_debug", source, "model.num_layers=3"), "another model"),
    ]
    for i, (args, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message):
            train(compose_cfg(cheap(tmp_path, digits_shards, *args, steps=1, run=f"bad{i}")))


# --------------------------------------------------------------------------------------------
# Distillation as sampling runs: the sampler's own states, the guided prediction, straight through
# --------------------------------------------------------------------------------------------


def recorded_sampling(name: str, digits_shards: Path, steps: int, guidance: float):
    """A family's pipeline (DiT: eps and DDIM) sampling two prompts, with the model's inputs at every call recorded:
    (pipe, sampler, [(x, t, text, mask, labels) per step], both CFG halves in each)."""
    from framework.models.objectives import Objective, ObjectiveConfig

    pipe = family_pipeline(name, digits_shards)
    objective, sampler = SAMPLING[name]
    pipe.objective = Objective(ObjectiveConfig(name=objective))
    calls = []
    hook = pipe.model.register_forward_pre_hook(lambda _, args: calls.append([a if a is None else a.clone() for a in args]))
    try:
        labels = [3, 7] if pipe.model.cfg.num_classes is not None else None
        pipe.generate(PROMPTS[:2], SamplingPlan(steps, guidance, sampler, seed=5), labels, batch_size=2)
    finally:
        hook.remove()
    assert len(calls) == steps
    return pipe, sampler, calls


def stage_for(pipe, sampler: str, steps: int, **cfg):
    """A CacheRouterStage and the module fields distill() reads, outside a run."""
    from framework.inference.caching import BranchRunner
    from plugins.cache_router import CacheRouterConfig, CacheRouterStage, Router

    stage = CacheRouterStage(CacheRouterConfig(steps=steps, **cfg), sampler, pipe.objective.cfg.name, Path("unused.json"), "")
    stage.runner = BranchRunner(pipe.model)
    router = Router(steps, model_signature(pipe.model, pipe.objective.cfg.name)["branches"], 0.0)
    with torch.no_grad():
        router.logits.normal_(0, 2, generator=torch.Generator().manual_seed(1))
    return stage, SimpleNamespace(model=pipe.model, objective=pipe.objective, router=router, empty_text=pipe.empty_text)


def conditioning(call: list, b: int) -> tuple:
    """The conditional half of a recorded call: (text, mask, labels)."""
    _, _, text, mask, labels = call
    return (None if text is None else text[:b], None if mask is None else mask[:b], None if labels is None else labels[:b])


@pytest.mark.parametrize("name", ["pixart_debug", "dit_debug"])
def test_the_distillation_starts_where_guided_sampling_is_and_distils_the_guided_prediction(name, digits_shards):
    """start=trajectory: the state at step k is the one framework.sample's guided sampler reaches from the same noise
    (recorded at every model call). The loss is the MSE of the guided predictions at step k, student against teacher,
    computed here by hand with each CFG half run on its own, its branch cache from its own step k-1."""
    steps, g, b = 6, 3.0, 2
    pipe, sampler, calls = recorded_sampling(name, digits_shards, steps, g)
    stage, module = stage_for(pipe, sampler, steps, guidance=g)
    text, mask, labels = conditioning(calls[0], b)
    noise = calls[0][0][:b]  # step 0's input is the noise (init_noise_sigma 1 for both samplers)
    predict = stage.guided(module, text, mask, labels)
    for k in (1, 3, 5):
        with stage.runner.installed():
            x_k, t_k = stage.state(module, k, noise, noise, predict)
        assert torch.allclose(x_k, calls[k][0][:b], atol=1e-5) and float(t_k) == float(calls[k][1][0])

    k, runner, model = 3, stage.runner, pipe.model
    beta = module.router.beta(k).detach()
    halves = [(h, *call[2:]) for h in (slice(0, b), slice(b, 2 * b)) for call in [calls[k - 1]]]
    student, teacher = [], []
    with runner.installed():
        for h, text_h, mask_h, labels_h in halves:
            cut = lambda v, h=h: None if v is None else v[h]
            runner.reset()
            with torch.no_grad():
                model(calls[k - 1][0][h], calls[k - 1][1][h], cut(text_h), cut(mask_h), cut(labels_h))  # fills the cache
                with runner.mix(beta):
                    student.append(model(calls[k][0][h], calls[k][1][h], cut(text_h), cut(mask_h), cut(labels_h)))
    with torch.no_grad():
        for h, text_h, mask_h, labels_h in halves:
            cut = lambda v, h=h: None if v is None else v[h]
            teacher.append(model(calls[k][0][h], calls[k][1][h], cut(text_h), cut(mask_h), cut(labels_h)))
    guided = lambda cond, uncond: uncond + g * (cond - uncond)
    expected = torch.nn.functional.mse_loss(guided(*student), guided(*teacher))
    with torch.no_grad():
        mse, _ = stage.distill(module, k, noise, noise, text, mask, labels)
    assert expected > 1e-6 and torch.allclose(mse, expected, rtol=1e-4), (float(mse), float(expected))

    # start=data: step k-1's state is the data noised to t_{k-1}, not the sampler's
    data_stage, _ = stage_for(pipe, sampler, steps, guidance=g, start="data")
    with data_stage.runner.installed():
        x_data, _ = data_stage.state(module, k, torch.zeros_like(noise), noise, predict)
    assert not torch.allclose(x_data, calls[k][0][:b], atol=1e-3)


def test_straight_through_trains_on_the_forward_that_sampling_runs(digits_shards):
    """hard=true: the student is the cached forward of the schedule (beta > threshold computes, the rest reuse step
    k-1), so its loss equals the scheduled forward's error, and beta still gets a gradient."""
    steps, g, b, k = 4, 2.0, 2, 3
    pipe, sampler, calls = recorded_sampling("pixart_debug", digits_shards, steps, g)
    stage, module = stage_for(pipe, sampler, steps, guidance=g, hard=True)
    text, mask, labels = conditioning(calls[0], b)
    noise = calls[0][0][:b]
    mse, beta = stage.distill(module, k, noise, noise, text, mask, labels)
    mse.backward()
    assert module.router.logits.grad[(k - 1) // 2].abs().sum() > 0

    predict = stage.guided(module, text, mask, labels)
    runner = stage.runner
    with runner.installed(), torch.no_grad():
        x_k, t_k = stage.state(module, k, noise, noise, predict)
        runner.compute = (beta > stage.cfg.threshold).tolist()  # reuse step k-1's cache where beta <= threshold
        scheduled = predict(x_k, t_k)
        runner.compute = None
        teacher = predict(x_k, t_k)
    expected = torch.nn.functional.mse_loss(scheduled, teacher)
    assert (beta > 0.5).any() and not (beta > 0.5).all()  # some branches cached, some computed
    assert torch.allclose(mse.detach(), expected, rtol=1e-4), (float(mse), float(expected))


# --------------------------------------------------------------------------------------------
# The quality-vs-speed curve (python -m framework.studies cache_curve)
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_cache_curve_compares_learned_schedules_with_uniform_and_fewer_steps(tmp_path, digits_shards, sources,
                                                                                 monkeypatch):
    """A router trained by the command itself (a child framework.train), read at two thresholds; uniform:K at each
    learned schedule's count of computed branches; fewer steps. The full sampler is the paired error's reference
    (0 for itself), every interval holds its estimate, and a re-thresholded schedule computes what its betas say."""
    from framework.studies.cache_curve import CacheCurveStudy, at_threshold, run

    source = sources["pixart_debug"]
    train_args = [a for a in cheap(tmp_path, digits_shards, *family_overrides("pixart_debug"), run="unused")
                  if not a.startswith(("run.dir", "trainer.max_steps"))]
    cfg = CacheCurveStudy(ckpt=str(source), sparsities=[3e-3], thresholds=[0.5, 0.9], router_steps=2,
                          router_overrides=train_args, uniform=[2.0], fewer=[2], steps=4, seeds=1, phrasings=1,
                          batch_size=32, time_images=10, repeats=1, bootstrap=20, weights="train", device="cpu",
                          out=str(tmp_path / "curve" / "cache_curve.json"))
    launched = forked_children(monkeypatch)
    rows = {r["variant"]: r for r in run(cfg)}
    assert len(launched) == 1  # the one sparsity's router stage
    router_dir = tmp_path / "curve" / "router_sparsity0.003"
    learned = CacheSchedule.load(router_dir / "cache_schedule.json")
    assert learned.source["guidance"] == 4.0 and learned.source["start"] == "trajectory"
    assert {"full", "learned s=0.003 t=0.5", "learned s=0.003 t=0.9", "uniform:2", "fewer:2"} <= rows.keys()
    for t in (0.5, 0.9):
        row = rows[f"learned s=0.003 t={t:g}"]
        betas = [v for step in learned.beta for block in step for v in block]  # full steps: beta 1
        assert row["branches_computed"] == pytest.approx(sum(v > t for v in betas) / len(betas))
        assert at_threshold(learned, t).threshold == t
        assert any(r["kind"] == "uniform" and abs(r["branches_computed"] - row["branches_computed"]) <= 0.125 + 1e-9
                   for r in rows.values())  # the matched uniform:K (whole full steps: 1/4 granularity at 4 steps)
    assert rows["full"]["paired_error"] == 0 and rows["full"]["speedup"] == 1.0 and rows["fewer:2"]["paired_error"] > 0
    for r in rows.values():
        for key in ("accuracy", "paired_error"):  # (fd's bootstrap is biased upward: its estimate may lie below)
            assert r[f"{key}_ci"][0] - 1e-9 <= r[key] <= r[f"{key}_ci"][1] + 1e-9, (r["variant"], key)
        assert r["fd_ci"][0] <= r["fd_ci"][1] and r["fd"] > 0
        assert r["num_images"] == rows["full"]["num_images"] > 0
    assert (tmp_path / "curve" / "cache_curve.png").is_file()
    # a finished router is kept: a second call trains nothing (the schedule file is not rewritten); the same router
    # added again by `routers` is a series of its own, named by its folder, not one overwriting the other
    stamp = (router_dir / "cache_schedule.json").stat().st_mtime_ns
    again = {r["variant"]: r for r in run(dataclasses.replace(cfg, thresholds=[0.5], fewer=[], uniform=[],
                                                               routers=[str(router_dir)]))}
    assert (router_dir / "cache_schedule.json").stat().st_mtime_ns == stamp
    added = again["learned s=0.003 (router_sparsity0.003) t=0.5"]
    assert added["branches_computed"] == again["learned s=0.003 t=0.5"]["branches_computed"]
    assert added["paired_error"] == again["learned s=0.003 t=0.5"]["paired_error"]  # same schedule, same seeds


def test_the_cache_curve_names_a_straight_through_router_apart():
    from framework.studies.cache_curve import learned_name

    soft = CacheSchedule("ddim", 4, {"branches": [["attn1"]]}, [[[True]]] * 4, kind="learned",
                         source={"sparsity": 0.003, "hard": False})
    hard = dataclasses.replace(soft, source={"sparsity": 0.003, "hard": True})
    assert learned_name(soft, Path("a/router_sparsity0.003/cache_schedule.json"), set()) == "learned s=0.003"
    assert learned_name(hard, Path("b/hard/cache_schedule.json"), {"learned s=0.003"}) == "learned s=0.003 hard"
    assert learned_name(hard, Path("b/hard/cache_schedule.json"), {"learned s=0.003 hard"}) == "learned s=0.003 hard (hard)"
    assert learned_name(dataclasses.replace(soft, source={}), Path("c/mine.json"), set()) == "learned c"


def test_the_cache_curve_plots_an_fd_below_its_biased_interval(tmp_path):
    """fd's bootstrap is biased upward, so an estimate can lie below its own interval (it did on the pairs model):
    the figure is still drawn, that bar starting at the point."""
    from framework.studies.cache_curve import plot

    def row(variant, kind, speedup, fd, ci):
        return {"variant": variant, "series": variant, "kind": kind, "speedup": speedup, "fd": fd, "fd_ci": ci,
                "paired_error": 0.1, "paired_error_ci": [0.05, 0.15], "accuracy": 0.9, "accuracy_ci": [0.85, 0.95]}

    rows = [row("full", "full", 1.0, 14.7, [14.9, 18.0]), row("learned", "learned", 1.4, 15.0, [15.1, 18.3])]
    assert plot(rows, tmp_path / "curve.png", "title").stat().st_size > 10_000


def test_the_cache_curve_calls_a_win_only_at_equal_speed_beyond_the_intervals():
    from framework.studies.cache_curve import compare

    def row(variant, kind, speed, fd):
        return {"variant": variant, "kind": kind, "images_per_s": speed, "fd": fd[0], "fd_ci": fd,
                "paired_error": 0.1, "paired_error_ci": [0.05, 0.15]}

    rows = [row("learned", "learned", 100.0, [9.0, 10.0]), row("uniform:2", "uniform", 102.9, [10.5, 11.0]),
            row("uniform:3", "uniform", 110.0, [20.0, 21.0]), row("fewer:10", "fewer", 97.5, [9.5, 10.6]),
            row("fewer:9", "fewer", 104.0, [30.0, 31.0])]
    compare(rows)
    learned = rows[0]
    assert [c["variant"] for c in learned["vs_uniform"]] == ["uniform:2"]  # 110 is 10% faster: not compared
    assert [c["variant"] for c in learned["vs_fewer"]] == ["fewer:10"]  # 104 is 4% faster: not compared
    assert learned["vs_uniform"][0]["beats_fd"] and not learned["vs_fewer"][0]["beats_fd"]  # 10.0 vs 9.5: overlap
    assert not learned["goal"] and not learned["vs_uniform"][0]["beats_paired_error"]
    rows[3]["fd_ci"] = [10.2, 10.6]
    compare(rows)
    assert rows[0]["goal"] and not rows[0]["goal_paired_error"]
    rows[0]["paired_error_ci"] = [0.01, 0.04]  # below both neighbours' [0.05, 0.15]
    compare(rows)
    assert rows[0]["goal_paired_error"]


def test_the_paired_bootstrap_sees_a_difference_that_separate_fd_intervals_hide():
    """Two variants whose images differ by a little everywhere (same prompts and seeds: paired): fd's own bootstrap
    intervals overlap, but the interval of the paired difference lies wholly on one side of 0, and it is 0 at 0 for
    a variant against itself. The paired error's difference is checked by hand."""
    from framework.studies.cache_curve import compare, paired_difference
    from framework.evaluation.realdata import fid_with_interval

    g = torch.Generator().manual_seed(0)
    real = torch.randn(300, 8, generator=g, dtype=torch.float64)
    base = torch.randn(400, 8, generator=g, dtype=torch.float64)
    a = {"real": real, "features": base * 1.02, "errors": torch.full((400,), 0.1, dtype=torch.float64)}
    b = {"real": real, "features": base * 1.15 + 0.05, "errors": torch.full((400,), 0.3, dtype=torch.float64)}
    fa, ia = fid_with_interval(real, a["features"], 100)
    fb, ib = fid_with_interval(real, b["features"], 100)
    assert fa < fb and ia[1] > ib[0]  # separate intervals overlap
    diff = paired_difference(a, b, 100)
    assert diff["fd"][1][1] < 0 and diff["fd"][0] == pytest.approx(fa - fb)
    assert diff["paired_error"][0] == pytest.approx(-0.2) and diff["paired_error"][1] == pytest.approx([-0.2, -0.2])
    same = paired_difference(a, a, 50)
    assert same["fd"] == (0.0, [0.0, 0.0])

    row = lambda variant, kind, fd, ci: {"variant": variant, "kind": kind, "images_per_s": 100.0, "fd": fd, "fd_ci": ci,
                                         "paired_error": 0.1, "paired_error_ci": [0.1, 0.1]}
    rows = [row("learned", "learned", fa, ia), row("uniform:2", "uniform", fb, ib), row("fewer:9", "fewer", fb, ib)]
    compare(rows)
    assert not rows[0]["goal"]  # by overlapping intervals: no win
    compare(rows, {"learned": a, "uniform:2": b, "fewer:9": b}, 100)
    assert rows[0]["goal"] and rows[0]["vs_uniform"][0]["beats_paired_error"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pixart_debug", "latte_debug"])
def test_the_router_trained_under_sequence_parallelism_follows_one_process(tmp_path, request, name):
    """The router stage on 2 sequence-parallel ranks (each holding half of every image's tokens; Latte on clips: half
    the frames in its spatial blocks, half the positions in its temporal blocks) against one process with the same
    batches. No sparsity penalty and a router that
    starts mostly cached, so the loss and the gradient are the distillation's: the same losses and gradient norms
    step by step (through the gathered prediction), the same router logits at the end, and the same branch costs
    (counted on the split model)."""
    from framework.train import train
    from tests.helpers import STEPS, cheap, compose_cfg, losses, run_train

    settings = ["plugins.cache_router.sparsity=0", "plugins.cache_router.init_logit=-2", "optimizer.lr=0.3"]
    if name == "pixart_debug":
        data, model = request.getfixturevalue("digits_shards"), None
        args = stage_args(name, request.getfixturevalue("sources")[name], *settings)
    else:  # a 2-step Latte on the moving digits' clips is the frozen backbone
        data, model = request.getfixturevalue("moving_shards"), ("model=latte_debug",)
        source = train(compose_cfg(cheap(tmp_path, data, "model=latte_debug", steps=2, run="source")))["checkpoint"]
        args = ["experiment=cache_router", f"init_from={source}", "plugins.cache_router.steps=4",
                "plugins.cache_router.sampler=flow_euler", "eval.at_end=false", *settings]
    args += ["data.batch_size=8", f"trainer.max_steps={STEPS}", "trainer.checkpoint_every_n_steps=2"]
    kw = {} if model is None else {"model": model}
    run_train(tmp_path / "ref", data, *args, **kw)
    run_train(tmp_path / "sp", data, *args, "strategy=ddp", "trainer.devices=2", "strategy.sequence_parallel=2", **kw)
    ref, got = losses(tmp_path / "ref"), losses(tmp_path / "sp")
    assert sorted(got) == list(range(STEPS)) and min(ref.values()) > 0, ref
    close = dict(rtol=1e-4, atol=0.0)  # relative only: the values are small
    torch.testing.assert_close(torch.tensor([got[s] for s in range(STEPS)]), torch.tensor([ref[s] for s in range(STEPS)]),
                               **close)
    norms = [logged(tmp_path / run, "train/grad_norm") for run in ("ref", "sp")]
    torch.testing.assert_close(torch.tensor(norms[1]), torch.tensor(norms[0]), **close)
    states = [torch.load(tmp_path / run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
              for run in ("ref", "sp")]
    assert not torch.equal(states[0]["router.logits"], torch.full_like(states[0]["router.logits"], -2.0))  # it moved
    torch.testing.assert_close(states[1]["router.cost"], states[0]["router.cost"], **close)
    # Adam divides each logit's step by its gradient's own scale, which magnifies rounding where a gradient is small
    torch.testing.assert_close(states[1]["router.logits"], states[0]["router.logits"], rtol=1e-3, atol=0.0)


def logged(run_dir: Path, key: str) -> list[float]:
    """The per-step values of one logged metric, in step order."""
    import csv

    with open(run_dir / "metrics.csv", newline="") as f:
        rows = {int(r["step"]): float(r[key]) for r in csv.DictReader(f) if r.get(key)}
    return [rows[s] for s in sorted(rows)]
