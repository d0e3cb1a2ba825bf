"""`python -m framework.studies optimizers`: loss curves and final quality of several optimizers on one recipe, over
several seeds (SANA-1.5's claim: CAME-8bit trains as CAME and AdamW do, in less memory).

Each (optimizer, seed) is one `python -m framework.train experiment=BASE optimizer=NAME seed=S` run with the base
experiment's learning rate, warm-up and schedule (the experiment's `optimizer:` keys apply over the optimizer
group's), evaluated at its end. Runs already complete are kept. Then optimizers.png (the training loss, a running
mean over `smooth` logged points, and its 95% t-interval over seeds, against the step) and optimizers.json: per
optimizer the final loss (mean of the last `tail` logged losses), the end-of-run evaluation (accuracy, fd) with
intervals, the same paired by seed against the first optimizer, the optimizer state in bytes per parameter
(framework.training.optim.state_bytes on the run's model) and whether any logged loss was non-finite.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from framework.cli import train_unless_complete
from framework.evaluation.realdata import t_interval


@dataclass
class OptimizersStudy:
    """Arguments of `python -m framework.studies optimizers`."""

    base: str = "quickstart"
    """The experiment every run trains (conf/experiment/NAME.yaml): task, data, model, lr and schedule."""
    optimizers: list[str] = field(default_factory=lambda: ["adamw", "came", "came8bit"])
    """conf/optimizer/NAME.yaml each; the first is the reference of the paired differences."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    smooth: int = 4
    """Logged losses averaged per point of the curve (a running mean)."""
    tail: int = 8
    """Last logged losses averaged into the final loss."""
    overrides: list[str] = field(default_factory=list)
    """More train overrides for every run, each quoted: "overrides=['trainer.max_steps=500']"."""
    out: str = "runs/optimizers_study"

    def __post_init__(self) -> None:
        if len(self.optimizers) < 2:
            raise ValueError(f"optimizers={self.optimizers}: give two or more to compare")
        if self.smooth < 1 or self.tail < 1:
            raise ValueError(f"smooth={self.smooth} and tail={self.tail} must be >= 1")


def run_dir(cmd: OptimizersStudy, name: str, seed: int) -> Path:
    return Path(cmd.out) / name / f"seed{seed}"


def train_run(cmd: OptimizersStudy, name: str, seed: int) -> Path:
    run = run_dir(cmd, name, seed)
    args = [f"experiment={cmd.base}", f"optimizer={name}", f"seed={seed}", f"run.dir={run}", "logger=csv",
            "resume=auto", "sample.every_n_steps=0", "eval.at_end=true", *cmd.overrides]
    return train_unless_complete(args, f"[optimizers study] {name} seed {seed}", run)


def logged(run: Path) -> tuple[dict[int, float], dict[str, float]]:
    """(step -> train/loss, the last value of each eval/* column) from the run's metrics.csv."""
    loss: dict[int, float] = {}
    evals: dict[str, float] = {}
    with open(run / "metrics.csv", newline="") as f:
        for r in csv.DictReader(f):
            if r.get("train/loss") not in (None, ""):
                loss[int(r["step"])] = float(r["train/loss"])
            for k, v in r.items():
                if k.startswith("eval/") and v not in (None, ""):
                    evals[k[len("eval/"):]] = float(v)
    return loss, evals


def state_bytes_per_param(run: Path) -> float:
    """The optimizer state the run's optimizer keeps, per trainable parameter of its model (framework/training/optim.py
    state_bytes on the shapes of a meta-device build)."""
    import torch

    import plugins  # noqa: F401  (registers came / came8bit and their state)
    from framework.models.backbones import build_denoiser, to_model_config
    from framework.training.optim import OptimizerConfig, state_bytes

    cfg = OmegaConf.load(run / "config.yaml")
    with torch.device("meta"):
        model = build_denoiser(to_model_config(cfg.model))
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    opt = OptimizerConfig(**OmegaConf.to_container(cfg.optimizer, resolve=True))
    return state_bytes(opt, shapes) / sum(math.prod(s) for s in shapes)


def running_mean(values: list[float], k: int) -> list[float]:
    """Mean of each value and the k - 1 before it (fewer at the start)."""
    return [sum(values[max(0, i - k + 1) : i + 1]) / (i + 1 - max(0, i - k + 1)) for i in range(len(values))]


def compare(cmd: OptimizersStudy) -> dict[str, Any]:
    ref = cmd.optimizers[0]
    runs = {name: {s: logged(run_dir(cmd, name, s)) for s in cmd.seeds} for name in cmd.optimizers}
    metrics = sorted({k for by_seed in runs.values() for _, ev in by_seed.values() for k in ev
                      if (k.endswith("accuracy") and not k.startswith("classifier_")) or k == "fd"})
    per_seed: dict[str, dict[str, dict[int, float]]] = {}
    curves: dict[str, dict[str, list[list[float]]]] = {}
    for name, by_seed in runs.items():
        curves[name] = {}
        per_seed[name] = {"final_loss": {}}
        for s, (loss, ev) in by_seed.items():
            steps = sorted(loss)
            values = [loss[t] for t in steps]
            curves[name][str(s)] = [[t, v] for t, v in zip(steps, running_mean(values, cmd.smooth))]
            per_seed[name]["final_loss"][s] = sum(values[-cmd.tail:]) / len(values[-cmd.tail:])
            per_seed[name].setdefault("nonfinite", {})[s] = float(any(not math.isfinite(v) for v in values))
            for m in metrics:
                if m in ev:
                    per_seed[name].setdefault(m, {})[s] = ev[m]
    named = lambda i: dict(zip(("mean", "low", "high"), i))
    keys = ["final_loss", *metrics]
    result: dict[str, Any] = {"base": cmd.base, "seeds": cmd.seeds, "reference": ref, "optimizers": {}}
    for name in cmd.optimizers:
        row: dict[str, Any] = {"state_bytes_per_param": state_bytes_per_param(run_dir(cmd, name, cmd.seeds[0])),
                               "nonfinite_runs": int(sum(per_seed[name]["nonfinite"].values()))}
        for k in keys:
            if k in per_seed[name] and len(per_seed[name][k]) == len(cmd.seeds):
                row[k] = named(t_interval([per_seed[name][k][s] for s in cmd.seeds]))
                if name != ref and k in per_seed[ref]:  # paired by seed: the seeds' shared data order cancels
                    row[f"{k}_minus_{ref}"] = named(t_interval([per_seed[name][k][s] - per_seed[ref][k][s]
                                                                for s in cmd.seeds]))
        result["optimizers"][name] = row
    result["curves"] = curves
    return result


def plot(cmd: OptimizersStudy, result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for name, by_seed in result["curves"].items():
        series = [dict((int(t), v) for t, v in pts) for pts in by_seed.values()]
        steps = sorted(set.intersection(*(set(one) for one in series)))
        stats = [t_interval([one[t] for one in series]) for t in steps]
        row = result["optimizers"][name]
        label = f"{name} ({row['state_bytes_per_param']:.2f} B/param of state)"
        for ax in axes:
            line, = ax.plot(steps, [m for m, _, _ in stats], label=label, linewidth=1.2)
            ax.fill_between(steps, [lo for _, lo, _ in stats], [hi for _, _, hi in stats], color=line.get_color(),
                            alpha=0.2)
    n = len(cmd.seeds)
    axes[0].set_title(f"training loss (running mean of {cmd.smooth} logged; mean of {n} seeds, 95% interval)",
                      fontsize=10)
    last = max(int(t) for by_seed in result["curves"].values() for pts in by_seed.values() for t, _ in pts)
    axes[1].set_xlim(last // 2, last)
    lows = [v for by_seed in result["curves"].values() for pts in by_seed.values() for t, v in pts if t >= last // 2]
    if lows:
        axes[1].set_ylim(min(lows) * 0.97, max(lows) * 1.03)
    axes[1].set_title("the second half, closer", fontsize=10)
    for ax in axes:
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run(cmd: OptimizersStudy) -> None:
    """Train every (optimizer, seed) not complete yet, then write and print the report."""
    for seed in cmd.seeds:
        for name in cmd.optimizers:
            train_run(cmd, name, seed)
    result = compare(cmd)
    out = Path(cmd.out) / "optimizers"
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    plot(cmd, result, out.with_suffix(".png"))
    print(json.dumps(result["optimizers"], indent=2))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
