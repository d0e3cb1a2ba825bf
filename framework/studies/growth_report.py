"""`python -m framework.studies growth_report small=RUN grown=RUN scratch=RUN out=DIR`: grown versus from scratch.

Reads the three runs' metrics.csv (train/loss, and eval/fd, eval/prompt_accuracy from
`eval.every_n_steps`), puts the grown run after the small one on one step axis (the small run's last
step + the grown run's steps), and writes growth.png (loss and fd against steps) and growth.json: the
final fd of each run, the steps each needs to reach the small model's final fd and the scratch run's,
and the loss just before and just after growing (the same function: no jump).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


LOSS_WINDOW = 4  # logged losses averaged on each side of the growth


@dataclass
class GrowthReport:
    """Arguments of `python -m framework.studies growth_report`."""

    small: str = "???"
    """Run dir of the small model (the growth source)."""
    grown: str = "???"
    """Run dir of the grown model's training (plugins=[growth] or init_from=GROWN)."""
    scratch: str = "???"
    """Run dir of the large model trained from scratch for the same total steps."""
    out: str = "???"
    """Folder for growth.png and growth.json."""


def read_series(run_dir: str | Path, key: str) -> list[tuple[int, float]]:
    """(step, value) of one logged metric in a run's metrics.csv, in step order."""
    path = Path(run_dir) / "metrics.csv"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: train the run with logger=csv")
    with open(path, newline="") as f:
        rows = [(int(r["step"]), float(r[key])) for r in csv.DictReader(f) if r.get(key) not in (None, "")]
    return sorted(rows)


def first_reaching(series: list[tuple[int, float]], target: float, offset: int = 0) -> int | None:
    """The first step (plus offset) whose value is at or below target; None if none is."""
    return next((s + offset for s, v in series if v <= target), None)


def compare(small: str | Path, grown: str | Path, scratch: str | Path) -> dict[str, Any]:
    runs = {"small": small, "grown": grown, "scratch": scratch}
    fd, loss, acc = ({name: read_series(run, key) for name, run in runs.items()}
                     for key in ("eval/fd", "train/loss", "eval/prompt_accuracy"))
    for name, series in fd.items():
        if not series:
            raise ValueError(f"the {name} run logged no eval/fd: train it with eval.every_n_steps=N")
    offset = max(s for s, _ in loss["small"] + fd["small"])
    target, scratch_final = fd["small"][-1][1], fd["scratch"][-1][1]
    mean = lambda pairs: sum(v for _, v in pairs) / len(pairs)
    return {
        "growth_step": offset,
        "small_final_fd": target,
        "final_fd": {k: v[-1][1] for k, v in fd.items()},
        "final_prompt_accuracy": {k: v[-1][1] for k, v in acc.items() if v},
        "final_step": {"small": offset, "grown": offset + fd["grown"][-1][0], "scratch": fd["scratch"][-1][0]},
        "steps_to_small_final_fd": {
            "grown_total": first_reaching(fd["grown"], target, offset),
            "grown_after_growth": first_reaching(fd["grown"], target),
            "scratch": first_reaching(fd["scratch"], target),
        },
        "steps_to_scratch_final_fd": {
            "grown_total": first_reaching(fd["grown"], scratch_final, offset),
            "scratch": first_reaching(fd["scratch"], scratch_final),
        },
        "fd_at_growth": {"small": target, "grown_step0": fd["grown"][0][1]},
        # Logged losses are single batches: the mean of the last / first LOSS_WINDOW logged ones.
        "loss_around_growth": {"small_last": mean(loss["small"][-LOSS_WINDOW:]),
                               "grown_first": mean(loss["grown"][:LOSS_WINDOW])},
        "curves": {"fd": fd, "loss": loss, "prompt_accuracy": acc},
    }


def plot(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    off = result["growth_step"]
    shift = {"small": 0, "grown": off, "scratch": 0}
    style = {"small": ("tab:gray", "small"), "grown": ("tab:blue", "grown from small"),
             "scratch": ("tab:orange", "from scratch")}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, title in ((axes[0], "loss", "training loss"), (axes[1], "fd", "fd to real held-out digits")):
        for name, series in result["curves"][key].items():
            if not series:
                continue
            color, label = style[name]
            xs = [s + shift[name] for s, _ in series]
            ys = [v for _, v in series]
            ax.plot(xs, ys, color=color, label=label, marker="o" if key == "fd" else None, markersize=3,
                    linewidth=1.5 if key == "fd" else 0.8)
        ax.axvline(off, color="black", linestyle=":", linewidth=0.8)
        ax.set_xlabel("optimizer steps (grown: small's steps + its own)")
        ax.set_title(title, fontsize=10)
    axes[1].axhline(result["small_final_fd"], color="tab:gray", linestyle="--", linewidth=0.8)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run(cmd: GrowthReport) -> None:
    """Compare the three runs; write and print the report."""
    out = Path(cmd.out)
    out.mkdir(parents=True, exist_ok=True)
    result = compare(cmd.small, cmd.grown, cmd.scratch)
    (out / "growth.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "growth.png")
    summary = {k: v for k, v in result.items() if k != "curves"}
    print(json.dumps(summary, indent=2))
    print(f"wrote {out / 'growth.json'} and {out / 'growth.png'}")
