"""`python -m framework.studies growth`: does growing pay at equal training compute? Every arm, several seeds.

One plan of `total_steps` optimizer steps with one learning-rate schedule (the base experiment's warm-up and
decay over total_steps), run as four arms per seed, each a `python -m framework.train` run evaluated every
`eval_every` steps (fd to real held-out images and the dataset's accuracy):

    small      `small_layers` blocks for the plan's first `small_steps` steps
    control    the small model continued unchanged for the rest of the plan (a fresh optimizer, the
               schedule continued: optimizer.schedule_start)
    grown_I    the small model grown to `large_layers` blocks with init I (plugins=[growth]), trained for
               the rest of the plan; the new blocks ramp in over `new_warmup_steps`
    scratch    `large_layers` blocks from random weights for the whole plan

Runs already complete are kept (a study can be stopped and started again, seeds added later). Then
growth.png (fd and accuracy against training FLOPs: seed means with 95% t-intervals) and growth.json (growth_TAG.*
for a grown_tag's arms):
per arm the final fd / accuracy with intervals, the same paired by seed against scratch and against the control
(the arm's final value minus theirs, seed by seed: the seeds' shared noise cancels), and for each grown arm the
fraction of the scratch run's training FLOPs at which it first reaches the scratch run's final fd (the goal is
<= 0.7 with the intervals of the final fds apart).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from framework.cli import train_unless_complete
from framework.evaluation.realdata import t_interval


@dataclass
class GrowthStudy:
    """Arguments of `python -m framework.studies growth`."""

    base: str = "pairs"
    """The experiment every arm trains (conf/experiment/NAME.yaml): the task, data, model width, lr and schedule."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    inits: list[str] = field(default_factory=lambda: ["constant", "cyclic", "block_expand"])
    small_layers: int = 4
    large_layers: int = 8
    small_steps: int = 1000
    total_steps: int = 2000
    eval_every: int = 250
    """Evaluate every this many steps (a divisor of small_steps and total_steps)."""
    new_warmup_steps: int = 100
    """The grown arms' new blocks ramp their lr in over this many steps (plugins.growth.new_warmup_steps)."""
    overrides: list[str] = field(default_factory=list)
    """More train overrides for every arm, each quoted: "overrides=['eval.seeds=1']"."""
    grown_overrides: list[str] = field(default_factory=list)
    """More train overrides for the grown arms only ("grown_overrides=['plugins.growth.new_lr_scale=4']"); they need
    a `grown_tag`, which names those arms (grown_cyclic_lr4), so they sit beside the untagged ones and share the
    small, control and scratch runs of the same `out`."""
    grown_tag: str = ""
    out: str = "runs/growth_study"

    def __post_init__(self) -> None:
        if self.grown_overrides and not self.grown_tag:
            raise ValueError(f"grown_overrides={self.grown_overrides} need a grown_tag naming those grown arms "
                             "(grown_tag=_lr4 gives grown_cyclic_lr4), so they do not mix with untagged runs")
        if not 0 < self.small_steps < self.total_steps:
            raise ValueError(f"small_steps={self.small_steps} must be between 0 and total_steps={self.total_steps}")
        if self.small_steps % self.eval_every or self.total_steps % self.eval_every:
            raise ValueError(f"eval_every={self.eval_every} must divide small_steps and total_steps")
        if self.large_layers <= self.small_layers:
            raise ValueError(f"large_layers={self.large_layers} must be more than small_layers={self.small_layers}")


# --------------------------------------------------------------------------------------------
# The runs
# --------------------------------------------------------------------------------------------


def arms(cmd: GrowthStudy) -> list[str]:
    return ["small", "control", *(f"grown_{i}{cmd.grown_tag}" for i in cmd.inits), "scratch"]


def arm_args(cmd: GrowthStudy, arm: str, small_ckpt: Path) -> list[str]:
    """The train overrides of one arm (module docstring)."""
    rest = [f"trainer.max_steps={cmd.total_steps - cmd.small_steps}", f"optimizer.schedule_start={cmd.small_steps}"]
    if arm == "small":
        return [f"model.num_layers={cmd.small_layers}", f"trainer.max_steps={cmd.small_steps}"]
    if arm == "control":
        return [f"model.num_layers={cmd.small_layers}", f"init_from={small_ckpt}", *rest]
    if arm == "scratch":
        return [f"model.num_layers={cmd.large_layers}", f"trainer.max_steps={cmd.total_steps}"]
    init = arm.removeprefix("grown_").removesuffix(cmd.grown_tag)
    return [f"model.num_layers={cmd.large_layers}", "plugins=[growth]", f"plugins.growth.ckpt={small_ckpt}",
            f"plugins.growth.init={init}", f"plugins.growth.new_warmup_steps={cmd.new_warmup_steps}", *rest,
            *cmd.grown_overrides]


def run_dir(cmd: GrowthStudy, arm: str, seed: int) -> Path:
    return Path(cmd.out) / arm / f"seed{seed}"


def train_arm(cmd: GrowthStudy, arm: str, seed: int) -> Path:
    run = run_dir(cmd, arm, seed)
    small = run_dir(cmd, "small", seed) / "checkpoints" / "last.ckpt"
    args = [f"experiment={cmd.base}", f"seed={seed}", f"run.dir={run}", "logger=csv", "resume=auto",
            f"optimizer.schedule_steps={cmd.total_steps}", f"eval.every_n_steps={cmd.eval_every}", "eval.at_end=false",
            "sample.every_n_steps=0", f"trainer.checkpoint_every_n_steps={cmd.eval_every}", "trainer.keep_checkpoints=1",
            *arm_args(cmd, arm, small), *cmd.overrides]
    return train_unless_complete(args, f"[growth study] {arm} seed {seed}", run)


# --------------------------------------------------------------------------------------------
# The comparison
# --------------------------------------------------------------------------------------------


def flops_per_step(run: Path) -> float:
    """Training FLOPs of one optimizer step of the run's model (counted on a batch shaped like its data) over the
    whole job: per sample, times the global batch its checkpoint records (micro-batch x data-parallel ranks x
    accumulation, as the run plan decided it)."""
    import torch

    from framework.inference.checkpoint import CKPT_KEY, checkpoint_meta
    from framework.models.backbones import build_denoiser, to_model_config
    from framework.models.flops import count_train_flops_per_sample

    cfg = OmegaConf.load(run / "config.yaml")
    m = to_model_config(cfg.model)
    h, w = m.latent_hw
    batch = {"latents": torch.randn(2, m.in_channels, h, w), "text_embeds": torch.randn(2, 16, m.text_dim or 1),
             "text_mask": torch.ones(2, 16, dtype=torch.bool)}
    if m.num_classes is not None:
        batch["label"] = torch.zeros(2, dtype=torch.long)
    per_sample = count_train_flops_per_sample(build_denoiser(m), batch)
    return float(per_sample * checkpoint_meta(run / "checkpoints" / "last.ckpt")[CKPT_KEY]["global_batch"])


def evaluations(run: Path) -> dict[int, dict[str, float]]:
    """step -> the eval/* values logged at it."""
    path = run / "metrics.csv"
    out: dict[int, dict[str, float]] = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            for k, v in r.items():
                if k.startswith("eval/") and v not in (None, ""):
                    out.setdefault(int(r["step"]), {})[k[len("eval/"):]] = float(v)
    return out


def curves(cmd: GrowthStudy) -> dict[str, dict[int, dict[float, dict[str, float]]]]:
    """arm -> seed -> training FLOPs so far (the small run's included for control and grown arms) -> eval values."""
    out: dict[str, dict[int, dict[float, dict[str, float]]]] = {}
    for seed in cmd.seeds:
        small = run_dir(cmd, "small", seed)
        small_flops = flops_per_step(small) * cmd.small_steps
        for arm in arms(cmd):
            run = run_dir(cmd, arm, seed)
            per_step = flops_per_step(run)
            offset = 0.0 if arm in ("small", "scratch") else small_flops
            out.setdefault(arm, {})[seed] = {offset + per_step * s: v for s, v in sorted(evaluations(run).items())}
    return out


def compare(cmd: GrowthStudy, metric: str) -> dict[str, Any]:
    data = curves(cmd)
    scratch_total = max(data["scratch"][cmd.seeds[0]])
    # each arm's last evaluation, seed by seed
    last = {arm: {s: runs[s][max(runs[s])][metric] for s in cmd.seeds} for arm, runs in data.items()}
    final = {arm: t_interval(list(values.values())) for arm, values in last.items()}
    target = final["scratch"][0]
    lower_is_better = metric == "fd"
    reach: dict[str, Any] = {}
    for arm in arms(cmd):
        if not arm.startswith("grown_"):
            continue
        fractions = []
        for s in cmd.seeds:
            hit = [x for x, v in sorted(data[arm][s].items())
                   if (v[metric] <= target if lower_is_better else v[metric] >= target)]
            fractions.append(hit[0] / scratch_total if hit else None)
        reach[arm] = fractions
    # Paired by seed: an arm's final value minus scratch's (or the control's) of the same seed. The seeds' shared
    # noise (data order, the small model) cancels, which the arms' own intervals above keep.
    paired = {ref: {arm: t_interval([last[arm][s] - last[ref][s] for s in cmd.seeds]) for arm in last if arm != ref}
              for ref in ("scratch", "control")}
    named = lambda intervals: {arm: dict(zip(("mean", "low", "high"), i)) for arm, i in intervals.items()}
    return {"metric": metric, "seeds": cmd.seeds, "scratch_total_flops": scratch_total, "final": named(final),
            "paired_to_scratch": named(paired["scratch"]), "paired_to_control": named(paired["control"]),
            "flops_fraction_to_reach_scratch_final": reach,
            "curves": {arm: {str(s): [[x, v[metric]] for x, v in sorted(runs[s].items()) if metric in v] for s in runs}
                       for arm, runs in data.items()}}


def plot(cmd: GrowthStudy, results: dict[str, dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"small": "tab:gray", "control": "black", "scratch": "tab:orange", "grown_constant": "tab:blue",
              "grown_cyclic": "tab:green", "grown_block_expand": "tab:purple"}
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, (metric, res) in zip(axes[0], results.items()):
        for arm, by_seed in res["curves"].items():
            series = [dict((x, v) for x, v in pts) for pts in by_seed.values()]
            xs = sorted({x for one in series for x in one})
            stats = [t_interval([one[x] for one in series if x in one]) for x in xs]
            scale = [x / res["scratch_total_flops"] for x in xs]
            ax.plot(scale, [m for m, _, _ in stats], color=colors.get(arm), label=arm, marker="o", markersize=3)
            ax.fill_between(scale, [lo for _, lo, _ in stats], [hi for _, _, hi in stats], color=colors.get(arm),
                            alpha=0.15)
        ax.axvline(0.7, color="red", linestyle=":", linewidth=0.8)
        ax.set_xlabel("training FLOPs / the scratch run's total")
        ax.set_title(f"{metric} (mean of {len(cmd.seeds)} seeds, 95% interval)", fontsize=10)
        if metric == "fd":
            ax.set_yscale("log")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def accuracy_key(cmd: GrowthStudy) -> str | None:
    """The dataset's accuracy metric as the evaluations logged it (pair_accuracy, prompt_accuracy), if any."""
    logged = evaluations(run_dir(cmd, "scratch", cmd.seeds[0]))
    keys = {k for v in logged.values() for k in v}
    return next((k for k in ("pair_accuracy", "prompt_accuracy") if k in keys), None)


def run(cmd: GrowthStudy) -> None:
    """Train every arm of every seed that is not complete yet, then write and print the report."""
    for seed in cmd.seeds:
        for arm in arms(cmd):
            train_arm(cmd, arm, seed)
    results = {"fd": compare(cmd, "fd")}
    acc = accuracy_key(cmd)
    if acc:
        results[acc] = compare(cmd, acc)
    report = report_path(cmd)
    report.with_suffix(".json").write_text(json.dumps(results, indent=2))
    plot(cmd, results, report.with_suffix(".png"))
    summary = {m: {k: v for k, v in r.items() if k != "curves"} for m, r in results.items()}
    print(json.dumps(summary, indent=2))
    print(f"wrote {report.with_suffix('.json')} and {report.with_suffix('.png')}")


def report_path(cmd: GrowthStudy) -> Path:
    """out/growth (+ .json, .png); a tagged study's report is its own (growth_lr4), so the untagged one is kept."""
    return Path(cmd.out) / f"growth{cmd.grown_tag}"
