"""`python -m plugins.prune ckpt=PATH keep=K out=PRUNED.ckpt`: depth pruning by block importance (SANA-1.5).

Each block's importance is measured on calibration prompts over the whole sampling trajectory:

    BI_i = 1 - mean cos(input of block i, output of block i)

averaged over prompts, sampler steps (both halves of classifier-free guidance) and tokens; a block
that barely turns its input has BI near 0 and goes first. `method=last` (drop the last blocks) and
`method=random` (seeded) are the baselines to compare against. No block is protected unless asked
(`protect=[0,-1]` keeps the first and last), except dit's block 0, whose embedder also conditions
diffusers' final layer. Writes importance.json and importance.png beside the checkpoint; the pruned
checkpoint is read by sample, eval and export, and fine-tuned with
`python -m framework.train init_from=PRUNED model.num_layers=K ...`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import torch
import torch.nn.functional as F
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from framework.models.families import families_with, plan_of
from framework.models.blocks import has_stack, layer_views, restack_state
from framework.cli import quiet_hydra
from framework.inference.pipeline import Pipeline
from framework.inference.sampling import SamplingPlan

METHODS = ("importance", "last", "random")


@dataclass
class PruneCommand:
    """Arguments of `python -m plugins.prune`."""

    ckpt: str = "???"
    """Checkpoint to prune: a .ckpt file or a sharded (fsdp) folder."""
    keep: int = 0
    """Blocks the pruned model keeps."""
    out: str = "???"
    """The pruned checkpoint, a .ckpt file; importance.json and importance.png go beside it."""
    method: str = "importance"
    """importance (drop the lowest BI), last (drop the last blocks) or random (seeded by `seed`)."""
    protect: list[int] = field(default_factory=list)
    """Block indices never dropped (negative counts from the end), e.g. [0,-1]."""
    prompts: list[str] | None = None
    """Calibration prompts, each once; null: `samples` of the dataset's own training prompts (digits, digit pairs,
    moving digits)."""
    samples: int = 100
    """prompts=null: this many calibration trajectories (SANA-1.5 calibrates on 100), the dataset's training prompts
    (every phrasing) taken in turn, repeated with new noise when there are fewer."""
    steps: int = 20
    """Sampler steps of the calibration trajectories."""
    guidance: float = 4.0
    """Classifier-free guidance scale of the calibration trajectories."""
    sampler: str | None = None
    """null: the objective's default sampler."""
    seed: int = 0
    """Noise seed of the calibration trajectories, and the draw of method=random."""
    weights: str = "ema"
    """ema (when the checkpoint has EMA weights) or train."""
    device: str = "auto"
    """auto (a GPU when there is one), cpu or cuda."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r}: choose one of {METHODS}")
        if self.keep < 1:
            raise ValueError(f"keep={self.keep}: give the number of blocks to keep (>= 1)")
        if self.samples < 1:
            raise ValueError(f"samples={self.samples}: give the number of calibration trajectories (>= 1)")


ConfigStore.instance().store(name="prune_command", node=PruneCommand)


# --------------------------------------------------------------------------------------------
# Importance
# --------------------------------------------------------------------------------------------


def block_importance(pipe: Pipeline, prompts: list[str], labels: list[int | None] | None,
                     plan: SamplingPlan) -> list[float]:
    """BI of every layer of `pipe.model`'s stack (a block, or Latte's spatial and temporal block i: the mean over both
    blocks' tokens), measured while it samples `prompts`."""
    layers = layer_views(pipe.model)
    total = torch.zeros(len(layers), dtype=torch.float64)
    count = torch.zeros(len(layers), dtype=torch.float64)

    def recorder(i: int) -> Any:
        def hook(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
            x = args[0] if args else kwargs["hidden_states"]  # (B, N, D)
            y = output[0] if isinstance(output, tuple) else output
            cos = F.cosine_similarity(x.float().flatten(0, -2), y.float().flatten(0, -2), dim=-1)  # (B * N,)
            total[i] += cos.double().sum().cpu()
            count[i] += cos.numel()
        return hook

    handles = [v.module.register_forward_hook(recorder(i), with_kwargs=True) for i, layer in enumerate(layers)
               for v in layer]
    try:
        pipe.generate(prompts, plan, labels, progress=True)
    finally:
        for h in handles:
            h.remove()
    return (1.0 - total / count).tolist()


def choose_kept(importance: list[float], keep: int, method: str, protect: list[int], seed: int,
                family: str) -> list[int]:
    """Indices (ascending) of the blocks to keep."""
    n = len(importance)
    protected = {p % n for p in protect if -n <= p < n}
    if len(protected) != len(set(protect)):
        raise ValueError(f"protect={protect}: indices must lie in [-{n}, {n - 1}] and be distinct blocks")
    protected.update(plan_of(family).required_blocks)  # blocks the rest of the net reads (dit: block 0)
    if not len(protected) <= keep < n:
        raise ValueError(f"keep={keep}: the model has {n} blocks; keep between {max(len(protected), 1)} "
                         f"(protected {sorted(protected)}) and {n - 1}")
    free = [i for i in range(n) if i not in protected]
    if method == "importance":
        order = sorted(free, key=lambda i: importance[i])  # least important first
    elif method == "last":
        order = free[::-1]
    else:
        g = torch.Generator().manual_seed(seed)
        order = [free[i] for i in torch.randperm(len(free), generator=g).tolist()]
    dropped = set(order[: n - keep])
    return [i for i in range(n) if i not in dropped]


def plot_importance(importance: list[float], kept: list[int], method: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * len(importance) + 2), 3.2))
    colors = ["tab:blue" if i in kept else "tab:red" for i in range(len(importance))]
    ax.bar(range(len(importance)), importance, color=colors)
    ax.set_xlabel("block")
    ax.set_ylabel("BI = 1 - mean cos(in, out)")
    ax.set_title(f"block importance; red: dropped (method={method})", fontsize=9)
    ax.set_xticks(range(len(importance)))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------


def calibration_prompts(pipe: Pipeline, given: list[str] | None, samples: int = 100) -> list[str]:
    """The given prompts, or `samples` of the dataset's training prompts (every phrasing of every class), spread
    over the classes and repeated in turn when there are fewer (each trajectory draws its own noise)."""
    if given:
        return list(given)
    from framework.evaluation.prompts import dataset_kind, training_prompts

    kind = dataset_kind(pipe.info)
    if kind is None:
        raise ValueError("prompts=[...] is needed: this dataset has no built-in prompt set to calibrate on")
    pool = training_prompts(kind)  # every class in one phrasing, then in the next
    return [pool[i % len(pool)] for i in range(samples)]


def prune(cmd: PruneCommand) -> dict[str, Any]:
    """Measure, choose, write; returns the report written to importance.json."""
    from framework.training.checkpointing import save_derived
    from framework.cli import resolve_device
    from framework.inference.checkpoint import read_checkpoint, weights_used
    from framework.evaluation.prompts import prompt_labels

    ckpt = read_checkpoint(cmd.ckpt)
    used = weights_used(ckpt, cmd.weights)
    pipe = Pipeline.from_checkpoint_dict(ckpt, resolve_device(cmd.device), used, cmd.ckpt)
    if not has_stack(pipe.model):
        raise ValueError(f"prune: model.family={pipe.model.cfg.family} has no stack of transformer blocks to "
                         f"prune; pruning supports {families_with(lambda p: p.stack)}.")
    prompts = calibration_prompts(pipe, cmd.prompts, cmd.samples)
    with torch.no_grad():
        importance = block_importance(pipe, prompts, prompt_labels(pipe, prompts), SamplingPlan.of(cmd))
    n = len(importance)
    kept = choose_kept(importance, cmd.keep, cmd.method, list(cmd.protect), cmd.seed, pipe.model.cfg.family)
    whole = {k: v.detach().cpu() for k, v in pipe.model.state_dict().items()}  # an adapter run's: merged
    state = restack_state(whole, kept, pipe.model.cfg.family)
    report = {"command": "prune", "source": str(cmd.ckpt), "source_step": ckpt.get("global_step"), "weights": used,
              "method": cmd.method, "from_layers": n, "to_layers": cmd.keep, "kept": kept,
              "dropped": [i for i in range(n) if i not in kept], "protect": list(cmd.protect),
              "importance": importance, "calibration": {"prompts": len(prompts), "steps": cmd.steps,
                                                         "guidance": cmd.guidance, "seed": cmd.seed}}
    out = save_derived(cmd.out, state, ckpt, {"num_layers": cmd.keep}, report)
    (out.parent / "importance.json").write_text(json.dumps(report, indent=2))
    plot_importance(importance, kept, cmd.method, out.parent / "importance.png")
    return report


@hydra.main(version_base="1.3", config_path=None, config_name="prune_command")
def main(cfg: PruneCommand) -> None:
    cmd: PruneCommand = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    report = prune(cmd)
    out = Path(cmd.out)
    bars = " ".join(f"{i}:{b:.3f}" for i, b in enumerate(report["importance"]))
    print(f"importance (BI, {report['weights']} weights): {bars}")
    print(f"kept {report['kept']}, dropped {report['dropped']} (method={cmd.method})")
    print(f"wrote {out}, {out.parent / 'importance.json'}, {out.parent / 'importance.png'}")
    print(f"fine-tune with: python -m framework.train init_from={out} model.num_layers={cmd.keep} ...")


if __name__ == "__main__":
    quiet_hydra()
    main()
