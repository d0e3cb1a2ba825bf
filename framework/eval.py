"""`python -m framework.eval ckpt=PATH`: generate for a prompt set and score it (framework/evaluation/evaluate.py),
or best-of-N for several N (scaling=[...]).

For the digits data the score is `prompt_accuracy`: the share of generated images the digit judge
classifies as the digit their prompt asked for, over every digit, several caption phrasings and
several seeds. The last line of output is one JSON object of metrics.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from framework.cli import EncoderPaths, RankSharing, quiet_hydra, resolve_device, share_ranks
from framework.config import EvalSettings
from framework.evaluation.evaluate import eval_summary, evaluate
from framework.evaluation.prompts import dataset_kind, prompt_set
from framework.evaluation.scoring import generate_candidates, score_images
from framework.inference.pipeline import Pipeline
from framework.inference.sharing import Sharing

__all__ = ["EvalCommand", "eval_summary", "evaluate", "run", "scaling_curve"]


def scaling_curve(pipe: Pipeline, settings: EvalSettings, ns: list[int], out: Path,
                  ranks: Sharing | None = None, steps_too: bool = True) -> dict[str, Any]:
    """Best-of-N for each N (same seeds: N's candidates are the first N of the largest N) and both selections; with
    steps_too, also one candidate drawn with N x `steps` denoising steps for each N (the same compute as best-of-N
    without the judge: selection "steps"). Each row's `compute` is its denoiser steps per prompt.
    ranks: as in evaluate; rank 0 scores and writes, the others get {}."""
    from dataclasses import replace

    import torch.distributed as dist

    from framework.inference.bestof import SELECTIONS, select
    from framework.evaluation.judge import get_judge

    kind = dataset_kind(pipe.info)
    ps = prompt_set(kind, settings.seeds, settings.phrasings)
    if not ns or any(n < 1 for n in ns):
        raise ValueError(f"scaling={ns}: give candidate counts >= 1, e.g. scaling=[1,2,4,8]")
    ns = sorted(set(ns))
    candidates, images_per_s = generate_candidates(pipe, ps, settings, ns[-1], ranks, progress=True)
    longer = {n: generate_candidates(pipe, ps, replace(settings, steps=n * settings.steps), 1, ranks, progress=True)[0]
              for n in ns[1:]} if steps_too else {}  # N=1 is candidate 0: plain sampling at `steps`
    if candidates is None or (dist.is_initialized() and dist.get_rank() != 0):  # rank 0 scores and writes
        return {}
    judge = get_judge(settings.judge or ps.judge, settings.judge_path)
    rows = []

    def add(selection: str, n: int, steps: int, kept) -> None:
        m = score_images(ps, kept)
        m.pop("per_digit_accuracy", None)
        rows.append({"selection": selection, "best_of": n, "steps": steps, "compute": n * steps, **m})
        print(f"  {selection:<10} N={n:<4} steps={steps:<5} " + "  ".join(
            f"{k} {v:.3f}" for k, v in m.items() if k.endswith("accuracy") or k == "fd"))

    for selection in SELECTIONS:
        for n in ns:
            add(selection, n, settings.steps, select(candidates[:, :n], ps.prompts, judge, selection, 1).flatten(0, 1))
    if steps_too:
        for n in ns:
            add("steps", 1, n * settings.steps, candidates[:, 0] if n == 1 else longer[n][:, 0])
    result = {"judge": judge.name, "kind": kind, "images_per_s": images_per_s,
              "candidates_generated": int(candidates.shape[0] * candidates.shape[1]),
              "steps": settings.steps, "seeds": settings.seeds, "phrasings": settings.phrasings, "rows": rows}
    (out / "scaling.json").write_text(json.dumps(result, indent=2))
    plot_scaling(result, out / "scaling.png")
    return result


def plot_scaling(result: dict[str, Any], path: Path) -> Path:
    """Accuracy and fd against compute (denoiser steps per prompt, log scale): one line per selection, and one for more
    denoising steps at the same compute where the result has them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc = "prompt_accuracy" if result["kind"] == "digits" else "pair_accuracy"
    keys = [acc, f"heldout_{'phrasing' if result['kind'] == 'digits' else 'pair'}_accuracy", "fd"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key in zip(axes, keys):
        for k, selection in enumerate(dict.fromkeys(r["selection"] for r in result["rows"])):
            rs = [r for r in result["rows"] if r["selection"] == selection]
            # Dashed and hollow for the second: where both selections pick the same images the lines coincide.
            label = f"{selection} (best of N)" if selection != "steps" else "N x steps (best of 1)"
            ax.plot([r["compute"] for r in rs], [r[key] for r in rs], marker="osd"[k % 3],
                    linestyle=("-", "--", ":")[k % 3], fillstyle="full" if k != 1 else "none",
                    markersize=10 if k == 1 else 7, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"compute: denoiser steps per prompt (N x {result['steps']})")
        ax.set_title(key + (" (lower is better)" if key == "fd" else ""))
        ax.grid(alpha=0.3)
    axes[0].legend(title=f"judge={result['judge']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------
# Command
# --------------------------------------------------------------------------------------------


@dataclass
class EvalCommand(EvalSettings, RankSharing, EncoderPaths):
    """Arguments of `python -m framework.eval`."""

    ckpt: str | None = None
    """Checkpoint to evaluate (or watch=)."""
    watch: str | None = None
    """A training run's folder: evaluate each of its numbered checkpoints as it appears, log eval/* into the run's
    logger at the checkpoint's step, and end once the run has ended (framework/evaluation/watch.py)."""
    watch_poll_s: float = 30.0
    """With watch: how often the run's checkpoints folder is looked at."""
    watch_idle_s: float | None = None
    """With watch: stop after this many seconds without a new checkpoint (a run that failed and will not come back);
    null: wait until the run ends."""
    out: str | None = None
    """Folder for the judged grid and metrics.json (default: beside the checkpoint's run dir)."""
    weights: str = "ema"
    """ema (when the checkpoint has EMA weights) or train."""
    device: str = "auto"
    """auto: a GPU when present."""
    scaling: list[int] | None = None
    """Best-of-N for each N, e.g. [1,2,4,8,16,32], both selections: writes scaling.json and scaling.png."""
    scaling_steps: bool = True
    """With scaling: also draw one image per prompt with N x steps denoising steps for each N (the same compute),
    the steps curve beside the best-of-N curves."""


ConfigStore.instance().store(name="eval_command", node=EvalCommand)


@hydra.main(version_base="1.3", config_path=None, config_name="eval_command")
def main(cfg: EvalCommand) -> None:
    from framework.distributed.env import leave

    run(OmegaConf.to_object(cfg))
    leave()  # under torchrun: every rank ends its part in the process group before the interpreter exits


def run(cfg: EvalCommand) -> None:
    """The eval command on its arguments: print (and write) the metrics on rank 0."""
    if (cfg.ckpt is None) == (cfg.watch is None):
        raise SystemExit("framework.eval: give ckpt=PATH (one checkpoint) or watch=RUN_DIR (each checkpoint of a "
                         "training run as it appears), not " + ("both" if cfg.ckpt else "neither"))
    if cfg.watch is not None:
        from framework.evaluation.watch import watch

        run_dir = Path(cfg.watch)
        out = Path(cfg.out) if cfg.out else run_dir / "eval"
        watch(run_dir, out, lambda ckpt, folder: run_one(cfg, str(ckpt), folder), cfg.watch_poll_s, cfg.watch_idle_s)
        return
    run_one(cfg, cfg.ckpt, Path(cfg.out) if cfg.out else Path(cfg.ckpt).resolve().parent.parent / "eval")


def run_one(cfg: EvalCommand, ckpt: str, out: Path) -> dict[str, Any]:
    """One checkpoint evaluated into `out`; its metrics on rank 0 ({} on the others)."""
    pipe = Pipeline.from_checkpoint(ckpt, device=resolve_device(cfg.device), weights=cfg.weights,
                                    vae=cfg.vae, text_encoder=cfg.text_encoder, lazy=bool(cfg.decode_ranks))
    rank0 = share_ranks(pipe, cfg)
    if dataset_kind(pipe.info) is None and not cfg.real:
        raise SystemExit(
            f"framework.eval: the checkpoint was trained on {pipe.info.get('source')!r}; only the digits and"
            " digit_pairs prompt sets have a classifier. For one's own data give real=DIR_OF_HELD_OUT_IMAGES with"
            " inception=FILE and/or clip=DIR (fid, clip_score); framework.sample shows the images."
        )
    out.mkdir(parents=True, exist_ok=True)
    if cfg.scaling:
        result = scaling_curve(pipe, cfg, list(cfg.scaling), out, cfg.sharing(), cfg.scaling_steps)
        if rank0:
            print(f"scaling: {out / 'scaling.json'} {out / 'scaling.png'}")
            print(json.dumps(result))
        return result
    grid = out / ("samples.png" if cfg.real else "judged.png")
    metrics = evaluate(pipe, cfg, grid if rank0 else None, cfg.sharing(), progress=True)
    if not rank0:
        return {}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(f"{'grid' if cfg.real else 'judged grid'}: {grid}")
    print(eval_summary(metrics))
    print(json.dumps(metrics))
    return metrics


if __name__ == "__main__":
    quiet_hydra()
    main()
